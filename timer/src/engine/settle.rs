//! What becomes of claims after their publish: fired one-shot timers become Reached, recurring
//! ones move to their next occurrence, failed publishes are retried with backoff or, after
//! `engine.max_attempts`, given up with a `TimerFailed` dead letter.

use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn, Level};

use super::retry::{backoff, jittered, Retry};
use super::{metrics as metric, Engine};
use crate::model::{ClaimedTimer, Timestamp};
use crate::store::Settlement;
use crate::wire::TimerFailedEnvelope;

/// Attempts at settling a fired batch before its leases are left to expire (the timers then
/// fire again: a duplicate, never a loss).
const SETTLE_ATTEMPTS: u32 = 5;

impl Engine {
    /// Settles a batch whose events the broker confirmed. The next occurrence of a recurring
    /// timer is computed from the later of its due time and now, so missed occurrences fire
    /// once, not all.
    pub(super) async fn settle_fired(
        &self,
        claimed: &[ClaimedTimer],
        reached_at: Timestamp,
        shutdown: &CancellationToken,
    ) {
        let inner = &self.inner;
        let settled: Vec<(ClaimedTimer, Settlement)> = claimed
            .iter()
            .map(|timer| {
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
                let settlement = next.map_or(Settlement::Reached, Settlement::Next);
                (timer.clone(), settlement)
            })
            .collect();
        let retry = Retry {
            level: Level::ERROR,
            max_failures: Some(SETTLE_ATTEMPTS),
            ..self.store_retry(shutdown, "settling fired timers")
        };
        let Some(changed) = retry
            .until_ok(|| inner.store.settle(&settled, &inner.owner, reached_at))
            .await
        else {
            return; // unsettled rows fire again when the lease expires
        };
        self.history_written(changed);
        if (changed as usize) < claimed.len() {
            // Rescheduled while it fired (another revision now): the fire did not count for
            // it, and its lease would keep it "firing" until the new due time. Give it back.
            self.give_back(claimed, reached_at, "releasing rescheduled timers")
                .await;
        }
    }

    /// Returns leases unchanged (`Retry` at `at`, no error); a failure only logs: the leases
    /// expire by themselves.
    pub(super) async fn give_back(&self, claimed: &[ClaimedTimer], at: Timestamp, what: &str) {
        let inner = &self.inner;
        let released: Vec<(ClaimedTimer, Settlement)> = claimed
            .iter()
            .map(|t| (t.clone(), Settlement::Retry { at, error: None }))
            .collect();
        if let Err(e) = inner.store.settle(&released, &inner.owner, at).await {
            warn!(error = %e.chain(), "{what} failed; their lease expires");
        }
    }

    /// A publish failed: each timer is released for a retry after its backoff, or, at its last
    /// allowed attempt, given up.
    pub(super) async fn release_with_backoff(&self, claimed: &[ClaimedTimer], error: &str) {
        let inner = &self.inner;
        let now = inner.clock.now();
        let max = inner.config.max_attempts;
        let (last, mut retry): (Vec<ClaimedTimer>, Vec<ClaimedTimer>) = claimed
            .iter()
            .cloned()
            .partition(|t| max > 0 && t.attempts.saturating_add(1) >= max);
        // The broker just failed a publish: after the first dead letter that does not go out
        // either, the rest are retried instead of each waiting out its own deadline.
        let mut broker_up = true;
        for timer in last {
            broker_up = broker_up && self.give_up(&timer, error).await;
            if !broker_up {
                retry.push(timer);
            }
        }
        let released: Vec<(ClaimedTimer, Settlement)> = retry
            .into_iter()
            .map(|t| {
                let delay = jittered(
                    backoff(&inner.config, t.attempts + 1),
                    inner.config.retry_jitter_percent,
                );
                let settlement = Settlement::Retry {
                    at: now.saturating_add(delay),
                    error: Some(error.to_owned()),
                };
                (t, settlement)
            })
            .collect();
        if released.is_empty() {
            return;
        }
        match inner.store.settle(&released, &inner.owner, now).await {
            Ok(changed) => self.history_written(changed),
            Err(e) => {
                warn!(error = %e.chain(), "releasing timers failed; they return when the lease expires")
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
        let sent = self
            .within_half_lease(
                "sending TimerFailed",
                inner.broker.dead_letter(&envelope.to_json(), &reason),
            )
            .await;
        if let Err(e) = sent {
            warn!(timer = %timer.key, error = %e.chain(), "sending TimerFailed failed; retrying the timer");
            return false;
        }
        let failed = [(timer.clone(), Settlement::Failed(error.to_owned()))];
        match inner.store.settle(&failed, &inner.owner, at).await {
            Ok(0) => {
                // Rescheduled meanwhile (another revision): it lives on, the dead letter was
                // early. Give its lease back so it is not "firing" until the lease ends.
                info!(timer = %timer.key, "TimerFailed sent, but the timer changed meanwhile and stays");
                self.give_back(
                    std::slice::from_ref(timer),
                    at,
                    "releasing a rescheduled timer",
                )
                .await;
            }
            Ok(changed) => {
                self.history_written(changed);
                ::metrics::counter!(metric::TIMERS_FAILED).increment(1);
                warn!(timer = %timer.key, attempts, "timer failed: engine.max_attempts reached; TimerFailed sent");
            }
            Err(e) => {
                // The dead letter is out but the row is unchanged: it is claimed again when the
                // lease expires and its publish tried once more (it may still succeed, so a
                // DueTimeReached can follow the TimerFailed; never a lost timer).
                warn!(timer = %timer.key, error = %e.chain(), "marking a timer failed did not work; it will be tried again");
            }
        }
        true
    }
}
