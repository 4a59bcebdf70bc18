//! `memory`: an in-process broker. Commands are handed to this process's engine (and stay
//! delivered until acknowledged); events and dead letters are kept in a bounded buffer that the
//! HTTP API and tests can read. Nothing survives a restart.

mod plugin;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use timer_core::config::duration;
use timer_core::{Broker, Delivery, Error, OutboundEvent, Result, TimerKey, Undelivered};
use tokio::sync::Notify;
use tokio::time::Instant;
use uuid::Uuid;

pub use plugin::{HubConfig, MemoryTestClient, PLUGIN};

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
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            kind: "memory".into(),
            ack_wait: Duration::from_secs(30),
            retain: 10_000,
        }
    }
}

/// An event as the memory broker holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishedEvent {
    pub id: Uuid,
    pub key: TimerKey,
    pub body: Vec<u8>,
}

/// A command that was dead-lettered, with the reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeadLetter {
    pub body: String,
    pub reason: String,
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

#[derive(Default)]
struct HubState {
    queue: VecDeque<Vec<u8>>,
    in_flight: HashMap<u64, InFlight>,
    next_tag: u64,
    events: VecDeque<PublishedEvent>,
    dead_letters: VecDeque<DeadLetter>,
}

struct InFlight {
    consumer: u64,
    body: Vec<u8>,
    deadline: Instant,
}

impl HubState {
    /// Puts unacknowledged deliveries that match back at the front of the queue.
    fn requeue(&mut self, pred: impl Fn(&InFlight) -> bool) -> usize {
        let mut back: Vec<(u64, Vec<u8>)> = Vec::new();
        self.in_flight.retain(|tag, f| {
            if pred(f) {
                back.push((*tag, std::mem::take(&mut f.body)));
                false
            } else {
                true
            }
        });
        // Older deliveries (lower tags) go first.
        back.sort_by_key(|(tag, _)| std::cmp::Reverse(*tag));
        let n = back.len();
        for (_, body) in back {
            self.queue.push_front(body);
        }
        n
    }
}

fn push_bounded<T>(buf: &mut VecDeque<T>, item: T, retain: usize) {
    if buf.len() >= retain.max(1) {
        buf.pop_front();
    }
    buf.push_back(item);
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

    /// Enqueues a command, as a producing service would.
    pub fn send_command(&self, body: impl Into<Vec<u8>>) -> Result<()> {
        self.lock()?.queue.push_back(body.into());
        self.inner.arrived.notify_waiters();
        self.inner.arrived.notify_one();
        Ok(())
    }

    /// The retained published events, oldest first.
    pub fn events(&self) -> Result<Vec<PublishedEvent>> {
        Ok(self.lock()?.events.iter().cloned().collect())
    }

    /// The retained dead letters, oldest first.
    pub fn dead_letters(&self) -> Result<Vec<DeadLetter>> {
        Ok(self.lock()?.dead_letters.iter().cloned().collect())
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
        for body in state.queue.drain(..n).collect::<Vec<_>>() {
            state.next_tag += 1;
            let tag = state.next_tag;
            state.in_flight.insert(
                tag,
                InFlight {
                    consumer: self.consumer,
                    body: body.clone(),
                    deadline: now + ack_wait,
                },
            );
            out.push(Delivery { tag, body });
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
            state.in_flight.remove(tag);
        }
        Ok(())
    }

    fn ack_wait(&self) -> Option<Duration> {
        Some(self.hub.inner.config.ack_wait)
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
        let retain = self.hub.inner.config.retain;
        let mut state = self.hub.lock()?;
        for e in events {
            let event = PublishedEvent {
                id: e.id,
                key: e.key.clone(),
                body: e.body.clone(),
            };
            push_bounded(&mut state.events, event, retain);
        }
        Ok(Vec::new())
    }

    async fn dead_letter(&self, body: &[u8], reason: &str) -> Result<()> {
        let retain = self.hub.inner.config.retain;
        let letter = DeadLetter {
            body: String::from_utf8_lossy(body).into_owned(),
            reason: reason.to_owned(),
        };
        push_bounded(&mut self.hub.lock()?.dead_letters, letter, retain);
        Ok(())
    }

    async fn health(&self) -> Result<()> {
        self.hub.lock().map(|_| ())
    }
}
