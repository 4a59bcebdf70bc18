//! Timers claimed ahead of their due time (`engine.claim_ahead`) and held by the firing task
//! until it, so a claim's cost (a round trip, a wait for the store's write lock behind other
//! writes) is paid before the due time instead of after it.
//!
//! # Invariants
//! - Only what [`Due`] takes is claimed ahead: a timer at its first due time
//!   (`available_at = due_at`), never a retry, a lease's end or a paced turn, so holding a
//!   timer until its `due_at` holds it until it became claimable; nothing fires early.
//! - `covered`: every timer first due by then was in the store when a claim looked, so it is
//!   held here or fired. A timer scheduled afterwards for a time before it is not: the firing
//!   task is woken for it ([`Ready::wake_before`]) and claims again.
//! - At most about two batches are held: a claim is made only while fewer than
//!   `engine.batch_size` wait.
//! - The claims are leased for `engine.lease`, and held at most `engine.claim_ahead` (under a
//!   fifth of it) before they fire, when their lease is renewed as any publish's is.
//! - Held timers belong to the membership they were claimed under: when its fence is cut they
//!   are dropped, not fired and not given back (their leases may be another instance's by
//!   then); at shutdown they are given back, claimable at their due time.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::model::{ClaimedTimer, Due, Timestamp};

/// The timers the firing task claimed and holds until their due time.
#[derive(Default)]
pub(super) struct Ready {
    /// Earliest due first, each with when its lease surely runs out.
    waiting: VecDeque<(ClaimedTimer, Instant)>,
    /// See the module doc. `None`: the next look claims (nothing claimed yet, a claim was full,
    /// or a sooner timer arrived).
    covered: Option<Timestamp>,
    /// The fence of the membership the waiting timers were claimed under.
    fence: Option<CancellationToken>,
}

/// Timers whose due time came, and when the first of their leases runs out.
pub(super) struct Now {
    pub timers: Vec<ClaimedTimer>,
    pub held_until: Instant,
}

impl Ready {
    /// Whether the firing task claims at `now`: the window it covers ends within half of
    /// `ahead` (so the next claim is made while what it claimed is still ahead), and fewer
    /// than `batch` wait.
    pub fn claims(&self, now: Timestamp, ahead: Duration, batch: usize) -> bool {
        !self.is_full(batch)
            && self
                .covered
                .is_none_or(|covered| covered < now.saturating_add(ahead / 2))
    }

    /// Adds a claim of `limit` made with `due`, held until `held_until`, under `fence`.
    pub fn add(
        &mut self,
        claimed: Vec<ClaimedTimer>,
        due: Due,
        limit: usize,
        held_until: Instant,
        fence: &CancellationToken,
    ) {
        // A full claim may have left rows of its window behind: claim again next time.
        self.covered = (claimed.len() < limit).then_some(due.ahead);
        self.fence = Some(fence.clone());
        self.waiting
            .extend(claimed.into_iter().map(|t| (t, held_until)));
        self.waiting
            .make_contiguous()
            .sort_by(|(a, _), (b, _)| a.due_at.cmp(&b.due_at).then_with(|| a.key.cmp(&b.key)));
    }

    /// Takes the timers due at `now`, if any.
    pub fn take_due(&mut self, now: Timestamp) -> Option<Now> {
        let n = self.waiting.partition_point(|(t, _)| t.due_at <= now);
        if n == 0 {
            return None;
        }
        let mut held_until = None::<Instant>;
        let timers = self
            .waiting
            .drain(..n)
            .map(|(t, until)| {
                held_until = Some(held_until.map_or(until, |h| h.min(until)));
                t
            })
            .collect();
        Some(Now {
            timers,
            held_until: held_until.unwrap_or_else(Instant::now),
        })
    }

    /// The next claim looks again (a sooner timer may have arrived).
    pub fn look_again(&mut self) {
        self.covered = None;
    }

    /// When the firing task should look next for what it holds: the first due time, or when
    /// the window it covers needs extending (half of `ahead` before its end, while fewer than
    /// `batch` are held). `None` when nothing is held.
    pub fn next_look(&self, ahead: Duration, batch: usize) -> Option<Timestamp> {
        let (first, _) = self.waiting.front()?;
        let extend = self
            .covered
            .filter(|_| !self.is_full(batch))
            .map(|c| c.saturating_sub(ahead / 2));
        Some(extend.map_or(first.due_at, |e| e.min(first.due_at)))
    }

    /// The due time of the first held timer.
    pub fn first_due(&self) -> Option<Timestamp> {
        self.waiting.front().map(|(t, _)| t.due_at)
    }

    /// A timer due before this needs a wake-up: it is not held, and no planned claim takes it
    /// in time (`None`: the next look claims anyway, or cannot for a full hold).
    pub fn wake_before(&self) -> Option<Timestamp> {
        self.covered
    }

    /// Whether a whole batch is held: no claim is made until some fire.
    pub fn is_full(&self, batch: usize) -> bool {
        self.waiting.len() >= batch
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// The fence the held timers were claimed under, while some are held.
    pub fn fence(&self) -> Option<&CancellationToken> {
        self.fence.as_ref().filter(|_| !self.waiting.is_empty())
    }

    /// Everything held, emptied.
    pub fn take_all(&mut self) -> Vec<ClaimedTimer> {
        self.covered = None;
        self.fence = None;
        self.waiting.drain(..).map(|(t, _)| t).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::TimerKey;

    fn claimed(id: &str, due: i64) -> ClaimedTimer {
        ClaimedTimer {
            due_at: Timestamp::from_millis(due),
            revision: 1,
            ..ClaimedTimer::for_tests(TimerKey::new("t", id))
        }
    }

    fn ids(now: &Now) -> Vec<&str> {
        now.timers
            .iter()
            .map(|t| t.key.service_call_id.as_str())
            .collect()
    }

    const AHEAD: Duration = Duration::from_millis(50);

    #[test]
    fn holds_each_timer_until_its_due_time_earliest_first() {
        let mut ready = Ready::default();
        let now = Timestamp::from_millis(1_000);
        assert!(ready.claims(now, AHEAD, 10), "nothing claimed yet");
        let fence = CancellationToken::new();
        let due = Due::ahead(now, AHEAD);
        let held = Instant::now();
        ready.add(
            vec![
                claimed("b", 1_030),
                claimed("late", 990),
                claimed("a", 1_010),
            ],
            due,
            10,
            held,
            &fence,
        );
        let first = ready.take_due(now).expect("the one past due");
        assert_eq!(ids(&first), ["late"]);
        assert!(ready.take_due(Timestamp::from_millis(1_009)).is_none());
        assert_eq!(
            ready.next_look(AHEAD, 10),
            Some(Timestamp::from_millis(1_010))
        );
        let second = ready.take_due(Timestamp::from_millis(1_030)).expect("both");
        assert_eq!(ids(&second), ["a", "b"]);
        assert!(ready.is_empty());
        assert_eq!(ready.next_look(AHEAD, 10), None);
    }

    #[test]
    fn claims_again_before_the_window_ends_unless_a_batch_is_held() {
        let mut ready = Ready::default();
        let now = Timestamp::from_millis(1_000);
        let fence = CancellationToken::new();
        ready.add(
            vec![claimed("a", 1_040)],
            Due::ahead(now, AHEAD),
            10,
            Instant::now(),
            &fence,
        );
        assert_eq!(ready.wake_before(), Some(Timestamp::from_millis(1_050)));
        // Covered until 1,050: the next claim at 1,025, half the window before its end.
        assert!(!ready.claims(Timestamp::from_millis(1_024), AHEAD, 10));
        assert!(ready.claims(Timestamp::from_millis(1_026), AHEAD, 10));
        assert_eq!(
            ready.next_look(AHEAD, 10),
            Some(Timestamp::from_millis(1_025))
        );
        assert_eq!(
            ready.next_look(AHEAD, 1),
            Some(Timestamp::from_millis(1_040)),
            "a full hold waits for its first"
        );
        // A sooner timer arrived: look at once.
        ready.look_again();
        assert!(ready.claims(now, AHEAD, 10));
        // A full claim covers nothing for sure, but a full hold claims no more.
        let mut full = Ready::default();
        full.add(
            vec![claimed("x", 1_040), claimed("y", 1_040)],
            Due::ahead(now, AHEAD),
            2,
            Instant::now(),
            &fence,
        );
        assert_eq!(full.wake_before(), None);
        assert!(!full.claims(now, AHEAD, 2));
        assert!(full.claims(now, AHEAD, 3));
    }

    #[test]
    fn the_fence_and_the_first_lease_go_with_the_held_timers() {
        let mut ready = Ready::default();
        let fence = CancellationToken::new();
        let now = Timestamp::from_millis(1_000);
        let (early, later) = (Instant::now(), Instant::now() + Duration::from_secs(5));
        ready.add(vec![claimed("a", 1_000)], Due::at(now), 10, later, &fence);
        ready.add(vec![claimed("b", 1_000)], Due::at(now), 10, early, &fence);
        assert!(ready.fence().is_some());
        let due = ready.take_due(now).expect("due");
        assert_eq!(due.held_until, early, "the first lease to run out");
        assert!(ready.fence().is_none(), "nothing held, no fence");
        ready.add(vec![claimed("c", 1_040)], Due::at(now), 10, later, &fence);
        assert_eq!(
            ids(&Now {
                timers: ready.take_all(),
                held_until: later
            }),
            ["c"]
        );
        assert!(ready.is_empty());
        assert!(ready.claims(now, AHEAD, 10));
    }
}
