//! Engine behaviour with a manual clock: exact wake-ups, crash between publish and mark, retries
//! with backoff, shutdown releasing claims, and the ingest path. Time moves only when a test
//! moves it; real time is used only as a deadline for waiting on conditions.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use timer_brokers::memory::{MemoryConfig, MemoryHub};
use timer_conformance::wait_for;
use timer_core::{
    Broker, CancelOutcome, ClaimedTimer, Delivery, Engine, EngineConfig, Error, Lease, Limits,
    ManualClock, NewTimer, OutboundEvent, Reason, Recurrence, Result, ScheduleOutcome, Scheduled,
    Settlement, Store, Timer, TimerKey, TimerState, Timestamp,
};
use timer_stores::memory::MemoryStore;
use tokio_util::sync::CancellationToken;

const T0: Timestamp = Timestamp::from_millis(1_800_000_000_000);
const WAIT: Duration = Duration::from_secs(10);
/// How long a check that something does *not* happen watches for it.
const QUIET: Duration = Duration::from_millis(300);

fn config() -> EngineConfig {
    EngineConfig {
        poll_interval: Duration::from_secs(3600),
        lease: Duration::from_secs(10),
        retry_base: Duration::from_secs(1),
        retry_max: Duration::from_secs(60),
        shutdown_grace: Duration::from_millis(50),
        instance_id: "engine-a".into(),
        // Exact retry times; jitter has a unit test of its own.
        retry_jitter_percent: 0,
        ..EngineConfig::default()
    }
}

struct Rig {
    clock: Arc<ManualClock>,
    store: Arc<dyn Store>,
    hub: MemoryHub,
    engine: Engine,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

fn start(
    store: Arc<dyn Store>,
    broker: Arc<dyn Broker>,
    hub: MemoryHub,
    clock: Arc<ManualClock>,
    config: EngineConfig,
) -> Rig {
    let engine = Engine::new(
        store.clone(),
        broker,
        clock.clone(),
        config,
        Limits::default(),
    );
    let shutdown = CancellationToken::new();
    let task = engine.start(shutdown.clone());
    Rig {
        clock,
        store,
        hub,
        engine,
        shutdown,
        task,
    }
}

fn rig() -> Rig {
    let hub = MemoryHub::new(MemoryConfig::default());
    let broker: Arc<dyn Broker> = Arc::new(hub.connect());
    start(
        Arc::new(MemoryStore::new()),
        broker,
        hub,
        Arc::new(ManualClock::new(T0)),
        config(),
    )
}

fn timer(id: &str, due: Timestamp) -> NewTimer {
    NewTimer {
        key: TimerKey::new("t", id),
        due_at: due,
        correlation_id: None,
        payload: None,
        recurrence: None,
    }
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

async fn events(hub: &MemoryHub, n: usize) -> Option<Vec<timer_brokers::memory::PublishedEvent>> {
    wait_for(WAIT, || async {
        hub.events().ok().filter(|e| e.len() >= n)
    })
    .await
}

async fn no_events_for_a_while(hub: &MemoryHub) {
    let fired = wait_for(QUIET, || async {
        hub.events().ok().filter(|e| !e.is_empty())
    })
    .await;
    assert!(fired.is_none(), "fired too early: {fired:?}");
}

async fn timer_where(store: &Arc<dyn Store>, id: &str, pred: impl Fn(&Timer) -> bool) -> Timer {
    let key = TimerKey::new("t", id);
    wait_for(WAIT, || async {
        store.get(&key).await.ok().flatten().filter(|t| pred(t))
    })
    .await
    .unwrap_or_else(|| panic!("timer {id} never reached the expected state"))
}

#[tokio::test]
async fn timer_due_in_50ms_fires_without_waiting_for_the_poll_interval() {
    let r = rig();
    let out = r
        .engine
        .schedule(&[timer("soon", T0.saturating_add(ms(50)))])
        .await
        .expect("schedule");
    assert_eq!(out, vec![Scheduled::Stored(ScheduleOutcome::Created)]);
    r.clock.advance(ms(49));
    no_events_for_a_while(&r.hub).await;
    r.clock.advance(ms(1));
    let fired = events(&r.hub, 1)
        .await
        .expect("fired at its due time, long before the 1 h poll");
    let envelope: serde_json::Value = serde_json::from_slice(&fired[0].body).expect("json");
    assert_eq!(envelope["aggregateId"], "soon");
    assert_eq!(
        envelope["timestampMs"],
        T0.as_millis() + 50,
        "fired at due time exactly"
    );
    let t = timer_where(&r.store, "soon", |t| t.state == TimerState::Reached).await;
    assert_eq!(t.reached_at, Some(T0.saturating_add(ms(50))));
}

#[tokio::test]
async fn a_sooner_timer_wakes_the_sleeping_firing_task() {
    let r = rig();
    r.engine
        .schedule(&[timer("late", T0.saturating_add(Duration::from_secs(600)))])
        .await
        .expect("schedule");
    // Let the firing task go to sleep until the late timer; then a sooner one must wake it.
    let planned = wait_for(WAIT, || async {
        r.store.next_due_at().await.ok().flatten()
    })
    .await;
    assert!(planned.is_some());
    r.engine
        .schedule(&[timer("early", T0.saturating_add(ms(20)))])
        .await
        .expect("schedule");
    r.clock.advance(ms(20));
    let fired = events(&r.hub, 1).await.expect("the sooner timer fired");
    assert_eq!(fired[0].key.service_call_id, "early");
    assert_eq!(fired.len(), 1, "the late timer waits");
}

#[tokio::test]
async fn past_due_timers_fire_at_once_in_due_order() {
    let r = rig();
    let batch: Vec<NewTimer> = (0..5)
        .map(|i| {
            timer(
                &format!("p{i}"),
                Timestamp::from_millis(T0.as_millis() - 1000 + i),
            )
        })
        .collect();
    r.engine.schedule(&batch).await.expect("schedule");
    let fired = events(&r.hub, 5)
        .await
        .expect("all past-due timers fired without moving the clock");
    let order: Vec<&str> = fired
        .iter()
        .map(|e| e.key.service_call_id.as_str())
        .collect();
    assert_eq!(order, ["p0", "p1", "p2", "p3", "p4"]);
}

/// A memory store with injected faults: the first `schedule_failures` schedules fail, as an
/// unreachable database would; with `hang_reached`, settling a fired one-shot timer never
/// returns (the process "dies" between publishing and marking).
struct Faulty {
    inner: Arc<dyn Store>,
    schedule_failures: AtomicU32,
    hang_reached: bool,
}

impl Faulty {
    fn new(inner: Arc<dyn Store>) -> Self {
        Faulty {
            inner,
            schedule_failures: AtomicU32::new(0),
            hang_reached: false,
        }
    }
}

#[async_trait]
impl Store for Faulty {
    fn name(&self) -> &'static str {
        "faulty"
    }
    async fn schedule(&self, t: &[NewTimer], now: Timestamp) -> Result<Vec<ScheduleOutcome>> {
        if self
            .schedule_failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(Error::unavailable("injected store outage"));
        }
        self.inner.schedule(t, now).await
    }
    async fn claim_due(
        &self,
        now: Timestamp,
        limit: usize,
        lease: &Lease,
    ) -> Result<Vec<ClaimedTimer>> {
        self.inner.claim_due(now, limit, lease).await
    }
    async fn settle(
        &self,
        claims: &[(ClaimedTimer, Settlement)],
        owner: &str,
        at: Timestamp,
    ) -> Result<u64> {
        if self.hang_reached && claims.iter().any(|(_, s)| *s == Settlement::Reached) {
            std::future::pending::<()>().await;
        }
        self.inner.settle(claims, owner, at).await
    }
    async fn next_due_at(&self) -> Result<Option<Timestamp>> {
        self.inner.next_due_at().await
    }
    async fn get(&self, key: &TimerKey) -> Result<Option<Timer>> {
        self.inner.get(key).await
    }
    async fn cancel(&self, key: &TimerKey, now: Timestamp) -> Result<CancelOutcome> {
        self.inner.cancel(key, now).await
    }
    async fn purge(&self, older_than: Timestamp, limit: usize) -> Result<u64> {
        self.inner.purge(older_than, limit).await
    }
    async fn scheduled_count(&self) -> Result<u64> {
        self.inner.scheduled_count().await
    }
    async fn health(&self) -> Result<()> {
        self.inner.health().await
    }
}

#[tokio::test]
async fn crash_between_publish_and_mark_gives_a_duplicate_not_a_loss() {
    let durable: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let hub = MemoryHub::new(MemoryConfig::default());
    let clock = Arc::new(ManualClock::new(T0));
    let first = start(
        Arc::new(Faulty {
            hang_reached: true,
            ..Faulty::new(durable.clone())
        }),
        Arc::new(hub.connect()),
        hub.clone(),
        clock.clone(),
        config(),
    );
    first
        .engine
        .schedule(&[timer("dup", T0)])
        .await
        .expect("schedule");
    events(&hub, 1).await.expect("published once");
    first.task.abort(); // the crash: published, never marked
    let _ = first.task.await;
    assert_eq!(
        durable
            .get(&TimerKey::new("t", "dup"))
            .await
            .expect("get")
            .expect("row")
            .state,
        TimerState::Scheduled
    );

    let second = start(
        durable.clone(),
        Arc::new(hub.connect()),
        hub.clone(),
        clock.clone(),
        EngineConfig {
            instance_id: "engine-b".into(),
            ..config()
        },
    );
    // Nothing happens while the dead instance's lease lives...
    clock.advance(Duration::from_secs(9));
    let early = wait_for(QUIET, || async {
        hub.events().ok().filter(|e| e.len() > 1)
    })
    .await;
    assert!(
        early.is_none(),
        "fired again while the lease lived: {early:?}"
    );
    // ...and the timer fires again once it expired.
    clock.advance(Duration::from_secs(1));
    let fired = events(&hub, 2)
        .await
        .expect("fired again after the lease expired");
    assert_eq!(fired.len(), 2);
    assert_eq!(fired[0].key, fired[1].key);
    assert_eq!(
        fired[0].id, fired[1].id,
        "a repeat carries the same envelope id, so brokers and consumers can drop it"
    );
    let t = timer_where(&durable, "dup", |t| t.state == TimerState::Reached).await;
    assert_eq!(t.lease_owner.as_deref(), Some("engine-b"));
    second.shutdown.cancel();
}

/// A broker whose first `failures` publishes fail.
struct FlakyBroker {
    inner: timer_brokers::memory::MemoryBroker,
    failures: AtomicU32,
}

#[async_trait]
impl Broker for FlakyBroker {
    fn name(&self) -> &'static str {
        "flaky"
    }
    async fn receive(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>> {
        self.inner.receive(max, wait).await
    }
    async fn ack(&self, tags: &[u64]) -> Result<()> {
        self.inner.ack(tags).await
    }
    async fn publish(&self, events: &[OutboundEvent]) -> Result<()> {
        if self
            .failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(Error::unavailable("injected publish failure"));
        }
        self.inner.publish(events).await
    }
    async fn dead_letter(&self, body: &[u8], reason: &str) -> Result<()> {
        self.inner.dead_letter(body, reason).await
    }
    async fn health(&self) -> Result<()> {
        self.inner.health().await
    }
}

#[tokio::test]
async fn failed_publish_is_retried_with_exponential_backoff() {
    let hub = MemoryHub::new(MemoryConfig::default());
    let broker = Arc::new(FlakyBroker {
        inner: hub.connect(),
        failures: AtomicU32::new(2),
    });
    let r = start(
        Arc::new(MemoryStore::new()),
        broker,
        hub.clone(),
        Arc::new(ManualClock::new(T0)),
        config(),
    );
    r.engine
        .schedule(&[timer("retry", T0)])
        .await
        .expect("schedule");

    let t = timer_where(&r.store, "retry", |t| t.attempts == 1).await;
    assert_eq!(t.state, TimerState::Scheduled);
    assert!(
        t.last_error
            .as_deref()
            .is_some_and(|e| e.contains("injected publish failure")),
        "{t:?}"
    );
    assert_eq!(
        t.available_at,
        T0.saturating_add(Duration::from_secs(1)),
        "first retry after retry_base"
    );

    r.clock.advance(Duration::from_secs(1));
    let t = timer_where(&r.store, "retry", |t| t.attempts == 2).await;
    assert_eq!(
        t.available_at,
        T0.saturating_add(Duration::from_secs(3)),
        "second retry after 2 x retry_base"
    );
    r.clock.advance(ms(1999));
    no_events_for_a_while(&hub).await;
    r.clock.advance(ms(1));
    events(&hub, 1)
        .await
        .expect("published on the third attempt");
    let t = timer_where(&r.store, "retry", |t| t.state == TimerState::Reached).await;
    assert_eq!(t.attempts, 2, "attempts stay visible after success");
}

/// A broker whose publish never completes.
struct StuckBroker {
    inner: timer_brokers::memory::MemoryBroker,
}

#[async_trait]
impl Broker for StuckBroker {
    fn name(&self) -> &'static str {
        "stuck"
    }
    async fn receive(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>> {
        self.inner.receive(max, wait).await
    }
    async fn ack(&self, tags: &[u64]) -> Result<()> {
        self.inner.ack(tags).await
    }
    async fn publish(&self, _: &[OutboundEvent]) -> Result<()> {
        std::future::pending().await
    }
    async fn dead_letter(&self, body: &[u8], reason: &str) -> Result<()> {
        self.inner.dead_letter(body, reason).await
    }
    async fn health(&self) -> Result<()> {
        self.inner.health().await
    }
}

#[tokio::test]
async fn shutdown_releases_claims() {
    let hub = MemoryHub::new(MemoryConfig::default());
    let r = start(
        Arc::new(MemoryStore::new()),
        Arc::new(StuckBroker {
            inner: hub.connect(),
        }),
        hub,
        Arc::new(ManualClock::new(T0)),
        config(),
    );
    r.engine
        .schedule(&[timer("held", T0)])
        .await
        .expect("schedule");
    timer_where(&r.store, "held", |t| {
        t.lease_owner.as_deref() == Some("engine-a")
    })
    .await;
    r.shutdown.cancel();
    tokio::time::timeout(WAIT, r.task)
        .await
        .expect("engine stops within the grace period")
        .expect("no panic");
    let t = r
        .store
        .get(&TimerKey::new("t", "held"))
        .await
        .expect("get")
        .expect("row");
    assert_eq!(t.lease_owner, None, "claim released");
    assert_eq!(t.attempts, 0, "a shutdown is not a failed attempt");
    let lease = Lease {
        owner: "engine-b".into(),
        until: T0.saturating_add(Duration::from_secs(10)),
    };
    let claimed = r.store.claim_due(T0, 10, &lease).await.expect("claim");
    assert_eq!(
        claimed.len(),
        1,
        "another instance can fire it at once, without waiting for the lease"
    );
}

#[tokio::test]
async fn ingest_stores_valid_commands_and_dead_letters_bad_ones() {
    let r = rig();
    let good = |id: &str| {
        format!(
            r#"{{"tenantId":"t","serviceCallId":"{id}","dueTimeMs":{}}}"#,
            T0.as_millis() + 60_000
        )
    };
    r.hub.send_command(good("g1")).expect("send");
    r.hub.send_command("{not json").expect("send");
    r.hub
        .send_command(r#"{"tenantId":"t","dueTimeMs":1}"#)
        .expect("send");
    r.hub
        .send_command(format!(
            r#"{{"tenantId":"t","serviceCallId":"{}","dueTimeMs":1}}"#,
            "x".repeat(500)
        ))
        .expect("send");
    r.hub
        .send_command(r#"{"tenantId":"t\u0001","serviceCallId":"c","dueTimeMs":1}"#)
        .expect("send");
    r.hub
        .send_command(r#"{"tenantId":"t","serviceCallId":"c","dueAt":"next tuesday"}"#)
        .expect("send");
    r.hub
        .send_command(r#"{"type":"Explode","tenantId":"t"}"#)
        .expect("send");
    r.hub.send_command(good("g2")).expect("send");

    timer_where(&r.store, "g2", |t| t.state == TimerState::Scheduled).await;
    timer_where(&r.store, "g1", |t| t.state == TimerState::Scheduled).await;
    let letters = wait_for(WAIT, || async {
        r.hub.dead_letters().ok().filter(|d| d.len() >= 6)
    })
    .await
    .expect("6 dead letters");
    let reasons: Vec<&str> = letters.iter().map(|d| d.reason.as_str()).collect();
    for (expected, body_part) in [
        ("invalid_json", "{not json"),
        ("serviceCallId (missing_field)", r#""dueTimeMs":1}"#),
        ("serviceCallId (invalid_id)", "xxxx"),
        ("tenantId (invalid_id)", r#"t\u0001"#),
        ("dueAt (invalid_time)", "next tuesday"),
        ("type (unknown_type)", "Explode"),
    ] {
        assert!(
            letters
                .iter()
                .any(|d| d.reason.starts_with(expected) && d.body.contains(body_part)),
            "a dead letter {expected:?} for {body_part:?} in {reasons:?}"
        );
    }
    let acked = wait_for(WAIT, || async {
        (r.hub.unacknowledged().ok()? == 0).then_some(())
    })
    .await;
    assert!(
        acked.is_some(),
        "every command acknowledged, good or bad: the stream keeps flowing"
    );
}

#[tokio::test]
async fn commands_are_not_acknowledged_until_the_store_committed_them() {
    let hub = MemoryHub::new(MemoryConfig::default());
    let inner: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let store = Arc::new(Faulty {
        schedule_failures: AtomicU32::new(2),
        ..Faulty::new(inner.clone())
    });
    let r = start(
        store,
        Arc::new(hub.connect()),
        hub.clone(),
        Arc::new(ManualClock::new(T0)),
        EngineConfig {
            retry_base: ms(20),
            ..config()
        },
    );
    hub.send_command(format!(
        r#"{{"tenantId":"t","serviceCallId":"kept","dueTimeMs":{}}}"#,
        T0.as_millis()
    ))
    .expect("send");
    // While the store fails, the command stays unacknowledged; once it recovers, it is stored,
    // acknowledged and fired.
    events(&hub, 1)
        .await
        .expect("fired after the store recovered");
    assert_eq!(hub.unacknowledged().expect("count"), 0);
    timer_where(&inner, "kept", |t| t.state == TimerState::Reached).await;
    r.shutdown.cancel();
}

#[tokio::test]
async fn a_timer_fails_after_max_attempts_with_a_timer_failed_dead_letter() {
    let hub = MemoryHub::new(MemoryConfig::default());
    let broker = Arc::new(FlakyBroker {
        inner: hub.connect(),
        failures: AtomicU32::new(u32::MAX),
    });
    let r = start(
        Arc::new(MemoryStore::new()),
        broker,
        hub.clone(),
        Arc::new(ManualClock::new(T0)),
        EngineConfig {
            max_attempts: 3,
            ..config()
        },
    );
    r.engine
        .schedule(&[timer("doomed", T0)])
        .await
        .expect("schedule");
    timer_where(&r.store, "doomed", |t| t.attempts == 1).await;
    r.clock.advance(Duration::from_secs(1));
    timer_where(&r.store, "doomed", |t| t.attempts == 2).await;
    r.clock.advance(Duration::from_secs(2));
    let t = timer_where(&r.store, "doomed", |t| t.state == TimerState::Failed).await;
    assert_eq!(t.attempts, 3, "every attempt counted");
    assert!(
        t.last_error
            .as_deref()
            .is_some_and(|e| e.contains("injected publish failure")),
        "{t:?}"
    );
    let letters = wait_for(WAIT, || async {
        hub.dead_letters().ok().filter(|d| !d.is_empty())
    })
    .await
    .expect("a TimerFailed dead letter");
    assert_eq!(letters.len(), 1);
    let v: serde_json::Value = serde_json::from_str(&letters[0].body).expect("json");
    assert_eq!(v["type"], "TimerFailed");
    assert_eq!(v["aggregateId"], "doomed");
    assert_eq!(v["payload"]["attempts"], 3);
    assert!(
        letters[0].reason.starts_with("max_attempts"),
        "{}",
        letters[0].reason
    );
    // Failed is final: no further attempts, no event.
    r.clock.advance(Duration::from_secs(600));
    no_events_for_a_while(&hub).await;
    let t = timer_where(&r.store, "doomed", |_| true).await;
    assert_eq!((t.state, t.attempts), (TimerState::Failed, 3));
}

fn every_second(id: &str, first: Timestamp) -> NewTimer {
    NewTimer {
        recurrence: Some(Recurrence {
            cron: "*/1 * * * * *".into(),
            time_zone: "Europe/Berlin".into(),
            end_at: None,
            max_occurrences: None,
        }),
        ..timer(id, first)
    }
}

fn payload_of(e: &timer_brokers::memory::PublishedEvent) -> serde_json::Value {
    serde_json::from_slice::<serde_json::Value>(&e.body).expect("event json")["payload"].clone()
}

#[tokio::test]
async fn a_recurring_timer_fires_each_occurrence_and_a_missed_run_once() {
    let r = rig();
    // T0 is a whole second.
    let first = T0.saturating_add(Duration::from_secs(1));
    r.engine
        .schedule(&[every_second("tick", first)])
        .await
        .expect("schedule");
    no_events_for_a_while(&r.hub).await;
    r.clock.advance(Duration::from_secs(1));
    let e = events(&r.hub, 1).await.expect("first occurrence");
    assert_eq!(payload_of(&e[0])["dueAt"], first.to_rfc3339());
    assert_eq!(payload_of(&e[0])["occurrence"], 1);
    let t = timer_where(&r.store, "tick", |t| t.occurrences == 1).await;
    assert_eq!(t.state, TimerState::Scheduled);
    assert_eq!(t.due_at, T0.saturating_add(Duration::from_secs(2)));

    r.clock.advance(Duration::from_secs(1));
    events(&r.hub, 2).await.expect("second occurrence");
    // Ten seconds pass at once (the service was down): one late fire, not ten.
    r.clock.advance(Duration::from_secs(10));
    let e = events(&r.hub, 3).await.expect("the missed occurrence");
    assert_eq!(
        payload_of(&e[2])["dueAt"],
        T0.saturating_add(Duration::from_secs(3)).to_rfc3339()
    );
    let t = timer_where(&r.store, "tick", |t| t.occurrences == 3).await;
    assert_eq!(
        t.due_at,
        T0.saturating_add(Duration::from_secs(13)),
        "the rhythm continues from now"
    );
    let quiet = wait_for(QUIET, || async {
        r.hub.events().ok().filter(|e| e.len() > 3)
    })
    .await;
    assert!(quiet.is_none(), "no flood of missed occurrences: {quiet:?}");
    r.clock.advance(Duration::from_secs(1));
    events(&r.hub, 4).await.expect("back in rhythm");
}

#[tokio::test]
async fn finished_timers_are_purged_after_the_retention() {
    let hub = MemoryHub::new(MemoryConfig::default());
    let broker: Arc<dyn Broker> = Arc::new(hub.connect());
    let r = start(
        Arc::new(MemoryStore::new()),
        broker,
        hub.clone(),
        Arc::new(ManualClock::new(T0)),
        EngineConfig {
            retention: Duration::from_secs(60),
            purge_interval: Duration::from_secs(10),
            ..config()
        },
    );
    r.engine
        .schedule(&[
            timer("old", T0),
            timer("later", T0.saturating_add(Duration::from_secs(3600))),
        ])
        .await
        .expect("schedule");
    timer_where(&r.store, "old", |t| t.state == TimerState::Reached).await;
    r.clock.advance(Duration::from_secs(30));
    let kept = wait_for(QUIET, || async {
        r.store
            .get(&TimerKey::new("t", "old"))
            .await
            .ok()
            .filter(|t| t.is_none())
    })
    .await;
    assert!(kept.is_none(), "younger than the retention: kept");
    r.clock.advance(Duration::from_secs(40));
    let gone = wait_for(WAIT, || async {
        r.store
            .get(&TimerKey::new("t", "old"))
            .await
            .ok()
            .filter(|t| t.is_none())
    })
    .await;
    assert!(gone.is_some(), "purged once older than the retention");
    timer_where(&r.store, "later", |t| t.state == TimerState::Scheduled).await;
}

#[tokio::test]
async fn cancel_commands_apply_in_order_with_schedules() {
    let r = rig();
    let due = T0.as_millis() + 1_000;
    for body in [
        format!(r#"{{"tenantId":"t","serviceCallId":"a","dueTimeMs":{due}}}"#),
        r#"{"type":"CancelTimer","tenantId":"t","serviceCallId":"a"}"#.to_owned(),
        format!(r#"{{"tenantId":"t","serviceCallId":"b","dueTimeMs":{due}}}"#),
        // Cancels of unknown timers change nothing and are acknowledged.
        r#"{"type":"CancelTimer","tenantId":"t","serviceCallId":"nobody"}"#.to_owned(),
    ] {
        r.hub.send_command(body).expect("send");
    }
    timer_where(&r.store, "a", |t| t.state == TimerState::Cancelled).await;
    timer_where(&r.store, "b", |t| t.state == TimerState::Scheduled).await;
    wait_for(WAIT, || async {
        (r.hub.unacknowledged().ok()? == 0).then_some(())
    })
    .await
    .expect("all acknowledged");
    r.clock.advance(Duration::from_secs(1));
    let e = events(&r.hub, 1).await.expect("b fires");
    assert_eq!(e.len(), 1, "the cancelled timer does not: {e:?}");
    assert_eq!(payload_of(&e[0])["serviceCallId"], "b");
}

#[tokio::test]
async fn cancel_is_refused_while_publishing_and_wins_after_a_failed_publish() {
    let hub = MemoryHub::new(MemoryConfig::default());
    let r = start(
        Arc::new(MemoryStore::new()),
        Arc::new(StuckBroker {
            inner: hub.connect(),
        }),
        hub.clone(),
        Arc::new(ManualClock::new(T0)),
        EngineConfig {
            // The publish gives up after half the lease (real time): 300 ms.
            lease: Duration::from_millis(600),
            ..config()
        },
    );
    let key = TimerKey::new("t", "racing");
    r.engine
        .schedule(&[timer("racing", T0)])
        .await
        .expect("schedule");
    timer_where(&r.store, "racing", |t| t.lease_owner.is_some()).await;
    assert_eq!(
        r.engine.cancel(&key).await.expect("cancel"),
        CancelOutcome::Firing,
        "its event may be on the way"
    );
    // The publish times out and the claim is released for a retry: now the cancel wins.
    timer_where(&r.store, "racing", |t| {
        t.attempts == 1 && t.lease_owner.is_none()
    })
    .await;
    assert_eq!(
        r.engine.cancel(&key).await.expect("cancel"),
        CancelOutcome::Cancelled
    );
    r.clock.advance(Duration::from_secs(3600));
    let t = timer_where(&r.store, "racing", |_| true).await;
    assert_eq!(t.state, TimerState::Cancelled, "never claimed again");
}

#[tokio::test]
async fn a_cancel_command_that_meets_a_fire_waits_for_it_and_then_applies() {
    let hub = MemoryHub::new(MemoryConfig::default());
    let r = start(
        Arc::new(MemoryStore::new()),
        Arc::new(StuckBroker {
            inner: hub.connect(),
        }),
        hub.clone(),
        Arc::new(ManualClock::new(T0)),
        EngineConfig {
            lease: Duration::from_millis(600),
            ..config()
        },
    );
    r.engine
        .schedule(&[timer("racing", T0)])
        .await
        .expect("schedule");
    timer_where(&r.store, "racing", |t| t.lease_owner.is_some()).await;
    hub.send_command(r#"{"type":"CancelTimer","tenantId":"t","serviceCallId":"racing"}"#)
        .expect("send");
    // Not dropped as "firing": once the publish gave up (300 ms) the cancel applies.
    let t = timer_where(&r.store, "racing", |t| t.state == TimerState::Cancelled).await;
    assert_eq!(t.attempts, 1, "after the failed publish");
    wait_for(WAIT, || async {
        (hub.unacknowledged().ok()? == 0).then_some(())
    })
    .await
    .expect("the cancel is acknowledged once applied");
}

#[tokio::test]
async fn a_tenant_over_its_limit_is_refused_and_others_are_not() {
    let hub = MemoryHub::new(MemoryConfig::default());
    let broker: Arc<dyn Broker> = Arc::new(hub.connect());
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let clock = Arc::new(ManualClock::new(T0));
    let engine = Engine::new(
        store.clone(),
        broker,
        clock.clone(),
        config(),
        Limits {
            max_pending_per_tenant: 2,
            ..Limits::default()
        },
    );
    let shutdown = CancellationToken::new();
    let task = engine.start(shutdown.clone());
    let later = T0.saturating_add(Duration::from_secs(60));
    let cmd = |tenant: &str, id: &str| {
        format!(
            r#"{{"tenantId":"{tenant}","serviceCallId":"{id}","dueTimeMs":{}}}"#,
            later.as_millis()
        )
    };
    for body in [
        cmd("big", "1"),
        cmd("big", "2"),
        cmd("big", "3"),
        cmd("small", "1"),
    ] {
        hub.send_command(body).expect("send");
    }
    let letters = wait_for(WAIT, || async {
        hub.dead_letters().ok().filter(|d| !d.is_empty())
    })
    .await
    .expect("the third timer of `big` is dead-lettered");
    assert_eq!(letters.len(), 1);
    assert!(
        letters[0].reason.starts_with("tenant_limit"),
        "{}",
        letters[0].reason
    );
    assert!(
        letters[0].body.contains(r#""serviceCallId":"3""#),
        "{}",
        letters[0].body
    );
    wait_for(WAIT, || async {
        (hub.unacknowledged().ok()? == 0).then_some(())
    })
    .await
    .expect("all acknowledged");
    let exists = |tenant: &'static str, id: &'static str| {
        let store = store.clone();
        async move {
            store
                .get(&TimerKey::new(tenant, id))
                .await
                .expect("get")
                .is_some()
        }
    };
    assert!(exists("big", "1").await && exists("big", "2").await);
    assert!(!exists("big", "3").await, "over the limit: not stored");
    assert!(exists("small", "1").await, "another tenant is not affected");
    // At the limit, moving an existing timer is still allowed; a new one is not.
    let moved = NewTimer {
        key: TimerKey::new("big", "1"),
        ..timer("x", later.saturating_add(Duration::from_secs(1)))
    };
    let fresh = NewTimer {
        key: TimerKey::new("big", "4"),
        ..timer("x", later)
    };
    let outcomes = engine.schedule(&[moved, fresh]).await.expect("schedule");
    assert_eq!(outcomes[0], Scheduled::Stored(ScheduleOutcome::Updated));
    assert!(
        matches!(&outcomes[1], Scheduled::Refused(r) if r.reason == Reason::TenantLimit),
        "{outcomes:?}"
    );
    assert_eq!(outcomes.len(), 2);
    shutdown.cancel();
    let _ = task.await;
}
