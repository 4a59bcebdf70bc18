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

/// How many `TimerFailed` dead letters of a batch of give-ups are sent at once.
const DEAD_LETTERS_AT_ONCE: usize = 16;

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
        let last = last
            .into_iter()
            .map(|(timer, error)| {
                let attempts = timer.attempts.saturating_add(1);
                let reason = format!("max_attempts: publishing failed {attempts} times: {error}");
                (timer, error, reason)
            })
            .collect();
        retry.extend(self.give_up_all(last).await);
        self.retry_later(retry, now, not_before).await;
    }

    /// Gives up claims in the firing task (claimed until `held_until`): timers whose work did
    /// not complete within their completion timeouts too often, or whose target `targets`
    /// refuses now, each with its error, in rounds as [`give_up_all`](Self::give_up_all) does.
    /// Each round holds the leases of the timers not yet given up (as a publish does; when they
    /// are lost, or fenced, what is left is left to whoever claims it next): those a round
    /// marked Failed have none to renew. Those whose `TimerFailed` does not go out are retried
    /// after their backoff, which grows with each such try (their attempts count them). At
    /// shutdown, what is left is given back.
    pub(super) async fn give_up_claimed(
        &self,
        timers: Vec<GivingUp>,
        held_until: tokio::time::Instant,
        fence: &CancellationToken,
        shutdown: &CancellationToken,
    ) {
        let claimed: Vec<ClaimedTimer> = timers.iter().map(|g| g.timer.clone()).collect();
        let giving_up = timers
            .into_iter()
            .map(|GivingUp { timer, error, code }| {
                let reason = format!("{code}: {error}");
                (timer, error, reason)
            })
            .collect();
        let mut retry = Vec::new();
        let mut done = 0;
        for these in rounds(giving_up) {
            // This round's and those of the rounds after it.
            let held = &claimed[done..];
            done += these.len();
            if !retry.is_empty() {
                // Not tried: the broker just refused one.
                retry.extend(these.into_iter().map(|(t, error, _)| (t, not_sent(error))));
                continue;
            }
            let giving_up = self.give_up_round(these);
            match self
                .while_leased(held, held_until, fence, shutdown, giving_up)
                .await
            {
                Leased::Done(refused) => retry.extend(refused),
                Leased::Abandoned(why) => {
                    warn!(
                        timers = held.len(),
                        why, "giving up timers stopped; whoever claims them next gives them up"
                    );
                    return;
                }
                Leased::Shutdown => {
                    // What a round marked Failed stays so; the others are claimable again.
                    let now = self.inner.clock.now();
                    self.give_back(held, now, "releasing timers at shutdown")
                        .await;
                    return;
                }
            }
        }
        // After the dead letters' waits: the backoff counts from now.
        let now = self.inner.clock.now();
        self.retry_later(retry, now, None).await;
    }

    /// Gives up `timers` (each with its error and its dead letter's reason) together: their
    /// `TimerFailed` dead letters go out [`DEAD_LETTERS_AT_ONCE`] at a time, each within
    /// `engine.publish_timeout` (the first alone: when the broker refuses it, the others are
    /// not tried), and those of each such round that went out become Failed in one write. One
    /// by one, a thousand give-ups (a narrowed `targets.allow`) cost a thousand round trips to
    /// the broker and as many commits, in the firing task. Returns those whose dead letter did
    /// not go out, each with its error, to be retried.
    pub(super) async fn give_up_all(
        &self,
        timers: Vec<(ClaimedTimer, String, String)>,
    ) -> Vec<(ClaimedTimer, String)> {
        let mut retry = Vec::new();
        for these in rounds(timers) {
            if !retry.is_empty() {
                // Not tried: the broker just refused one.
                retry.extend(these.into_iter().map(|(t, error, _)| (t, not_sent(error))));
                continue;
            }
            retry.extend(self.give_up_round(these).await);
        }
        retry
    }

    /// One round of give-ups: each one's `TimerFailed` sent at once, those that went out
    /// marked Failed in one write. Returns those whose dead letter did not go out.
    async fn give_up_round(
        &self,
        these: Vec<(ClaimedTimer, String, String)>,
    ) -> Vec<(ClaimedTimer, String)> {
        let at = self.inner.clock.now();
        let sent = futures::future::join_all(these.into_iter().map(|giving_up| async {
            let sent = self.send_timer_failed(&giving_up, at).await;
            (giving_up, sent)
        }))
        .await;
        let (sent, refused): (Vec<_>, Vec<_>) = sent.into_iter().partition(|(_, sent)| *sent);
        self.mark_failed(sent.into_iter().map(|(g, _)| g).collect(), at)
            .await;
        refused
            .into_iter()
            .map(|((timer, error, _), _)| (timer, not_sent(error)))
            .collect()
    }

    /// Sends the `TimerFailed` of a timer given up at `at` (with its error and the dead letter's
    /// reason), within `engine.publish_timeout`; false when it did not go out.
    async fn send_timer_failed(
        &self,
        (timer, error, reason): &(ClaimedTimer, String, String),
        at: Timestamp,
    ) -> bool {
        let attempts = timer.attempts.saturating_add(1);
        let envelope = TimerFailedEnvelope::for_timer(timer, at, attempts, error).to_json();
        let sent = self
            .within_publish_timeout(
                "sending TimerFailed",
                self.inner.broker.dead_letter(&envelope, reason),
            )
            .await;
        if let Err(e) = &sent {
            warn!(timer = %timer.key, trace_id = timer.trace_id(), error = %e.chain(), "sending TimerFailed failed; retrying the timer");
        }
        sent.is_ok()
    }

    /// Marks Failed, in one write, timers whose `TimerFailed` went out.
    async fn mark_failed(&self, failed: Vec<(ClaimedTimer, String, String)>, at: Timestamp) {
        let inner = &self.inner;
        if failed.is_empty() {
            return;
        }
        let settled: Vec<(ClaimedTimer, Settlement)> = failed
            .iter()
            .map(|(timer, error, _)| (timer.clone(), Settlement::Failed(error.clone())))
            .collect();
        match self
            .bounded(inner.store.settle(&settled, &inner.owner, at))
            .await
        {
            Ok(changed) => {
                self.history_written(changed);
                ::metrics::counter!(metric::TIMERS_FAILED).increment(changed);
                for (timer, _, reason) in &failed {
                    let attempts = timer.attempts.saturating_add(1);
                    warn!(timer = %timer.key, trace_id = timer.trace_id(), attempts, reason, "timer failed; TimerFailed sent");
                }
                if (changed as usize) < failed.len() {
                    // Some were rescheduled meanwhile (another revision): they live on, their
                    // dead letters were early. Their leases go back, so they are not "firing"
                    // until the leases end (the Failed ones have none left to give).
                    info!(
                        timers = failed.len() - changed as usize,
                        "TimerFailed sent, but timers changed meanwhile and stay"
                    );
                    let claimed: Vec<ClaimedTimer> =
                        failed.into_iter().map(|(timer, _, _)| timer).collect();
                    self.give_back(&claimed, at, "releasing rescheduled timers")
                        .await;
                }
            }
            Err(e) => {
                // The dead letters are out but the rows are unchanged: they are claimed again
                // when their leases expire and tried once more (a publish may still succeed,
                // so a DueTimeReached can follow a TimerFailed; never a lost timer).
                warn!(timers = failed.len(), error = %e.chain(), "marking timers failed did not work; they will be tried again");
            }
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
        let one = vec![(timer.clone(), error.to_owned(), reason.to_owned())];
        self.give_up_all(one).await.is_empty()
    }
}

/// `timers` in rounds of give-ups: the first alone (when the broker refuses its dead letter,
/// the others are not tried), then [`DEAD_LETTERS_AT_ONCE`] at a time.
fn rounds<T>(timers: Vec<T>) -> impl Iterator<Item = Vec<T>> {
    let mut timers = timers.into_iter().peekable();
    let mut size = 1;
    std::iter::from_fn(move || {
        timers.peek()?;
        let round = timers.by_ref().take(size).collect();
        size = DEAD_LETTERS_AT_ONCE;
        Some(round)
    })
}

/// The error of a give-up whose `TimerFailed` did not go out: it is retried.
fn not_sent(error: String) -> String {
    format!("{error}; its TimerFailed could not be sent: retried")
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
