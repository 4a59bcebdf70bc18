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
//! - At most two batches are held: a claim is made only while fewer than `engine.batch_size`
//!   wait, or exactly that many of which none is due yet (the task has nothing to fire until
//!   then, so the next claim's cost is paid before that due time: a herd's first two claims
//!   are made before it is due, both shared between tenants when more are due than one
//!   takes). A fire takes at most `engine.batch_size`.
//! - The claims are leased for `engine.lease`, and held at most `engine.claim_ahead` (under a
//!   fifth of it) before they fire, when their lease is renewed as any publish's is; in a fair
//!   claim's backlog every tenant's share looks eight times as far, or twice the time between
//!   two claims (`crate::fair`), never more than a fifth of the lease.
//! - Held timers belong to the membership they were claimed under: when its fence is cut they
//!   are dropped, not fired and not given back (their leases may be another instance's by
//!   then); at shutdown they are given back, claimable at their due time.

use std::collections::{HashMap, VecDeque};
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
    /// `ahead` (so the next claim is made while what it claimed is still ahead), and the hold
    /// is not full ([`Ready::is_full`]).
    pub fn claims(&self, now: Timestamp, ahead: Duration, batch: usize) -> bool {
        !self.is_full(now, batch)
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

    /// Takes the timers due at `now`, if any: all of them, or when more than `batch` are due,
    /// `batch` of them shared between their tenants as a claim is (`crate::fair`): one of each
    /// tenant's earliest in turn, so a tenant's timer that came due behind another's herd goes
    /// with the next fire.
    pub fn take_due(&mut self, now: Timestamp, batch: usize) -> Option<Now> {
        let n = self.waiting.partition_point(|(t, _)| t.due_at <= now);
        if n == 0 || batch == 0 {
            return None;
        }
        let taken: Vec<(ClaimedTimer, Instant)> = if n <= batch {
            self.waiting.drain(..n).collect()
        } else {
            let picked = round_robin(
                self.waiting.range(..n).map(|(t, _)| &t.key.tenant_id),
                batch,
            );
            let mut taken = Vec::with_capacity(batch);
            let mut rest = VecDeque::with_capacity(self.waiting.len() - batch);
            for (i, held) in self.waiting.drain(..).enumerate() {
                if picked.get(i).copied().unwrap_or(false) {
                    taken.push(held);
                } else {
                    rest.push_back(held);
                }
            }
            self.waiting = rest;
            taken
        };
        let held_until = taken.iter().map(|(_, until)| *until).min();
        Some(Now {
            timers: taken.into_iter().map(|(t, _)| t).collect(),
            held_until: held_until.unwrap_or_else(Instant::now),
        })
    }

    /// The next claim looks again (a sooner timer may have arrived).
    pub fn look_again(&mut self) {
        self.covered = None;
    }

    /// When the firing task should look next for what it holds: the first due time, or when
    /// the window it covers needs extending (half of `ahead` before its end, while the hold is
    /// not full at `now`). `None` when nothing is held.
    pub fn next_look(&self, now: Timestamp, ahead: Duration, batch: usize) -> Option<Timestamp> {
        let (first, _) = self.waiting.front()?;
        let extend = self
            .covered
            .filter(|_| !self.is_full(now, batch))
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

    /// Whether no claim is made until some fire: more than a batch is held, or a batch of
    /// which the first is due at `now`. (So at most two batches are held.)
    pub fn is_full(&self, now: Timestamp, batch: usize) -> bool {
        let held = self.waiting.len();
        held > batch || (held >= batch && self.first_due().is_some_and(|first| first <= now))
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

/// Which of `tenants` (each entry's tenant, earliest first) `take` picks: one of each tenant's
/// earliest in turn, in the order the tenants first appear, until `take` are picked.
fn round_robin<'a>(tenants: impl Iterator<Item = &'a String>, take: usize) -> Vec<bool> {
    let mut queues: Vec<VecDeque<usize>> = Vec::new();
    let mut queue_of: HashMap<&String, usize> = HashMap::new();
    let mut len = 0;
    for (i, tenant) in tenants.enumerate() {
        let q = *queue_of.entry(tenant).or_insert_with(|| {
            queues.push(VecDeque::new());
            queues.len() - 1
        });
        queues[q].push_back(i);
        len = i + 1;
    }
    let mut picked = vec![false; len];
    let mut left = take.min(len);
    while left > 0 {
        for queue in &mut queues {
            if left == 0 {
                break;
            }
            if let Some(i) = queue.pop_front() {
                picked[i] = true;
                left -= 1;
            }
        }
    }
    picked
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
        let first = ready.take_due(now, 10).expect("the one past due");
        assert_eq!(ids(&first), ["late"]);
        assert!(ready.take_due(Timestamp::from_millis(1_009), 10).is_none());
        assert_eq!(
            ready.next_look(now, AHEAD, 10),
            Some(Timestamp::from_millis(1_010))
        );
        let second = ready
            .take_due(Timestamp::from_millis(1_030), 10)
            .expect("both");
        assert_eq!(ids(&second), ["a", "b"]);
        assert!(ready.is_empty());
        assert_eq!(ready.next_look(now, AHEAD, 10), None);
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
            ready.next_look(now, AHEAD, 10),
            Some(Timestamp::from_millis(1_025))
        );
        assert_eq!(
            ready.next_look(Timestamp::from_millis(1_040), AHEAD, 1),
            Some(Timestamp::from_millis(1_040)),
            "a full hold whose first is due waits for it"
        );
        // A sooner timer arrived: look at once.
        ready.look_again();
        assert!(ready.claims(now, AHEAD, 10));
        // A full claim covers nothing for sure: while none of it is due, one more batch is
        // claimed; then, or once the first is due, no more.
        let mut full = Ready::default();
        full.add(
            vec![claimed("x", 1_040), claimed("y", 1_040)],
            Due::ahead(now, AHEAD),
            2,
            Instant::now(),
            &fence,
        );
        assert_eq!(full.wake_before(), None);
        assert!(full.claims(now, AHEAD, 2), "one batch held, not yet due");
        assert!(
            !full.claims(Timestamp::from_millis(1_040), AHEAD, 2),
            "its first is due"
        );
        full.add(
            vec![claimed("z1", 1_045)],
            Due::ahead(now, AHEAD),
            2,
            Instant::now(),
            &fence,
        );
        assert!(!full.claims(now, AHEAD, 2), "more than a batch held");
        full.add(
            vec![claimed("z2", 1_045)],
            Due::ahead(now, AHEAD),
            2,
            Instant::now(),
            &fence,
        );
        // A fire takes one batch at the most, earliest first.
        let fire = full
            .take_due(Timestamp::from_millis(1_050), 2)
            .expect("due");
        assert_eq!(ids(&fire), ["x", "y"]);
        assert!(!full.claims(Timestamp::from_millis(1_050), AHEAD, 2));
        let fire = full
            .take_due(Timestamp::from_millis(1_050), 2)
            .expect("due");
        assert_eq!(ids(&fire), ["z1", "z2"]);
        assert!(full.claims(Timestamp::from_millis(1_050), AHEAD, 2));
    }

    #[test]
    fn more_due_than_a_fire_takes_are_shared_between_tenants_in_due_order() {
        let of = |tenant: &str, id: &str, due: i64| ClaimedTimer {
            due_at: Timestamp::from_millis(due),
            ..ClaimedTimer::for_tests(TimerKey::new(tenant, id))
        };
        let mut held: Vec<ClaimedTimer> = (1..=6).map(|i| of("big", &format!("b{i}"), i)).collect();
        held.extend([of("small", "s1", 5), of("small", "s2", 6)]);
        let mut ready = Ready::default();
        let now = Timestamp::from_millis(10);
        ready.add(
            held,
            Due::at(now),
            8,
            Instant::now(),
            &CancellationToken::new(),
        );
        let first = ready.take_due(now, 4).expect("due");
        assert_eq!(ids(&first), ["b1", "b2", "s1", "s2"]);
        let second = ready.take_due(now, 4).expect("the rest");
        assert_eq!(ids(&second), ["b3", "b4", "b5", "b6"]);
        assert!(ready.is_empty());
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
        let due = ready.take_due(now, 10).expect("due");
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
