//! Engine behaviour with a manual clock: exact wake-ups, crash between publish and mark, retries
//! with backoff, shutdown releasing claims, and the ingest path. Time moves only when a test
//! moves it; real time is used only as a deadline for waiting on conditions.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use timer_brokers::memory::{DeadLetter, MemoryBroker, MemoryConfig, MemoryHub, PublishedEvent};
use timer_conformance::wait_for;
use timer_core::config::TenantFireRate;
use timer_core::engine::Triggered;
use timer_core::policy::{CatchUp, Completion, Outcome, Overlap, Policy, Work};
use timer_core::{
    Action, Broker, CancelOutcome, ClaimedTimer, ControlOutcome, Delivery, Due, Engine,
    EngineConfig, Error, KeyLimit, Lease, Limits, ManualClock, NewTimer, OutboundEvent, Reason,
    Recurrence, Result, ScheduleOutcome, Scheduled, Settlement, Store, Target, Timer, TimerKey,
    TimerState, Timestamp, Undelivered,
};
use timer_stores::memory::MemoryStore;
use tokio_util::sync::CancellationToken;

const T0: Timestamp = Timestamp::from_millis(1_800_000_000_000);
const WAIT: Duration = Duration::from_secs(10);
/// How long a check that something does *not* happen watches for it.
const QUIET: Duration = Duration::from_millis(300);

/// The metrics the engine records on this thread, as the Prometheus text the service serves.
/// `#[tokio::test]` runs the engine's tasks on the test's thread, so a recorder of that thread
/// sees this test's engine only.
struct Metrics {
    handle: metrics_exporter_prometheus::PrometheusHandle,
    _recording: metrics::LocalRecorderGuard<'static>,
}

impl Metrics {
    fn record() -> Self {
        let recorder: &'static metrics_exporter_prometheus::PrometheusRecorder = Box::leak(
            Box::new(metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder()),
        );
        Metrics {
            handle: recorder.handle(),
            _recording: metrics::set_default_local_recorder(recorder),
        }
    }

    /// The value of `series` (`name{labels}` as rendered), 0 when it was never recorded.
    fn value(&self, series: &str) -> f64 {
        timer_conformance::e2e::metric(&self.handle.render(), series)
    }
}

fn config() -> EngineConfig {
    EngineConfig {
        poll_interval: Duration::from_secs(3600),
        lease: Duration::from_secs(10),
        // Asleep until a timer's due time, as these tests read it; claiming ahead has tests of
        // its own.
        claim_ahead: Duration::ZERO,
        retry_base: Duration::from_secs(1),
        retry_max: Duration::from_secs(60),
        shutdown_grace: Duration::from_millis(50),
        instance_id: "engine-a".into(),
        // Exact retry times; jitter has a unit test of its own.
        retry_jitter_percent: 0,
        ..EngineConfig::default()
    }
}

/// What an engine under test runs on. The default: a fresh memory store, the memory broker
/// publishing normally, a manual clock at T0, `config()` and default limits; a test changes
/// what it needs.
struct Setup {
    store: Arc<dyn Store>,
    hub: MemoryHub,
    clock: Arc<ManualClock>,
    publish: Publish,
    dead_letters: DeadLetterGate,
    config: EngineConfig,
    limits: Limits,
    /// Where fires with an HTTP target go ([`ScriptedCaller`]).
    caller: Option<Arc<dyn timer_core::Caller>>,
}

impl Setup {
    fn on(store: Arc<dyn Store>) -> Self {
        Setup {
            store,
            ..Setup::default()
        }
    }

    fn publishing(publish: Publish) -> Self {
        Setup {
            publish,
            ..Setup::default()
        }
    }

    /// This setup with every dead letter refused until the returned gate opens.
    fn refusing_dead_letters(self) -> (Self, DeadLetterGate) {
        let gate = DeadLetterGate::refusing();
        let setup = Setup {
            dead_letters: gate.clone(),
            ..self
        };
        (setup, gate)
    }
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            store: Arc::new(MemoryStore::new()),
            hub: MemoryHub::new(MemoryConfig::default()),
            clock: Arc::new(ManualClock::new(T0)),
            publish: Publish::Works,
            dead_letters: DeadLetterGate::default(),
            config: config(),
            limits: Limits::default(),
            caller: None,
        }
    }
}

/// A started engine and what it runs on.
struct Rig {
    clock: Arc<ManualClock>,
    store: Arc<dyn Store>,
    hub: MemoryHub,
    engine: Engine,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Setup {
    fn start(self) -> Rig {
        let broker = FaultyBroker::new(self.hub.connect(), self.publish, self.dead_letters);
        let engine = Engine::new(
            self.store.clone(),
            Arc::new(broker),
            self.clock.clone(),
            self.config,
            self.limits,
        );
        let engine = match self.caller {
            Some(caller) => engine.with_caller(caller).expect("one caller"),
            None => engine,
        };
        let shutdown = CancellationToken::new();
        let task = engine.start(shutdown.clone());
        Rig {
            clock: self.clock,
            store: self.store,
            hub: self.hub,
            engine,
            shutdown,
            task,
        }
    }
}

impl Rig {
    /// Stops the engine, which must stop in time and without a panic.
    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("engine stops")
            .expect("no panic");
    }

    /// Schedules through the engine, which must accept the batch.
    async fn schedule(&self, timers: &[NewTimer]) -> Vec<Scheduled> {
        self.engine.schedule(timers).await.expect("schedule")
    }
}

fn rig() -> Rig {
    Setup::default().start()
}

fn timer(id: &str, due: Timestamp) -> NewTimer {
    NewTimer::new(TimerKey::new("t", id), due)
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

async fn events(hub: &MemoryHub, n: usize) -> Option<Vec<PublishedEvent>> {
    wait_for(WAIT, || async {
        hub.events().ok().filter(|e| e.len() >= n)
    })
    .await
}

impl Rig {
    /// The events beyond the first `n` once the firing task is asleep until after now (so
    /// nothing more fires until the clock moves or a timer wakes it); `None` when there are
    /// none. Fails when the task never goes to sleep.
    async fn more_events(&self, n: usize) -> Option<Vec<PublishedEvent>> {
        let now = timer_core::Clock::now(self.clock.as_ref());
        let asleep = self.asleep(|until| until > now).await;
        assert!(
            asleep.is_some(),
            "the firing task never went to sleep: planned {:?}, sleepers {:?}",
            self.engine.asleep_until(),
            self.clock.sleepers()
        );
        self.hub.events().ok().filter(|e| e.len() > n)
    }

    /// Waits until the firing task sleeps on the clock until a time `wanted` accepts; that
    /// time, or `None` at the deadline.
    async fn asleep(&self, wanted: impl Fn(Timestamp) -> bool) -> Option<Timestamp> {
        wait_for(WAIT, || async {
            let until = self.engine.asleep_until()?;
            (wanted(until) && self.clock.sleepers().contains(&until)).then_some(until)
        })
        .await
    }

    /// Nothing fired, and the firing task is asleep: nothing fires until the clock moves.
    async fn no_events(&self) {
        let fired = self.more_events(0).await;
        assert!(fired.is_none(), "fired too early: {fired:?}");
    }
}

/// What another instance (`engine-b`) claims at `now`, straight from the store.
async fn claimed_by_another(store: &Arc<dyn Store>, now: Timestamp) -> Vec<ClaimedTimer> {
    let lease = Lease {
        owner: "engine-b".into(),
        until: now.saturating_add(secs(10)),
    };
    store
        .claim_due(now.into(), 10, &lease)
        .await
        .expect("claim")
}

async fn dead_letters(hub: &MemoryHub, n: usize) -> Option<Vec<DeadLetter>> {
    wait_for(WAIT, || async {
        hub.dead_letters().ok().filter(|d| d.len() >= n)
    })
    .await
}

/// Whether every command sent is acknowledged within the wait.
async fn all_acknowledged(hub: &MemoryHub) -> bool {
    wait_for(WAIT, || async {
        (hub.unacknowledged().ok()? == 0).then_some(())
    })
    .await
    .is_some()
}

async fn timer_where(store: &Arc<dyn Store>, id: &str, pred: impl Fn(&Timer) -> bool) -> Timer {
    key_where(store, &TimerKey::new("t", id), pred).await
}

/// The timer of `key` once `pred` holds for it; panics at the deadline.
async fn key_where(store: &Arc<dyn Store>, key: &TimerKey, pred: impl Fn(&Timer) -> bool) -> Timer {
    wait_for(WAIT, || async {
        store.get(key).await.ok().flatten().filter(|t| pred(t))
    })
    .await
    .unwrap_or_else(|| panic!("timer {key} never reached the expected state"))
}

/// A memory store with injected faults: the first `schedule_failures` schedules fail, as an
/// unreachable database would; with `hang_fired`, settling a fired timer (one-shot or series) never
/// returns (the process "dies" between publishing and marking); the first `hung_claims` claims
/// and the first `hung_next_due` reads of the next due time never answer (a connection that
/// hangs without a reset); `notices` are the store's wake-ups (as PostgreSQL's NOTIFY of a
/// timer another instance scheduled); the first `renew_failures` renewals
/// of leases fail, and the store refuses the first `settle_failures` settles.
struct Faulty {
    inner: Arc<dyn Store>,
    schedule_failures: AtomicU32,
    schedule_panics: AtomicU32,
    hang_fired: bool,
    hung_claims: AtomicU32,
    hung_next_due: AtomicU32,
    notices: Option<tokio::sync::broadcast::Sender<Timestamp>>,
    renew_failures: AtomicU32,
    /// Renewals that are real I/O: pending at their first poll, as a SQL store's are.
    renew_yields: bool,
    /// Offers shared allowances (`limits.rate.shared`) whose calls never answer, as a
    /// connection that hangs without a reset.
    hung_allowances: bool,
    settle_failures: AtomicU32,
}

impl Faulty {
    fn new(inner: Arc<dyn Store>) -> Self {
        Faulty {
            inner,
            schedule_failures: AtomicU32::new(0),
            schedule_panics: AtomicU32::new(0),
            hang_fired: false,
            hung_claims: AtomicU32::new(0),
            hung_next_due: AtomicU32::new(0),
            notices: None,
            renew_failures: AtomicU32::new(0),
            renew_yields: false,
            hung_allowances: false,
            settle_failures: AtomicU32::new(0),
        }
    }
}

/// Takes one of the injected failures left in `counter`, if any is.
fn injected(counter: &AtomicU32) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

#[async_trait]
impl Store for Faulty {
    fn name(&self) -> &'static str {
        "faulty"
    }
    async fn schedule(&self, t: &[NewTimer], now: Timestamp) -> Result<Vec<ScheduleOutcome>> {
        assert!(!injected(&self.schedule_panics), "an injected panic");
        if injected(&self.schedule_failures) {
            return Err(Error::unavailable("injected store outage"));
        }
        self.inner.schedule(t, now).await
    }
    async fn claim_due(&self, due: Due, limit: usize, lease: &Lease) -> Result<Vec<ClaimedTimer>> {
        if injected(&self.hung_claims) {
            std::future::pending::<()>().await;
        }
        self.inner.claim_due(due, limit, lease).await
    }
    async fn settle(
        &self,
        claims: &[(ClaimedTimer, Settlement)],
        owner: &str,
        at: Timestamp,
    ) -> Result<u64> {
        let fired = |s: &Settlement| matches!(s, Settlement::Reached | Settlement::Next(_));
        if self.hang_fired && claims.iter().any(|(_, s)| fired(s)) {
            std::future::pending::<()>().await;
        }
        if injected(&self.settle_failures) {
            // Refused, not unreachable (an outage is waited for).
            return Err(Error::internal("injected: the store refused the mark"));
        }
        self.inner.settle(claims, owner, at).await
    }
    async fn renew(&self, keys: &[TimerKey], owner: &str, until: Timestamp) -> Result<u64> {
        if injected(&self.renew_failures) {
            return Err(Error::unavailable("injected renewal failure"));
        }
        if self.renew_yields {
            tokio::task::yield_now().await;
        }
        self.inner.renew(keys, owner, until).await
    }
    async fn next_due_at(&self) -> Result<Option<Timestamp>> {
        if injected(&self.hung_next_due) {
            std::future::pending::<()>().await;
        }
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

    fn tenant_counts(&self) -> &dyn timer_core::TenantCounts {
        self.inner.tenant_counts()
    }

    fn queries(&self) -> &dyn timer_core::TimerQueries {
        self.inner.queries()
    }

    fn control(&self) -> &dyn timer_core::TimerControl {
        self.inner.control()
    }

    fn history(&self) -> &dyn timer_core::TimerHistory {
        self.inner.history()
    }
    fn wakeups(&self) -> Option<tokio::sync::broadcast::Receiver<Timestamp>> {
        self.notices.as_ref().map(|n| n.subscribe())
    }

    fn shared_allowances(&self) -> Option<&dyn timer_core::SharedAllowances> {
        self.hung_allowances
            .then_some(self as &dyn timer_core::SharedAllowances)
    }
}

#[async_trait]
impl timer_core::SharedAllowances for Faulty {
    async fn take(&self, _take: &timer_core::Take<'_>) -> Result<timer_core::Taken> {
        std::future::pending().await
    }
    async fn forget(&self, _before_us: i64) -> Result<u64> {
        std::future::pending().await
    }
}

/// How the test broker publishes.
#[derive(Debug, Clone)]
enum Publish {
    /// As the memory broker does.
    Works,
    /// The first `n` publishes fail.
    FailsFirst(u32),
    /// No publish ever completes.
    Hangs,
    /// Each publish waits until the gate is opened (`notify_one`), then works.
    Gated(Arc<tokio::sync::Notify>),
    /// As `Gated`, each publish's events counted in `started` as it begins.
    Counted {
        started: Arc<AtomicU32>,
        gate: Arc<tokio::sync::Notify>,
    },
    /// The first `n` publishes panic (as an SDK that panics on input it should refuse).
    PanicsFirst(u32),
    /// Events of this tenant come back undelivered, one by one (as RabbitMQ returns an event
    /// no queue is bound for); the others are published.
    Refuses(String),
    /// In the first `n` publishes that hold events of this tenant, those are left for a later
    /// publish, not tried (as a broker that looks up only so many destinations at once); the
    /// others are published.
    Defers(String, u32),
}

/// Dead letters the test broker refuses while `refusing` is set (as a broker that is down
/// would), or holds until `held` has permits (a slow one), each try counted; by default none is
/// refused or held.
#[derive(Clone, Default)]
struct DeadLetterGate {
    refusing: Arc<std::sync::atomic::AtomicBool>,
    held: Option<Arc<tokio::sync::Semaphore>>,
    tries: Arc<AtomicU32>,
}

impl DeadLetterGate {
    fn refusing() -> Self {
        let gate = DeadLetterGate::default();
        gate.refusing.store(true, Ordering::SeqCst);
        gate
    }

    fn holding() -> Self {
        DeadLetterGate {
            held: Some(Arc::new(tokio::sync::Semaphore::new(0))),
            ..DeadLetterGate::default()
        }
    }

    /// Lets one held dead letter go out.
    fn let_one(&self) {
        if let Some(held) = &self.held {
            held.add_permits(1);
        }
    }

    /// Lets the held dead letters go out, and every one after them.
    fn release(&self) {
        if let Some(held) = &self.held {
            held.close();
        }
    }

    fn open(&self) {
        self.refusing.store(false, Ordering::SeqCst);
    }

    /// Waits until `n` dead letters were tried; false at the deadline.
    async fn tried(&self, n: u32) -> bool {
        wait_for(WAIT, || async {
            (self.tries.load(Ordering::SeqCst) >= n).then_some(())
        })
        .await
        .is_some()
    }
}

/// The memory broker, its publishing as [`Publish`] says, its dead letters as the
/// [`DeadLetterGate`] lets them.
struct FaultyBroker {
    inner: MemoryBroker,
    failures: AtomicU32,
    panics: AtomicU32,
    hangs: bool,
    gate: Option<Arc<tokio::sync::Notify>>,
    started: Option<Arc<AtomicU32>>,
    refuses: Option<String>,
    defers: Option<(String, AtomicU32)>,
    dead_letters: DeadLetterGate,
}

impl FaultyBroker {
    fn new(inner: MemoryBroker, publish: Publish, dead_letters: DeadLetterGate) -> Self {
        let mut broker = FaultyBroker {
            inner,
            failures: AtomicU32::new(0),
            panics: AtomicU32::new(0),
            hangs: false,
            gate: None,
            started: None,
            refuses: None,
            defers: None,
            dead_letters,
        };
        match publish {
            Publish::Works => {}
            Publish::FailsFirst(n) => broker.failures = AtomicU32::new(n),
            Publish::Hangs => broker.hangs = true,
            Publish::Gated(gate) => broker.gate = Some(gate),
            Publish::Counted { started, gate } => {
                (broker.started, broker.gate) = (Some(started), Some(gate));
            }
            Publish::PanicsFirst(n) => broker.panics = AtomicU32::new(n),
            Publish::Refuses(tenant) => broker.refuses = Some(tenant),
            Publish::Defers(tenant, n) => broker.defers = Some((tenant, AtomicU32::new(n))),
        }
        broker
    }
}

#[async_trait]
impl Broker for FaultyBroker {
    fn name(&self) -> &'static str {
        "faulty"
    }
    async fn receive(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>> {
        self.inner.receive(max, wait).await
    }
    async fn ack(&self, tags: &[u64]) -> Result<()> {
        self.inner.ack(tags).await
    }
    fn ack_wait(&self) -> Option<Duration> {
        self.inner.ack_wait()
    }
    async fn keep(&self, tags: &[u64]) -> Result<()> {
        self.inner.keep(tags).await
    }
    fn check_key(&self, key: &TimerKey) -> std::result::Result<(), KeyLimit> {
        self.inner.check_key(key)
    }
    fn check_target(&self, target: &Target) -> std::result::Result<String, String> {
        self.inner.check_target(target)
    }
    async fn publish(&self, events: &[OutboundEvent]) -> Result<Vec<Undelivered>> {
        if self.hangs {
            std::future::pending::<()>().await;
        }
        if let Some(started) = &self.started {
            started.fetch_add(events.len() as u32, Ordering::SeqCst);
        }
        if let Some(gate) = &self.gate {
            gate.notified().await;
        }
        if injected(&self.failures) {
            return Err(Error::unavailable("injected publish failure"));
        }
        if injected(&self.panics) {
            panic!("injected publish panic");
        }
        if let Some((tenant, left)) = &self.defers {
            let (mine, others): (Vec<_>, Vec<_>) = events
                .iter()
                .enumerate()
                .partition(|(_, e)| &e.key.tenant_id == tenant);
            if !mine.is_empty() && injected(left) {
                let others: Vec<OutboundEvent> =
                    others.into_iter().map(|(_, e)| e.clone()).collect();
                self.inner.publish(&others).await?;
                return Ok(mine
                    .into_iter()
                    .map(|(index, _)| {
                        let error = Error::unavailable("injected: not looked up yet");
                        Undelivered::deferred(index, error)
                    })
                    .collect());
            }
        }
        let Some(refused) = &self.refuses else {
            return self.inner.publish(events).await;
        };
        let (mine, others): (Vec<_>, Vec<_>) = events
            .iter()
            .enumerate()
            .partition(|(_, e)| &e.key.tenant_id == refused);
        let others: Vec<OutboundEvent> = others.into_iter().map(|(_, e)| e.clone()).collect();
        self.inner.publish(&others).await?;
        Ok(mine
            .into_iter()
            .map(|(index, _)| {
                let error = Error::unavailable(format!("injected: no queue bound for {refused}"));
                Undelivered::new(index, error)
            })
            .collect())
    }
    async fn dead_letter(&self, body: &[u8], reason: &str) -> Result<()> {
        self.dead_letters.tries.fetch_add(1, Ordering::SeqCst);
        if let Some(held) = &self.dead_letters.held {
            // Returns once a permit is added (`let_one`: each lets one dead letter go), or the
            // gate is closed (`release`: every one goes).
            if let Ok(permit) = held.acquire().await {
                permit.forget();
            }
        }
        if self.dead_letters.refusing.load(Ordering::SeqCst) {
            return Err(Error::unavailable("injected: dead letters refused"));
        }
        self.inner.dead_letter(body, reason).await
    }
    async fn health(&self) -> Result<()> {
        self.inner.health().await
    }
}

#[tokio::test]
async fn timer_due_in_50ms_fires_without_waiting_for_the_poll_interval() {
    let r = rig();
    let out = r
        .schedule(&[timer("soon", T0.saturating_add(ms(50)))])
        .await;
    assert_eq!(out, vec![Scheduled::Stored(ScheduleOutcome::Created)]);
    r.clock.advance(ms(49));
    r.no_events().await;
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

/// `engine.claim_ahead`: the timer is claimed that long before its due time and held until
/// then; it fires at its due time exactly, never before.
#[tokio::test]
async fn a_timer_claimed_ahead_fires_at_its_due_time_and_not_before() {
    let mut setup = Setup::default();
    setup.config.claim_ahead = ms(50);
    let r = setup.start();
    let due = T0.saturating_add(secs(1));
    r.schedule(&[timer("ahead", due)]).await;
    let look = r.asleep(|until| until > T0).await;
    assert_eq!(
        look,
        Some(T0.saturating_add(ms(950))),
        "asleep until claim_ahead before the due time"
    );
    r.clock.advance(ms(950));
    timer_where(&r.store, "ahead", |t| {
        t.lease_owner.as_deref() == Some("engine-a")
    })
    .await;
    // Claimed, held until its due time: asleep until then, nothing published.
    let held = r.asleep(|until| until > T0.saturating_add(ms(950))).await;
    assert!(
        held.is_some_and(|until| until <= due),
        "asleep until {held:?}, after the due time {due}"
    );
    r.no_events().await;
    r.clock.set(due.saturating_sub(ms(1)));
    r.no_events().await;
    r.clock.set(due);
    let fired = events(&r.hub, 1).await.expect("fired at its due time");
    let envelope: serde_json::Value = serde_json::from_slice(&fired[0].body).expect("json");
    assert_eq!(envelope["timestampMs"], due.as_millis(), "at its due time");
    let t = timer_where(&r.store, "ahead", |t| t.state == TimerState::Reached).await;
    assert_eq!(t.reached_at, Some(due));
}

/// A sooner timer scheduled while others are held wakes the firing task, which claims it too;
/// a retry is not claimed ahead of its time (only first due times are).
#[tokio::test]
async fn claiming_ahead_takes_a_sooner_timer_and_leaves_a_retry_until_its_time() {
    let mut setup = Setup::publishing(Publish::FailsFirst(1));
    setup.config.claim_ahead = ms(50);
    let r = setup.start();
    r.schedule(&[timer("retried", T0)]).await;
    let t = timer_where(&r.store, "retried", |t| t.attempts == 1).await;
    let retry_at = T0.saturating_add(secs(1));
    assert_eq!(t.available_at, retry_at);
    r.schedule(&[timer("later", T0.saturating_add(ms(1_040)))])
        .await;
    r.clock.advance(ms(990));
    timer_where(&r.store, "later", |t| t.lease_owner.is_some()).await;
    let t = timer_where(&r.store, "retried", |_| true).await;
    assert_eq!(
        t.lease_owner, None,
        "a retry is not claimed ahead of its time"
    );
    // A sooner one, scheduled while `later` is held.
    r.schedule(&[timer("sooner", T0.saturating_add(ms(1_020)))])
        .await;
    timer_where(&r.store, "sooner", |t| t.lease_owner.is_some()).await;
    r.no_events().await;
    r.clock.set(retry_at);
    let fired = events(&r.hub, 1).await.expect("the retry, at its time");
    assert_eq!(fired[0].key.service_call_id, "retried");
    r.clock.set(T0.saturating_add(ms(1_040)));
    let fired = events(&r.hub, 3).await.expect("all three");
    let order: Vec<&str> = fired
        .iter()
        .map(|e| e.key.service_call_id.as_str())
        .collect();
    assert_eq!(order, ["retried", "sooner", "later"]);
}

/// Timers held until their due time at shutdown are given back, claimable at their due time
/// (not before), with no attempt counted.
#[tokio::test]
async fn timers_claimed_ahead_are_given_back_at_shutdown_claimable_at_their_due_time() {
    let mut setup = Setup::default();
    setup.config.claim_ahead = ms(50);
    let r = setup.start();
    let due = T0.saturating_add(ms(30));
    r.schedule(&[timer("held", due)]).await;
    timer_where(&r.store, "held", |t| {
        t.lease_owner.as_deref() == Some("engine-a")
    })
    .await;
    r.shutdown.cancel();
    tokio::time::timeout(WAIT, r.task)
        .await
        .expect("engine stops")
        .expect("no panic");
    assert!(r.hub.events().expect("events").is_empty(), "nothing fired");
    let t = timer_where(&r.store, "held", |_| true).await;
    assert_eq!(t.lease_owner, None, "given back");
    assert_eq!((t.attempts, t.available_at), (0, due));
    let before = claimed_by_another(&r.store, T0).await;
    assert!(
        before.is_empty(),
        "claimable before its due time: {before:?}"
    );
    let at_due = claimed_by_another(&r.store, due).await;
    assert_eq!(at_due.len(), 1, "claimable at its due time");
}

#[tokio::test]
async fn a_sooner_timer_wakes_the_sleeping_firing_task() {
    let r = rig();
    let late = T0.saturating_add(secs(600));
    r.schedule(&[timer("late", late)]).await;
    // The firing task is asleep until the late timer (the poll interval is an hour) ...
    let asleep = r.asleep(|until| until == late).await;
    assert!(
        asleep.is_some(),
        "asleep until {late}: {:?}",
        r.clock.sleepers()
    );
    // ... and a sooner one wakes it: it sleeps until the sooner one's due time instead,
    // before the clock moves at all.
    let early = T0.saturating_add(ms(20));
    r.schedule(&[timer("early", early)]).await;
    let woken = r.asleep(|until| until == early).await;
    assert!(
        woken.is_some(),
        "the sooner timer did not wake the firing task: {:?}",
        r.clock.sleepers()
    );
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
            let due = Timestamp::from_millis(T0.as_millis() - 1000 + i);
            timer(&format!("p{i}"), due)
        })
        .collect();
    r.schedule(&batch).await;
    let fired = events(&r.hub, 5)
        .await
        .expect("all past-due timers fired without moving the clock");
    let order: Vec<&str> = fired
        .iter()
        .map(|e| e.key.service_call_id.as_str())
        .collect();
    assert_eq!(order, ["p0", "p1", "p2", "p3", "p4"]);
}

#[tokio::test]
async fn crash_between_publish_and_mark_gives_a_duplicate_not_a_loss() {
    crash_between_publish_and_mark(timer("dup", T0)).await;
}

/// The same for an occurrence of a series: it is published before the series moves on.
#[tokio::test]
async fn crash_between_publishing_an_occurrence_and_moving_on_gives_a_duplicate_not_a_loss() {
    crash_between_publish_and_mark(every_second("dup", T0)).await;
}

/// The instance "dies" after publishing `dup` and before its settle: the store still has it
/// Scheduled at its due time, and the next instance fires it again, with the same event id,
/// once the lease expired.
async fn crash_between_publish_and_mark(dup: NewTimer) {
    let durable: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let hub = MemoryHub::new(MemoryConfig::default());
    let clock = Arc::new(ManualClock::new(T0));
    let first = Setup {
        store: Arc::new(Faulty {
            hang_fired: true,
            ..Faulty::new(durable.clone())
        }),
        hub: hub.clone(),
        clock: clock.clone(),
        ..Setup::default()
    }
    .start();
    first.schedule(&[dup]).await;
    events(&hub, 1).await.expect("published once");
    first.task.abort(); // the crash: published, never marked
    let _ = first.task.await;
    let t = timer_where(&durable, "dup", |_| true).await;
    assert_eq!(t.state, TimerState::Scheduled);
    assert_eq!((t.due_at, t.occurrences), (T0, 0), "not moved on: {t:?}");

    let second = Setup {
        store: durable.clone(),
        hub: hub.clone(),
        clock: clock.clone(),
        config: EngineConfig {
            instance_id: "engine-b".into(),
            ..config()
        },
        ..Setup::default()
    }
    .start();
    // Nothing happens while the dead instance's lease lives...
    clock.advance(secs(9));
    let early = second.more_events(1).await;
    assert!(
        early.is_none(),
        "fired again while the lease lived: {early:?}"
    );
    // ...and the timer fires again once it expired.
    clock.advance(secs(1));
    let fired = events(&hub, 2)
        .await
        .expect("fired again after the lease expired");
    assert_eq!(fired[0].key, fired[1].key);
    assert_eq!(
        fired[0].id, fired[1].id,
        "a repeat carries the same envelope id, so brokers and consumers can drop it"
    );
    let t = timer_where(&durable, "dup", |t| {
        t.occurrences >= 1 || t.state == TimerState::Reached
    })
    .await;
    if t.state == TimerState::Reached {
        assert_eq!(t.lease_owner.as_deref(), Some("engine-b"));
    }
    second.shutdown.cancel();
}

#[tokio::test]
async fn failed_publish_is_retried_with_exponential_backoff() {
    let r = Setup::publishing(Publish::FailsFirst(2)).start();
    r.schedule(&[timer("retry", T0)]).await;

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
        T0.saturating_add(secs(1)),
        "first retry after retry_base"
    );

    r.clock.advance(secs(1));
    let t = timer_where(&r.store, "retry", |t| t.attempts == 2).await;
    assert_eq!(
        t.available_at,
        T0.saturating_add(secs(3)),
        "second retry after 2 x retry_base"
    );
    r.clock.advance(ms(1999));
    r.no_events().await;
    r.clock.advance(ms(1));
    events(&r.hub, 1)
        .await
        .expect("published on the third attempt");
    let t = timer_where(&r.store, "retry", |t| t.state == TimerState::Reached).await;
    assert_eq!(t.attempts, 2, "attempts stay visible after success");
}

/// A panic in the firing task (here the broker's publish) does not stop firing for good: the
/// task is started again after the retry backoff, `tasks_down` reports it meanwhile (`/readyz`
/// answers 503), and the timer it held fires once its lease runs out.
#[tokio::test]
async fn a_firing_task_that_panics_is_restarted_and_reported_down_meanwhile() {
    let r = Setup::publishing(Publish::PanicsFirst(1)).start();
    r.schedule(&[timer("poison", T0)]).await;
    let down = wait_for(WAIT, || async {
        Some(r.engine.tasks_down()).filter(|d| !d.is_empty())
    })
    .await
    .expect("the firing task is reported down");
    assert_eq!(down[0].0, "firing", "{down:?}");
    assert!(down[0].1.contains("injected publish panic"), "{down:?}");
    wait_for(WAIT, || async {
        r.engine.tasks_down().is_empty().then_some(())
    })
    .await
    .expect("the firing task runs again after retry_base");
    r.no_events().await;
    r.clock.advance(secs(10)); // the lease of the panicked batch runs out
    events(&r.hub, 1)
        .await
        .expect("fired by the restarted task");
    timer_where(&r.store, "poison", |t| t.state == TimerState::Reached).await;
}

/// An event the broker refuses on its own (a tenant whose queue is unbound) is retried on its
/// own backoff with its own error; the other tenant's event of the same batch is delivered and
/// Reached, with no error and no attempt counted.
#[tokio::test]
async fn an_event_the_broker_refuses_does_not_hold_back_the_rest_of_its_batch() {
    let r = Setup::publishing(Publish::Refuses("unbound".into())).start();
    let unbound = NewTimer {
        key: TimerKey::new("unbound", "a"),
        ..timer("a", T0)
    };
    r.schedule(&[unbound, timer("b", T0)]).await;
    let fired = events(&r.hub, 1).await.expect("b is delivered");
    assert_eq!(fired.len(), 1);
    assert_eq!(fired[0].key, TimerKey::new("t", "b"));
    let b = timer_where(&r.store, "b", |t| t.state == TimerState::Reached).await;
    assert_eq!((b.attempts, b.last_error), (0, None));
    // Released for a retry.
    let a = key_where(&r.store, &TimerKey::new("unbound", "a"), |a| {
        a.attempts == 1
    })
    .await;
    assert_eq!(a.state, TimerState::Scheduled);
    assert_eq!(
        a.available_at,
        T0.saturating_add(secs(1)),
        "after retry_base"
    );
    assert!(
        a.last_error
            .as_deref()
            .is_some_and(|e| e.contains("no queue bound for unbound")),
        "{a:?}"
    );
}

/// An event the broker left for a later publish (not tried: its destination not looked up yet)
/// counts no attempt: released at once with nothing against it, it goes out in a later
/// publish, and `engine.max_attempts` never gives it up for being left.
#[tokio::test]
async fn an_event_the_broker_defers_counts_no_attempt_and_goes_out_later() {
    let mut setup = Setup::publishing(Publish::Defers("later".into(), 3));
    setup.config.max_attempts = 2;
    let r = setup.start();
    let later = NewTimer {
        key: TimerKey::new("later", "a"),
        ..timer("a", T0)
    };
    r.schedule(&[later, timer("b", T0)]).await;
    // The clock does not move: a backoff would hold it.
    let a = key_where(&r.store, &TimerKey::new("later", "a"), |a| {
        a.state == TimerState::Reached
    })
    .await;
    assert_eq!((a.attempts, a.last_error), (0, None));
    let fired = events(&r.hub, 2).await.expect("both delivered");
    assert_eq!(fired.len(), 2, "{fired:?}");
    assert!(r.hub.dead_letters().expect("dead letters").is_empty());
}

/// A batch the broker confirmed in part settles what it delivered while the timers it refused
/// are given up: a slow dead letter does not keep the delivered ones leased, their leases no
/// longer renewed (another instance would fire them again). Until the refused ones are given
/// up, the firing task is not reported asleep.
#[tokio::test]
async fn a_batch_settles_what_it_delivered_while_its_refused_timers_are_given_up() {
    let mut setup = Setup::publishing(Publish::Refuses("unbound".into()));
    setup.config.max_attempts = 1;
    setup.dead_letters = DeadLetterGate::holding();
    let gate = setup.dead_letters.clone();
    let r = setup.start();
    let unbound = NewTimer {
        key: TimerKey::new("unbound", "a"),
        ..timer("a", T0)
    };
    r.schedule(&[unbound, timer("b", T0)]).await;
    assert!(gate.tried(1).await, "a's TimerFailed is on its way");
    timer_where(&r.store, "b", |t| t.state == TimerState::Reached).await;
    assert_eq!(
        r.engine.asleep_until(),
        None,
        "not asleep while what the batch fired is not out (a is still leased)"
    );
    gate.release();
    // a fails once its dead letter went out.
    key_where(&r.store, &TimerKey::new("unbound", "a"), |a| {
        a.state == TimerState::Failed
    })
    .await;
}

#[tokio::test]
async fn shutdown_releases_claims() {
    let r = Setup::publishing(Publish::Hangs).start();
    r.schedule(&[timer("held", T0)]).await;
    timer_where(&r.store, "held", |t| {
        t.lease_owner.as_deref() == Some("engine-a")
    })
    .await;
    r.shutdown.cancel();
    tokio::time::timeout(WAIT, r.task)
        .await
        .expect("engine stops within the grace period")
        .expect("no panic");
    let t = timer_where(&r.store, "held", |_| true).await;
    assert_eq!(t.lease_owner, None, "claim released");
    assert_eq!(t.attempts, 0, "a shutdown is not a failed attempt");
    let claimed = claimed_by_another(&r.store, T0).await;
    assert_eq!(
        claimed.len(),
        1,
        "another instance can fire it at once, without waiting for the lease"
    );
}

/// A broker whose publishes wait for a confirm the test gives ([`Publish::Counted`]), and the
/// events handed to it so far.
struct Confirms {
    started: Arc<AtomicU32>,
    gate: Arc<tokio::sync::Notify>,
}

impl Confirms {
    /// A setup publishing through such a broker, claiming 50 ms ahead.
    fn setup() -> (Setup, Confirms) {
        let confirms = Confirms {
            started: Arc::new(AtomicU32::new(0)),
            gate: Arc::new(tokio::sync::Notify::new()),
        };
        let mut setup = Setup::publishing(Publish::Counted {
            started: confirms.started.clone(),
            gate: confirms.gate.clone(),
        });
        setup.config.claim_ahead = ms(50);
        (setup, confirms)
    }

    /// How many events were handed to the broker, once at least `n` were; None at the deadline.
    async fn sent(&self, n: u32) -> Option<u32> {
        wait_for(WAIT, || async {
            let sent = self.started.load(Ordering::SeqCst);
            (sent >= n).then_some(sent)
        })
        .await
    }

    /// `first` (due at T0) being published, awaiting its confirm, and `second` (due 10 ms
    /// later, within `claim_ahead`) claimed.
    async fn one_publishing_one_claimed(&self, r: &Rig) {
        r.schedule(&[timer("first", T0)]).await;
        self.sent(1).await.expect("the first is being published");
        r.schedule(&[timer("second", T0.saturating_add(ms(10)))])
            .await;
        timer_where(&r.store, "second", |t| t.lease_owner.is_some()).await;
    }

    /// Confirms one waiting publish (or the next to come).
    fn confirm_one(&self) {
        self.gate.notify_one();
    }
}

/// A fire does not wait for an earlier batch's confirm: a held timer that comes due while the
/// broker has not yet confirmed the batch before it is published at once, beside it
/// (`timer/src/engine/publish.rs`); both are settled once confirmed.
#[tokio::test]
async fn a_timer_due_while_a_publish_awaits_its_confirm_is_published_beside_it() {
    let (setup, confirms) = Confirms::setup();
    let r = setup.start();
    // One claim takes both: the second is due within claim_ahead.
    r.schedule(&[
        timer("first", T0),
        timer("second", T0.saturating_add(ms(10))),
    ])
    .await;
    confirms.sent(1).await.expect("the first publish starts");
    r.clock.advance(ms(10));
    confirms
        .sent(2)
        .await
        .expect("the second publish starts while the first awaits its confirm");
    assert!(
        r.hub.events().unwrap_or_default().is_empty(),
        "neither is confirmed yet"
    );
    confirms.confirm_one();
    confirms.confirm_one();
    events(&r.hub, 2).await.expect("both go out");
    for id in ["first", "second"] {
        timer_where(&r.store, id, |t| t.state == TimerState::Reached).await;
    }
}

/// A claim waits for the confirms of the batches fired before it at most a fifth of
/// `engine.claim_ahead` (`timer/src/engine/publish.rs`): a timer scheduled while a publish
/// awaits a confirm that does not come is still claimed, and published when due.
#[tokio::test]
async fn a_claim_waits_for_an_unconfirmed_publish_only_so_long() {
    let (setup, confirms) = Confirms::setup();
    let r = setup.start();
    confirms.one_publishing_one_claimed(&r).await;
    r.clock.advance(ms(10));
    confirms
        .sent(2)
        .await
        .expect("the second is published while the first still awaits its confirm");
}

/// At most `engine.batch_size` timers are being published at once: a fire takes no more than
/// the room the publishes awaiting their confirms leave.
#[tokio::test]
async fn at_most_a_batch_of_timers_is_being_published_at_once() {
    let (mut setup, confirms) = Confirms::setup();
    setup.config.batch_size = 3;
    let r = setup.start();
    let later = T0.saturating_add(ms(10));
    r.schedule(&[timer("first", T0)]).await;
    assert_eq!(
        confirms.sent(1).await,
        Some(1),
        "the first is being published"
    );
    // Three come due, one claim's worth, while the first awaits its confirm.
    r.schedule(&[timer("a", later), timer("b", later), timer("c", later)])
        .await;
    r.clock.advance(ms(10));
    assert_eq!(
        confirms.sent(2).await,
        Some(3),
        "two of them start beside the first: three in all, one batch"
    );
    confirms.confirm_one();
    assert_eq!(
        confirms.sent(4).await,
        Some(4),
        "the third once the first is confirmed"
    );
}

/// A store that panics while a group commit writes single schedules: that batch's callers get
/// an error, and the next schedule is written, not queued for ever behind the flag of a flush
/// task that is gone.
#[tokio::test]
async fn a_panic_while_writing_single_schedules_holds_back_no_later_one() {
    let r = Setup {
        store: Arc::new(Faulty {
            schedule_panics: AtomicU32::new(1),
            ..Faulty::new(Arc::new(MemoryStore::new()))
        }),
        ..Setup::default()
    }
    .start();
    let later = T0.saturating_add(secs(3600));
    let e = r
        .engine
        .schedule_one(timer("first", later))
        .await
        .expect_err("its flush panicked");
    assert!(e.to_string().contains("stopped without an answer"), "{e}");
    let second = tokio::time::timeout(WAIT, r.engine.schedule_one(timer("second", later)))
        .await
        .expect("not queued behind the flag of the flush that panicked")
        .expect("written");
    assert_eq!(second, Scheduled::Stored(ScheduleOutcome::Created));
}

/// Shared allowances (`limits.rate.shared`) in a store that stops answering cost a schedule
/// `engine.store_timeout`, not a wait for as long as the connection takes to give up: the
/// instance limits alone meanwhile, and paced fires go on.
#[tokio::test]
async fn shared_allowances_that_do_not_answer_hold_nothing_past_the_store_timeout() {
    let mut setup = Setup::on(Arc::new(Faulty {
        hung_allowances: true,
        ..Faulty::new(Arc::new(MemoryStore::new()))
    }));
    setup.config.store_timeout = ms(200);
    setup.limits.rate.schedules_per_second = 100;
    setup.limits.rate.shared = true;
    setup.limits.fire_rate.fires_per_second = 100;
    let r = setup.start();
    let timers = [timer("a", T0), timer("b", T0)];
    tokio::time::timeout(WAIT, r.engine.within_rate(&timers))
        .await
        .expect("the rate is checked without the store's answer")
        .expect("within this instance's own limit");
    r.schedule(&timers).await;
    let e = events(&r.hub, 2).await.expect("both fire, paced here");
    assert_eq!(e.len(), 2);
}

/// A claim whose lease ran out while it waited for room to publish (behind a slow broker) is
/// not published on it: its lease is renewed first, and a timer cancelled meanwhile (its lease
/// gone, the cancel was final) never goes out; the claim behind it is fired.
#[tokio::test]
async fn a_claim_whose_lease_ran_out_while_it_waited_is_not_published_on_it() {
    let (mut setup, confirms) = Confirms::setup();
    setup.store = Arc::new(Faulty {
        renew_yields: true,
        ..Faulty::new(Arc::new(MemoryStore::new()))
    });
    setup.config.batch_size = 1;
    let lease = ms(500);
    setup.config.lease = lease;
    setup.config.publish_timeout = secs(3600);
    let r = setup.start();
    confirms.one_publishing_one_claimed(&r).await;
    // Due now, and held: no room while the first awaits its confirm.
    r.clock.advance(ms(10));
    // The lease runs on the monotonic clock: only its end, in real time, is what this waits for.
    tokio::time::sleep(lease).await;
    r.clock.advance(lease + ms(100));
    let key = TimerKey::new("t", "second");
    assert_eq!(
        r.engine.cancel(&key).await.expect("cancel"),
        CancelOutcome::Cancelled,
        "its lease ran out: the cancel is final"
    );
    let now = timer_core::Clock::now(r.clock.as_ref());
    r.schedule(&[timer("third", now)]).await;
    confirms.confirm_one();
    confirms.sent(2).await.expect("the next publish starts");
    confirms.confirm_one();
    let e = events(&r.hub, 2).await.expect("two events");
    let ids: Vec<&str> = e.iter().map(|e| e.key.service_call_id.as_str()).collect();
    assert_eq!(
        ids,
        ["first", "third"],
        "the cancelled timer never went out"
    );
    let second = timer_where(&r.store, "second", |_| true).await;
    assert_eq!(second.state, TimerState::Cancelled);
}

#[tokio::test]
async fn a_publish_confirmed_during_the_shutdown_grace_is_settled() {
    let gate = Arc::new(tokio::sync::Notify::new());
    let r = Setup {
        config: EngineConfig {
            shutdown_grace: secs(30),
            ..config()
        },
        ..Setup::publishing(Publish::Gated(gate.clone()))
    }
    .start();
    r.schedule(&[timer("in-flight", T0)]).await;
    timer_where(&r.store, "in-flight", |t| {
        t.lease_owner.as_deref() == Some("engine-a")
    })
    .await;
    // Shutdown while the publish waits; the broker confirms it within the grace.
    r.shutdown.cancel();
    gate.notify_one();
    tokio::time::timeout(WAIT, r.task)
        .await
        .expect("engine stops once the publish is settled")
        .expect("no panic");
    events(&r.hub, 1).await.expect("the event went out");
    let t = timer_where(&r.store, "in-flight", |_| true).await;
    assert_eq!(
        t.state,
        TimerState::Reached,
        "settled at once, not left leased to fire again when the lease ends"
    );
}

#[tokio::test]
async fn a_publish_longer_than_the_lease_keeps_its_timer_from_another_instance() {
    let gate = Arc::new(tokio::sync::Notify::new());
    let lease = secs(1);
    let slow = Setup {
        config: EngineConfig {
            lease,
            publish_timeout: secs(3600),
            ..config()
        },
        ..Setup::publishing(Publish::Gated(gate.clone()))
    };
    let (store, hub, clock) = (slow.store.clone(), slow.hub.clone(), slow.clock.clone());
    let r = slow.start();
    r.schedule(&[timer("slow", T0)]).await;
    timer_where(&r.store, "slow", |t| {
        t.lease_owner.as_deref() == Some("engine-a")
    })
    .await;
    // A second instance on the same store, free to claim whatever is claimable.
    let other = Setup {
        store,
        hub,
        clock,
        config: EngineConfig {
            instance_id: "engine-b".into(),
            ..config()
        },
        ..Setup::default()
    }
    .start();
    // Five leases long: each step moves past the lease's end as it was before the renewal
    // that this step waits for (renewals come every third of the lease, in real time).
    for _ in 0..10 {
        r.clock.advance(ms(500));
        let renewed_to = timer_core::Clock::now(r.clock.as_ref()).saturating_add(lease);
        timer_where(&r.store, "slow", |t| t.available_at == renewed_to).await;
    }
    gate.notify_one();
    let t = timer_where(&r.store, "slow", |t| t.state == TimerState::Reached).await;
    assert_eq!(t.lease_owner.as_deref(), Some("engine-a"));
    let fired: Vec<_> = history_of(&r, "slow")
        .await
        .into_iter()
        .filter(|c| c["type"] == "fired")
        .collect();
    assert_eq!(fired.len(), 1, "fired once, by the lease holder: {fired:?}");
    assert_eq!(fired[0]["instance"], "engine-a");
    let e = events(&r.hub, 1).await.expect("the event");
    assert_eq!(e.len(), 1, "engine-b never fired it: {e:?}");
    other.shutdown.cancel();
}

/// When the leases of a publish in flight cannot be renewed, the firing task stops waiting for
/// that publish before the leases run out (another instance may claim the timers then) and goes
/// on; the abandoned timers are left leased, unsettled, for whoever claims them after the lease.
#[tokio::test]
async fn a_publish_whose_leases_cannot_be_renewed_is_abandoned_before_they_run_out() {
    let mut setup = Setup {
        store: Arc::new(Faulty {
            renew_failures: AtomicU32::new(u32::MAX),
            ..Faulty::new(Arc::new(MemoryStore::new()))
        }),
        ..Setup::publishing(Publish::Hangs)
    };
    setup.config.lease = ms(600);
    // Far beyond the test's wait: only the abandonment ends the publish's wait.
    setup.config.publish_timeout = secs(60);
    let r = setup.start();
    r.schedule(&[timer("stranded", T0)]).await;
    timer_where(&r.store, "stranded", |t| t.lease_owner.is_some()).await;
    let asleep = r.asleep(|_| true).await;
    assert!(
        asleep.is_some(),
        "the firing task still waits for a publish whose leases it could not renew"
    );
    let t = timer_where(&r.store, "stranded", |_| true).await;
    assert_eq!(
        (t.state, t.attempts, t.lease_owner.as_deref()),
        (TimerState::Scheduled, 0, Some("engine-a")),
        "abandoned as it was: neither settled nor given back"
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
    for body in [
        good("g1"),
        "{not json".to_owned(),
        r#"{"tenantId":"t","dueTimeMs":1}"#.to_owned(),
        format!(
            r#"{{"tenantId":"t","serviceCallId":"{}","dueTimeMs":1}}"#,
            "x".repeat(500)
        ),
        r#"{"tenantId":"t\u0001","serviceCallId":"c","dueTimeMs":1}"#.to_owned(),
        r#"{"tenantId":"t","serviceCallId":"c","dueAt":"next tuesday"}"#.to_owned(),
        r#"{"type":"Explode","tenantId":"t"}"#.to_owned(),
        good("g2"),
    ] {
        r.hub.send_command(body).expect("send");
    }

    timer_where(&r.store, "g2", |t| t.state == TimerState::Scheduled).await;
    timer_where(&r.store, "g1", |t| t.state == TimerState::Scheduled).await;
    let letters = dead_letters(&r.hub, 6).await.expect("6 dead letters");
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
    assert!(
        all_acknowledged(&r.hub).await,
        "every command acknowledged, good or bad: the stream keeps flowing"
    );
}

/// A refused command is acknowledged only once its dead letter went out: while the broker
/// refuses dead letters, the command stays unacknowledged (the broker keeps it), and nothing
/// behind it is lost.
#[tokio::test]
async fn a_refused_command_stays_unacknowledged_until_its_dead_letter_went_out() {
    let (mut setup, gate) = Setup::default().refusing_dead_letters();
    setup.config.retry_base = ms(20);
    let r = setup.start();
    r.hub.send_command("{not json").expect("send");
    // Until the dead letter was tried twice, or the command acknowledged.
    let acknowledged = wait_for(WAIT, || async {
        let acknowledged = r.hub.unacknowledged().ok()? == 0;
        (acknowledged || gate.tries.load(Ordering::SeqCst) >= 2).then_some(acknowledged)
    })
    .await;
    assert_eq!(
        acknowledged,
        Some(false),
        "acknowledged a refused command whose dead letter did not go out (None: never tried)"
    );
    assert!(r.hub.dead_letters().expect("dead letters").is_empty());
    gate.open();
    let letters = dead_letters(&r.hub, 1).await.expect("the dead letter");
    assert!(letters[0].reason.starts_with("invalid_json"), "{letters:?}");
    assert!(
        all_acknowledged(&r.hub).await,
        "acknowledged once it went out"
    );
}

/// A schedule the store refuses (the tenant is at its pending limit) is acknowledged only once
/// its dead letter went out: a shutdown while the broker refuses dead letters leaves it with the
/// broker (the schedules of its batch that were stored are acknowledged), and the next engine
/// dead-letters it.
#[tokio::test]
async fn a_refused_schedule_whose_dead_letter_did_not_go_out_stays_for_the_next_engine() {
    let (mut setup, gate) = Setup::default().refusing_dead_letters();
    setup.limits.max_pending_per_tenant = 1;
    let (store, hub) = (setup.store.clone(), setup.hub.clone());
    let r = setup.start();
    let later = T0.saturating_add(secs(60));
    for id in ["1", "2"] {
        r.hub
            .send_command(format!(
                r#"{{"tenantId":"big","serviceCallId":"{id}","dueTimeMs":{}}}"#,
                later.as_millis()
            ))
            .expect("send");
    }
    assert!(gate.tried(1).await, "big/2's dead letter was tried");
    r.shutdown.cancel();
    r.task.await.expect("the engine stopped");
    drop(r.engine);
    let mut next = Setup {
        store,
        hub,
        ..Setup::default()
    };
    next.limits.max_pending_per_tenant = 1;
    let next = next.start();
    let letters = dead_letters(&next.hub, 1)
        .await
        .expect("big/2 dead-lettered by the next engine");
    assert!(
        letters[0].body.contains(r#""serviceCallId":"2""#),
        "{letters:?}"
    );
    assert!(all_acknowledged(&next.hub).await);
}

/// Commands held back by a tenant's rate are not acknowledged: a shutdown leaves them with the
/// broker, and the next engine stores them.
#[tokio::test]
async fn commands_held_at_shutdown_stay_with_the_broker_for_the_next_engine() {
    let mut setup = Setup::default();
    setup.limits.rate.schedules_per_second = 1;
    setup.limits.rate.burst = 1;
    let store = setup.store.clone();
    let hub = setup.hub.clone();
    let r = setup.start();
    let later = T0.saturating_add(secs(3600));
    for id in ["0", "1", "2"] {
        r.hub
            .send_command(format!(
                r#"{{"tenantId":"big","serviceCallId":"{id}","dueTimeMs":{}}}"#,
                later.as_millis()
            ))
            .expect("send");
    }
    let key = |id: &str| TimerKey::new("big", id);
    let held = wait_for(WAIT, || async {
        let stored = r.store.get(&key("0")).await.ok()??;
        (r.hub.unacknowledged().ok()? == 2).then_some(stored)
    })
    .await;
    assert!(held.is_some(), "one stored (the burst), two held");
    r.shutdown.cancel();
    r.task.await.expect("the engine stopped");
    drop(r.engine);
    for id in ["1", "2"] {
        assert!(store.get(&key(id)).await.expect("get").is_none());
    }
    let next = Setup {
        store: store.clone(),
        hub,
        ..Setup::default()
    }
    .start();
    for id in ["1", "2"] {
        let stored = wait_for(WAIT, || async { next.store.get(&key(id)).await.ok()? }).await;
        assert!(
            stored.is_some(),
            "big/{id}, held at the shutdown, stored by the next engine"
        );
    }
    assert!(all_acknowledged(&next.hub).await);
}

/// Without a wake-up (a timer another instance stored), the firing task still asks the store
/// at least every `engine.poll_interval`, and then sleeps until the timer it found.
#[tokio::test]
async fn the_firing_task_asks_the_store_at_least_every_poll_interval() {
    let mut setup = Setup::default();
    setup.config.poll_interval = secs(5);
    let r = setup.start();
    let first = r.asleep(|_| true).await.expect("asleep");
    assert!(
        first <= T0.saturating_add(secs(5)),
        "asleep until {first:?}, beyond the poll interval"
    );
    // Written straight into the store: nothing wakes this engine.
    r.store
        .schedule(&[timer("elsewhere", T0.saturating_add(secs(7)))], T0)
        .await
        .expect("schedule");
    r.clock.advance(secs(5));
    let next = r
        .asleep(|until| until > T0.saturating_add(secs(5)))
        .await
        .expect("asleep again");
    assert_eq!(
        next,
        T0.saturating_add(secs(7)),
        "after the poll it sleeps until the timer it found"
    );
    r.clock.advance(secs(2));
    events(&r.hub, 1).await.expect("fired at its due time");
}

/// A mark the store keeps refusing (not an outage: that is waited for) is given up after a few
/// tries: the firing task goes on with other timers, and the unmarked timer fires again once its
/// lease expired (a repeat with the same id, never a loss, never a stuck firing task).
#[tokio::test]
async fn a_mark_the_store_keeps_refusing_is_given_up_and_the_timer_fires_again() {
    let faulty = Arc::new(Faulty {
        settle_failures: AtomicU32::new(u32::MAX),
        ..Faulty::new(Arc::new(MemoryStore::new()))
    });
    let mut setup = Setup::on(faulty.clone());
    setup.config.retry_base = ms(20);
    let r = setup.start();
    r.schedule(&[
        timer("unmarked", T0),
        timer("next", T0.saturating_add(secs(1))),
    ])
    .await;
    events(&r.hub, 1).await.expect("published");
    // Refused five times (the engine's settle attempts), then given up: the settle runs behind
    // the firing task, which meanwhile sleeps until the next timer; it does not retry forever.
    let refused = wait_for(WAIT, || async {
        (faulty.settle_failures.load(Ordering::SeqCst) <= u32::MAX - 5).then_some(())
    })
    .await;
    assert!(refused.is_some(), "the store refused the mark five times");
    let asleep = r.asleep(|until| until > T0).await;
    assert!(asleep.is_some(), "the firing task still retries the mark");
    faulty.settle_failures.store(0, Ordering::SeqCst);
    r.clock.advance(secs(1));
    let fired = events(&r.hub, 2).await.expect("the next timer fired");
    assert_eq!(fired[1].key, TimerKey::new("t", "next"));
    // The lease of the unmarked one runs out (10 s): it fires again, with the same id.
    r.clock.advance(secs(10));
    let fired = events(&r.hub, 3)
        .await
        .expect("fired again after its lease");
    assert_eq!((&fired[2].key, fired[2].id), (&fired[0].key, fired[0].id));
    timer_where(&r.store, "unmarked", |t| t.state == TimerState::Reached).await;
}

/// A store call that never answers (a connection hanging without a reset) holds the firing task
/// only for `engine.store_timeout`: the claim is tried again and the timer fires.
#[tokio::test]
async fn a_store_call_that_hangs_is_given_up_after_the_store_timeout() {
    let mut setup = Setup::on(Arc::new(Faulty {
        hung_claims: AtomicU32::new(1),
        ..Faulty::new(Arc::new(MemoryStore::new()))
    }));
    setup.config.store_timeout = ms(200);
    setup.config.retry_base = ms(20);
    let r = setup.start();
    r.schedule(&[timer("after-a-hang", T0)]).await;
    events(&r.hub, 1)
        .await
        .expect("fired once the hung claim was given up");
}

/// A read of the next due time that hangs is given up as well (the firing task would otherwise
/// stop there for good): a timer scheduled while it hung fires.
#[tokio::test]
async fn a_next_due_read_that_hangs_is_given_up_after_the_store_timeout() {
    let faulty = Arc::new(Faulty {
        hung_next_due: AtomicU32::new(1),
        ..Faulty::new(Arc::new(MemoryStore::new()))
    });
    let mut setup = Setup::on(faulty.clone());
    setup.config.store_timeout = ms(200);
    let r = setup.start();
    let hung = wait_for(WAIT, || async {
        (faulty.hung_next_due.load(Ordering::SeqCst) == 0).then_some(())
    })
    .await;
    assert!(
        hung.is_some(),
        "the firing task never read the next due time"
    );
    r.schedule(&[timer("after-a-hang", T0)]).await;
    events(&r.hub, 1)
        .await
        .expect("fired once the hung read was given up");
}

/// A timer another instance scheduled wakes the sleeping firing task through the store's
/// notice when it is due sooner than the task planned to wake; one due later does not.
#[tokio::test]
async fn a_notice_of_a_sooner_timer_from_elsewhere_wakes_the_firing_task() {
    let (notices, _) = tokio::sync::broadcast::channel(16);
    let inner: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let store = Faulty {
        notices: Some(notices.clone()),
        ..Faulty::new(inner.clone())
    };
    let r = Setup::on(Arc::new(store)).start();
    let planned = r.asleep(|until| until > T0).await.expect("asleep");
    // Another instance writes straight to the store: this engine hears only the notice.
    inner
        .schedule(&[timer("elsewhere", T0)], T0)
        .await
        .expect("schedule");
    notices
        .send(planned.saturating_add(secs(1)))
        .expect("a listener");
    let woken = wait_for(QUIET, || async {
        r.hub.events().ok().filter(|e| !e.is_empty())
    })
    .await;
    assert!(
        woken.is_none(),
        "a notice of a later timer woke it: {woken:?}"
    );
    notices.send(T0).expect("a listener");
    events(&r.hub, 1).await.expect("woken by the notice");
}

/// A publish that ends while its leases cannot be renewed, long before they run out, is
/// settled as usual: the lease is counted from the claim, not given up at once.
#[tokio::test]
async fn a_publish_that_ends_well_within_its_lease_needs_no_renewal() {
    let gate = Arc::new(tokio::sync::Notify::new());
    let mut setup = Setup::on(Arc::new(Faulty {
        renew_failures: AtomicU32::new(u32::MAX),
        ..Faulty::new(Arc::new(MemoryStore::new()))
    }));
    setup.publish = Publish::Gated(gate.clone());
    let r = setup.start();
    r.schedule(&[timer("quick", T0)]).await;
    timer_where(&r.store, "quick", |t| t.lease_owner.is_some()).await;
    gate.notify_one();
    let t = timer_where(&r.store, "quick", |t| t.state != TimerState::Scheduled).await;
    assert_eq!((t.state, t.attempts), (TimerState::Reached, 0), "{t:?}");
}

/// Schedules one-shot timers `ids` of tenant `t` due at T0 whose work must complete within 5 s,
/// and waits until each fired and waits for its completion.
async fn fired_awaiting_completion(r: &Rig, ids: &[&str]) {
    let policy = Policy {
        completion_timeout: Some(secs(5)),
        ..Policy::default()
    };
    let timers: Vec<NewTimer> = ids
        .iter()
        .map(|id| NewTimer {
            policy: Some(policy.clone()),
            ..timer(id, T0)
        })
        .collect();
    r.schedule(&timers).await;
    events(&r.hub, ids.len()).await.expect("fired");
    for id in ids {
        timer_where(&r.store, id, |t| {
            t.work.as_ref().is_some_and(|w| w.awaiting.is_some()) && t.lease_owner.is_none()
        })
        .await;
    }
}

/// A one-shot timer given up for its completion timeouts whose `TimerFailed` cannot be sent is
/// given back for a retry after the backoff (not held until its lease ends), and fails once
/// the dead letter goes out.
#[tokio::test]
async fn a_give_up_whose_timer_failed_cannot_be_sent_is_retried_after_the_backoff() {
    let (mut setup, gate) = Setup::default().refusing_dead_letters();
    setup.config.max_attempts = 1;
    let r = setup.start();
    fired_awaiting_completion(&r, &["abandoned"]).await;
    r.clock.advance(secs(5));
    assert!(gate.tried(1).await, "the TimerFailed was tried");
    let t = timer_where(&r.store, "abandoned", |t| {
        t.lease_owner.is_none() && t.available_at > T0.saturating_add(secs(5))
    })
    .await;
    assert_eq!(
        t.state,
        TimerState::Scheduled,
        "not Failed without its TimerFailed"
    );
    assert!(
        t.available_at < T0.saturating_add(secs(5) + config().lease),
        "given back for the backoff, not left to its lease: {t:?}"
    );
    gate.open();
    r.clock
        .advance(t.available_at.duration_since(T0.saturating_add(secs(5))));
    timer_where(&r.store, "abandoned", |t| t.state == TimerState::Failed).await;
    let letters = dead_letters(&r.hub, 1).await.expect("the TimerFailed");
    assert!(
        letters[0].reason.starts_with("completion_timeout"),
        "{letters:?}"
    );
}

/// A give-up waiting for its `TimerFailed` holds the timer's lease as a publish does: when the
/// lease cannot be renewed, the firing task stops waiting (another instance may claim the
/// timer then) and goes on firing the others.
#[tokio::test]
async fn a_give_up_whose_lease_cannot_be_renewed_is_abandoned_before_it_runs_out() {
    let mut setup = Setup {
        store: Arc::new(Faulty {
            renew_failures: AtomicU32::new(u32::MAX),
            ..Faulty::new(Arc::new(MemoryStore::new()))
        }),
        dead_letters: DeadLetterGate::holding(),
        ..Setup::default()
    };
    setup.config.max_attempts = 1;
    setup.config.lease = ms(600);
    // Far beyond the test's wait: only the abandonment ends the dead letter's wait.
    setup.config.publish_timeout = secs(60);
    let gate = setup.dead_letters.clone();
    let r = setup.start();
    fired_awaiting_completion(&r, &["abandoned"]).await;
    // Due while the give-up's lease (600 ms on the clock) still stands, so claimed alone.
    let other = T0.saturating_add(ms(5_300));
    r.schedule(&[NewTimer::new(TimerKey::new("other", "o"), other)])
        .await;
    r.clock.advance(secs(5));
    assert!(gate.tried(1).await, "the TimerFailed was tried");
    r.clock.advance(ms(300));
    let fired = events(&r.hub, 2).await;
    assert!(
        fired.is_some(),
        "the firing task still waits for the held dead letter"
    );
    gate.release();
}

/// Of timers given up together whose `TimerFailed` cannot be sent, one is tried: the others are
/// retried after the backoff with it, which grows with each failed try.
#[tokio::test]
async fn give_ups_whose_dead_letters_fail_try_one_and_back_off() {
    let (mut setup, gate) = Setup::default().refusing_dead_letters();
    setup.config.max_attempts = 1;
    let r = setup.start();
    let abandoned = ["a-1", "a-2", "a-3"];
    fired_awaiting_completion(&r, &abandoned).await;
    r.clock.advance(secs(5));
    assert!(gate.tried(1).await, "a TimerFailed was tried");
    // Each retried after its backoff (retry_base, 1 s, after the first failed try), then after
    // twice that.
    let first_try = T0.saturating_add(secs(5));
    for id in abandoned {
        let t = timer_where(&r.store, id, |t| t.attempts == 1 && t.lease_owner.is_none()).await;
        assert_eq!(t.state, TimerState::Scheduled, "{t:?}");
        assert_eq!(t.available_at, first_try.saturating_add(secs(1)), "{t:?}");
        assert!(
            t.last_error
                .as_deref()
                .is_some_and(|e| e.contains("could not be sent")),
            "{t:?}"
        );
    }
    assert_eq!(
        gate.tries.load(Ordering::SeqCst),
        1,
        "one try for the three"
    );
    r.clock.advance(secs(1));
    assert!(gate.tried(2).await, "a TimerFailed was tried again");
    let second_try = first_try.saturating_add(secs(1));
    for id in abandoned {
        let t = timer_where(&r.store, id, |t| t.attempts == 2 && t.lease_owner.is_none()).await;
        assert_eq!(t.available_at, second_try.saturating_add(secs(2)), "{t:?}");
    }
    assert_eq!(gate.tries.load(Ordering::SeqCst), 2, "one try a round");
}

/// A one-shot timer waiting for its work, sent again (the same due time) without a
/// `completionTimeout`, waits for nothing: it becomes Reached and fires no more (it fired again
/// and again, as fast as the engine could, once the old deadline had passed).
#[tokio::test]
async fn a_timer_sent_again_without_its_completion_timeout_is_reached() {
    let r = Setup::default().start();
    fired_awaiting_completion(&r, &["job"]).await;
    r.schedule(&[timer("job", T0)]).await;
    r.clock.advance(secs(6));
    let t = timer_where(&r.store, "job", |t| t.state != TimerState::Scheduled).await;
    assert_eq!(t.state, TimerState::Reached, "{t:?}");
    assert_eq!(
        r.hub.events().expect("events").len(),
        1,
        "fired once, and once only"
    );
}

#[tokio::test]
async fn commands_are_not_acknowledged_until_the_store_committed_them() {
    let inner: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let faulty = Arc::new(Faulty {
        schedule_failures: AtomicU32::new(u32::MAX),
        ..Faulty::new(inner.clone())
    });
    let mut setup = Setup::on(faulty.clone());
    setup.config.retry_base = ms(20);
    let r = setup.start();
    r.hub
        .send_command(format!(
            r#"{{"tenantId":"t","serviceCallId":"kept","dueTimeMs":{}}}"#,
            T0.as_millis()
        ))
        .expect("send");
    // The store has refused the command twice: the broker still has it unacknowledged.
    let refused_twice = wait_for(WAIT, || async {
        (faulty.schedule_failures.load(Ordering::SeqCst) <= u32::MAX - 2).then_some(())
    })
    .await;
    assert!(
        refused_twice.is_some(),
        "the engine tried to store the command"
    );
    assert_eq!(
        r.hub.unacknowledged().expect("count"),
        1,
        "acknowledged before the store committed it"
    );
    assert!(inner
        .get(&TimerKey::new("t", "kept"))
        .await
        .expect("get")
        .is_none());
    // The store recovers: the command is stored, then acknowledged, and fires.
    faulty.schedule_failures.store(0, Ordering::SeqCst);
    events(&r.hub, 1)
        .await
        .expect("fired after the store recovered");
    assert_eq!(r.hub.unacknowledged().expect("count"), 0);
    timer_where(&inner, "kept", |t| t.state == TimerState::Reached).await;
    r.shutdown.cancel();
}

/// At its last attempt a timer becomes Failed only once its `TimerFailed` went out: while the
/// broker refuses dead letters, the timer stays Scheduled and is tried again.
#[tokio::test]
async fn a_timer_whose_timer_failed_cannot_be_sent_is_retried_not_failed() {
    let (mut setup, gate) =
        Setup::publishing(Publish::FailsFirst(u32::MAX)).refusing_dead_letters();
    setup.config.max_attempts = 2;
    let r = setup.start();
    r.schedule(&[timer("doomed", T0)]).await;
    timer_where(&r.store, "doomed", |t| t.attempts == 1).await;
    r.clock.advance(secs(1));
    assert!(gate.tried(1).await, "the TimerFailed was tried");
    let t = timer_where(&r.store, "doomed", |t| t.attempts == 2).await;
    assert_eq!(
        t.state,
        TimerState::Scheduled,
        "Failed without its TimerFailed sent"
    );
    assert!(r.hub.dead_letters().expect("dead letters").is_empty());
    gate.open();
    r.clock
        .advance(t.available_at.duration_since(T0.saturating_add(secs(1))));
    let t = timer_where(&r.store, "doomed", |t| t.state == TimerState::Failed).await;
    let letters = dead_letters(&r.hub, 1).await.expect("the TimerFailed");
    assert!(letters[0].reason.starts_with("max_attempts"), "{letters:?}");
    assert!(t.attempts >= 2, "{t:?}");
}

#[tokio::test]
async fn a_timer_fails_after_max_attempts_with_a_timer_failed_dead_letter() {
    let mut setup = Setup::publishing(Publish::FailsFirst(u32::MAX));
    setup.config.max_attempts = 3;
    let r = setup.start();
    r.schedule(&[timer("doomed", T0)]).await;
    timer_where(&r.store, "doomed", |t| t.attempts == 1).await;
    r.clock.advance(secs(1));
    timer_where(&r.store, "doomed", |t| t.attempts == 2).await;
    r.clock.advance(secs(2));
    let t = timer_where(&r.store, "doomed", |t| t.state == TimerState::Failed).await;
    assert_eq!(t.attempts, 3, "every attempt counted");
    assert!(
        t.last_error
            .as_deref()
            .is_some_and(|e| e.contains("injected publish failure")),
        "{t:?}"
    );
    let letters = dead_letters(&r.hub, 1)
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
    r.clock.advance(secs(600));
    r.no_events().await;
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

fn payload_of(e: &PublishedEvent) -> serde_json::Value {
    serde_json::from_slice::<serde_json::Value>(&e.body).expect("event json")["payload"].clone()
}

#[tokio::test]
async fn a_recurring_timer_fires_each_occurrence_and_a_missed_run_once() {
    let r = rig();
    // T0 is a whole second.
    let first = T0.saturating_add(secs(1));
    r.schedule(&[every_second("tick", first)]).await;
    r.no_events().await;
    r.clock.advance(secs(1));
    let e = events(&r.hub, 1).await.expect("first occurrence");
    assert_eq!(payload_of(&e[0])["dueAt"], first.to_rfc3339());
    assert_eq!(payload_of(&e[0])["occurrence"], 1);
    let t = timer_where(&r.store, "tick", |t| t.occurrences == 1).await;
    assert_eq!(t.state, TimerState::Scheduled);
    assert_eq!(t.due_at, T0.saturating_add(secs(2)));

    r.clock.advance(secs(1));
    events(&r.hub, 2).await.expect("second occurrence");
    // Ten seconds pass at once (the service was down): one late fire, not ten.
    r.clock.advance(secs(10));
    let e = events(&r.hub, 3).await.expect("the missed occurrence");
    assert_eq!(
        payload_of(&e[2])["dueAt"],
        T0.saturating_add(secs(3)).to_rfc3339()
    );
    let t = timer_where(&r.store, "tick", |t| t.occurrences == 3).await;
    assert_eq!(
        t.due_at,
        T0.saturating_add(secs(13)),
        "the rhythm continues from now"
    );
    let quiet = r.more_events(3).await;
    assert!(quiet.is_none(), "no flood of missed occurrences: {quiet:?}");
    r.clock.advance(secs(1));
    events(&r.hub, 4).await.expect("back in rhythm");
}

#[tokio::test]
async fn finished_timers_are_purged_after_the_retention() {
    let mut setup = Setup::default();
    setup.config.retention = secs(60);
    setup.config.purge_interval = secs(10);
    let r = setup.start();
    r.schedule(&[
        timer("old", T0),
        timer("later", T0.saturating_add(secs(3600))),
    ])
    .await;
    timer_where(&r.store, "old", |t| t.state == TimerState::Reached).await;
    let purged = |wait| {
        wait_for(wait, || async {
            r.store
                .get(&TimerKey::new("t", "old"))
                .await
                .ok()
                .filter(|t| t.is_none())
        })
    };
    r.clock.advance(secs(30));
    let kept = purged(QUIET).await;
    assert!(kept.is_none(), "younger than the retention: kept");
    r.clock.advance(secs(40));
    let gone = purged(WAIT).await;
    assert!(gone.is_some(), "purged once older than the retention");
    timer_where(&r.store, "later", |t| t.state == TimerState::Scheduled).await;
}

/// `engine.retention = 0` keeps finished timers forever: years later, still there.
#[tokio::test]
async fn a_retention_of_zero_keeps_finished_timers_forever() {
    let mut setup = Setup::default();
    setup.config.retention = Duration::ZERO;
    setup.config.purge_interval = secs(10);
    let r = setup.start();
    r.schedule(&[timer("kept", T0)]).await;
    timer_where(&r.store, "kept", |t| t.state == TimerState::Reached).await;
    r.clock.advance(secs(10 * 365 * 24 * 3600));
    let purged = wait_for(QUIET, || async {
        r.store
            .get(&TimerKey::new("t", "kept"))
            .await
            .ok()
            .filter(|t| t.is_none())
    })
    .await;
    assert!(
        purged.is_none(),
        "a finished timer was purged with retention 0"
    );
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
    assert!(all_acknowledged(&r.hub).await, "all acknowledged");
    r.clock.advance(secs(1));
    let e = events(&r.hub, 1).await.expect("b fires");
    assert_eq!(e.len(), 1, "the cancelled timer does not: {e:?}");
    assert_eq!(payload_of(&e[0])["serviceCallId"], "b");
}

/// Timer `racing` being fired by an engine whose publishes never complete; each gives up after
/// the 300 ms publish timeout (real time), and the timer is released for a retry.
async fn racing_fire() -> Rig {
    let mut setup = Setup::publishing(Publish::Hangs);
    setup.config.lease = ms(600);
    setup.config.publish_timeout = ms(300);
    let r = setup.start();
    r.schedule(&[timer("racing", T0)]).await;
    timer_where(&r.store, "racing", |t| t.lease_owner.is_some()).await;
    r
}

#[tokio::test]
async fn cancel_is_refused_while_publishing_and_wins_after_a_failed_publish() {
    let r = racing_fire().await;
    let key = TimerKey::new("t", "racing");
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
    r.clock.advance(secs(3600));
    let t = timer_where(&r.store, "racing", |_| true).await;
    assert_eq!(t.state, TimerState::Cancelled, "never claimed again");
}

/// A reschedule while the timer's publish runs gives it a new revision; once the publish ends,
/// the fire hands the lease back at once instead of keeping the timer "firing" until the lease
/// ends, so a cancel succeeds without waiting.
#[tokio::test]
async fn a_reschedule_during_a_fire_gets_its_lease_back_when_the_publish_ends() {
    let gate = Arc::new(tokio::sync::Notify::new());
    let r = Setup::publishing(Publish::Gated(gate.clone())).start();
    r.schedule(&[timer("moved", T0)]).await;
    timer_where(&r.store, "moved", |t| t.lease_owner.is_some()).await;
    r.schedule(&[timer("moved", T0.saturating_add(secs(3600)))])
        .await;
    gate.notify_one();
    events(&r.hub, 1)
        .await
        .expect("the fire in flight went out");
    let t = timer_where(&r.store, "moved", |t| t.lease_owner.is_none()).await;
    assert_eq!(
        (t.state, t.due_at),
        (TimerState::Scheduled, T0.saturating_add(secs(3600))),
        "{t:?}"
    );
    assert_eq!(
        r.engine
            .cancel(&TimerKey::new("t", "moved"))
            .await
            .expect("cancel"),
        CancelOutcome::Cancelled,
        "the clock has not moved: the lease was handed back, not left to expire"
    );
}

#[tokio::test]
async fn a_cancel_command_that_meets_a_fire_waits_for_it_and_then_applies() {
    let r = racing_fire().await;
    r.hub
        .send_command(r#"{"type":"CancelTimer","tenantId":"t","serviceCallId":"racing"}"#)
        .expect("send");
    // Not dropped as "firing": once the publish gave up (300 ms) the cancel applies.
    let t = timer_where(&r.store, "racing", |t| t.state == TimerState::Cancelled).await;
    assert_eq!(t.attempts, 1, "after the failed publish");
    assert!(
        all_acknowledged(&r.hub).await,
        "the cancel is acknowledged once applied"
    );
}

/// A `CancelTimer` that meets a fire in progress is held aside with the later commands of its
/// own tenant: another tenant's commands are applied meanwhile, not held behind that fire (a
/// slow broker or HTTP target would stop every tenant's commands for as long). Once the fire
/// settled, the cancel applies (here: changes nothing, the event went out) and its tenant's
/// next command follows, in order.
#[tokio::test]
async fn a_command_that_meets_a_fire_holds_back_only_its_own_tenant() {
    let gate = Arc::new(tokio::sync::Notify::new());
    let mut setup = Setup::publishing(Publish::Gated(gate.clone()));
    // The publish waits for the gate, not for its timeout.
    setup.config.publish_timeout = secs(600);
    let r = setup.start();
    r.schedule(&[timer("racing", T0)]).await;
    timer_where(&r.store, "racing", |t| t.lease_owner.is_some()).await;
    let due = T0.as_millis() + 3_600_000;
    for body in [
        r#"{"type":"CancelTimer","tenantId":"t","serviceCallId":"racing"}"#.to_owned(),
        format!(r#"{{"tenantId":"t","serviceCallId":"after","dueTimeMs":{due}}}"#),
        format!(r#"{{"tenantId":"u","serviceCallId":"other","dueTimeMs":{due}}}"#),
        r#"{"type":"PauseTimer","tenantId":"u","serviceCallId":"other"}"#.to_owned(),
    ] {
        r.hub.send_command(body).expect("send");
    }
    key_where(&r.store, &TimerKey::new("u", "other"), |t| {
        t.state == TimerState::Paused
    })
    .await;
    let acked = wait_for(WAIT, || async {
        (r.hub.unacknowledged().ok()? == 2).then_some(())
    })
    .await;
    assert!(
        acked.is_some(),
        "u's commands acknowledged, t's two held: {:?} unacknowledged",
        r.hub.unacknowledged()
    );
    let after = TimerKey::new("t", "after");
    assert!(
        r.store.get(&after).await.expect("get").is_none(),
        "t's schedule waits behind its cancel"
    );
    let racing = timer_where(&r.store, "racing", |_| true).await;
    assert!(racing.lease_owner.is_some(), "still firing: {racing:?}");

    gate.notify_one();
    events(&r.hub, 1).await.expect("the fire went out");
    key_where(&r.store, &after, |t| t.state == TimerState::Scheduled).await;
    assert!(all_acknowledged(&r.hub).await, "all acknowledged");
    let racing = timer_where(&r.store, "racing", |_| true).await;
    assert_eq!(
        racing.state,
        TimerState::Reached,
        "the cancel came too late"
    );
}

/// An engine whose tenants may schedule one timer a second (a burst of 1), holding at most
/// `max_held` commands and `per_tenant` of one tenant, after `big` schedules of tenant `big`
/// (`big/0`, `big/1`, ...) and then one of tenant `t` (`t/0`) were sent, all due in an hour.
fn flooded((max_held, per_tenant): (usize, usize), big: usize) -> Rig {
    let mut setup = Setup::default();
    setup.limits.rate.schedules_per_second = 1;
    setup.limits.rate.burst = 1;
    setup.limits.rate.max_held = max_held;
    setup.limits.rate.max_held_per_tenant = per_tenant;
    let r = setup.start();
    let later = T0.saturating_add(secs(3600));
    let cmd = |tenant: &str, id: usize| {
        format!(
            r#"{{"tenantId":"{tenant}","serviceCallId":"{id}","dueTimeMs":{}}}"#,
            later.as_millis()
        )
    };
    for i in 0..big {
        r.hub.send_command(cmd("big", i)).expect("send");
    }
    r.hub.send_command(cmd("t", 0)).expect("send");
    r
}

/// A tenant flooding far over its rate holds at most `limits.rate.max_held_per_tenant`
/// commands; the rest are dead-lettered (`tenant_limit`) and acknowledged, so the flood cannot
/// fill `limits.rate.max_held` and stop the other tenants' commands. What it holds is applied as
/// its allowance refills.
#[tokio::test]
async fn a_flooding_tenant_holds_only_its_share_and_the_others_go_on() {
    let r = flooded((5, 3), 10);
    // 1 applied (the burst), 3 held, 6 refused; `t` is not held behind them.
    let letters = dead_letters(&r.hub, 6).await.expect("6 dead letters");
    assert_eq!(letters.len(), 6);
    for letter in &letters {
        assert!(
            letter.reason.starts_with("tenantId (tenant_limit)"),
            "{}",
            letter.reason
        );
        assert!(
            letter.reason.contains("limits.rate.max_held_per_tenant"),
            "{}",
            letter.reason
        );
    }
    timer_where(&r.store, "0", |t| t.state == TimerState::Scheduled).await;
    assert_eq!(r.hub.unacknowledged().expect("count"), 3, "3 held");
    // Refilled (one a second: a burst of 1), they are applied in order.
    for held in (0..3).rev() {
        r.clock.advance(secs(1));
        let applied = wait_for(WAIT, || async {
            (r.hub.unacknowledged().ok()? == held).then_some(())
        })
        .await;
        assert!(applied.is_some(), "one more applied, {held} held");
    }
    let big = |id: &'static str| {
        let store = r.store.clone();
        async move { store.get(&TimerKey::new("big", id)).await.expect("get") }
    };
    for id in ["0", "1", "2", "3"] {
        assert!(big(id).await.is_some(), "big/{id} stored");
    }
    assert!(big("4").await.is_none(), "big/4 was refused");
}

/// With `limits.rate.max_held` commands held (and no share per tenant), the ingest task reads
/// nothing more, every tenant waiting with the flood on the broker, unacknowledged; it does not
/// stop: as the allowance refills it reads on, and everything is applied, nothing refused.
#[tokio::test]
async fn with_max_held_commands_held_the_rest_wait_on_the_broker() {
    let metrics = Metrics::record();
    let r = flooded((2, 0), 5);
    // big/0 applied (the burst), big/1 and big/2 held: full. The rest stay on the broker.
    let held = wait_for(WAIT, || async {
        (metrics.value("timer_commands_held") == 2.0).then_some(())
    })
    .await;
    assert!(held.is_some(), "2 held");
    let quiet = wait_for(QUIET, || async {
        (r.hub.unacknowledged().ok()? != 5 || !r.hub.dead_letters().ok()?.is_empty()).then_some(())
    })
    .await;
    assert!(
        quiet.is_none(),
        "with the held slots full, nothing more is read: {:?} unacknowledged, dead letters {:?}",
        r.hub.unacknowledged(),
        r.hub.dead_letters()
    );
    // A second at a time, the allowance frees a slot: the task reads on.
    for _ in 0..10 {
        let before = r.hub.unacknowledged().expect("count");
        if before == 0 {
            break;
        }
        r.clock.advance(secs(1));
        let moved = wait_for(WAIT, || async {
            (r.hub.unacknowledged().ok()? < before).then_some(())
        })
        .await;
        assert!(
            moved.is_some(),
            "applied on after the refill ({before} left)"
        );
    }
    assert_eq!(r.hub.unacknowledged().expect("count"), 0, "all applied");
    assert!(r.hub.dead_letters().expect("dead letters").is_empty());
    for id in 0..5 {
        let key = TimerKey::new("big", id.to_string());
        assert!(r.store.get(&key).await.expect("get").is_some(), "big/{id}");
    }
    timer_where(&r.store, "0", |t| t.state == TimerState::Scheduled).await;
    assert_eq!(
        metrics.value("timer_commands_throttled{path=\"broker\"}"),
        4.0,
        "big/1 to big/4 were held, each once"
    );
}

/// Held commands are kept (`Broker::keep`) a third of the way into the broker's ack wait, so
/// the broker does not deliver them again while they wait for their tenant's allowance; even
/// when the ack wait is shorter than the ingest task's longest receive.
#[tokio::test]
async fn held_commands_are_kept_and_not_delivered_again() {
    let metrics = Metrics::record();
    let ack_wait = ms(300);
    let mut setup = Setup {
        hub: MemoryHub::new(MemoryConfig {
            ack_wait,
            ..MemoryConfig::default()
        }),
        ..Setup::default()
    };
    setup.limits.rate.schedules_per_second = 1;
    setup.limits.rate.burst = 1;
    let r = setup.start();
    let later = T0.saturating_add(secs(3600));
    for id in 0..3 {
        let cmd = format!(
            r#"{{"tenantId":"t","serviceCallId":"{id}","dueTimeMs":{}}}"#,
            later.as_millis()
        );
        r.hub.send_command(cmd).expect("send");
    }
    timer_where(&r.store, "0", |t| t.state == TimerState::Scheduled).await;
    let throttled = || metrics.value("timer_commands_throttled{path=\"broker\"}");
    let held = wait_for(WAIT, || async { (throttled() == 2.0).then_some(()) }).await;
    assert!(held.is_some(), "1 and 2 held");
    // Six ack waits: a command delivered again would be held again, and counted.
    let again = wait_for(ack_wait * 6, || async { (throttled() > 2.0).then_some(()) }).await;
    assert!(
        again.is_none(),
        "held commands were delivered again within 6 ack waits of {ack_wait:?}: {} held",
        throttled()
    );
    assert_eq!(r.hub.unacknowledged().expect("count"), 2);
    for id in ["1", "2"] {
        r.clock.advance(secs(1));
        timer_where(&r.store, id, |t| t.state == TimerState::Scheduled).await;
    }
    let done = wait_for(WAIT, || async {
        (r.hub.unacknowledged().ok()? == 0).then_some(())
    })
    .await;
    assert!(done.is_some(), "all acknowledged");
}

/// `limits.fire_rate`: a tenant's herd goes out at its rate after its burst, each timer at its
/// turn with its attempts kept, while another tenant's timer due at the same instant fires at
/// once.
#[tokio::test]
async fn a_tenant_over_its_fire_rate_fires_at_its_turns_and_others_at_once() {
    let metrics = Metrics::record();
    let mut setup = Setup::default();
    setup.limits.fire_rate.tenants.insert(
        "herd".into(),
        TenantFireRate {
            fires_per_second: 10,
            burst: 2,
        },
    );
    let r = setup.start();
    let herd: Vec<NewTimer> = (0..5)
        .map(|i| NewTimer {
            key: TimerKey::new("herd", format!("h{i}")),
            ..timer("x", T0)
        })
        .collect();
    r.schedule(&herd).await;
    r.schedule(&[timer("other", T0)]).await;
    let tenants = |events: &[PublishedEvent]| -> Vec<String> {
        events
            .iter()
            .map(|e| {
                let envelope: serde_json::Value =
                    serde_json::from_slice(&e.body).expect("event json");
                envelope["tenantId"].as_str().unwrap_or("?").to_owned()
            })
            .collect()
    };
    // The burst of 2 and the other tenant's timer now; the rest of the herd waits.
    let now = events(&r.hub, 3).await.expect("3 events at once");
    let mut first = tenants(&now);
    first.sort();
    assert_eq!(first, ["herd", "herd", "t"]);
    assert!(
        r.more_events(3).await.is_none(),
        "the herd's rest waits for its turns"
    );
    let waiting = r
        .store
        .get(&TimerKey::new("herd", "h2"))
        .await
        .expect("get")
        .expect("h2");
    assert_eq!(waiting.state, TimerState::Scheduled);
    assert_eq!(waiting.attempts, 0, "a turn is not an attempt");
    assert_eq!(waiting.due_at, T0, "nor a reschedule");
    // Then one every 100 ms.
    for n in 4..=5 {
        r.clock.advance(ms(100));
        let fired = events(&r.hub, n).await.expect("one more at its turn");
        assert_eq!(fired.len(), n, "exactly one more after 100 ms");
    }
    r.clock.advance(ms(100));
    events(&r.hub, 6).await.expect("the last at its turn");
    // Three fires waited for their turns: 100, 200 and 300 ms.
    assert_eq!(metrics.value(r#"timer_fires_paced{tenant="herd"}"#), 3.0);
    assert_eq!(metrics.value(r#"timer_fires_paced{tenant="t"}"#), 0.0);
    let count = metrics.value(r#"timer_fire_pace_delay_count{tenant="herd"}"#);
    let sum = metrics.value(r#"timer_fire_pace_delay_sum{tenant="herd"}"#);
    assert_eq!(count, 3.0);
    assert!((sum - 0.6).abs() < 1e-6, "pace delays add up to {sum} s");
}

#[tokio::test]
async fn a_tenant_over_its_limit_is_refused_and_others_are_not() {
    let mut setup = Setup::default();
    setup.limits.max_pending_per_tenant = 2;
    let r = setup.start();
    let later = T0.saturating_add(secs(60));
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
        r.hub.send_command(body).expect("send");
    }
    let letters = dead_letters(&r.hub, 1)
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
    assert!(all_acknowledged(&r.hub).await, "all acknowledged");
    let exists = |tenant: &'static str, id: &'static str| {
        let store = r.store.clone();
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
        ..timer("x", later.saturating_add(secs(1)))
    };
    let fresh = NewTimer {
        key: TimerKey::new("big", "4"),
        ..timer("x", later)
    };
    let outcomes = r.schedule(&[moved, fresh]).await;
    assert_eq!(outcomes[0], Scheduled::Stored(ScheduleOutcome::Updated));
    assert!(
        matches!(&outcomes[1], Scheduled::Refused(r) if r.reason == Reason::TenantLimit),
        "{outcomes:?}"
    );
    assert_eq!(outcomes.len(), 2);
    r.shutdown.cancel();
    let _ = r.task.await;
}

// Policies (#22): completion, overlap, catch-up, jitter.

fn series_with(id: &str, first: Timestamp, policy: Policy) -> NewTimer {
    NewTimer {
        policy: Some(policy),
        ..every_second(id, first)
    }
}

/// Schedules an every-second series `id` with `policy`, first due at T0 + 1 s, and lets its
/// first occurrence fire and settle.
async fn first_fired(r: &Rig, id: &str, policy: Policy) {
    r.schedule(&[series_with(id, T0.saturating_add(secs(1)), policy)])
        .await;
    r.clock.advance(secs(1));
    events(&r.hub, 1).await.expect("occurrence 1");
    timer_where(&r.store, id, |t| t.occurrences == 1).await;
}

/// Advances the clock to each of the `seconds` (after T0) in turn and waits until series `id`
/// settled that occurrence (fired or not): it moved on to the next second.
async fn moved_past(r: &Rig, id: &str, seconds: impl IntoIterator<Item = u64>) {
    for s in seconds {
        r.clock.advance(secs(1));
        let next = T0.saturating_add(secs(s + 1));
        timer_where(&r.store, id, |t| t.due_at == next).await;
    }
}

fn complete(occurrence: Option<u32>) -> Action {
    Action::Complete(Completion {
        occurrence,
        outcome: Some(Outcome::Succeeded),
        message: None,
    })
}

async fn completed(r: &Rig, id: &str, occurrence: Option<u32>) -> ControlOutcome {
    r.engine
        .control(&[TimerKey::new("t", id)], &complete(occurrence))
        .await
        .expect("complete")[0]
}

/// The history of timer `id` as its entries' JSON.
async fn history_of(r: &Rig, id: &str) -> Vec<serde_json::Value> {
    let history = r.store.history();
    history
        .read(&TimerKey::new("t", id), 0, 1000)
        .await
        .expect("history")
        .into_iter()
        .map(|e| serde_json::from_str(&e.change.to_json()).expect("json"))
        .collect()
}

fn due_ats(events: &[PublishedEvent]) -> Vec<String> {
    events
        .iter()
        .map(|e| {
            payload_of(e)["dueAt"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect()
}

fn at(s: u64) -> String {
    T0.saturating_add(secs(s)).to_rfc3339()
}

#[tokio::test]
async fn overlap_skip_skips_while_the_work_runs_and_goes_on_after_its_completion() {
    let r = rig();
    let policy = Policy {
        overlap: Overlap::Skip,
        completion_timeout: Some(secs(60)),
        ..Policy::default()
    };
    first_fired(&r, "s", policy).await;
    // Its work runs: the next two are skipped.
    moved_past(&r, "s", [2, 3]).await;
    assert!(
        r.more_events(1).await.is_none(),
        "nothing fired while it ran"
    );
    assert_eq!(completed(&r, "s", Some(1)).await, ControlOutcome::Completed);
    assert_eq!(
        completed(&r, "s", Some(1)).await,
        ControlOutcome::AlreadyCompleted
    );
    assert_eq!(
        completed(&r, "s", Some(7)).await,
        ControlOutcome::UnknownOccurrence
    );
    r.clock.advance(secs(1));
    let e = events(&r.hub, 2)
        .await
        .expect("occurrence 2 after the completion");
    assert_eq!(due_ats(&e), [at(1), at(4)]);
    assert_eq!(payload_of(&e[1])["occurrence"], 2);
    let history = history_of(&r, "s").await;
    let skipped: Vec<_> = history.iter().filter(|c| c["type"] == "skipped").collect();
    assert_eq!(skipped.len(), 2, "{history:?}");
    assert!(
        skipped.iter().all(|c| c["reason"] == "overlap"),
        "{history:?}"
    );
    let done: Vec<_> = history
        .iter()
        .filter(|c| c["type"] == "completed")
        .collect();
    assert_eq!(done.len(), 1, "one completion recorded: {history:?}");
    assert_eq!(done[0]["occurrence"], 1);
    assert_eq!(done[0]["durationMs"], 2000, "completed 2 s after the fire");
    let t = r
        .store
        .get(&TimerKey::new("t", "s"))
        .await
        .unwrap()
        .unwrap();
    let counts = t.work.expect("work").counts;
    assert_eq!((counts.skipped_overlap, counts.completed), (2, 1));
}

#[tokio::test]
async fn a_completion_timeout_frees_a_series_whose_consumer_never_answers() {
    let metrics = Metrics::record();
    let r = rig();
    let policy = Policy {
        overlap: Overlap::Skip,
        completion_timeout: Some(ms(2500)),
        ..Policy::default()
    };
    first_fired(&r, "s", policy).await;
    // 2 and 3 fall within the 2.5 s; 4 comes after the timeout and fires.
    moved_past(&r, "s", [2, 3]).await;
    r.clock.advance(secs(1));
    let e = events(&r.hub, 2).await.expect("the series is free again");
    assert_eq!(due_ats(&e), [at(1), at(4)]);
    let history = history_of(&r, "s").await;
    assert!(
        history
            .iter()
            .any(|c| c["type"] == "timed_out" && c["occurrence"] == 1),
        "{history:?}"
    );
    assert_eq!(metrics.value("timer_completions_timed_out"), 1.0);
    // A completion that comes now is late: recorded, nothing else changes.
    assert_eq!(
        completed(&r, "s", Some(1)).await,
        ControlOutcome::CompletedLate
    );
}

#[tokio::test]
async fn buffer_one_fires_the_waiting_occurrence_when_the_previous_completes() {
    let metrics = Metrics::record();
    let r = rig();
    let policy = Policy {
        overlap: Overlap::BufferOne,
        completion_timeout: Some(secs(60)),
        ..Policy::default()
    };
    first_fired(&r, "b", policy).await;
    r.clock.advance(secs(1));
    timer_where(&r.store, "b", |t| {
        t.work.as_ref().is_some_and(|w| w.buffered)
    })
    .await;
    r.clock.advance(ms(1500));
    assert!(r.more_events(1).await.is_none(), "it waits");
    assert_eq!(completed(&r, "b", Some(1)).await, ControlOutcome::Completed);
    let e = events(&r.hub, 2)
        .await
        .expect("the buffered one fires at once");
    assert_eq!(due_ats(&e), [at(1), at(2)], "the one that waited, late");
    let t = timer_where(&r.store, "b", |t| t.occurrences == 2).await;
    assert_eq!(t.due_at, T0.saturating_add(secs(4)), "3 was skipped");
    let history = history_of(&r, "b").await;
    assert!(
        history.iter().any(|c| c["type"] == "buffered"),
        "{history:?}"
    );
    assert_eq!(metrics.value("timer_occurrences_buffered"), 1.0);
    // 3 is recorded once, as an overlap skip (not again when the buffered one settled).
    let skipped: Vec<_> = history.iter().filter(|c| c["type"] == "skipped").collect();
    assert_eq!(skipped.len(), 1, "{history:?}");
    assert_eq!(
        (skipped[0]["count"].as_u64(), skipped[0]["reason"].as_str()),
        (Some(1), Some("overlap"))
    );
    let counts = t.work.expect("work").counts;
    assert_eq!((counts.skipped_overlap, counts.skipped_catch_up), (1, 0));
}

#[tokio::test]
async fn catch_up_all_fires_the_last_missed_up_to_its_limit_then_goes_on() {
    let metrics = Metrics::record();
    let r = rig();
    let policy = Policy {
        catch_up: Some(CatchUp::All),
        catch_up_limit: Some(3),
        ..Policy::default()
    };
    first_fired(&r, "c", policy).await;
    // Down for 10 s: 2..=11 are due; the last 3 fire, 2..=8 are skipped.
    r.clock.advance(secs(10));
    let e = events(&r.hub, 4).await.expect("three caught up");
    assert_eq!(due_ats(&e), [at(1), at(9), at(10), at(11)]);
    assert!(r.more_events(4).await.is_none(), "no more than the limit");
    r.clock.advance(secs(1));
    let e = events(&r.hub, 5).await.expect("back on time");
    assert_eq!(due_ats(&e)[4], at(12));
    let history = history_of(&r, "c").await;
    let skipped: Vec<_> = history.iter().filter(|c| c["type"] == "skipped").collect();
    assert_eq!(skipped.len(), 1, "{history:?}");
    assert_eq!(
        (skipped[0]["count"].as_u64(), &skipped[0]["reason"]),
        (Some(7), &serde_json::json!("catch_up"))
    );
    // 9 and 10 fired with later ones due behind them; 11 was the latest by then.
    assert_eq!(metrics.value("timer_occurrences_caught_up"), 2.0);
    assert_eq!(
        metrics.value(r#"timer_occurrences_skipped{reason="catch_up"}"#),
        7.0
    );
}

#[tokio::test]
async fn catch_up_skip_drops_what_was_missed_and_once_fires_the_first() {
    let r = rig();
    let skip = Policy {
        catch_up: Some(CatchUp::Skip),
        ..Policy::default()
    };
    let once = Policy {
        catch_up: Some(CatchUp::Once),
        ..Policy::default()
    };
    let first = T0.saturating_add(secs(1));
    r.schedule(&[
        series_with("skip", first, skip),
        series_with("once", first, once),
    ])
    .await;
    r.clock.advance(secs(1));
    events(&r.hub, 2).await.expect("both fire once on time");
    timer_where(&r.store, "skip", |t| t.occurrences == 1).await;
    timer_where(&r.store, "once", |t| t.occurrences == 1).await;
    r.clock.advance(secs(10));
    let e = events(&r.hub, 3).await.expect("the first missed of `once`");
    assert!(r.more_events(3).await.is_none(), "`skip` fires none late");
    assert_eq!(e[2].key.service_call_id, "once");
    assert_eq!(due_ats(&e)[2], at(2));
    let t = timer_where(&r.store, "skip", |t| {
        t.due_at == T0.saturating_add(secs(12))
    })
    .await;
    assert_eq!(t.work.expect("work").counts.skipped_catch_up, 10);
}

#[tokio::test]
async fn a_one_shot_timer_fires_again_until_its_work_completes() {
    let r = Setup {
        config: EngineConfig {
            max_attempts: 3,
            ..config()
        },
        ..Setup::default()
    }
    .start();
    let policy = Policy {
        completion_timeout: Some(secs(5)),
        ..Policy::default()
    };
    let due = T0.saturating_add(secs(1));
    r.schedule(&[
        NewTimer {
            policy: Some(policy.clone()),
            ..timer("done", due)
        },
        NewTimer {
            policy: Some(policy),
            ..timer("never", due)
        },
    ])
    .await;
    r.clock.advance(secs(1));
    let e = events(&r.hub, 2).await.expect("both fire");
    timer_where(&r.store, "done", |t| {
        t.work.as_ref().is_some_and(|w| w.awaiting.is_some())
    })
    .await;
    // No completion within 5 s: each fires again, with an id of its own.
    r.clock.advance(secs(5));
    let again = events(&r.hub, 4).await.expect("fired again");
    assert_eq!(payload_of(&again[2])["refire"], 1);
    assert_ne!(again[2].id, e[0].id);
    assert_ne!(again[2].id, e[1].id);
    timer_where(&r.store, "done", |t| {
        t.work
            .as_ref()
            .and_then(|w| w.awaiting.as_ref())
            .is_some_and(|a| a.refires == 1)
    })
    .await;
    assert_eq!(completed(&r, "done", None).await, ControlOutcome::Completed);
    let t = timer_where(&r.store, "done", |t| t.state == TimerState::Reached).await;
    assert!(t.work.expect("work").awaiting.is_none());
    assert_eq!(
        completed(&r, "done", None).await,
        ControlOutcome::AlreadyCompleted
    );
    // The other one: a third fire, then no more (engine.max_attempts = 3): Failed.
    r.clock.advance(secs(5));
    events(&r.hub, 5).await.expect("a third fire");
    r.clock.advance(secs(5));
    let dead = dead_letters(&r.hub, 1).await.expect("TimerFailed");
    assert!(
        dead[0].reason.starts_with("completion_timeout:"),
        "{}",
        dead[0].reason
    );
    timer_where(&r.store, "never", |t| t.state == TimerState::Failed).await;
    // A retry fires it again as new, with three fires of its own before it gives up again.
    let retried = r
        .engine
        .control(&[TimerKey::new("t", "never")], &Action::Retry)
        .await
        .expect("retry");
    assert_eq!(retried, [ControlOutcome::Retried]);
    let e = events(&r.hub, 6)
        .await
        .expect("fired again after the retry");
    assert_eq!(
        payload_of(&e[5])["refire"],
        serde_json::Value::Null,
        "a first fire"
    );
    timer_where(&r.store, "never", |t| {
        t.state == TimerState::Scheduled && t.work.as_ref().is_some_and(|w| w.awaiting.is_some())
    })
    .await;
}

#[tokio::test]
async fn jitter_moves_each_occurrence_by_the_same_offset_every_time() {
    let r = rig();
    let policy = Policy {
        jitter: Some(ms(800)),
        ..Policy::default()
    };
    let key = TimerKey::new("t", "j");
    let first = T0.saturating_add(secs(1));
    let new = NewTimer {
        due_at: timer_core::policy::fire_time(&key, first, Some(&policy)),
        work: Some(Work {
            nominal: Some(first),
            ..Work::default()
        }),
        ..series_with("j", first, policy.clone())
    };
    r.schedule(&[new]).await;
    // 100 ms at a time, each step settled before the next: one occurrence due at a time.
    stepped(&r, "j", ms(100), T0.saturating_add(secs(4))).await;
    let e = events(&r.hub, 3).await.expect("three occurrences");
    for (i, event) in e.iter().enumerate() {
        let nominal = first.saturating_add(secs(i as u64));
        let expected = timer_core::policy::fire_time(&key, nominal, Some(&policy));
        assert_eq!(payload_of(event)["dueAt"], expected.to_rfc3339());
        assert!(expected >= nominal && expected < nominal.saturating_add(ms(800)));
    }
}

#[tokio::test]
async fn a_completion_that_meets_its_fire_waits_for_it_then_applies() {
    let gate = Arc::new(tokio::sync::Notify::new());
    let r = Setup::publishing(Publish::Gated(gate.clone())).start();
    let policy = Policy {
        completion_timeout: Some(secs(60)),
        ..Policy::default()
    };
    r.schedule(&[NewTimer {
        policy: Some(policy),
        ..timer("w", T0.saturating_add(secs(1)))
    }])
    .await;
    r.clock.advance(secs(1));
    timer_where(&r.store, "w", |t| t.lease_owner.is_some()).await;
    // The consumer answers before the broker confirmed the event: over HTTP that is `firing`
    // (nothing changed), on the broker the command waits for the fire to settle.
    assert_eq!(completed(&r, "w", None).await, ControlOutcome::Firing);
    r.hub
        .send_command(r#"{"type":"TimerCompleted","tenantId":"t","serviceCallId":"w"}"#)
        .expect("send");
    gate.notify_one();
    let t = timer_where(&r.store, "w", |t| t.state == TimerState::Reached).await;
    assert!(t.work.expect("work").awaiting.is_none(), "nothing awaited");
    assert!(
        all_acknowledged(&r.hub).await,
        "the completion is acknowledged"
    );
    let types: Vec<String> = history_of(&r, "w")
        .await
        .iter()
        .filter_map(|c| c["type"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(types, ["created", "fired", "completed"]);
    // Not fired again when its timeout would have run out.
    r.clock.advance(secs(120));
    assert!(r.more_events(1).await.is_none(), "one fire only");
}

#[tokio::test]
async fn a_resume_catches_up_with_catch_up_all_and_once_and_skips_without() {
    let r = rig();
    let first = T0.saturating_add(secs(1));
    let all = Policy {
        catch_up: Some(CatchUp::All),
        catch_up_limit: Some(2),
        ..Policy::default()
    };
    let once = Policy {
        catch_up: Some(CatchUp::Once),
        ..Policy::default()
    };
    r.schedule(&[
        series_with("all", first, all),
        series_with("once", first, once),
        every_second("plain", first),
    ])
    .await;
    r.clock.advance(secs(1));
    events(&r.hub, 3).await.expect("each fires once");
    let keys: Vec<TimerKey> = ["all", "once", "plain"]
        .iter()
        .map(|id| TimerKey::new("t", *id))
        .collect();
    for id in ["all", "once", "plain"] {
        timer_where(&r.store, id, |t| t.occurrences == 1).await;
    }
    let paused = r
        .engine
        .control(&keys, &Action::Pause { note: None })
        .await
        .expect("pause");
    assert!(
        paused.iter().all(|o| *o == ControlOutcome::Paused),
        "{paused:?}"
    );
    // Paused while 2..=6 come due (resumed half a second after 6).
    r.clock.advance(ms(5500));
    assert!(r.more_events(3).await.is_none(), "nothing fires paused");
    r.engine
        .control(&keys, &Action::Resume)
        .await
        .expect("resume");
    let e = events(&r.hub, 6).await.expect("three fires caught up");
    assert!(r.more_events(6).await.is_none(), "and no more");
    let of = |id: &str| -> Vec<String> {
        let fired: Vec<PublishedEvent> = e[3..]
            .iter()
            .filter(|e| e.key.service_call_id == id)
            .cloned()
            .collect();
        due_ats(&fired)
    };
    assert_eq!(of("all"), [at(5), at(6)], "the latest two of the pause");
    assert_eq!(of("once"), [at(2)], "the first one of the pause, late");
    assert!(of("plain").is_empty(), "without catchUp a resume skips");
    let plain = timer_where(&r.store, "plain", |_| true).await;
    assert_eq!(plain.due_at, T0.saturating_add(secs(7)));
    let reasons = |history: Vec<serde_json::Value>| -> Vec<(u64, String)> {
        history
            .iter()
            .filter(|c| c["type"] == "skipped")
            .map(|c| {
                (
                    c["count"].as_u64().unwrap_or(0),
                    c["reason"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect()
    };
    assert_eq!(
        reasons(history_of(&r, "all").await),
        [(3, "catch_up".into())]
    );
    timer_where(&r.store, "once", |t| t.occurrences == 2).await;
    assert_eq!(
        reasons(history_of(&r, "once").await),
        [(4, "catch_up".into())]
    );
    assert_eq!(
        reasons(history_of(&r, "plain").await),
        [(5, "pause".into())]
    );
}

#[tokio::test]
async fn catch_up_window_skips_what_is_later_than_the_window() {
    let r = rig();
    let policy = Policy {
        catch_up: Some(CatchUp::All),
        catch_up_limit: Some(10),
        catch_up_window: Some(secs(3)),
        ..Policy::default()
    };
    first_fired(&r, "w", policy).await;
    // Down for 10 s: at 11 s, 2..=7 are more than 3 s late; 8..=11 fire.
    r.clock.advance(secs(10));
    let e = events(&r.hub, 5).await.expect("the ones within the window");
    assert_eq!(due_ats(&e[1..]), [at(8), at(9), at(10), at(11)]);
    assert!(r.more_events(5).await.is_none(), "no more");
    let history = history_of(&r, "w").await;
    let skipped: Vec<_> = history.iter().filter(|c| c["type"] == "skipped").collect();
    assert_eq!(skipped.len(), 1, "{history:?}");
    assert_eq!(skipped[0]["count"], 6);
    assert_eq!(skipped[0]["reason"], "catch_up_window");
    assert_eq!(
        (skipped[0]["first"].as_str(), skipped[0]["last"].as_str()),
        (Some(at(2).as_str()), Some(at(7).as_str()))
    );
}

/// A series of `cron` in Europe/Berlin with `jitter`, first due after `start`, as the wire
/// decoder builds it: due at the first occurrence's fire time, its cron time kept as nominal.
fn jittered(id: &str, cron: &str, start: Timestamp, jitter: Duration) -> (NewTimer, Timestamp) {
    let recurrence = Recurrence {
        cron: cron.into(),
        time_zone: "Europe/Berlin".into(),
        end_at: None,
        max_occurrences: None,
    };
    let first = recurrence
        .schedule()
        .expect("a valid pattern")
        .first(start)
        .expect("an occurrence");
    let policy = Policy {
        jitter: Some(jitter),
        ..Policy::default()
    };
    let key = TimerKey::new("t", id);
    let timer = NewTimer {
        due_at: timer_core::policy::fire_time(&key, first, Some(&policy)),
        recurrence: Some(recurrence),
        policy: Some(policy),
        work: Some(Work {
            nominal: Some(first),
            ..Work::default()
        }),
        ..timer(id, first)
    };
    (timer, first)
}

fn utc(text: &str) -> Timestamp {
    let at = chrono::DateTime::parse_from_rfc3339(text).expect("an RFC 3339 time");
    Timestamp::from_millis(at.timestamp_millis())
}

/// Moves the clock in `step`s until `until`, each step settled before the next (series `id` due
/// after now).
async fn stepped(r: &Rig, id: &str, step: Duration, until: Timestamp) {
    while timer_core::Clock::now(&*r.clock) < until {
        r.clock.advance(step);
        let now = timer_core::Clock::now(&*r.clock);
        timer_where(&r.store, id, |t| t.due_at > now).await;
    }
}

#[tokio::test]
async fn jitter_keeps_the_daylight_saving_rules_of_the_pattern() {
    let jitter = Duration::from_secs(600);
    let policy = Policy {
        jitter: Some(jitter),
        ..Policy::default()
    };
    let fire_time = |id: &str, nominal: &str| {
        timer_core::policy::fire_time(&TimerKey::new("t", id), utc(nominal), Some(&policy))
            .to_rfc3339()
    };
    // Fall back (2026-10-25, 03:00 CEST becomes 02:00 CET): an hourly pattern fires on both
    // passes of 02:00, each with its own offset.
    let start = utc("2026-10-24T23:30:00Z");
    let r = Setup {
        clock: Arc::new(ManualClock::new(start)),
        ..Setup::default()
    }
    .start();
    let (hourly, first) = jittered("hourly", "0 0 * * * *", start, jitter);
    assert_eq!(first, utc("2026-10-25T00:00:00Z"), "02:00 CEST");
    r.schedule(&[hourly]).await;
    stepped(&r, "hourly", secs(300), utc("2026-10-25T03:00:00Z")).await;
    let e = events(&r.hub, 3).await.expect("three hours");
    assert_eq!(
        due_ats(&e),
        [
            fire_time("hourly", "2026-10-25T00:00:00Z"), // 02:00 CEST
            fire_time("hourly", "2026-10-25T01:00:00Z"), // 02:00 CET
            fire_time("hourly", "2026-10-25T02:00:00Z"), // 03:00 CET
        ]
    );
    r.shutdown.cancel();
    let _ = r.task.await;

    // Spring forward (2026-03-29, 02:00 CET becomes 03:00 CEST): 02:30 does not exist, the
    // pattern fires at 03:00 CEST, jittered from there; the next day at 02:30 again.
    let start = utc("2026-03-28T12:00:00Z");
    let r = Setup {
        clock: Arc::new(ManualClock::new(start)),
        ..Setup::default()
    }
    .start();
    let (daily, first) = jittered("daily", "0 30 2 * * *", start, jitter);
    assert_eq!(first, utc("2026-03-29T01:00:00Z"), "03:00 CEST");
    r.schedule(&[daily]).await;
    stepped(&r, "daily", secs(3600), utc("2026-03-30T02:00:00Z")).await;
    let e = events(&r.hub, 2).await.expect("two days");
    assert_eq!(
        due_ats(&e),
        [
            fire_time("daily", "2026-03-29T01:00:00Z"), // 03:00 CEST, after the gap
            fire_time("daily", "2026-03-30T00:30:00Z"), // 02:30 CEST
        ]
    );
    assert!(r.more_events(2).await.is_none(), "once a day");
}

#[tokio::test]
async fn a_one_shot_timer_awaiting_its_work_is_not_fired_again_by_a_resume() {
    let r = rig();
    let policy = Policy {
        completion_timeout: Some(secs(60)),
        ..Policy::default()
    };
    r.schedule(&[
        NewTimer {
            policy: Some(policy.clone()),
            ..timer("resumed", T0.saturating_add(secs(1)))
        },
        NewTimer {
            policy: Some(policy),
            ..timer("paused", T0.saturating_add(secs(1)))
        },
    ])
    .await;
    r.clock.advance(secs(1));
    events(&r.hub, 2).await.expect("both fire");
    let keys = [TimerKey::new("t", "resumed"), TimerKey::new("t", "paused")];
    for key in &keys {
        timer_where(&r.store, &key.service_call_id, |t| {
            t.work.as_ref().is_some_and(|w| w.awaiting.is_some())
        })
        .await;
    }
    r.engine
        .control(&keys, &Action::Pause { note: None })
        .await
        .expect("pause");
    r.engine
        .control(&keys[..1], &Action::Resume)
        .await
        .expect("resume");
    // Resumed with its work still running: it waits for its deadline, no second fire.
    let deadline = T0.saturating_add(secs(61));
    timer_where(&r.store, "resumed", |t| {
        t.state == TimerState::Scheduled && t.available_at == deadline
    })
    .await;
    r.clock.advance(secs(30));
    assert!(r.more_events(2).await.is_none(), "not fired again");
    // Completed while paused: its work is done, nothing is left to fire.
    assert_eq!(
        completed(&r, "paused", None).await,
        ControlOutcome::Completed
    );
    timer_where(&r.store, "paused", |t| t.state == TimerState::Reached).await;
}

/// A manual trigger publishes an event of its own (`"trigger": "manual"`, an id that is not the
/// scheduled fire's), records it in the history, and leaves the schedule as it was: the timer
/// still fires at its due time, with its own id.
#[tokio::test]
async fn a_manual_trigger_sends_its_own_event_and_leaves_the_schedule() {
    let r = rig();
    let due = T0.saturating_add(secs(3600));
    r.schedule(&[timer("manual", due)]).await;
    let key = TimerKey::new("t", "manual");
    let before = timer_where(&r.store, "manual", |_| true).await;
    let Triggered::Fired { event_id, at } = r.engine.trigger(&key).await.expect("trigger") else {
        panic!("a Scheduled timer is triggered");
    };
    assert_eq!(at, T0);
    let sent = events(&r.hub, 1).await.expect("the manual event");
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(sent[0].id, event_id);
    let payload = payload_of(&sent[0]);
    assert_eq!(payload["trigger"], "manual", "{payload}");
    let after = timer_where(&r.store, "manual", |_| true).await;
    assert_eq!(after, before, "the schedule did not move");
    let history = history_of(&r, "manual").await;
    assert!(
        history
            .iter()
            .any(|e| e["type"] == "triggered" && e["eventId"] == event_id.to_string()),
        "{history:?}"
    );
    r.clock.advance(secs(3600));
    let both = events(&r.hub, 2).await.expect("the scheduled fire");
    assert_eq!(both.len(), 2, "{both:?}");
    assert_ne!(both[1].id, event_id, "the scheduled fire has its own id");
    assert_eq!(payload_of(&both[1])["dueAt"], due.to_rfc3339());
}

/// A manual trigger the broker does not confirm is an error and records nothing: no event, no
/// history entry, the timer as it was; the next trigger goes out.
#[tokio::test]
async fn a_manual_trigger_the_broker_refuses_is_an_error_and_records_nothing() {
    let r = Setup::publishing(Publish::FailsFirst(1)).start();
    let due = T0.saturating_add(secs(3600));
    r.schedule(&[timer("refused", due)]).await;
    let key = TimerKey::new("t", "refused");
    let before = timer_where(&r.store, "refused", |_| true).await;
    let history_before = history_of(&r, "refused").await;
    let refused = r.engine.trigger(&key).await;
    assert!(refused.is_err(), "{refused:?}");
    assert!(r.hub.events().expect("events").is_empty());
    assert_eq!(history_of(&r, "refused").await, history_before);
    let after = timer_where(&r.store, "refused", |_| true).await;
    assert_eq!(after, before, "the schedule did not move");
    let again = r.engine.trigger(&key).await.expect("trigger");
    assert!(matches!(again, Triggered::Fired { .. }), "{again:?}");
    events(&r.hub, 1)
        .await
        .expect("the second trigger went out");
}

/// A memory queue as a timer's target.
fn queue(name: &str) -> timer_core::Target {
    let serde_json::Value::Object(fields) = serde_json::json!({ "queue": name }) else {
        unreachable!("an object")
    };
    timer_core::Target::new(fields)
}

/// A timer taken under rules that allowed its target and due after they were narrowed (an
/// instance started with a `targets.allow` that no longer names it) is not sent there: at its
/// due time it is given up with a `TimerFailed` naming the rule, and a manual trigger is
/// refused the same way. Timers the new rules allow fire as before.
#[tokio::test]
async fn a_target_the_rules_refuse_now_is_given_up_at_its_fire_not_sent() {
    let mut wide = Setup::default();
    wide.limits.targets.allow = vec!["{tenant}.*".into(), "partners.*".into()];
    let (store, hub, clock) = (wide.store.clone(), wide.hub.clone(), wide.clock.clone());
    let first = wide.start();
    let due = T0.saturating_add(secs(60));
    let mut narrowed = timer("narrowed", due);
    narrowed.target = Some(queue("partners.orders"));
    let mut kept = timer("kept", due);
    kept.target = Some(queue("t.orders"));
    let mut triggered = timer("triggered", T0.saturating_add(secs(3600)));
    triggered.target = Some(queue("partners.orders"));
    let stored = first.schedule(&[narrowed, kept, triggered]).await;
    assert!(
        stored.iter().all(|s| matches!(s, Scheduled::Stored(_))),
        "{stored:?}"
    );
    first.stop().await;

    // The default rules: tenant `t` sends to `t.*` only.
    let second = Setup {
        store: store.clone(),
        hub: hub.clone(),
        clock: clock.clone(),
        ..Setup::default()
    }
    .start();
    let refused = second
        .engine
        .trigger(&TimerKey::new("t", "triggered"))
        .await
        .expect("trigger");
    assert!(
        matches!(&refused, Triggered::NotCarried(r)
            if r.reason == Reason::InvalidTarget && r.field.as_deref() == Some("target")),
        "{refused:?}"
    );
    clock.advance(secs(60));
    let failed = timer_where(&store, "narrowed", |t| t.state == TimerState::Failed).await;
    let error = failed.last_error.unwrap_or_default();
    assert!(
        error.starts_with("target: tenant \"t\" may not send to \"partners.orders\"")
            && error.contains("checked again at its fire"),
        "{error}"
    );
    let letters = dead_letters(&hub, 1).await.expect("a TimerFailed");
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].reason, format!("invalid_target: {error}"));
    timer_where(&store, "kept", |t| t.state == TimerState::Reached).await;
    let sent = hub.events().expect("events");
    assert_eq!(
        sent.len(),
        1,
        "only the allowed target got an event: {sent:?}"
    );
    assert_eq!(sent[0].queue.as_deref(), Some("t.orders"));
    second.shutdown.cancel();
}

/// Twenty timers, `g00` to `g19`, due a minute after T0 with a target that only wider rules
/// took: stored by an engine of `setup` that allowed `partners.*`, then stopped. Answers that
/// setup under the default rules, its dead letters as `gate` lets them, started and moved to
/// their due time, where it gives each of them up: the first `TimerFailed` was tried, and let
/// out.
async fn narrowed_give_ups(setup: Setup, gate: &DeadLetterGate) -> Rig {
    let config = setup.config.clone();
    let mut wide = setup;
    wide.limits.targets.allow = vec!["partners.*".into()];
    let (store, hub, clock) = (wide.store.clone(), wide.hub.clone(), wide.clock.clone());
    let first = wide.start();
    let due = T0.saturating_add(secs(60));
    let refused: Vec<NewTimer> = (0..20)
        .map(|i| {
            let mut t = timer(&format!("g{i:02}"), due);
            t.target = Some(queue("partners.orders"));
            t
        })
        .collect();
    first.schedule(&refused).await;
    first.stop().await;
    let second = Setup {
        store,
        hub,
        clock,
        dead_letters: gate.clone(),
        config,
        ..Setup::default()
    }
    .start();
    second.clock.advance(secs(60));
    assert!(gate.tried(1).await, "the first TimerFailed is on its way");
    gate.let_one();
    second
}

/// The give-ups of one batch send their dead letters together: the first alone (when the
/// broker refuses it, the others are not tried), then the rest many at a time, not each after
/// the one before (a narrowed `targets.allow` gives up every stored timer it refuses now).
#[tokio::test]
async fn the_give_ups_of_a_batch_send_their_dead_letters_together() {
    let gate = DeadLetterGate::holding();
    let second = narrowed_give_ups(Setup::default(), &gate).await;
    let (store, hub) = (second.store.clone(), second.hub.clone());
    // The others set out together while none of them goes out.
    assert!(
        gate.tried(17).await,
        "the others wait one after another: {} tried",
        gate.tries.load(Ordering::SeqCst)
    );
    gate.release();
    let letters = dead_letters(&hub, 20).await.expect("20 TimerFailed");
    assert_eq!(letters.len(), 20);
    for i in 0..20 {
        timer_where(&store, &format!("g{i:02}"), |t| {
            t.state == TimerState::Failed
        })
        .await;
    }
    assert!(hub.events().expect("events").is_empty(), "none was sent");
    second.shutdown.cancel();
}

/// Give-ups whose rounds outlast a lease renewal hold the leases of the timers still to give up:
/// those an earlier round marked Failed have none to renew, and are not counted as leases lost
/// (which ended the whole batch: the rest were left leased, their dead letters sent again).
#[tokio::test]
async fn give_ups_longer_than_a_lease_renew_what_is_left() {
    let lease = secs(1);
    let short = Setup {
        config: EngineConfig {
            lease,
            publish_timeout: secs(3600),
            ..config()
        },
        ..Setup::default()
    };
    let gate = DeadLetterGate::holding();
    let second = narrowed_give_ups(short, &gate).await;
    let (store, hub, clock) = (
        second.store.clone(),
        second.hub.clone(),
        second.clock.clone(),
    );
    timer_where(&store, "g00", |t| t.state == TimerState::Failed).await;
    assert!(gate.tried(17).await, "the second round is on its way");
    // Renewals of the leases left, past the end of the first (each step waits for one).
    for _ in 0..3 {
        clock.advance(ms(500));
        let renewed_to = timer_core::Clock::now(clock.as_ref()).saturating_add(lease);
        timer_where(&store, "g19", |t| t.available_at == renewed_to).await;
    }
    gate.release();
    for i in 0..20 {
        timer_where(&store, &format!("g{i:02}"), |t| {
            t.state == TimerState::Failed
        })
        .await;
    }
    let letters = dead_letters(&hub, 20).await.expect("20 TimerFailed");
    assert_eq!(letters.len(), 20, "one each");
    second.shutdown.cancel();
}

/// A caller of HTTP targets that answers as scripted, one answer per call, then delivers (or,
/// with `hang`, never answers).
#[derive(Default)]
struct ScriptedCaller {
    answers: std::sync::Mutex<std::collections::VecDeque<timer_core::Called>>,
    calls: AtomicU32,
    hang: bool,
}

#[async_trait]
impl timer_core::Caller for ScriptedCaller {
    fn name(&self) -> &'static str {
        "scripted"
    }

    fn takes(&self, target: &timer_core::Target) -> bool {
        target.fields().contains_key("url")
    }

    fn check_target(&self, target: &timer_core::Target) -> Result<String, String> {
        target.text("url").map(str::to_owned).ok_or("no url".into())
    }

    async fn call(&self, _event: &timer_core::OutboundEvent) -> timer_core::Called {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let next = self.answers.lock().ok().and_then(|mut a| a.pop_front());
        match next {
            Some(answer) => answer,
            None if self.hang => std::future::pending().await,
            None => timer_core::Called::Delivered {
                answer: "h:80 answered 200 OK in 1 ms".into(),
            },
        }
    }
}

/// An engine whose fires to `http://h/…` go to `caller`.
fn calling(caller: &Arc<ScriptedCaller>) -> Rig {
    let mut setup = Setup::default();
    setup.limits.targets.allow = vec!["http://h".into()];
    setup.caller = Some(caller.clone());
    setup.start()
}

/// A timer due at `due` with an HTTP target.
fn hook(id: &str, due: Timestamp) -> NewTimer {
    let mut t = timer(id, due);
    let serde_json::Value::Object(fields) = serde_json::json!({"url": format!("http://h/{id}")})
    else {
        unreachable!("an object")
    };
    t.target = Some(timer_core::Target::new(fields));
    t
}

#[tokio::test]
async fn a_delivered_call_settles_its_timer_with_the_answer_and_nothing_goes_to_the_broker() {
    let caller = Arc::new(ScriptedCaller::default());
    let r = calling(&caller);
    r.schedule(&[hook("hooked", T0), timer("plain", T0)]).await;
    timer_where(&r.store, "hooked", |t| t.state == TimerState::Reached).await;
    let published = events(&r.hub, 1).await.expect("the plain timer's event");
    assert_eq!(
        published.len(),
        1,
        "only the plain timer went to the broker"
    );
    assert_eq!(caller.calls.load(Ordering::SeqCst), 1);
    let history = r
        .store
        .history()
        .read(&TimerKey::new("t", "hooked"), 0, 10)
        .await
        .expect("history");
    assert!(
        history.iter().any(|e| matches!(&e.change,
            timer_core::Change::Fired { answer: Some(a), .. } if a.contains("200 OK"))),
        "{history:?}"
    );
}

#[tokio::test]
async fn a_refused_call_fails_its_timer_at_once_with_a_dead_letter() {
    let caller = Arc::new(ScriptedCaller::default());
    caller
        .answers
        .lock()
        .expect("answers")
        .push_back(timer_core::Called::Refused {
            error: "h:80 answered 404 Not Found".into(),
        });
    let r = calling(&caller);
    r.schedule(&[hook("gone", T0)]).await;
    let t = timer_where(&r.store, "gone", |t| t.state == TimerState::Failed).await;
    assert_eq!(t.last_error.as_deref(), Some("h:80 answered 404 Not Found"));
    let letters = dead_letters(&r.hub, 1).await.expect("a TimerFailed");
    assert!(
        letters[0]
            .reason
            .starts_with("target_refused: h:80 answered 404"),
        "{letters:?}"
    );
    assert_eq!(caller.calls.load(Ordering::SeqCst), 1, "called once");
}

#[tokio::test]
async fn a_retried_call_waits_for_its_retry_after_and_a_busy_one_counts_no_attempt() {
    let caller = Arc::new(ScriptedCaller::default());
    {
        let mut answers = caller.answers.lock().expect("answers");
        answers.push_back(timer_core::Called::Retry {
            error: "h:80 answered 429 Too Many Requests".into(),
            not_before: Some(secs(30)),
        });
        answers.push_back(timer_core::Called::Busy { after: secs(1) });
    }
    let r = calling(&caller);
    r.schedule(&[hook("later", T0)]).await;
    // Retry-After 30 s, longer than the backoff (1 s): the next attempt is 30 s on.
    let t = timer_where(&r.store, "later", |t| t.attempts == 1).await;
    assert_eq!(t.available_at, T0.saturating_add(secs(30)), "{t:?}");
    r.clock.advance(secs(29));
    r.no_events().await;
    assert_eq!(
        caller.calls.load(Ordering::SeqCst),
        1,
        "not before Retry-After"
    );
    r.clock.advance(secs(1));
    // Busy: handed back for a second, the attempt not counted.
    let t = timer_where(&r.store, "later", |t| {
        t.available_at == T0.saturating_add(secs(31))
    })
    .await;
    assert_eq!((t.state, t.attempts), (TimerState::Scheduled, 1), "{t:?}");
    r.clock.advance(secs(1));
    timer_where(&r.store, "later", |t| t.state == TimerState::Reached).await;
    assert_eq!(caller.calls.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn shutdown_during_a_call_gives_its_claim_back() {
    let caller = Arc::new(ScriptedCaller {
        hang: true,
        ..ScriptedCaller::default()
    });
    let r = calling(&caller);
    r.schedule(&[hook("held", T0)]).await;
    wait_for(WAIT, || async {
        (caller.calls.load(Ordering::SeqCst) == 1).then_some(())
    })
    .await
    .expect("the call started");
    r.shutdown.cancel();
    tokio::time::timeout(WAIT, r.task)
        .await
        .expect("the engine stops within the grace period, the call with it")
        .expect("no panic");
    let t = timer_where(&r.store, "held", |_| true).await;
    assert_eq!(t.lease_owner, None, "claim released");
    assert_eq!(
        (t.state, t.attempts),
        (TimerState::Scheduled, 0),
        "a shutdown is not a failed attempt"
    );
}
