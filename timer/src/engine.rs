//! The engine: an ingest task (commands → store → ack) and a firing task (claim → publish →
//! mark), DESIGN §5. Publish comes before mark: a crash between them repeats an event, it never
//! loses one.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, oneshot, Notify};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::broker::{Broker, Delivery, OutboundEvent};
use crate::clock::Clock;
use crate::config::{EngineConfig, Limits};
use crate::error::{Error, Result};
use crate::model::{
    CancelOutcome, ClaimedTimer, Lease, NewTimer, ScheduleOutcome, TimerKey, Timestamp,
};
use crate::store::Store;
use crate::wire::{decode, Command, DueTimeReachedEnvelope, TimerFailedEnvelope};

/// Metric names (seed 000 §"Observability" plus ours). The binary installs the exporter.
pub mod metric {
    pub const COMMANDS_RECEIVED: &str = "timer.commands.received";
    pub const COMMANDS_REJECTED: &str = "timer.commands.rejected";
    pub const SCHEDULES_PROCESSED: &str = "timer.schedules.processed";
    pub const POLLING_DURATION: &str = "timer.polling.duration";
    pub const TIMERS_FIRED: &str = "timer.timers.fired";
    pub const PUBLISH_FAILURES: &str = "timer.publish.failures";
    pub const FIRE_LATENESS: &str = "timer.fire.lateness";
    pub const PENDING: &str = "timer.pending";
    pub const CANCELS_PROCESSED: &str = "timer.cancels.processed";
    pub const TIMERS_FAILED: &str = "timer.timers.failed";
    pub const TIMERS_PURGED: &str = "timer.timers.purged";
}

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

struct Inner {
    store: Arc<dyn Store>,
    broker: Arc<dyn Broker>,
    clock: Arc<dyn Clock>,
    config: EngineConfig,
    limits: Limits,
    owner: String,
    /// Wakes the firing task early when a sooner timer arrives.
    wake: Notify,
    /// When the firing task plans to look next (ms); `i64::MAX` while it is busy or planning,
    /// so every schedule wakes it then (a stored permit makes it plan again at once).
    planned: AtomicI64,
    fired: broadcast::Sender<Arc<FiredEvent>>,
    /// Single schedules (HTTP) waiting to be written together in one transaction.
    pending: Mutex<Vec<Waiting>>,
    /// Whether a flush task is writing `pending`.
    flushing: AtomicBool,
}

type Waiting = (NewTimer, oneshot::Sender<Result<ScheduleOutcome>>);

/// How often a `CancelTimer` that met a fire in progress looks again.
const FIRING_RECHECK: Duration = Duration::from_millis(100);

/// One step of an ingested batch.
enum Step<'a> {
    /// Timers to store together, with the deliveries they came from.
    Schedule(Vec<NewTimer>, Vec<&'a Delivery>),
    Cancel(TimerKey),
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
        // Room for a burst of fires while a watcher (event stream, bench) catches up.
        let (fired, _) = broadcast::channel(65_536);
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
                fired,
                pending: Mutex::new(Vec::new()),
                flushing: AtomicBool::new(false),
            }),
        }
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

    /// Events as they fire (after the broker confirmed them). Slow receivers lag and skip.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<FiredEvent>> {
        self.inner.fired.subscribe()
    }

    /// Starts the ingest and firing tasks. The returned task ends once `shutdown` is cancelled
    /// and both have stopped (claims finished or released). Aborting it aborts both at once,
    /// which is how tests simulate a crash.
    pub fn start(&self, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(self.clone().ingest_loop(shutdown.clone()));
        tasks.spawn(self.clone().purge_loop(shutdown.clone()));
        tasks.spawn(self.clone().fire_loop(shutdown));
        tokio::spawn(async move {
            while let Some(result) = tasks.join_next().await {
                if let Err(e) = result {
                    error!(error = %e, "engine task panicked");
                }
            }
        })
    }

    /// Stores a batch (one transaction) and wakes the firing task if a timer is due sooner than
    /// it planned to look. The broker path and the HTTP API both schedule through here.
    pub async fn schedule(&self, timers: &[NewTimer]) -> Result<Vec<ScheduleOutcome>> {
        if timers.is_empty() {
            return Ok(Vec::new());
        }
        let inner = &self.inner;
        let refused = self.over_tenant_limit(timers).await?;
        let outcomes = if refused.iter().any(|r| *r) {
            let allowed: Vec<NewTimer> = timers
                .iter()
                .zip(&refused)
                .filter(|(_, r)| !**r)
                .map(|(t, _)| t.clone())
                .collect();
            let mut stored = inner
                .store
                .schedule(&allowed, inner.clock.now())
                .await?
                .into_iter();
            let mut outcomes = Vec::with_capacity(timers.len());
            for r in &refused {
                outcomes.push(if *r {
                    ScheduleOutcome::TenantLimit
                } else {
                    stored.next().ok_or_else(|| {
                        Error::internal("the store returned fewer outcomes than timers")
                    })?
                });
            }
            outcomes
        } else {
            inner.store.schedule(timers, inner.clock.now()).await?
        };
        let mut soonest = i64::MAX;
        let mut changed = 0u64;
        for (timer, outcome) in timers.iter().zip(&outcomes) {
            if matches!(outcome, ScheduleOutcome::Created | ScheduleOutcome::Updated) {
                changed += 1;
                soonest = soonest.min(timer.due_at.as_millis());
            }
        }
        metrics::counter!(metric::SCHEDULES_PROCESSED).increment(changed);
        if soonest < inner.planned.load(Ordering::SeqCst) {
            inner.wake.notify_one();
        }
        Ok(outcomes)
    }

    /// Which timers `limits.max_pending_per_tenant` refuses: new timers of a tenant that has
    /// that many Scheduled ones (counting this batch). A timer that already exists as Scheduled
    /// is a reschedule and always allowed. Instances check independently, so several of them
    /// together may overshoot by up to one batch each.
    async fn over_tenant_limit(&self, timers: &[NewTimer]) -> Result<Vec<bool>> {
        let inner = &self.inner;
        let limit = inner.limits.max_pending_per_tenant;
        if limit == 0 {
            return Ok(vec![false; timers.len()]);
        }
        let mut tenants: Vec<String> = timers.iter().map(|t| t.key.tenant_id.clone()).collect();
        tenants.sort_unstable();
        tenants.dedup();
        let mut counts = inner.store.pending_by_tenant(&tenants).await?;
        let mut refused = Vec::with_capacity(timers.len());
        for timer in timers {
            let count = counts.entry(timer.key.tenant_id.clone()).or_insert(0);
            if *count < limit {
                *count += 1; // as if new; a reschedule counted twice only refuses early
                refused.push(false);
                continue;
            }
            let existing = inner.store.get(&timer.key).await?;
            let reschedule =
                existing.is_some_and(|t| t.state == crate::model::TimerState::Scheduled);
            refused.push(!reschedule);
        }
        Ok(refused)
    }

    /// Cancels a timer (the HTTP API's DELETE and the broker's `CancelTimer`).
    pub async fn cancel(&self, key: &TimerKey) -> Result<CancelOutcome> {
        let outcome = self.inner.store.cancel(key, self.inner.clock.now()).await?;
        let label = match outcome {
            CancelOutcome::Cancelled => "cancelled",
            CancelOutcome::Firing => "firing",
            CancelOutcome::NotFound => "not_found",
            _ => "already_finished",
        };
        metrics::counter!(metric::CANCELS_PROCESSED, "outcome" => label).increment(1);
        Ok(outcome)
    }

    /// Schedules one timer, sharing a transaction with whoever else schedules at the same time
    /// (group commit: one fsync for many HTTP requests instead of one each).
    pub async fn schedule_one(&self, timer: NewTimer) -> Result<ScheduleOutcome> {
        let (tx, rx) = oneshot::channel();
        self.inner
            .pending
            .lock()
            .map_err(|_| Error::internal("schedule queue poisoned"))?
            .push((timer, tx));
        if !self.inner.flushing.swap(true, Ordering::SeqCst) {
            // A task of its own, so a caller that goes away cannot strand the queue.
            tokio::spawn(self.clone().flush_pending());
        }
        rx.await
            .map_err(|_| Error::internal("the schedule flush task stopped without an answer"))?
    }

    async fn flush_pending(self) {
        let inner = &self.inner;
        loop {
            let batch: Vec<Waiting> = match inner.pending.lock() {
                Ok(mut q) => {
                    let n = q.len().min(inner.config.batch_size.max(1));
                    q.drain(..n).collect()
                }
                Err(_) => Vec::new(),
            };
            if batch.is_empty() {
                inner.flushing.store(false, Ordering::SeqCst);
                // Someone may have queued after the drain but before the flag dropped.
                let more = inner.pending.lock().map(|q| !q.is_empty()).unwrap_or(false);
                if more && !inner.flushing.swap(true, Ordering::SeqCst) {
                    continue;
                }
                return;
            }
            let (timers, waiters): (Vec<NewTimer>, Vec<_>) = batch.into_iter().unzip();
            match self.schedule(&timers).await {
                Ok(outcomes) => {
                    for (waiter, outcome) in waiters.into_iter().zip(outcomes) {
                        let _ = waiter.send(Ok(outcome));
                    }
                }
                Err(e) => {
                    for waiter in waiters {
                        let copy = Error::new(e.kind(), e.chain()).with_retryable(e.is_retryable());
                        let _ = waiter.send(Err(copy));
                    }
                }
            }
        }
    }

    async fn ingest_loop(self, shutdown: CancellationToken) {
        let mut failures = 0u32;
        loop {
            let received = tokio::select! {
                _ = shutdown.cancelled() => break,
                r = self.inner.broker.receive(self.inner.config.batch_size, Duration::from_secs(1)) => r,
            };
            match received {
                Ok(deliveries) if deliveries.is_empty() => {}
                Ok(deliveries) => {
                    failures = 0;
                    self.ingest_batch(deliveries, &shutdown).await;
                }
                Err(e) => {
                    failures += 1;
                    warn!(broker = self.inner.broker.name(), error = %e.chain(), "receiving commands failed; retrying");
                    if !pause(&shutdown, self.error_pause(failures)).await {
                        break;
                    }
                }
            }
        }
        debug!("ingest task stopped");
    }

    async fn ingest_batch(&self, deliveries: Vec<Delivery>, shutdown: &CancellationToken) {
        let inner = &self.inner;
        metrics::counter!(metric::COMMANDS_RECEIVED).increment(deliveries.len() as u64);
        let now = inner.clock.now();
        // Applied in arrival order: runs of schedules in one transaction each, cancels between.
        let mut steps: Vec<Step> = Vec::new();
        let mut acks = Vec::with_capacity(deliveries.len());
        for delivery in &deliveries {
            match decode(&delivery.body, &inner.limits, now) {
                Ok(Command::Schedule(timer)) => {
                    match steps.last_mut() {
                        Some(Step::Schedule(run, from)) => {
                            run.push(timer);
                            from.push(delivery);
                        }
                        _ => steps.push(Step::Schedule(vec![timer], vec![delivery])),
                    }
                    acks.push(delivery.tag);
                }
                Ok(Command::Cancel(key)) => {
                    steps.push(Step::Cancel(key));
                    acks.push(delivery.tag);
                }
                Err(rejection) => {
                    metrics::counter!(metric::COMMANDS_REJECTED, "reason" => rejection.reason)
                        .increment(1);
                    warn!(reason = rejection.reason, error = %rejection, "command rejected; dead-lettering it");
                    if !self
                        .dead_letter(&delivery.body, &rejection.to_string(), shutdown)
                        .await
                    {
                        return; // shutting down: unacknowledged, the batch comes again
                    }
                    acks.push(delivery.tag);
                }
            }
        }
        for step in &steps {
            let mut failures = 0u32;
            loop {
                let result = match step {
                    Step::Schedule(timers, from) => match self.schedule(timers).await {
                        Ok(outcomes) => {
                            self.refuse_over_limit(&outcomes, from, &mut acks, shutdown)
                                .await;
                            Ok(true)
                        }
                        Err(e) => Err(e),
                    },
                    Step::Cancel(key) => self.cancel(key).await.map(|outcome| match outcome {
                        // Its event is being published: wait for that fire to settle (bounded
                        // by half the lease), then cancel what is left (a recurring series, or
                        // a timer whose publish failed).
                        CancelOutcome::Firing => false,
                        CancelOutcome::Cancelled => true,
                        other => {
                            info!(timer = %key, outcome = ?other, "CancelTimer changed nothing");
                            true
                        }
                    }),
                };
                let e = match result {
                    Ok(true) => break,
                    Ok(false) => {
                        if !pause(shutdown, FIRING_RECHECK).await {
                            return; // unacknowledged: the cancel comes again
                        }
                        continue;
                    }
                    Err(e) => e,
                };
                failures += 1;
                error!(store = inner.store.name(), error = %e.chain(), "storing commands failed; retrying (not acknowledged)");
                if !pause(shutdown, self.error_pause(failures)).await {
                    return; // unacknowledged: the broker delivers the batch again
                }
            }
        }
        if let Err(e) = inner.broker.ack(&acks).await {
            // Stored but not acked: redelivery applies the same commands again, which is
            // harmless (schedules are upserts, a second cancel changes nothing).
            warn!(error = %e.chain(), "acknowledging commands failed; they will be redelivered");
        }
    }

    /// Dead-letters the commands `limits.max_pending_per_tenant` refused; one whose dead letter
    /// was not sent before shutdown is taken out of `acks`, so it comes back.
    async fn refuse_over_limit(
        &self,
        outcomes: &[ScheduleOutcome],
        from: &[&Delivery],
        acks: &mut Vec<u64>,
        shutdown: &CancellationToken,
    ) {
        let inner = &self.inner;
        for (outcome, delivery) in outcomes.iter().zip(from) {
            if *outcome != ScheduleOutcome::TenantLimit {
                continue;
            }
            metrics::counter!(metric::COMMANDS_REJECTED, "reason" => "tenant_limit").increment(1);
            let reason = format!(
                "tenant_limit: the tenant has {} Scheduled timers already \
                 (limits.max_pending_per_tenant)",
                inner.limits.max_pending_per_tenant
            );
            warn!(
                reason = "tenant_limit",
                "command refused; dead-lettering it"
            );
            if !self.dead_letter(&delivery.body, &reason, shutdown).await {
                acks.retain(|tag| *tag != delivery.tag);
            }
        }
    }

    /// Sends a refused command to the dead-letter destination, retrying with backoff until it
    /// went out (a broker may not deliver an unacknowledged command again, e.g. Kafka within one
    /// session). False only when shutdown came first: the command stays unacknowledged.
    async fn dead_letter(&self, body: &[u8], reason: &str, shutdown: &CancellationToken) -> bool {
        let mut failures = 0u32;
        loop {
            match self.inner.broker.dead_letter(body, reason).await {
                Ok(()) => return true,
                Err(e) => {
                    failures += 1;
                    error!(error = %e.chain(), "dead-lettering a refused command failed; retrying (not acknowledged)");
                    if !pause(shutdown, self.error_pause(failures)).await {
                        return false;
                    }
                }
            }
        }
    }

    /// Deletes finished timers older than `engine.retention`, a small batch at a time, every
    /// `engine.purge_interval`.
    async fn purge_loop(self, shutdown: CancellationToken) {
        let inner = &self.inner;
        let retention = inner.config.retention;
        if retention.is_zero() {
            return;
        }
        let batch = inner.config.purge_batch.max(1);
        loop {
            let older_than = inner.clock.now().saturating_sub(retention);
            loop {
                if shutdown.is_cancelled() {
                    return;
                }
                match inner.store.purge(older_than, batch).await {
                    Ok(n) => {
                        metrics::counter!(metric::TIMERS_PURGED).increment(n);
                        if (n as usize) < batch {
                            break;
                        }
                        tokio::task::yield_now().await;
                    }
                    Err(e) => {
                        warn!(error = %e.chain(), "purging finished timers failed; trying again next round");
                        break;
                    }
                }
            }
            let next = inner
                .clock
                .now()
                .saturating_add(inner.config.purge_interval);
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = inner.clock.sleep_until(next) => {}
            }
        }
    }

    async fn fire_loop(self, shutdown: CancellationToken) {
        let inner = &self.inner;
        let mut failures = 0u32;
        let mut wakeups = inner.store.wakeups();
        while !shutdown.is_cancelled() {
            inner.planned.store(i64::MAX, Ordering::SeqCst);
            let now = inner.clock.now();
            let lease = Lease {
                owner: inner.owner.clone(),
                until: now.saturating_add(inner.config.lease),
            };
            let started = Instant::now();
            let claimed = inner
                .store
                .claim_due(now, inner.config.batch_size, &lease)
                .await;
            metrics::histogram!(metric::POLLING_DURATION).record(started.elapsed().as_secs_f64());
            match claimed {
                Ok(claimed) if !claimed.is_empty() => {
                    failures = 0;
                    self.fire(claimed, &shutdown).await;
                    continue;
                }
                Ok(_) => failures = 0,
                Err(e) => {
                    failures += 1;
                    warn!(store = inner.store.name(), error = %e.chain(), "claiming due timers failed; retrying");
                    if !pause(&shutdown, self.error_pause(failures)).await {
                        break;
                    }
                    continue;
                }
            }
            let next = match inner.store.next_due_at().await {
                Ok(next) => next.unwrap_or(Timestamp::MAX),
                Err(e) => {
                    warn!(error = %e.chain(), "reading the next due time failed; polling");
                    Timestamp::MAX
                }
            };
            let wake_at = next.min(now.saturating_add(inner.config.poll_interval));
            inner.planned.store(wake_at.as_millis(), Ordering::SeqCst);
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = inner.clock.sleep_until(wake_at) => {}
                _ = inner.wake.notified() => {}
                _ = sooner_elsewhere(&mut wakeups, wake_at) => {}
            }
        }
        debug!("firing task stopped");
    }

    /// Publishes a claimed batch, then marks it Reached; on failure releases it with backoff.
    async fn fire(&self, claimed: Vec<ClaimedTimer>, shutdown: &CancellationToken) {
        let inner = &self.inner;
        let reached_at = inner.clock.now();
        let envelopes: Vec<DueTimeReachedEnvelope> = claimed
            .iter()
            .map(|t| DueTimeReachedEnvelope::for_timer(t, reached_at))
            .collect();
        let events: Vec<OutboundEvent> = claimed
            .iter()
            .zip(&envelopes)
            .map(|(t, e)| OutboundEvent {
                id: e.id,
                key: t.key.clone(),
                body: e.to_json(),
            })
            .collect();
        let grace = inner.config.shutdown_grace;
        // A publish never outlives half the lease: a cancel can only succeed once no lease is
        // live, so the event of a cancelled timer cannot arrive after the cancel.
        let deadline = inner.config.lease / 2;
        let publish = async {
            match tokio::time::timeout(deadline, inner.broker.publish(&events)).await {
                Ok(result) => result,
                Err(_) => Err(Error::unavailable(format!(
                    "publishing timed out after {} (half of engine.lease)",
                    humantime::format_duration(deadline)
                ))),
            }
        };
        let published = tokio::select! {
            r = publish => Some(r),
            _ = async { shutdown.cancelled().await; tokio::time::sleep(grace).await } => None,
        };
        match published {
            Some(Ok(())) => self.confirmed(&claimed, events, reached_at, shutdown).await,
            Some(Err(e)) => {
                metrics::counter!(metric::PUBLISH_FAILURES).increment(claimed.len() as u64);
                let message = e.chain();
                warn!(broker = inner.broker.name(), error = %message, timers = claimed.len(), "publishing events failed; releasing the timers for a retry");
                self.release_with_backoff(&claimed, &message).await;
            }
            None => {
                info!(
                    timers = claimed.len(),
                    "shutdown while publishing; releasing claims"
                );
                if let Err(e) = inner
                    .store
                    .release(&claimed, &inner.owner, inner.clock.now(), None)
                    .await
                {
                    warn!(error = %e.chain(), "releasing claims at shutdown failed; they return when the lease expires");
                }
            }
        }
    }

    async fn confirmed(
        &self,
        claimed: &[ClaimedTimer],
        events: Vec<OutboundEvent>,
        reached_at: Timestamp,
        shutdown: &CancellationToken,
    ) {
        let inner = &self.inner;
        metrics::counter!(metric::TIMERS_FIRED).increment(claimed.len() as u64);
        for timer in claimed {
            // A timer scheduled when already past due is late only from when it arrived.
            let due = timer.due_at.max(timer.registered_at);
            let late = reached_at.duration_since(due);
            metrics::histogram!(metric::FIRE_LATENESS).record(late.as_secs_f64());
        }
        for (timer, event) in claimed.iter().zip(events) {
            // No receivers is fine: the stream is for whoever watches.
            let _ = inner.fired.send(Arc::new(FiredEvent {
                tenant_id: timer.key.tenant_id.clone(),
                json: String::from_utf8(event.body).unwrap_or_default(),
            }));
        }
        // One-shot timers become Reached; recurring ones move to their next occurrence, computed
        // from the later of their due time and now, so missed occurrences fire once, not all.
        let mut once = Vec::new();
        let mut again = Vec::new();
        for timer in claimed {
            let next = timer.recurrence.as_ref().and_then(|r| match r.schedule() {
                Ok(schedule) => schedule.next(
                    timer.due_at.max(reached_at),
                    timer.occurrences.saturating_add(1),
                ),
                Err(e) => {
                    error!(timer = %timer.key, error = %e.message, "stored recurrence does not parse; the series ends");
                    None
                }
            });
            match next {
                Some(next) => again.push((timer.clone(), next)),
                None => once.push(timer.clone()),
            }
        }
        let (mut marked, mut advanced) = (once.is_empty(), again.is_empty());
        let mut changed = 0u64;
        let mut failures = 0u32;
        loop {
            let mut result = Ok(());
            if !marked {
                match inner
                    .store
                    .mark_reached(&once, &inner.owner, reached_at)
                    .await
                {
                    Ok(n) => (changed, marked) = (changed + n, true),
                    Err(e) => result = Err(e),
                }
            }
            if result.is_ok() && !advanced {
                match inner.store.advance(&again, &inner.owner, reached_at).await {
                    Ok(n) => (changed, advanced) = (changed + n, true),
                    Err(e) => result = Err(e),
                }
            }
            let Err(e) = result else { break };
            failures += 1;
            // Unmarked rows fire again when the lease expires: a duplicate, not a loss.
            error!(error = %e.chain(), timers = claimed.len(), "marking fired timers failed; retrying");
            if failures >= 5 || !pause(shutdown, self.error_pause(failures)).await {
                return;
            }
        }
        if (changed as usize) < claimed.len() {
            // Rescheduled while it fired (another revision now): the fire did not count for
            // it, and its lease would keep it "firing" until the new due time. Give it back.
            if let Err(e) = inner
                .store
                .release(claimed, &inner.owner, reached_at, None)
                .await
            {
                warn!(error = %e.chain(), "releasing rescheduled timers failed; their lease expires");
            }
        }
    }

    /// How long a task waits after `failures` errors in a row from the store or the broker:
    /// the retry backoff, but never longer than the poll interval, so a recovered server is
    /// used again promptly.
    fn error_pause(&self, failures: u32) -> Duration {
        backoff(&self.inner.config, failures).min(self.inner.config.poll_interval)
    }

    async fn release_with_backoff(&self, claimed: &[ClaimedTimer], error: &str) {
        let inner = &self.inner;
        let now = inner.clock.now();
        let max = inner.config.max_attempts;
        let (last, retry): (Vec<ClaimedTimer>, Vec<ClaimedTimer>) = claimed
            .iter()
            .cloned()
            .partition(|t| max > 0 && t.attempts.saturating_add(1) >= max);
        let mut retry = retry;
        // The broker just failed a publish: after the first dead letter that does not go out
        // either, the rest are retried instead of each waiting out its own deadline.
        let mut broker_up = true;
        for timer in last {
            broker_up = broker_up && self.give_up(&timer, error).await;
            if !broker_up {
                retry.push(timer);
            }
        }
        // Timers of one batch usually share their attempt count; release each group at once.
        let mut attempts: Vec<u32> = retry.iter().map(|t| t.attempts).collect();
        attempts.sort_unstable();
        attempts.dedup();
        for n in attempts {
            let group: Vec<ClaimedTimer> =
                retry.iter().filter(|t| t.attempts == n).cloned().collect();
            let delay = jittered(
                backoff(&inner.config, n + 1),
                inner.config.retry_jitter_percent,
            );
            let retry_at = now.saturating_add(delay);
            if let Err(e) = inner
                .store
                .release(&group, &inner.owner, retry_at, Some(error))
                .await
            {
                warn!(error = %e.chain(), "releasing timers failed; they return when the lease expires");
            }
        }
    }

    /// The last attempt failed: a `TimerFailed` dead letter, then the timer becomes Failed.
    /// False when the dead letter could not be sent either (the timer is retried instead).
    async fn give_up(&self, timer: &ClaimedTimer, error: &str) -> bool {
        let inner = &self.inner;
        let at = inner.clock.now();
        let attempts = timer.attempts.saturating_add(1);
        let envelope = TimerFailedEnvelope::for_timer(timer, at, attempts, error);
        let reason = format!("max_attempts: publishing failed {attempts} times: {error}");
        // Bounded like a publish, so a stuck broker cannot hold the firing task past the lease.
        let deadline = inner.config.lease / 2;
        let sent = tokio::time::timeout(
            deadline,
            inner.broker.dead_letter(&envelope.to_json(), &reason),
        )
        .await;
        match sent {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                warn!(timer = %timer.key, error = %e.chain(), "sending TimerFailed failed; retrying the timer");
                return false;
            }
            Err(_) => {
                warn!(timer = %timer.key, "sending TimerFailed timed out; retrying the timer");
                return false;
            }
        }
        match inner
            .store
            .fail(std::slice::from_ref(timer), &inner.owner, at, error)
            .await
        {
            Ok(0) => {
                // Rescheduled meanwhile (another revision): it lives on, the dead letter was
                // early. Give its lease back so it is not "firing" until the lease ends.
                info!(timer = %timer.key, "TimerFailed sent, but the timer changed meanwhile and stays");
                if let Err(e) = inner
                    .store
                    .release(std::slice::from_ref(timer), &inner.owner, at, None)
                    .await
                {
                    warn!(error = %e.chain(), "releasing a rescheduled timer failed; its lease expires");
                }
                true
            }
            Ok(_) => {
                metrics::counter!(metric::TIMERS_FAILED).increment(1);
                warn!(timer = %timer.key, attempts, "timer failed: engine.max_attempts reached; TimerFailed sent");
                true
            }
            Err(e) => {
                // The dead letter is out but the row is unchanged: it is claimed again when the
                // lease expires and its publish tried once more (it may still succeed, so a
                // DueTimeReached can follow the TimerFailed; never a lost timer).
                warn!(timer = %timer.key, error = %e.chain(), "marking a timer failed did not work; it will be tried again");
                true
            }
        }
    }
}

/// Shortens `delay` by a random share of up to `percent` percent.
fn jittered(delay: Duration, percent: u32) -> Duration {
    let percent = u128::from(percent.min(100));
    if percent == 0 {
        return delay;
    }
    let cut = uuid::Uuid::new_v4().as_u128() % (percent + 1);
    let ms = delay.as_millis() * (100 - cut) / 100;
    Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX))
}

/// Returns when the store reports a timer (scheduled by any instance) due before `wake_at`, or
/// when notices were lost (replan to be safe). Never returns without a wake-up channel.
async fn sooner_elsewhere(
    wakeups: &mut Option<broadcast::Receiver<Timestamp>>,
    wake_at: Timestamp,
) {
    loop {
        let Some(rx) = wakeups.as_mut() else {
            return std::future::pending().await;
        };
        match rx.recv().await {
            Ok(due) if due < wake_at => return,
            Ok(_) => {}
            Err(broadcast::error::RecvError::Lagged(_)) => return,
            Err(broadcast::error::RecvError::Closed) => *wakeups = None,
        }
    }
}

/// Exponential backoff: `retry_base * 2^(attempt-1)`, capped at `retry_max`.
pub fn backoff(config: &EngineConfig, attempt: u32) -> Duration {
    let exp = attempt.saturating_sub(1).min(30);
    config
        .retry_base
        .saturating_mul(1u32 << exp)
        .min(config.retry_max)
}

/// Waits `d` unless shutdown comes first; false when shutting down.
async fn pause(shutdown: &CancellationToken, d: Duration) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let config = EngineConfig {
            retry_base: Duration::from_millis(100),
            retry_max: Duration::from_secs(1),
            ..EngineConfig::default()
        };
        let got: Vec<u128> = (1..=6).map(|a| backoff(&config, a).as_millis()).collect();
        assert_eq!(got, vec![100, 200, 400, 800, 1000, 1000]);
        assert_eq!(backoff(&config, u32::MAX), Duration::from_secs(1));
    }

    #[test]
    fn jitter_only_shortens_within_its_share() {
        let d = Duration::from_millis(1_000);
        assert_eq!(jittered(d, 0), d);
        let got: Vec<Duration> = (0..200).map(|_| jittered(d, 20)).collect();
        assert!(got
            .iter()
            .all(|g| *g >= Duration::from_millis(800) && *g <= d));
        assert!(got.iter().any(|g| *g < d), "some delays are shortened");
    }
}
