//! What becomes of claims after their publish: fired one-shot timers become Reached, recurring
//! ones move to their next occurrence, failed publishes are retried with backoff or, after
//! `engine.max_attempts`, given up with a `TimerFailed` dead letter.

use opentelemetry::trace::Span as _;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn, Level};

use super::owners::Leased;
use super::retry::{backoff, jittered, Retry};
use super::{metrics as metric, spans, Engine};
use crate::control::Change;
use crate::model::{ClaimedTimer, Timestamp};
use crate::store::Settlement;
use crate::wire::{Rejection, TimerFailedEnvelope};

/// Attempts at settling a fired batch that the store refuses (not merely cannot be reached:
/// that is waited for, since every claim waits for it too) before its leases are left to
/// expire (the timers then fire again: a duplicate, never a loss).
const SETTLE_ATTEMPTS: u32 = 5;

impl Engine {
    /// Settles claims as [`crate::policy`] decided (fired ones after the broker confirmed
    /// them; skipped or buffered ones without a fire), and counts what the policies did.
    pub(super) async fn settle_all(
        &self,
        settled: Vec<(ClaimedTimer, Settlement)>,
        reached_at: Timestamp,
        shutdown: &CancellationToken,
    ) {
        let inner = &self.inner;
        let retry = Retry {
            level: Level::ERROR,
            max_failures: Some(SETTLE_ATTEMPTS),
            ..self.store_retry(shutdown, "settling fired timers")
        };
        let span = self
            .spans()
            .map(|s| s.settle(settled.iter().map(|(t, _)| t)));
        let written = retry
            .until_ok(|| inner.store.settle(&settled, &inner.owner, reached_at))
            .await;
        match (written, span) {
            (Some(_), Some(mut span)) => span.end(),
            (None, Some(span)) => spans::failed(span, "not written: the leases run out"),
            _ => {}
        }
        let Some(changed) = written else {
            return; // unsettled rows fire again when the lease expires
        };
        self.history_written(changed);
        count_policies(&settled);
        if (changed as usize) < settled.len() {
            // Rescheduled while it fired (another revision now): the fire did not count for
            // it, and its lease would keep it "firing" until the new due time. Give it back.
            let claimed: Vec<ClaimedTimer> = settled.into_iter().map(|(t, _)| t).collect();
            self.give_back(&claimed, reached_at, "releasing rescheduled timers")
                .await;
            // Claimable now; the firing task may have planned while they were leased.
            self.wake_for(reached_at.as_millis());
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
        if let Err(e) = self
            .bounded(inner.store.settle(&released, &inner.owner, at))
            .await
        {
            warn!(error = %e.chain(), "{what} failed; their lease expires");
        }
    }

    /// Publishes failed: each timer is released for a retry after its backoff, or, at its last
    /// allowed attempt, given up. Each timer comes with its own error (one refused event of a
    /// batch has its own; a failed batch shares one).
    pub(super) async fn release_with_backoff(&self, failed: Vec<(ClaimedTimer, String)>) {
        self.release_after(failed, None).await
    }

    /// As [`release_with_backoff`](Self::release_with_backoff), but not sooner than
    /// `not_before` from now (a destination's `Retry-After`).
    pub(super) async fn release_after(
        &self,
        failed: Vec<(ClaimedTimer, String)>,
        not_before: Option<std::time::Duration>,
    ) {
        let inner = &self.inner;
        let now = inner.clock.now();
        let max = inner.config.max_attempts;
        let (last, mut retry): (Vec<_>, Vec<_>) = failed
            .into_iter()
            .partition(|(t, _)| max > 0 && t.attempts.saturating_add(1) >= max);
        // The broker just failed a publish: after the first dead letter that does not go out
        // either, the rest are retried instead of each waiting out its own deadline.
        let mut broker_up = true;
        for (timer, error) in last {
            let attempts = timer.attempts.saturating_add(1);
            let reason = format!("max_attempts: publishing failed {attempts} times: {error}");
            broker_up = broker_up && self.give_up(&timer, &error, &reason).await;
            if !broker_up {
                retry.push((timer, error));
            }
        }
        self.retry_later(retry, now, not_before).await;
    }

    /// Gives up claims in the firing task (claimed until `held_until`): timers whose work did
    /// not complete within their completion timeouts too often, or whose target `targets`
    /// refuses now, each with its error. Each waits
    /// for its dead letter, up to `engine.publish_timeout`, holding its lease meanwhile (as a
    /// publish does; one that is lost, or fenced, is left to whoever claims it next); after the
    /// first whose `TimerFailed` does not go out the rest are not tried, and each is retried
    /// after its backoff, which grows with each such try (its attempts count them). At
    /// shutdown, what is left is given back.
    pub(super) async fn give_up_claimed(
        &self,
        timers: Vec<GivingUp>,
        held_until: tokio::time::Instant,
        fence: &CancellationToken,
        shutdown: &CancellationToken,
    ) {
        let mut broker_up = true;
        let mut retry = Vec::new();
        let mut back = Vec::new();
        for GivingUp { timer, error, code } in timers {
            let leased = if !back.is_empty() {
                Leased::Shutdown
            } else if !broker_up {
                // Not tried: the broker just refused one.
                Leased::Done(false)
            } else {
                let reason = format!("{code}: {error}");
                let one = std::slice::from_ref(&timer);
                let giving_up = self.give_up(&timer, &error, &reason);
                self.while_leased(one, held_until, fence, shutdown, giving_up)
                    .await
            };
            match leased {
                Leased::Done(true) => {}
                Leased::Done(false) => {
                    broker_up = false;
                    let error = format!("{error}; its TimerFailed could not be sent: retried");
                    retry.push((timer, error));
                }
                Leased::Abandoned(why) => {
                    warn!(timer = %timer.key, why, "giving up a timer stopped; whoever claims it next gives it up");
                }
                Leased::Shutdown => back.push(timer),
            }
        }
        // After the dead letters' waits: the backoff counts from now.
        let now = self.inner.clock.now();
        self.retry_later(retry, now, None).await;
        if !back.is_empty() {
            self.give_back(&back, now, "releasing timers at shutdown")
                .await;
        }
    }

    /// Releases `retry` for a retry after each one's backoff, not sooner than `not_before` from
    /// `now`, each with its error.
    async fn retry_later(
        &self,
        retry: Vec<(ClaimedTimer, String)>,
        now: Timestamp,
        not_before: Option<std::time::Duration>,
    ) {
        let inner = &self.inner;
        let released: Vec<(ClaimedTimer, Settlement)> = retry
            .into_iter()
            .map(|(t, error)| {
                let delay = jittered(
                    backoff(&inner.config, t.attempts + 1),
                    inner.config.retry_jitter_percent,
                )
                .max(not_before.unwrap_or_default());
                let settlement = Settlement::Retry {
                    at: now.saturating_add(delay),
                    error: Some(error),
                };
                (t, settlement)
            })
            .collect();
        if released.is_empty() {
            return;
        }
        match self
            .bounded(inner.store.settle(&released, &inner.owner, now))
            .await
        {
            Ok(changed) => self.history_written(changed),
            Err(e) => {
                warn!(error = %e.chain(), "releasing timers failed; they return when the lease expires")
            }
        }
    }

    /// The last attempt failed (a publish, or a one-shot timer's work that never completed):
    /// a `TimerFailed` dead letter with `reason`, then the timer becomes Failed with `error`.
    /// False when the dead letter could not be sent either (the timer is retried instead).
    pub(super) async fn give_up(&self, timer: &ClaimedTimer, error: &str, reason: &str) -> bool {
        let inner = &self.inner;
        let at = inner.clock.now();
        let attempts = timer.attempts.saturating_add(1);
        let envelope = TimerFailedEnvelope::for_timer(timer, at, attempts, error);
        let sent = self
            .within_publish_timeout(
                "sending TimerFailed",
                inner.broker.dead_letter(&envelope.to_json(), reason),
            )
            .await;
        if let Err(e) = sent {
            warn!(timer = %timer.key, trace_id = timer.trace_id(), error = %e.chain(), "sending TimerFailed failed; retrying the timer");
            return false;
        }
        let failed = [(timer.clone(), Settlement::Failed(error.to_owned()))];
        match self
            .bounded(inner.store.settle(&failed, &inner.owner, at))
            .await
        {
            Ok(0) => {
                // Rescheduled meanwhile (another revision): it lives on, the dead letter was
                // early. Give its lease back so it is not "firing" until the lease ends.
                info!(timer = %timer.key, trace_id = timer.trace_id(), "TimerFailed sent, but the timer changed meanwhile and stays");
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
                warn!(timer = %timer.key, trace_id = timer.trace_id(), attempts, reason, "timer failed; TimerFailed sent");
            }
            Err(e) => {
                // The dead letter is out but the row is unchanged: it is claimed again when the
                // lease expires and its publish tried once more (it may still succeed, so a
                // DueTimeReached can follow the TimerFailed; never a lost timer).
                warn!(timer = %timer.key, trace_id = timer.trace_id(), error = %e.chain(), "marking a timer failed did not work; it will be tried again");
            }
        }
        true
    }
}

/// A claim the firing task gives up, and why.
pub(super) struct GivingUp {
    pub timer: ClaimedTimer,
    /// Its `lastError` in the `TimerFailed` and in the Failed row.
    pub error: String,
    /// Ahead of the error in the dead letter's reason (`completion_timeout`, `invalid_target`).
    pub code: &'static str,
}

impl GivingUp {
    /// A claim whose target `targets` refuses now (it was taken under other patterns).
    pub fn refused(timer: ClaimedTimer, refused: Rejection) -> Self {
        let field = refused.field.map(|f| format!("{f}: ")).unwrap_or_default();
        let error = format!(
            "{field}{} (checked again at its fire: the patterns changed since it was taken)",
            refused.message
        );
        GivingUp {
            timer,
            error,
            code: refused.reason.as_str(),
        }
    }
}

/// Counts what the policies did in settlements that were written: skipped, buffered and
/// caught-up occurrences, timed-out completions.
fn count_policies(settled: &[(ClaimedTimer, Settlement)]) {
    for (_, settlement) in settled {
        let Settlement::Step(step) = settlement else {
            continue;
        };
        for change in &step.changes {
            match change {
                Change::Skipped {
                    count,
                    reason: Some(reason),
                    ..
                } => ::metrics::counter!(metric::OCCURRENCES_SKIPPED, "reason" => reason.as_str())
                    .increment(*count),
                Change::Buffered { .. } => {
                    ::metrics::counter!(metric::OCCURRENCES_BUFFERED).increment(1)
                }
                Change::TimedOut { .. } => {
                    ::metrics::counter!(metric::COMPLETIONS_TIMED_OUT).increment(1)
                }
                Change::Fired {
                    caught_up: true, ..
                } => ::metrics::counter!(metric::OCCURRENCES_CAUGHT_UP).increment(1),
                _ => {}
            }
        }
    }
}
