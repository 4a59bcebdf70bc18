//! The decisions about a claimed timer with a policy or work: [`plan`] what its claim does
//! (fire which occurrence, skip, buffer, give up), and [`fired`], the settlement once the broker
//! confirmed the fire.

use super::due::Due;
use super::{
    fire_time, Awaiting, CatchUp, Overlap, Policy, SkipReason, Work, DEFAULT_CATCH_UP_LIMIT,
};
use crate::control::Change;
use crate::model::{ClaimedTimer, TimerKey, TimerState, Timestamp};
use crate::recurrence::Skipped;
use crate::store::{Settlement, Step};

/// Records `occurrences` (cron times) of `key` as skipped for `reason`: counted in `work`, and
/// one `skipped` history entry with their fire times. `None` for none.
fn skipped(
    key: &TimerKey,
    policy: Option<&Policy>,
    work: &mut Work,
    reason: SkipReason,
    occurrences: Option<Skipped>,
) -> Option<Change> {
    let Skipped {
        count,
        first,
        last,
        at_least,
    } = occurrences?;
    work.counts.skipped(reason, count);
    Some(Change::Skipped {
        count,
        first: fire_time(key, first, policy),
        last: fire_time(key, last, policy),
        at_least,
        reason: Some(reason),
    })
}

/// What to do with a claimed timer that has a policy or work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Publish the event of one occurrence, then settle with [`fired`].
    Fire(Fire),
    /// No event: settle the claim as this step (occurrences skipped, one buffered).
    Settle(Step),
    /// A one-shot timer whose work did not complete after `engine.max_attempts` fires: send a
    /// `TimerFailed` with this error and mark it Failed.
    GiveUp { error: String },
}

/// The occurrence a [`Plan::Fire`] publishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fire {
    /// Its fire time: the event's `dueAt`, the base of its id.
    pub due_at: Timestamp,
    /// The cron occurrence it stands for (the due time without jitter).
    pub nominal: Timestamp,
    /// A one-shot timer fired again after its work timed out: the how-manyth time (0 for the
    /// first fire). Part of the event id, so a broker's de-duplication does not drop it.
    pub refire: u32,
    /// It was missed and fires late, with later occurrences due behind it.
    pub caught_up: bool,
    /// The last occurrence the plan decided on: this one, or a later one it recorded as
    /// skipped. The series goes on after it.
    pub accounted_until: Timestamp,
    /// History entries before the `fired` one (skips, a timeout).
    pub before: Vec<Change>,
    /// The work before the fire (a timed-out wait cleared, counts updated).
    pub work: Work,
}

impl Fire {
    /// The claim as its event describes it: due at [`Fire::due_at`].
    pub fn claim(&self, claim: &ClaimedTimer) -> ClaimedTimer {
        ClaimedTimer {
            due_at: self.due_at,
            ..claim.clone()
        }
    }
}

/// The decisions of one plan, kept as they are made.
struct Planner<'a> {
    claim: &'a ClaimedTimer,
    policy: Option<&'a Policy>,
    now: Timestamp,
    work: Work,
    before: Vec<Change>,
    /// The latest occurrence recorded as skipped so far.
    skipped_until: Option<Timestamp>,
}

impl Planner<'_> {
    fn skip(&mut self, reason: SkipReason, occurrences: Option<Skipped>) {
        if let Some(skipped) = &occurrences {
            self.skipped_until = self.skipped_until.max(Some(skipped.last));
        }
        let change = skipped(
            &self.claim.key,
            self.policy,
            &mut self.work,
            reason,
            occurrences,
        );
        self.before.extend(change);
    }

    fn time_out(&mut self, awaiting: &Awaiting) {
        self.work.counts.timed_out = self.work.counts.timed_out.saturating_add(1);
        self.before.push(Change::TimedOut {
            occurrence: awaiting.occurrence,
            fired_at: awaiting.fired_at,
        });
    }

    fn fire_time(&self, nominal: Timestamp) -> Timestamp {
        fire_time(&self.claim.key, nominal, self.policy)
    }

    /// Settles without a fire: the series goes on at `next` (nominal), or ends.
    fn settle_at(mut self, next: Option<Timestamp>) -> Plan {
        let (state, due_at) = match next {
            Some(next) => {
                self.work.nominal = self.policy.and_then(|p| p.jitter).map(|_| next);
                (TimerState::Scheduled, self.fire_time(next))
            }
            None => (TimerState::Reached, self.claim.due_at),
        };
        Plan::Settle(Step {
            state,
            due_at,
            available_at: due_at,
            fired: false,
            work: self.work.stored(),
            changes: self.before,
        })
    }
}

/// What to do with `claim` at `now`; `max_attempts` is `engine.max_attempts` (0: no limit).
pub fn plan(claim: &ClaimedTimer, now: Timestamp, max_attempts: u32) -> Plan {
    let policy = claim.policy.as_ref();
    let mut planner = Planner {
        claim,
        policy,
        now,
        work: claim.work.clone().unwrap_or_default(),
        before: Vec::new(),
        skipped_until: None,
    };
    let schedule = claim.recurrence.as_ref().and_then(|r| r.schedule().ok());
    let Some(schedule) = schedule else {
        return plan_one_shot(planner, max_attempts);
    };
    let nominal = planner.work.nominal.unwrap_or(claim.due_at);
    if planner.fire_time(nominal) > now {
        // Claimed at its due time before the series was sent again with a longer jitter: it
        // goes out at its new time, never before the due time its event says.
        return planner.settle_at(Some(nominal));
    }
    let fired = claim.occurrences;
    let fire_time = |n: Timestamp| fire_time(&claim.key, n, policy);
    // `catchUp: all` fires the latest `catchUpLimit`, but never more than `maxOccurrences`
    // lets the series fire still (the latest of those, not the first ones after the skips).
    let left = claim
        .recurrence
        .as_ref()
        .and_then(|r| r.max_occurrences)
        .map_or(u32::MAX, |max| max.saturating_sub(fired));
    let catch_up_limit = policy
        .and_then(|p| p.catch_up_limit)
        .unwrap_or(DEFAULT_CATCH_UP_LIMIT)
        .min(left)
        .max(1) as usize;
    // The latest due ones a plan may fire: `catchUp: all`'s limit, else the last one.
    let latest = match policy.and_then(|p| p.catch_up) {
        Some(CatchUp::All) => catch_up_limit,
        _ => 1,
    };
    // Later than the window (fired more than `catchUpWindow` before now): skipped.
    let mut first = nominal;
    if let Some(window) = policy.and_then(|p| p.catch_up_window) {
        let late_by =
            Timestamp::from_millis(now.saturating_sub(window).as_millis().saturating_sub(1));
        if fire_time(nominal) <= late_by {
            let late = Due::of(&schedule, nominal, late_by, fire_time, 1);
            planner.skip(SkipReason::CatchUpWindow, late.all(&schedule));
            // A buffered occurrence is the first due one: dropped with the others.
            planner.work.buffered = false;
            match late.next.filter(|n| fire_time(*n) <= now) {
                Some(in_window) => first = in_window,
                // Nothing due within the window: the series goes on after it (or ends).
                None => {
                    let after = late
                        .next
                        .filter(|_| schedule.next(late.last(), fired).is_some());
                    return planner.settle_at(after);
                }
            }
        }
    }
    // The occurrences due by now, from the first one not later than the window on.
    let mut due = Due::of(&schedule, first, now, fire_time, latest);
    // The first occurrence not due: where the series goes on when nothing due fires.
    let after_due = due
        .next
        .filter(|_| schedule.next(due.last(), fired).is_some());
    let overlap = policy.map(|p| p.overlap).unwrap_or_default();
    // The previous occurrence's work: timed out, or still running.
    let running = match planner.work.awaiting.clone() {
        Some(awaiting) if awaiting.deadline.is_some_and(|d| d <= now) => {
            planner.work.awaiting = None;
            planner.time_out(&awaiting);
            None
        }
        running => running,
    };
    if planner.work.buffered {
        // A buffered occurrence fires once its wait is over; what came due meanwhile is
        // skipped.
        planner.skip(SkipReason::Overlap, due.span(&schedule, 1..due.len()));
        if running.is_none() {
            planner.work.buffered = false;
            return fire(planner, due.first(), false, 0);
        }
        // Only the buffered one is left.
        due = due.first_only();
    }
    // Catch-up: more than one occurrence is due, the first ones were missed.
    let missed = due.many();
    match policy.and_then(|p| p.catch_up) {
        Some(CatchUp::Skip) if missed => {
            planner.skip(SkipReason::CatchUp, due.all(&schedule));
            return planner.settle_at(after_due);
        }
        Some(CatchUp::All) => {
            // The latest `catchUpLimit` fire; the earlier ones are skipped.
            let over = due.len().saturating_sub(catch_up_limit);
            planner.skip(SkipReason::CatchUp, due.span(&schedule, 0..over));
            due = due.from(over);
        }
        // `once` (and no policy): the first fires; the rest are skipped when it settles.
        _ => {}
    }
    let Some(awaiting) = running else {
        return fire(planner, due.first(), missed, 0);
    };
    match overlap {
        Overlap::Allow => fire(planner, due.first(), missed, 0),
        Overlap::Skip => {
            planner.skip(SkipReason::Overlap, due.all(&schedule));
            planner.settle_at(after_due)
        }
        Overlap::BufferOne => {
            // The latest due one waits (one buffered already keeps waiting); earlier ones are
            // skipped.
            let waits = due.last();
            planner.skip(SkipReason::Overlap, due.span(&schedule, 0..due.len() - 1));
            let due_at = planner.fire_time(waits);
            if !planner.work.buffered {
                planner.work.buffered = true;
                planner.work.counts.buffered = planner.work.counts.buffered.saturating_add(1);
                planner.before.push(Change::Buffered { due_at });
            }
            planner.work.nominal = policy.and_then(|p| p.jitter).map(|_| waits);
            // Claimable again when the previous one times out; its completion makes it
            // claimable at once.
            let available_at = awaiting.deadline.unwrap_or(Timestamp::MAX).max(due_at);
            Plan::Settle(Step {
                state: TimerState::Scheduled,
                due_at,
                available_at,
                fired: false,
                work: planner.work.stored(),
                changes: planner.before,
            })
        }
    }
}

fn fire(mut planner: Planner<'_>, nominal: Timestamp, caught_up: bool, refire: u32) -> Plan {
    if caught_up {
        planner.work.counts.caught_up = planner.work.counts.caught_up.saturating_add(1);
    }
    Plan::Fire(Fire {
        due_at: planner.fire_time(nominal),
        nominal,
        refire,
        caught_up,
        // Skips after the fired one (followers of a buffered occurrence) are decided too.
        accounted_until: planner.skipped_until.map_or(nominal, |s| s.max(nominal)),
        before: planner.before,
        work: planner.work,
    })
}

/// A one-shot timer: its first fire, or, when its work timed out, a fire again (or giving up).
fn plan_one_shot(mut planner: Planner<'_>, max_attempts: u32) -> Plan {
    let claim = planner.claim;
    let Some(mut awaiting) = planner.work.awaiting.clone() else {
        return fire(planner, claim.due_at, false, 0);
    };
    if claim
        .policy
        .as_ref()
        .is_none_or(|p| p.completion_timeout.is_none())
    {
        // Sent again without a completionTimeout while its work ran: no deadline is waited
        // for, so nothing fires again. Reached (it fired), still taking the completion.
        awaiting.deadline = None;
        planner.work.awaiting = Some(awaiting);
        return Plan::Settle(Step {
            state: TimerState::Reached,
            due_at: claim.due_at,
            available_at: claim.due_at,
            fired: false,
            work: planner.work.stored(),
            changes: planner.before,
        });
    }
    if let Some(deadline) = awaiting.deadline.filter(|d| *d > planner.now) {
        // Claimable before its deadline again (a resume, the same ScheduleTimer again): its
        // work still runs, so it waits for the deadline without a fire.
        return Plan::Settle(Step {
            state: TimerState::Scheduled,
            due_at: claim.due_at,
            available_at: deadline,
            fired: false,
            work: planner.work.stored(),
            changes: planner.before,
        });
    }
    planner.time_out(&awaiting);
    let fires = awaiting.refires.saturating_add(1);
    if max_attempts > 0 && fires >= max_attempts {
        let timeout = claim
            .policy
            .as_ref()
            .and_then(|p| p.completion_timeout)
            .unwrap_or_default();
        return Plan::GiveUp {
            error: format!(
                "the work did not complete within its completionTimeout of {} after any of \
                 {fires} fires (engine.max_attempts = {max_attempts})",
                humantime::format_duration(timeout)
            ),
        };
    }
    fire(planner, claim.due_at, false, fires)
}

/// The settlement of a planned fire that the broker confirmed at `at`, fired by `owner`; with
/// `answer`, how the destination answered a call (an HTTP target), kept in its history.
pub fn fired(
    claim: &ClaimedTimer,
    fire: &Fire,
    at: Timestamp,
    owner: &str,
    answer: Option<String>,
) -> Settlement {
    let policy = claim.policy.as_ref();
    let mut work = fire.work.clone();
    let mut changes = fire.before.clone();
    let recurring = claim.recurrence.is_some();
    let occurrence = if recurring {
        claim.occurrences.saturating_add(1)
    } else {
        1
    };
    changes.push(Change::Fired {
        due_at: fire.due_at,
        lateness_ms: u64::try_from(at.duration_since(fire.due_at).as_millis()).unwrap_or(u64::MAX),
        instance: owner.to_owned(),
        occurrence: recurring.then_some(occurrence),
        caught_up: fire.caught_up,
        refire: (fire.refire > 0).then_some(fire.refire),
        answer: answer.clone(),
    });
    let tracked = policy.is_some_and(Policy::tracks_completion);
    if !tracked {
        // Not waited for (a policy sent again without it): an older fire's wait is over too.
        work.awaiting = None;
    } else {
        work.awaiting = Some(Awaiting {
            occurrence,
            due_at: fire.due_at,
            fired_at: at,
            deadline: policy
                .and_then(|p| p.completion_timeout)
                .map(|t| at.saturating_add(t)),
            refires: fire.refire,
        });
    }
    let Some(schedule) = claim.recurrence.as_ref().and_then(|r| r.schedule().ok()) else {
        // A one-shot timer: waiting for its work until the deadline (then fired again), or
        // done.
        let deadline = work.awaiting.as_ref().and_then(|a| a.deadline);
        return match deadline {
            Some(deadline) => Settlement::Step(Step {
                state: TimerState::Scheduled,
                due_at: claim.due_at,
                available_at: deadline.max(claim.due_at),
                fired: true,
                work: work.stored(),
                changes,
            }),
            None if policy.is_none() && claim.work.is_none() && answer.is_none() => {
                Settlement::Reached
            }
            None => Settlement::Step(Step {
                state: TimerState::Reached,
                due_at: claim.due_at,
                available_at: claim.due_at,
                fired: true,
                work: work.stored(),
                changes,
            }),
        };
    };
    let count = claim.occurrences.saturating_add(1);
    let catch_all = policy.and_then(|p| p.catch_up) == Some(CatchUp::All);
    let next = if catch_all {
        // The next missed one fires next (the plan applies the limit).
        schedule.next(fire.accounted_until, count)
    } else {
        // What came due while this one fired is skipped (catch-up `once`).
        let fire_time = |n: Timestamp| fire_time(&claim.key, n, policy);
        match schedule.next(fire.accounted_until, count) {
            Some(n) if fire_time(n) <= at => {
                let due = Due::of(&schedule, n, at, fire_time, 1);
                changes.extend(self::skipped(
                    &claim.key,
                    policy,
                    &mut work,
                    SkipReason::CatchUp,
                    due.all(&schedule),
                ));
                due.next
                    .filter(|_| schedule.next(due.last(), count).is_some())
            }
            next => next,
        }
    };
    // Without a policy, work or anything to record but the fire itself, the store writes it
    // as a plain Reached or Next.
    let simple = policy.is_none() && claim.work.is_none() && changes.len() == 1 && answer.is_none();
    match next {
        Some(next) if simple => Settlement::Next(next),
        None if simple => Settlement::Reached,
        Some(next) => {
            work.nominal = policy.and_then(|p| p.jitter).map(|_| next);
            let due_at = fire_time(&claim.key, next, policy);
            Settlement::Step(Step {
                state: TimerState::Scheduled,
                due_at,
                available_at: due_at,
                fired: true,
                work: work.stored(),
                changes,
            })
        }
        None => Settlement::Step(Step {
            state: TimerState::Reached,
            due_at: claim.due_at,
            available_at: claim.due_at,
            fired: true,
            work: work.stored(),
            changes,
        }),
    }
}

#[cfg(test)]
mod tests;
