//! `memory`: an in-process broker. Commands are handed to this process's engine (and stay
//! delivered until acknowledged); events and dead letters are kept in a bounded buffer that the
//! HTTP API and tests can read. Nothing survives a restart.
//!
//! The rest is the plugin's page of the book (`README.md` beside this file).
#![doc = include_str!("README.md")]

mod plugin;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use timer_core::config::duration;
use timer_core::{
    Broker, Delivery, Error, MessageMeta, OutboundEvent, Result, Target, TimerKey, TraceHeaders,
    Undelivered,
};
use tokio::sync::Notify;
use tokio::time::Instant;
use uuid::Uuid;

#[cfg(feature = "testing")]
pub use plugin::MemoryTestClient;
pub use plugin::{HubConfig, PLUGIN};

/// The memory broker, the embedded default: commands, events and dead letters inside this
/// process, for one instance. Commands come from `POST /v1/commands`; events show on
/// `/v1/events`, and dead letters on `GET /v1/dead-letters`. Nothing survives a restart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryConfig {
    /// Always `memory`; checked by the binary.
    pub kind: String,
    /// A delivered command that is not acknowledged within this time is delivered again.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub ack_wait: Duration,
    /// How many published events, and how many dead letters, are kept for reading back (the
    /// oldest go first; 0 counts as 1).
    pub retain: usize,
    /// Most commands waiting or delivered and not yet acknowledged, over all tenants. A
    /// command sent beyond it is refused (`POST /v1/commands` answers 503 with `Retry-After`),
    /// so a producer faster than the store cannot grow the queue without end. 0 counts as 1.
    pub max_queued: usize,
    /// Most of them one tenant (the command's `tenantId`; commands without one count as one
    /// tenant) may have: a tenant that floods is refused before it fills the queue for all.
    /// 0 sets no limit but `broker.max_queued`.
    pub max_queued_per_tenant: usize,
    /// Most bytes of commands waiting or delivered and not yet acknowledged, over all tenants;
    /// once they hold it, a command is refused as beyond `broker.max_queued`, so large commands
    /// cannot make the process hold gigabytes (the command that crosses it is taken, whatever
    /// its size). 0 sets no limit but `broker.max_queued`.
    pub max_queued_bytes: usize,
    /// Most of those bytes one tenant may have (as `broker.max_queued_per_tenant` counts
    /// commands): a tenant sending large commands faster than it may (`limits.rate` holds them
    /// unacknowledged) is refused before it fills `broker.max_queued_bytes` for all. The
    /// command that crosses it is taken. 0 sets no limit but `broker.max_queued_bytes`.
    pub max_queued_bytes_per_tenant: usize,
    /// Most bytes of the events, and of the dead letters, kept for reading back, beside
    /// `broker.retain`: the oldest go first (the latest is kept whatever its size). 0 sets no
    /// limit but `broker.retain`.
    pub retain_bytes: usize,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            kind: "memory".into(),
            ack_wait: Duration::from_secs(30),
            retain: 10_000,
            max_queued: 100_000,
            max_queued_per_tenant: 10_000,
            max_queued_bytes: 64 * 1024 * 1024,
            max_queued_bytes_per_tenant: 8 * 1024 * 1024,
            retain_bytes: 64 * 1024 * 1024,
        }
    }
}

/// An event as the memory broker holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishedEvent {
    pub id: Uuid,
    pub key: TimerKey,
    pub body: Vec<u8>,
    /// The queue of its target (`{"queue": "..."}`), `None` for the events destination.
    pub queue: Option<String>,
    /// The content type and headers of a timer's own message.
    pub message: Option<MessageMeta>,
    /// The headers a broker would carry beside it: the trace context (`traceparent`,
    /// `tracestate`) it went out in.
    pub headers: BTreeMap<String, String>,
}

/// A command that was dead-lettered, with the reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeadLetter {
    pub body: String,
    pub reason: String,
}

/// The queue a memory target names.
fn queue_of(target: &Target) -> Option<&str> {
    target.text("queue")
}

/// The shared broker state. Producers (`send_command`) and readers (`events`) use the hub;
/// each engine connects its own [`MemoryBroker`].
#[derive(Clone)]
pub struct MemoryHub {
    inner: Arc<Hub>,
}

struct Hub {
    config: MemoryConfig,
    state: Mutex<HubState>,
    arrived: Notify,
    next_consumer: AtomicU64,
}

/// What one tenant has queued or in flight.
#[derive(Debug, Default, Clone, Copy)]
struct Queueing {
    commands: usize,
    bytes: usize,
}

#[derive(Default)]
struct HubState {
    queue: VecDeque<Queued>,
    in_flight: HashMap<u64, InFlight>,
    /// Commands queued or in flight, and their bytes, by tenant (absent: none).
    per_tenant: HashMap<Option<Arc<str>>, Queueing>,
    /// Bytes of the commands queued or in flight.
    queued_bytes: usize,
    next_tag: u64,
    events: Retained<PublishedEvent>,
    dead_letters: Retained<DeadLetter>,
}

/// What is kept for reading back, bounded by a count and by bytes: the oldest go first.
struct Retained<T> {
    items: VecDeque<T>,
    bytes: usize,
}

impl<T> Default for Retained<T> {
    fn default() -> Self {
        Retained {
            items: VecDeque::new(),
            bytes: 0,
        }
    }
}

impl<T> Retained<T> {
    /// Keeps `item`, of `size_of(item)` bytes; the oldest go until at most `count` items (0
    /// counts as 1) and `bytes` bytes (0: any) are kept, `item` always.
    fn push(&mut self, item: T, count: usize, bytes: usize, size_of: fn(&T) -> usize) {
        self.bytes += size_of(&item);
        self.items.push_back(item);
        while self.items.len() > count.max(1) || (bytes > 0 && self.bytes > bytes && self.items.len() > 1)
        {
            if let Some(old) = self.items.pop_front() {
                self.bytes -= size_of(&old);
            }
        }
    }
}

fn event_bytes(event: &PublishedEvent) -> usize {
    event.body.len()
}

fn letter_bytes(letter: &DeadLetter) -> usize {
    letter.body.len() + letter.reason.len()
}

/// A command waiting to be delivered, with the tenant it names and the trace context headers
/// it was sent with.
struct Queued {
    tenant: Option<Arc<str>>,
    body: Vec<u8>,
    trace: TraceHeaders,
}

struct InFlight {
    consumer: u64,
    command: Queued,
    deadline: Instant,
}

impl HubState {
    /// Puts unacknowledged deliveries that match back at the front of the queue.
    fn requeue(&mut self, pred: impl Fn(&InFlight) -> bool) -> usize {
        let mut back: Vec<(u64, InFlight)> = self.in_flight.extract_if(|_, f| pred(f)).collect();
        // Older deliveries (lower tags) go first.
        back.sort_by_key(|(tag, _)| std::cmp::Reverse(*tag));
        let n = back.len();
        for (_, f) in back {
            self.queue.push_front(f.command);
        }
        n
    }

    /// A command acknowledged: it counts no more.
    fn done(&mut self, command: &Queued) {
        self.queued_bytes = self.queued_bytes.saturating_sub(command.body.len());
        let tenant = &command.tenant;
        if let Some(mine) = self.per_tenant.get_mut(tenant) {
            mine.commands = mine.commands.saturating_sub(1);
            mine.bytes = mine.bytes.saturating_sub(command.body.len());
            if mine.commands == 0 {
                self.per_tenant.remove(tenant);
            }
        }
    }
}

/// The `tenantId` a command names, read as the engine will (a command without one, or not
/// JSON, is refused there; here it only counts).
fn tenant_of(body: &[u8]) -> Option<Arc<str>> {
    timer_core::wire::addressed(body).tenant_id.map(Arc::from)
}

impl MemoryHub {
    pub fn new(config: MemoryConfig) -> Self {
        MemoryHub {
            inner: Arc::new(Hub {
                config,
                state: Mutex::new(HubState::default()),
                arrived: Notify::new(),
                next_consumer: AtomicU64::new(1),
            }),
        }
    }

    fn lock(&self) -> Result<MutexGuard<'_, HubState>> {
        self.inner
            .state
            .lock()
            .map_err(|_| Error::internal("memory broker: a thread panicked while holding its lock"))
    }

    /// A new consumer connection. Its unacknowledged deliveries return to the queue when it is
    /// dropped.
    pub fn connect(&self) -> MemoryBroker {
        MemoryBroker {
            hub: self.clone(),
            consumer: self.inner.next_consumer.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// Enqueues a command, as a producing service would. Refused (`Unavailable`, try again
    /// later) when `broker.max_queued` commands are unacknowledged, or
    /// `broker.max_queued_per_tenant` of its tenant.
    pub fn send_command(&self, body: impl Into<Vec<u8>>) -> Result<()> {
        self.send_traced(body, TraceHeaders::default())
    }

    /// [`send_command`](Self::send_command) with the trace context headers the command came
    /// with (`POST /v1/commands` passes the request's).
    pub fn send_traced(&self, body: impl Into<Vec<u8>>, trace: TraceHeaders) -> Result<()> {
        let body = body.into();
        let tenant = tenant_of(&body);
        let config = &self.inner.config;
        let mut state = self.lock()?;
        let all = state.queue.len() + state.in_flight.len();
        if all >= config.max_queued.max(1) {
            return Err(Error::unavailable(format!(
                "memory broker: {all} commands are not acknowledged yet (broker.max_queued); \
                 send again later"
            )));
        }
        // Full once it holds the limit: the command that crosses it is taken, so one of any
        // size gets in as soon as there is room, not only into an empty queue.
        if config.max_queued_bytes > 0 && state.queued_bytes >= config.max_queued_bytes {
            return Err(Error::unavailable(format!(
                "memory broker: {} bytes of commands are not acknowledged yet \
                 (broker.max_queued_bytes); send again later",
                state.queued_bytes
            )));
        }
        let mine = state.per_tenant.get(&tenant).copied().unwrap_or_default();
        let named = tenant.as_deref().unwrap_or("");
        if config.max_queued_per_tenant > 0 && mine.commands >= config.max_queued_per_tenant {
            return Err(Error::unavailable(format!(
                "memory broker: tenant {named:?} has {} commands not acknowledged yet \
                 (broker.max_queued_per_tenant); send again later",
                mine.commands
            )));
        }
        let per_tenant = config.max_queued_bytes_per_tenant;
        if per_tenant > 0 && mine.bytes >= per_tenant {
            return Err(Error::unavailable(format!(
                "memory broker: tenant {named:?} has {} bytes of commands not acknowledged yet \
                 (broker.max_queued_bytes_per_tenant); send again later",
                mine.bytes
            )));
        }
        let mine = state.per_tenant.entry(tenant.clone()).or_default();
        mine.commands += 1;
        mine.bytes += body.len();
        state.queued_bytes += body.len();
        state.queue.push_back(Queued {
            tenant,
            body,
            trace,
        });
        drop(state);
        self.inner.arrived.notify_waiters();
        self.inner.arrived.notify_one();
        Ok(())
    }

    /// The retained published events, oldest first.
    pub fn events(&self) -> Result<Vec<PublishedEvent>> {
        Ok(self.lock()?.events.items.iter().cloned().collect())
    }

    /// The retained dead letters, oldest first.
    pub fn dead_letters(&self) -> Result<Vec<DeadLetter>> {
        Ok(self.lock()?.dead_letters.items.iter().cloned().collect())
    }

    /// Commands waiting or delivered but not yet acknowledged.
    pub fn unacknowledged(&self) -> Result<usize> {
        let state = self.lock()?;
        Ok(state.queue.len() + state.in_flight.len())
    }
}

/// One consumer connection to a [`MemoryHub`].
pub struct MemoryBroker {
    hub: MemoryHub,
    consumer: u64,
}

impl MemoryBroker {
    pub fn hub(&self) -> &MemoryHub {
        &self.hub
    }

    fn take(&self, max: usize) -> Result<Vec<Delivery>> {
        let ack_wait = self.hub.inner.config.ack_wait;
        let mut state = self.hub.lock()?;
        let now = Instant::now();
        state.requeue(|f| f.deadline <= now);
        let n = max.min(state.queue.len());
        let mut out = Vec::with_capacity(n);
        for command in state.queue.drain(..n).collect::<Vec<_>>() {
            state.next_tag += 1;
            let tag = state.next_tag;
            out.push(Delivery {
                tag,
                body: command.body.clone(),
                // POST /v1/commands checks the caller's tenants itself.
                tenant: None,
                trace: command.trace.clone(),
            });
            state.in_flight.insert(
                tag,
                InFlight {
                    consumer: self.consumer,
                    command,
                    deadline: now + ack_wait,
                },
            );
        }
        Ok(out)
    }
}

impl Drop for MemoryBroker {
    fn drop(&mut self) {
        let consumer = self.consumer;
        if let Ok(mut state) = self.hub.inner.state.lock() {
            if state.requeue(|f| f.consumer == consumer) > 0 {
                drop(state);
                self.hub.inner.arrived.notify_one();
            }
        }
    }
}

#[async_trait]
impl Broker for MemoryBroker {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn receive(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>> {
        let deadline = Instant::now() + wait;
        loop {
            // Register interest before looking, so a command sent in between is not missed.
            let arrived = self.hub.inner.arrived.notified();
            let got = self.take(max)?;
            if !got.is_empty() {
                return Ok(got);
            }
            // Wake at least every 100 ms to redeliver commands whose ack wait ran out.
            let until = deadline.min(Instant::now() + Duration::from_millis(100));
            if tokio::time::timeout_at(until, arrived).await.is_err() && Instant::now() >= deadline
            {
                return Ok(Vec::new());
            }
        }
    }

    async fn ack(&self, tags: &[u64]) -> Result<()> {
        let mut state = self.hub.lock()?;
        for tag in tags {
            if let Some(f) = state.in_flight.remove(tag) {
                state.done(&f.command);
            }
        }
        Ok(())
    }

    fn ack_wait(&self) -> Option<Duration> {
        Some(self.hub.inner.config.ack_wait)
    }

    /// `{"queue": "name"}`: a queue of the hub, kept with the events (the tests read it back).
    fn check_target(&self, target: &Target) -> std::result::Result<String, String> {
        let fields = target.fields();
        match queue_of(target) {
            Some(queue) if fields.len() == 1 && !queue.is_empty() => Ok(queue.to_owned()),
            _ => Err(format!(
                "the memory broker takes a target {{\"queue\": \"name\"}}, not {}",
                target.to_json()
            )),
        }
    }

    async fn keep(&self, tags: &[u64]) -> Result<()> {
        let deadline = Instant::now() + self.hub.inner.config.ack_wait;
        let mut state = self.hub.lock()?;
        for tag in tags {
            if let Some(f) = state.in_flight.get_mut(tag) {
                f.deadline = deadline;
            }
        }
        Ok(())
    }

    async fn publish(&self, events: &[OutboundEvent]) -> Result<Vec<Undelivered>> {
        let config = &self.hub.inner.config;
        let mut state = self.hub.lock()?;
        let mut undelivered = Vec::new();
        for (index, e) in events.iter().enumerate() {
            // A target not of this broker (stored by a build that had another destination for
            // it, e.g. an HTTP target's caller) is refused alone, never sent elsewhere.
            let queue = match &e.target {
                None => None,
                Some(target) => match self.check_target(target) {
                    Ok(queue) => Some(queue),
                    Err(why) => {
                        let error = Error::invalid(format!("memory broker: {why}"));
                        undelivered.push(Undelivered::new(index, error));
                        continue;
                    }
                },
            };
            let event = PublishedEvent {
                id: e.id,
                key: e.key.clone(),
                body: e.body.clone(),
                queue,
                message: e.message.clone(),
                headers: e
                    .trace_headers()
                    .map(|(name, value)| (name.to_owned(), value.to_owned()))
                    .collect(),
            };
            state.events.push(
                event,
                config.retain,
                config.retain_bytes,
                event_bytes,
            );
        }
        Ok(undelivered)
    }

    async fn dead_letter(&self, body: &[u8], reason: &str) -> Result<()> {
        let config = &self.hub.inner.config;
        let letter = DeadLetter {
            body: String::from_utf8_lossy(body).into_owned(),
            reason: reason.to_owned(),
        };
        self.hub.lock()?.dead_letters.push(
            letter,
            config.retain,
            config.retain_bytes,
            letter_bytes,
        );
        Ok(())
    }

    async fn health(&self) -> Result<()> {
        self.hub.lock().map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn command(tenant: &str) -> Vec<u8> {
        format!(r#"{{"type":"CancelTimer","tenantId":"{tenant}","serviceCallId":"x"}}"#)
            .into_bytes()
    }

    #[tokio::test]
    async fn a_flooding_tenant_is_refused_before_it_fills_the_queue_for_all() {
        let hub = MemoryHub::new(MemoryConfig {
            max_queued: 5,
            max_queued_per_tenant: 2,
            ..MemoryConfig::default()
        });
        hub.send_command(command("a")).unwrap();
        hub.send_command(command("a")).unwrap();
        let refused = hub.send_command(command("a")).unwrap_err();
        assert!(
            refused.to_string().contains(r#"tenant "a" has 2 commands"#),
            "{refused}"
        );
        assert!(refused.to_string().contains("broker.max_queued_per_tenant"));
        hub.send_command(command("b")).unwrap();
        hub.send_command(b"not json".to_vec()).unwrap();
        hub.send_command(command("c")).unwrap();
        let full = hub.send_command(command("d")).unwrap_err();
        assert!(full.to_string().contains("(broker.max_queued)"), "{full}");

        // Delivered and still unacknowledged, they count; acknowledged, they make room.
        let broker = hub.connect();
        let got = broker.receive(10, Duration::ZERO).await.unwrap();
        assert_eq!(got.len(), 5);
        assert!(hub.send_command(command("a")).is_err());
        broker.ack(&[got[0].tag]).await.unwrap();
        hub.send_command(command("a")).unwrap();
    }

    #[test]
    fn an_envelope_command_counts_for_its_payloads_tenant() {
        let envelope = br#"{"type":"CancelTimer","payload":{"tenantId":"a","serviceCallId":"x"}}"#;
        assert_eq!(tenant_of(envelope).as_deref(), Some("a"));
        assert_eq!(tenant_of(&command("b")).as_deref(), Some("b"));
        let odd_payload = br#"{"tenantId":"c","payload":"text"}"#;
        assert_eq!(tenant_of(odd_payload).as_deref(), Some("c"));
        assert_eq!(tenant_of(br#"{"payload":{"id":1}}"#), None);
        assert_eq!(tenant_of(b"not json"), None);
    }

    #[tokio::test]
    async fn a_target_of_another_destination_is_refused_alone_not_sent_to_the_events() {
        let hub = MemoryHub::new(MemoryConfig::default());
        let broker = hub.connect();
        let key = TimerKey::new("t", "x");
        let mut url = OutboundEvent::envelope(Uuid::nil(), key.clone(), b"{}".to_vec());
        url.target = Some(Target::new(
            serde_json::json!({"url": "https://hooks.example.com/t/"})
                .as_object()
                .cloned()
                .unwrap_or_default(),
        ));
        let plain = OutboundEvent::envelope(Uuid::from_u128(1), key, b"{}".to_vec());
        let undelivered = broker.publish(&[url, plain]).await.unwrap();
        assert_eq!(undelivered.len(), 1);
        assert_eq!(undelivered[0].index, 0);
        assert!(
            undelivered[0].error.to_string().contains("takes a target {\"queue\""),
            "{}",
            undelivered[0].error
        );
        let events = hub.events().unwrap();
        assert_eq!(events.len(), 1, "only the plain event: {events:?}");
        assert_eq!(events[0].id, Uuid::from_u128(1));
    }

    /// Commands count by bytes too: a flood of large ones is refused before the process holds
    /// gigabytes; the command that crosses the limit is taken, whatever its size.
    #[tokio::test]
    async fn large_commands_are_bounded_by_bytes() {
        let hub = MemoryHub::new(MemoryConfig {
            max_queued_bytes: 100,
            ..MemoryConfig::default()
        });
        let large = |n: usize| format!(r#"{{"tenantId":"a","pad":"{}"}}"#, "x".repeat(n));
        hub.send_command(large(200)).unwrap();
        let full = hub.send_command(large(10)).unwrap_err();
        assert!(full.to_string().contains("(broker.max_queued_bytes)"), "{full}");
        let broker = hub.connect();
        let got = broker.receive(10, Duration::ZERO).await.unwrap();
        broker.ack(&[got[0].tag]).await.unwrap();
        // 53 bytes, then 233: the second crosses the limit, and is taken.
        hub.send_command(large(30)).unwrap();
        hub.send_command(large(210)).unwrap();
        assert!(hub.send_command(large(1)).is_err(), "over 100 bytes");
    }

    /// One tenant's large commands are bounded by bytes of their own: a tenant that holds its
    /// share is refused while the others still send; once its commands are acknowledged it
    /// sends again.
    #[tokio::test]
    async fn one_tenants_large_commands_leave_room_for_the_others() {
        let hub = MemoryHub::new(MemoryConfig {
            max_queued_bytes: 1_000,
            max_queued_bytes_per_tenant: 300,
            ..MemoryConfig::default()
        });
        let large = |tenant: &str, n: usize| {
            format!(r#"{{"tenantId":"{tenant}","pad":"{}"}}"#, "x".repeat(n))
        };
        hub.send_command(large("flood", 150)).unwrap();
        hub.send_command(large("flood", 150)).unwrap();
        let full = hub.send_command(large("flood", 10)).unwrap_err();
        assert!(
            full.to_string()
                .contains("tenant \"flood\" has 358 bytes of commands not acknowledged yet \
                           (broker.max_queued_bytes_per_tenant)"),
            "{full}"
        );
        hub.send_command(large("quiet", 150)).unwrap();
        let broker = hub.connect();
        let got = broker.receive(10, Duration::ZERO).await.unwrap();
        let tags: Vec<u64> = got.iter().map(|d| d.tag).collect();
        broker.ack(&tags).await.unwrap();
        hub.send_command(large("flood", 10)).unwrap();
    }

    /// Events and dead letters kept for reading back are bounded by bytes too; the latest is
    /// kept whatever its size.
    #[tokio::test]
    async fn what_is_kept_for_reading_back_is_bounded_by_bytes() {
        let hub = MemoryHub::new(MemoryConfig {
            retain_bytes: 100,
            ..MemoryConfig::default()
        });
        let broker = hub.connect();
        for i in 0..5u8 {
            broker.dead_letter(&[b'x'; 40], &i.to_string()).await.unwrap();
            let event = OutboundEvent::envelope(Uuid::from_u128(u128::from(i)), TimerKey::new("t", "x"), vec![b'e'; 40]);
            broker.publish(&[event]).await.unwrap();
        }
        let letters = hub.dead_letters().unwrap();
        let reasons: Vec<&str> = letters.iter().map(|l| l.reason.as_str()).collect();
        assert_eq!(reasons, ["3", "4"]);
        let events = hub.events().unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(events[1].id, Uuid::from_u128(4));
        broker.dead_letter(&[b'x'; 500], "huge").await.unwrap();
        let letters = hub.dead_letters().unwrap();
        assert_eq!(letters.len(), 1, "the latest alone");
        assert_eq!(letters[0].reason, "huge");
    }
}
