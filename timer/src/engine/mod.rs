//! The engine: an ingest task (commands → store → ack) and a firing task (claim → publish →
//! settle), plus retention. Publish comes before settle: a crash between them repeats an event,
//! it never loses one.
//!
//! - `admit`: the one entry for commands from either path: decode, limits, schedule, metrics;
//! - `throttle`: per-tenant rate limits on schedules, and the commands the broker path holds
//!   back for them;
//! - `group_commit`: single schedules (HTTP) written together in one transaction;
//! - `ingest`: the broker path, in batches, acknowledged after the store committed;
//! - `fire`: claim due timers, publish their events within `engine.publish_timeout`;
//! - `ready`: the timers claimed ahead of their due time (`engine.claim_ahead`), held until it;
//! - `publish`: a fired batch's publish to the broker, on a task of its own, then its settle;
//! - `call`: the fires a [`Caller`] delivers (HTTP targets), each on its own task;
//! - `pace`: per-tenant fire rates, the turn of each timer over its tenant's rate;
//! - `owners`: membership in the store's live instances, taking over dead ones' leases, and
//!   renewing the leases of a publish in flight;
//! - `settle`: what becomes of a claim after its publish (reached, next occurrence, retry,
//!   failed);
//! - [`retry`]: the backoff and the retry loop every task uses;
//! - `purge`: deleting finished timers after `engine.retention`;
//! - `supervise`: starting a task that panicked again, and reporting it down meanwhile;
//! - `watchers`: the events this instance fired, for watchers (the HTTP event stream), each
//!   filtered and bounded on its own;
//! - `control`: pause, resume and cancel (one timer, or page by page over a filter), a manual
//!   trigger, and a timer's history;
//! - [`metrics`]: metric names and descriptions;
//! - `spans`: the spans of scheduling, claims, publishes, settles and control actions, and
//!   what is a child and what a link.

mod admit;
mod call;
mod control;
mod fire;
mod group_commit;
mod held;
mod ingest;
pub mod metrics;
mod owners;
mod pace;
mod publish;
mod purge;
mod ready;
mod recent;
pub mod retry;
mod settle;
mod spans;
mod supervise;
mod throttle;
mod watchers;

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;
use tracing::{error, warn};

use crate::broker::Broker;
use crate::call::Caller;
use crate::clock::Clock;
use crate::config::{EngineConfig, Limits};
use crate::model::Timestamp;
use crate::store::{Membership, Store};

pub use admit::Scheduled;
pub use control::{Bulk, Triggered};
pub use owners::TAKE_OVER_EVERY;
pub use recent::{LastMinute, MinuteFires, TenantMinute};
pub use retry::backoff;
pub use throttle::{Rate, Throttled};
pub use watchers::{Shows, Subscription};

/// Metric names, as before the split (`timer_core::engine::metric::TIMERS_FIRED`).
pub use self::metrics as metric;

/// A `DueTimeReached` the broker confirmed, as the HTTP event stream shows it.
#[derive(Debug, Clone)]
pub struct FiredEvent {
    pub tenant_id: String,
    pub json: String,
}

/// Shared handle on a running engine: the HTTP API schedules through it and streams its events.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

/// Lowers a flag that says a task of its own drains a queue (the schedules of group commit,
/// the settles of calls) when that task ends by a panic, so the next caller that queues starts
/// another; on a normal end the task `forget`s it (the flag may be another task's by then).
struct LoweredOnPanic<'a>(&'a AtomicBool);

impl Drop for LoweredOnPanic<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

struct Inner {
    store: Arc<dyn Store>,
    broker: Arc<dyn Broker>,
    clock: Arc<dyn Clock>,
    config: EngineConfig,
    limits: Limits,
    owner: String,
    /// Wakes the firing task early when a sooner timer arrives.
    wake: Notify,
    /// When the firing task plans to look next (ms); `i64::MAX` while it is busy or planning.
    planned: AtomicI64,
    /// A timer claimable before this (ms) needs the firing task woken: no claim it plans takes
    /// it in time ([`Engine::wake_for`]). `i64::MAX` while it is busy or planning, so every
    /// schedule wakes it then (a stored permit makes it plan again at once).
    wake_before: AtomicI64,
    fired: watchers::Watchers,
    /// Single schedules waiting to be written together ([`group_commit`]).
    queue: Mutex<Vec<group_commit::Waiting>>,
    /// Whether a flush task is writing `queue`.
    flushing: AtomicBool,
    /// What fired in the last minute (the status).
    recent: recent::RecentFires,
    /// Every tenant's allowance of schedules (`limits.rate`).
    throttle: throttle::Throttle,
    /// Every tenant's turns to fire (`limits.fire_rate`).
    pace: pace::Pace,
    /// While this instance is a member of the store's live instances: the fence cancelled when
    /// it stops being one ([`owners`]). Always set for a store without that ability.
    member: watch::Sender<Option<CancellationToken>>,
    /// A membership joined before the tasks started ([`Engine::join`]), and again at
    /// shutdown until it is left.
    joined: Mutex<Option<Box<dyn Membership>>>,
    /// Held by the firing task while it fires a batch: joining again waits for it, so a
    /// batch published before the membership was lost is settled before the join releases
    /// this instance's leases (which would fire it again).
    firing: tokio::sync::Mutex<()>,
    /// The tasks that panicked and wait to be started again ([`supervise`]).
    down: supervise::TasksDown,
    /// Where fires with a target of its own go instead of the broker (HTTP targets), set once
    /// before the engine starts ([`Engine::with_caller`]).
    caller: std::sync::OnceLock<Arc<dyn Caller>>,
    /// How many calls and publishes run on their own now ([`call`], [`publish`]): joining
    /// again and leaving wait for none.
    calls: watch::Sender<usize>,
    /// The timers the firing task's publishes hold ([`publish`]).
    in_flight: watch::Sender<publish::InFlight>,
    /// Calls that ended, waiting to be settled together ([`call`]).
    settling: Mutex<Vec<call::Settling>>,
    /// Whether a task is settling `settling`.
    settling_now: AtomicBool,
    /// Makes the engine's spans, when the binary exports them ([`Engine::with_tracer`]).
    spans: std::sync::OnceLock<spans::Spans>,
    /// The build this instance runs, as the instance list shows it ([`Engine::with_release`]).
    release: std::sync::OnceLock<crate::Release>,
    /// When this engine was made: its start in the instance list of a single-instance store.
    started_at: crate::Timestamp,
}

impl Engine {
    pub fn new(
        store: Arc<dyn Store>,
        broker: Arc<dyn Broker>,
        clock: Arc<dyn Clock>,
        config: EngineConfig,
        limits: Limits,
    ) -> Self {
        let owner = if config.instance_id.is_empty() {
            let id = uuid::Uuid::now_v7().simple().to_string();
            format!("{}-{}", std::process::id(), &id[id.len() - 8..])
        } else {
            config.instance_id.clone()
        };
        store.history().set_limit(config.history_per_timer);
        // `limits.rate.shared`: allowances in the store, for a store that keeps them (one
        // that only one instance uses needs none: its own are the only ones).
        let shared = limits
            .rate
            .shared
            .then(|| throttle::StoreAllowances::of(&store, config.store_timeout))
            .flatten();
        let throttle = throttle::Throttle::new(&limits.rate, clock.clone(), shared.clone());
        let pace = pace::Pace::new(&limits.fire_rate, shared);
        // Without lease owners in the store, one membership for the engine's life.
        let member =
            watch::Sender::new(store.lease_owners().is_none().then(CancellationToken::new));
        let started_at = clock.now();
        Engine {
            inner: Arc::new(Inner {
                store,
                broker,
                clock,
                config,
                limits,
                owner,
                wake: Notify::new(),
                planned: AtomicI64::new(i64::MAX),
                wake_before: AtomicI64::new(i64::MAX),
                fired: watchers::Watchers::default(),
                queue: Mutex::new(Vec::new()),
                flushing: AtomicBool::new(false),
                recent: recent::RecentFires::default(),
                throttle,
                pace,
                member,
                joined: Mutex::new(None),
                firing: tokio::sync::Mutex::new(()),
                down: supervise::TasksDown::default(),
                caller: std::sync::OnceLock::new(),
                calls: watch::Sender::new(0),
                in_flight: watch::Sender::new(publish::InFlight::default()),
                settling: Mutex::new(Vec::new()),
                settling_now: AtomicBool::new(false),
                spans: std::sync::OnceLock::new(),
                release: std::sync::OnceLock::new(),
                started_at,
            }),
        }
    }

    /// Sends the fires whose target `caller` [`takes`](Caller::takes) through it rather than the
    /// broker, and checks such targets with it at admission. Set once, before the engine starts;
    /// a second caller is refused.
    pub fn with_caller(self, caller: Arc<dyn Caller>) -> Result<Self, crate::Error> {
        self.inner
            .caller
            .set(caller)
            .map_err(|_| crate::Error::config("the engine has a caller already"))?;
        Ok(self)
    }

    /// Makes spans with `tracer` (`spans.rs`: scheduling, claims, publishes, settles, control
    /// actions) and keeps each timer's `schedule` span as its trace context. Set once, before
    /// the engine starts; without it the engine makes no spans.
    pub fn with_tracer(
        self,
        tracer: opentelemetry::global::BoxedTracer,
    ) -> Result<Self, crate::Error> {
        self.inner
            .spans
            .set(spans::Spans::new(tracer))
            .map_err(|_| crate::Error::config("the engine has a tracer already"))?;
        Ok(self)
    }

    /// Names the build this instance runs (the binary's version and git revision) in the
    /// store's instance list. Set once, before the engine starts; without it, timer-core's
    /// version and revision `unknown`.
    pub fn with_release(self, release: crate::Release) -> Result<Self, crate::Error> {
        self.inner
            .release
            .set(release)
            .map_err(|_| crate::Error::config("the engine has a release already"))?;
        Ok(self)
    }

    /// The build this instance runs.
    pub fn release(&self) -> &crate::Release {
        self.inner.release.get_or_init(crate::Release::core)
    }

    /// The live instances: the store's list (ordered by id) where several instances share it,
    /// else this one alone, with the leases held in the store.
    pub async fn instances(&self) -> crate::Result<Vec<crate::LiveInstance>> {
        if let Some(owners) = self.inner.store.lease_owners() {
            return owners.live().await;
        }
        let leases = self.inner.store.queries().leased().await?;
        Ok(vec![crate::LiveInstance {
            id: self.inner.owner.clone(),
            release: Some(self.release().clone()),
            started_at: self.inner.started_at,
            last_seen_at: Some(self.inner.clock.now()),
            leases,
        }])
    }

    fn spans(&self) -> Option<&spans::Spans> {
        self.inner.spans.get()
    }

    /// The caller of HTTP targets, if the engine has one.
    pub fn caller(&self) -> Option<&Arc<dyn Caller>> {
        self.inner.caller.get()
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    pub fn broker(&self) -> &Arc<dyn Broker> {
        &self.inner.broker
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.inner.clock
    }

    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// The lease owner name of this instance.
    pub fn instance_id(&self) -> &str {
        &self.inner.owner
    }

    /// The timers this instance fired in the last minute, and their lateness.
    pub fn last_minute(&self) -> LastMinute {
        self.inner.recent.last_minute(self.inner.clock.now())
    }

    /// Wakes the firing task if a timer claimable at `at` (ms) would otherwise wait for it:
    /// the task claims again and plans anew.
    fn wake_for(&self, at: i64) {
        if at < self.inner.wake_before.load(Ordering::SeqCst) {
            self.inner.wake.notify_one();
        }
    }

    /// When the firing task plans to wake next, while it waits (for the next due time, a
    /// poll, or a wake-up); `None` while it claims and fires, and while a batch it fired is
    /// being published. A test that sees the task asleep until after now on a manual clock
    /// knows nothing fires until the clock moves or a timer wakes it.
    pub fn asleep_until(&self) -> Option<Timestamp> {
        let planned = self.inner.planned.load(Ordering::SeqCst);
        (planned != i64::MAX && !self.publishing()).then(|| Timestamp::from_millis(planned))
    }

    /// The tenants this instance fired timers of in the last minute, most late first (by lateness
    /// p99): at most `limit` of them, and how many there were.
    pub fn last_minute_by_tenant(&self, limit: usize) -> (Vec<TenantMinute>, usize) {
        self.inner
            .recent
            .last_minute_by_tenant(self.inner.clock.now(), limit)
    }

    /// What this instance fired in each minute of the last hour that had fires, oldest first.
    pub fn last_hour(&self) -> Vec<MinuteFires> {
        self.inner.recent.last_hour(self.inner.clock.now())
    }

    /// Events as they fire (after the broker confirmed them), of the tenants `shows` lets
    /// through. At most `budget` bytes of them wait for the reader: a slower one is dropped
    /// ([`Subscription::lagged`]).
    pub fn subscribe(&self, budget: usize, shows: Shows) -> Subscription {
        self.inner.fired.add(budget, shows)
    }

    /// Starts the ingest, firing and purge tasks. The returned task ends once `shutdown` is
    /// cancelled and all have stopped (claims finished or released). Aborting it aborts them
    /// all at once, which is how tests simulate a crash.
    pub fn start(&self, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        let mut tasks = tokio::task::JoinSet::new();
        let s = &shutdown;
        tasks.spawn(
            self.clone()
                .supervise("ingest", s.clone(), Engine::ingest_loop),
        );
        tasks.spawn(
            self.clone()
                .supervise("purge", s.clone(), Engine::purge_loop),
        );
        tasks.spawn(
            self.clone()
                .supervise("membership", s.clone(), Engine::membership_loop),
        );
        tasks.spawn(
            self.clone()
                .supervise("take-over", s.clone(), Engine::take_over_loop),
        );
        tasks.spawn(
            self.clone()
                .supervise("firing", s.clone(), Engine::fire_loop),
        );
        let engine = self.clone();
        tokio::spawn(async move {
            while let Some(result) = tasks.join_next().await {
                if let Err(e) = result {
                    error!(error = %e, "engine task supervisor ended abnormally");
                }
            }
            // Every claim is settled or given back: leave the live instances.
            let membership = engine.inner.joined.lock().ok().and_then(|mut j| j.take());
            if let Some(membership) = membership {
                if let Err(e) = membership.leave().await {
                    warn!(error = %e.chain(), "leaving the store's live instances failed; the others find this instance dead");
                }
            }
        })
    }

    /// A store call of a task that does not retry it, bounded by `engine.store_timeout`
    /// ([`retry::within_store_timeout`]).
    async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = crate::error::Result<T>>,
    ) -> crate::error::Result<T> {
        retry::within_store_timeout(self.inner.config.store_timeout, call).await
    }

    /// How a task of this engine retries on the store.
    fn store_retry<'a>(
        &'a self,
        shutdown: &'a CancellationToken,
        what: &'static str,
    ) -> retry::Retry<'a> {
        retry::Retry {
            config: &self.inner.config,
            shutdown,
            what,
            plugin: ("store", self.inner.store.name()),
            level: tracing::Level::WARN,
            max_failures: None,
            timeout: Some(self.inner.config.store_timeout),
        }
    }

    /// How a task of this engine retries on the broker.
    fn broker_retry<'a>(
        &'a self,
        shutdown: &'a CancellationToken,
        what: &'static str,
    ) -> retry::Retry<'a> {
        retry::Retry {
            plugin: ("broker", self.inner.broker.name()),
            timeout: None,
            ..self.store_retry(shutdown, what)
        }
    }
}
