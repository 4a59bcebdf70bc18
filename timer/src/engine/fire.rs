//! The firing task: sleep until the next due time (or a wake-up), claim what is due, publish
//! its events within half the lease, then settle the claims.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::{metrics as metric, Engine};
use crate::broker::OutboundEvent;
use crate::error::{Error, Result};
use crate::model::{ClaimedTimer, Lease, Timestamp};
use crate::policy::{self, Fire, Plan};
use crate::store::Settlement;
use crate::wire::DueTimeReachedEnvelope;

impl Engine {
    pub(super) async fn fire_loop(self, shutdown: CancellationToken) {
        let inner = &self.inner;
        let mut wakeups = inner.store.wakeups();
        let retry = self.store_retry(&shutdown, "claiming due timers");
        while !shutdown.is_cancelled() {
            inner.planned.store(i64::MAX, Ordering::SeqCst);
            let claimed = retry
                .until_ok(|| async {
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
                    ::metrics::histogram!(metric::POLLING_DURATION)
                        .record(started.elapsed().as_secs_f64());
                    claimed
                })
                .await;
            let Some(claimed) = claimed else { break };
            if !claimed.is_empty() {
                self.fire(claimed, &shutdown).await;
                continue;
            }
            let now = inner.clock.now();
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

    /// Plans a claimed batch ([`policy::plan`]): settles what does not fire, gives up what
    /// timed out too often, publishes the rest, then settles it; on failure releases it with
    /// backoff.
    async fn fire(&self, claimed: Vec<ClaimedTimer>, shutdown: &CancellationToken) {
        let inner = &self.inner;
        let reached_at = inner.clock.now();
        let mut fires: Vec<Fire> = Vec::with_capacity(claimed.len());
        let mut firing: Vec<ClaimedTimer> = Vec::with_capacity(claimed.len());
        let mut settled: Vec<(ClaimedTimer, Settlement)> = Vec::new();
        for t in claimed {
            match policy::plan(&t, reached_at, inner.config.max_attempts) {
                Plan::Fire(fire) => {
                    fires.push(fire);
                    firing.push(t);
                }
                Plan::Settle(step) => settled.push((t, Settlement::Step(step))),
                Plan::GiveUp { error } => {
                    let reason = format!("completion_timeout: {error}");
                    if !self.give_up(&t, &error, &reason).await {
                        // The dead letter did not go out: try again after a backoff.
                        let at = reached_at.saturating_add(super::retry::backoff(
                            &inner.config,
                            t.attempts.saturating_add(1),
                        ));
                        self.give_back(std::slice::from_ref(&t), at, "releasing a timer")
                            .await;
                    }
                }
            }
        }
        if !settled.is_empty() {
            self.settle_all(settled, reached_at, shutdown).await;
        }
        if firing.is_empty() {
            return;
        }
        let claimed = firing;
        // Each claim as its event describes it (due at the occurrence that fires).
        let as_fired: Vec<ClaimedTimer> = claimed
            .iter()
            .zip(&fires)
            .map(|(t, fire)| fire.claim(t))
            .collect();
        let events: Vec<OutboundEvent> = as_fired
            .iter()
            .zip(&fires)
            .map(|(t, fire)| {
                let envelope = DueTimeReachedEnvelope::for_fire(t, reached_at, fire.refire);
                OutboundEvent {
                    id: envelope.id,
                    key: t.key.clone(),
                    body: envelope.to_json(),
                }
            })
            .collect();
        let grace = inner.config.shutdown_grace;
        let publish = self.within_half_lease("publishing", inner.broker.publish(&events));
        let published = tokio::select! {
            r = publish => Some(r),
            _ = async { shutdown.cancelled().await; tokio::time::sleep(grace).await } => None,
        };
        match published {
            Some(Ok(())) => {
                self.announce(&as_fired, events, reached_at);
                let settlements = claimed
                    .into_iter()
                    .zip(&fires)
                    .map(|(t, fire)| {
                        let settlement = policy::fired(&t, fire, reached_at, &inner.owner);
                        (t, settlement)
                    })
                    .collect();
                self.settle_all(settlements, reached_at, shutdown).await;
            }
            Some(Err(e)) => {
                ::metrics::counter!(metric::PUBLISH_FAILURES).increment(claimed.len() as u64);
                let message = e.chain();
                warn!(broker = inner.broker.name(), error = %message, timers = claimed.len(), "publishing events failed; releasing the timers for a retry");
                self.release_with_backoff(&claimed, &message).await;
            }
            None => {
                info!(
                    timers = claimed.len(),
                    "shutdown while publishing; releasing claims"
                );
                self.give_back(&claimed, inner.clock.now(), "releasing claims at shutdown")
                    .await;
            }
        }
    }

    /// Counts and streams the events the broker confirmed.
    fn announce(&self, claimed: &[ClaimedTimer], events: Vec<OutboundEvent>, at: Timestamp) {
        ::metrics::counter!(metric::TIMERS_FIRED).increment(claimed.len() as u64);
        for (timer, event) in claimed.iter().zip(events) {
            // A timer scheduled when already past due is late only from when it arrived.
            let due = timer.due_at.max(timer.registered_at);
            let late = at.duration_since(due);
            ::metrics::histogram!(metric::FIRE_LATENESS).record(late.as_secs_f64());
            let late_ms = u64::try_from(late.as_millis()).unwrap_or(u64::MAX);
            self.inner.recent.record(at, late_ms);
            // No receivers is fine: the stream is for whoever watches.
            let _ = self.inner.fired.send(Arc::new(super::FiredEvent {
                tenant_id: timer.key.tenant_id.clone(),
                json: String::from_utf8(event.body).unwrap_or_default(),
            }));
        }
    }

    /// Runs a send to the broker, but never for longer than half the lease: a cancel can only
    /// succeed once no lease is live, so the event of a cancelled timer cannot arrive after the
    /// cancel, and a stuck broker cannot hold the firing task past the lease.
    pub(super) async fn within_half_lease<F>(&self, what: &str, send: F) -> Result<()>
    where
        F: Future<Output = Result<()>>,
    {
        let deadline = self.inner.config.lease / 2;
        match tokio::time::timeout(deadline, send).await {
            Ok(result) => result,
            Err(_) => Err(Error::unavailable(format!(
                "{what} timed out after {} (half of engine.lease)",
                humantime::format_duration(deadline)
            ))),
        }
    }
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
