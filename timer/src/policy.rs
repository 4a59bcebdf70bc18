//! What a timer does around its fires: completion, overlap, catch-up and jitter.
//!
//! A `ScheduleTimer` may carry a [`Policy`]; the store keeps it beside the timer, with the
//! [`Work`] the engine records about the timer's fires (which occurrence awaits its
//! completion, whether one is buffered, counts). Both are plain data; the decisions are the
//! pure functions of this module, so every store behaves alike and the engine tests drive them
//! with a manual clock:
//! - [`plan`]: for a claimed timer at `now`, fire which occurrence (and record what was
//!   skipped or timed out before it), or settle it without a fire (skipped, buffered), or give
//!   it up (a one-shot timer whose work never completed).
//! - [`fired`]: the settlement of a planned fire once the broker confirmed it.
//! - [`complete`]: what a `TimerCompleted` does to the timer as stored.
//!
//! A timer without a policy and without work takes the engine's fast path (`Settlement::Reached`
//! / `Next`) unless it missed occurrences, which are then recorded as skipped.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::control::Change;
use crate::model::{ClaimedTimer, Timer, TimerKey, TimerState, Timestamp};
use crate::recurrence::{Schedule, MAX_COUNTED_SKIPS};
use crate::store::{Settlement, Step};

/// The `completionTimeout` of a series with `overlap` `skip` or `bufferOne` that gives none.
pub const DEFAULT_COMPLETION_TIMEOUT: Duration = Duration::from_secs(3600);
/// The `catchUpLimit` of `catchUp: all` that gives none.
pub const DEFAULT_CATCH_UP_LIMIT: u32 = 10;
/// The largest `catchUpLimit` accepted.
pub const MAX_CATCH_UP_LIMIT: u32 = 10_000;
/// How many coming occurrences `jitter` is checked against: it must be shorter than the
/// shortest gap between two of them, so occurrences keep their order.
pub const JITTER_CHECKED_OCCURRENCES: usize = 100;

/// What a recurring timer does with an occurrence that comes due while the previous one's work
/// has not completed (`overlap`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Overlap {
    /// It fires anyway (the behaviour without a policy).
    #[default]
    Allow,
    /// It is skipped, recorded and counted.
    Skip,
    /// It waits, at most one at a time, and fires as soon as the previous one completes (or
    /// its `completionTimeout` runs out); others due meanwhile are skipped.
    BufferOne,
}

impl Overlap {
    pub const ALL: [Overlap; 3] = [Overlap::Allow, Overlap::Skip, Overlap::BufferOne];

    pub fn as_str(self) -> &'static str {
        match self {
            Overlap::Allow => "allow",
            Overlap::Skip => "skip",
            Overlap::BufferOne => "bufferOne",
        }
    }
}

/// What a series does with occurrences it missed (the service down, the timer paused, a
/// publish retried): `catchUp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum CatchUp {
    /// The first missed occurrence fires late, once; the others are skipped.
    Once,
    /// Missed occurrences are skipped; the series goes on with the first one after now.
    Skip,
    /// Each missed occurrence fires, one after the other, at most `catchUpLimit` of them (the
    /// latest); older ones are skipped.
    All,
}

impl CatchUp {
    pub const ALL: [CatchUp; 3] = [CatchUp::Once, CatchUp::Skip, CatchUp::All];

    pub fn as_str(self) -> &'static str {
        match self {
            CatchUp::Once => "once",
            CatchUp::Skip => "skip",
            CatchUp::All => "all",
        }
    }
}

/// Why an occurrence did not fire (the `reason` of a `skipped` history entry and of the
/// `timer_occurrences_skipped` metric).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    /// It fell into a pause.
    Pause,
    /// The previous occurrence's work had not completed (`overlap: skip`, or a second one
    /// while one is buffered).
    Overlap,
    /// It was missed and `catchUp` drops it.
    CatchUp,
    /// It was later than `catchUpWindow`.
    CatchUpWindow,
}

impl SkipReason {
    pub const ALL: [SkipReason; 4] = [
        SkipReason::Pause,
        SkipReason::Overlap,
        SkipReason::CatchUp,
        SkipReason::CatchUpWindow,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::Pause => "pause",
            SkipReason::Overlap => "overlap",
            SkipReason::CatchUp => "catch_up",
            SkipReason::CatchUpWindow => "catch_up_window",
        }
    }
}

/// How the work a consumer reports through `TimerCompleted` ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub enum Outcome {
    Succeeded,
    Failed,
}

/// A timer's policies, as a `ScheduleTimer` gives them (validated by the wire decoder; the
/// defaults filled in). Stored as JSON with durations in milliseconds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Policy {
    #[serde(default, skip_serializing_if = "is_allow")]
    pub overlap: Overlap,
    /// How long the work of a fire may take: then a series is free again (recorded as timed
    /// out), a one-shot timer fires again.
    #[serde(
        default,
        rename = "completionTimeoutMs",
        skip_serializing_if = "Option::is_none",
        with = "millis"
    )]
    pub completion_timeout: Option<Duration>,
    /// `None`: `once` after downtime, and a resume skips what fell into the pause.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub catch_up: Option<CatchUp>,
    /// With `catchUp: all`: at most this many missed occurrences fire.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub catch_up_limit: Option<u32>,
    /// An occurrence later than this is skipped instead of fired.
    #[serde(
        default,
        rename = "catchUpWindowMs",
        skip_serializing_if = "Option::is_none",
        with = "millis"
    )]
    pub catch_up_window: Option<Duration>,
    /// Each occurrence fires this much later at most: by an offset in [0, jitter) derived
    /// from the timer's key and the occurrence.
    #[serde(
        default,
        rename = "jitterMs",
        skip_serializing_if = "Option::is_none",
        with = "millis"
    )]
    pub jitter: Option<Duration>,
}

fn is_allow(o: &Overlap) -> bool {
    *o == Overlap::Allow
}

impl Policy {
    /// Whether the consumer's completions are waited for: `overlap` other than `allow`, or a
    /// `completionTimeout`.
    pub fn tracks_completion(&self) -> bool {
        self.overlap != Overlap::Allow || self.completion_timeout.is_some()
    }

    pub fn to_json(&self) -> String {
        // Enums, numbers and durations cannot fail to serialize.
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn from_json(text: &str) -> crate::Result<Self> {
        serde_json::from_str(text).map_err(|e| {
            crate::Error::internal(format!("stored policy {text:?} does not parse: {e}"))
        })
    }

    /// Where a paused series goes on when resumed: with `catchUp` `once` or `all` the missed
    /// occurrences are caught up as after downtime (its due time stays); otherwise they are
    /// skipped.
    pub fn catches_up_after_pause(policy: Option<&Policy>) -> bool {
        matches!(
            policy.and_then(|p| p.catch_up),
            Some(CatchUp::Once | CatchUp::All)
        )
    }
}

/// A fired occurrence whose work has not reported its completion.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Awaiting {
    /// The occurrence's number (1 for a one-shot timer).
    pub occurrence: u32,
    /// Its due time (the event's `dueAt`).
    pub due_at: Timestamp,
    /// When its event went out (the last time, for a one-shot timer fired again).
    pub fired_at: Timestamp,
    /// When it counts as timed out; `None` without a `completionTimeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<Timestamp>,
    /// How often a one-shot timer fired again because its work did not complete in time.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub refires: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Occurrences per what the policies did with them, since the timer was scheduled (or
/// rescheduled with another pattern); shown by `GET` of the timer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
// Named `WorkCounts` in the API document (its `Counts` are the status counts).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema), schema(as = WorkCounts))]
#[serde(rename_all = "camelCase", default)]
pub struct Counts {
    /// Skipped because the previous one's work had not completed.
    pub skipped_overlap: u64,
    /// Missed and dropped by `catchUp`.
    pub skipped_catch_up: u64,
    /// Later than `catchUpWindow`.
    pub skipped_window: u64,
    pub buffered: u64,
    /// Fires whose work did not complete within `completionTimeout`.
    pub timed_out: u64,
    /// Missed occurrences fired late.
    pub caught_up: u64,
    pub completed: u64,
}

/// What the engine records about a timer's fires, beside the timer (JSON).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Work {
    /// The fired occurrence waiting for its completion.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub awaiting: Option<Awaiting>,
    /// The occurrence at the timer's due time waits for `awaiting` to complete (`bufferOne`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub buffered: bool,
    /// The cron occurrence the due time stands for, when `jitter` moved it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nominal: Option<Timestamp>,
    /// The last occurrence whose completion arrived.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completed: Option<u32>,
    #[serde(skip_serializing_if = "Counts::is_empty")]
    pub counts: Counts,
}

impl Counts {
    fn is_empty(&self) -> bool {
        *self == Counts::default()
    }

    fn skipped(&mut self, reason: SkipReason, n: u64) {
        let count = match reason {
            SkipReason::Pause => return,
            SkipReason::Overlap => &mut self.skipped_overlap,
            SkipReason::CatchUp => &mut self.skipped_catch_up,
            SkipReason::CatchUpWindow => &mut self.skipped_window,
        };
        *count = count.saturating_add(n);
    }
}

impl Work {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn from_json(text: &str) -> crate::Result<Self> {
        serde_json::from_str(text).map_err(|e| {
            crate::Error::internal(format!("stored work {text:?} does not parse: {e}"))
        })
    }

    /// `None` for nothing recorded, so that a store keeps NULL.
    pub fn stored(self) -> Option<Work> {
        (self != Work::default()).then_some(self)
    }
}

/// The offset in [0, `jitter`) of the occurrence at `nominal` of `key`: the same for the same
/// occurrence, every time (a name hash of key and occurrence).
pub fn jitter_offset(key: &TimerKey, nominal: Timestamp, jitter: Duration) -> Duration {
    let span = u64::try_from(jitter.as_millis()).unwrap_or(u64::MAX);
    if span == 0 {
        return Duration::ZERO;
    }
    let name = format!(
        "{}\u{0}{}\u{0}{}",
        key.tenant_id,
        key.service_call_id,
        nominal.as_millis()
    );
    let hash = uuid::Uuid::new_v5(&JITTER_NAMESPACE, name.as_bytes()).into_bytes();
    let mut word = [0u8; 8];
    word.copy_from_slice(&hash[..8]);
    Duration::from_millis(u64::from_be_bytes(word) % span)
}

/// Namespace of the jitter hash (a fixed random UUID; never change it: fire times would move).
const JITTER_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x0b8e_52d1_7c4f_4a39_9e06_3f2a_61d8_c5b7);

/// When the occurrence at `nominal` fires under `policy`: `nominal` plus its jitter offset.
pub fn fire_time(key: &TimerKey, nominal: Timestamp, policy: Option<&Policy>) -> Timestamp {
    match policy.and_then(|p| p.jitter) {
        Some(jitter) => nominal.saturating_add(jitter_offset(key, nominal, jitter)),
        None => nominal,
    }
}

/// Whether `jitter` fits the series: shorter than the shortest gap between two of its next
/// [`JITTER_CHECKED_OCCURRENCES`] occurrences from `first` on. `Err` names that gap.
pub fn check_jitter(
    schedule: &Schedule,
    first: Timestamp,
    jitter: Duration,
) -> Result<(), Duration> {
    let mut shortest: Option<Duration> = None;
    let mut at = first;
    for _ in 1..JITTER_CHECKED_OCCURRENCES {
        let Some(next) = schedule.after(at) else {
            break;
        };
        let gap = next.duration_since(at);
        shortest = Some(shortest.map_or(gap, |s| s.min(gap)));
        at = next;
    }
    match shortest {
        Some(gap) if jitter >= gap => Err(gap),
        _ => Ok(()),
    }
}

/// Records `occurrences` (cron times, in order) of `key` as skipped for `reason`: counted in
/// `work`, and one `skipped` history entry with their fire times. `None` for none.
fn skipped(
    key: &TimerKey,
    policy: Option<&Policy>,
    work: &mut Work,
    reason: SkipReason,
    occurrences: &[Timestamp],
) -> Option<Change> {
    let (first, last) = (occurrences.first()?, occurrences.last()?);
    let count = occurrences.len() as u64;
    work.counts.skipped(reason, count);
    Some(Change::Skipped {
        count,
        first: fire_time(key, *first, policy),
        last: fire_time(key, *last, policy),
        at_least: count >= MAX_COUNTED_SKIPS,
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
    fn skip(&mut self, reason: SkipReason, occurrences: &[Timestamp]) {
        if let Some(last) = occurrences.last() {
            self.skipped_until = self.skipped_until.max(Some(*last));
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
    let fired = claim.occurrences;
    // The occurrences due by now, from the claimed one on (at most MAX_COUNTED_SKIPS).
    let mut due = vec![nominal];
    let mut at = nominal;
    while due.len() < MAX_COUNTED_SKIPS as usize {
        match schedule.next(at, fired.saturating_add(due.len() as u32)) {
            Some(next) if planner.fire_time(next) <= now => {
                due.push(next);
                at = next;
            }
            _ => break,
        }
    }
    // The first occurrence not due: where the series goes on when nothing due fires.
    let after_due = schedule.next(due[due.len() - 1], fired);
    // Later than the window: skipped.
    if let Some(window) = policy.and_then(|p| p.catch_up_window) {
        let late = due
            .iter()
            .take_while(|n| now.duration_since(planner.fire_time(**n)) > window)
            .count();
        let skipped: Vec<Timestamp> = due.drain(..late).collect();
        planner.skip(SkipReason::CatchUpWindow, &skipped);
        // A buffered occurrence is the first due one: dropped with the others.
        planner.work.buffered &= late == 0;
    }
    if due.is_empty() {
        return planner.settle_at(after_due);
    }
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
        let rest: Vec<Timestamp> = due.drain(1..).collect();
        planner.skip(SkipReason::Overlap, &rest);
        if running.is_none() {
            planner.work.buffered = false;
            return fire(planner, due[0], false, 0);
        }
    }
    // Catch-up: more than one occurrence is due, the first ones were missed.
    let missed = due.len() > 1;
    match policy.and_then(|p| p.catch_up) {
        Some(CatchUp::Skip) if missed => {
            let skipped = std::mem::take(&mut due);
            planner.skip(SkipReason::CatchUp, &skipped);
            return planner.settle_at(after_due);
        }
        Some(CatchUp::All) => {
            let limit = policy
                .and_then(|p| p.catch_up_limit)
                .unwrap_or(DEFAULT_CATCH_UP_LIMIT)
                .max(1) as usize;
            let over = due.len().saturating_sub(limit);
            let skipped: Vec<Timestamp> = due.drain(..over).collect();
            planner.skip(SkipReason::CatchUp, &skipped);
        }
        // `once` (and no policy): the first fires; the rest are skipped when it settles.
        _ => {}
    }
    let Some(awaiting) = running else {
        return fire(planner, due[0], missed, 0);
    };
    match overlap {
        Overlap::Allow => fire(planner, due[0], missed, 0),
        Overlap::Skip => {
            let skipped = std::mem::take(&mut due);
            planner.skip(SkipReason::Overlap, &skipped);
            planner.settle_at(after_due)
        }
        Overlap::BufferOne => {
            // The latest due one waits (one buffered already keeps waiting); earlier ones are
            // skipped.
            let waits = due[due.len() - 1];
            let earlier: Vec<Timestamp> = due[..due.len() - 1].to_vec();
            planner.skip(SkipReason::Overlap, &earlier);
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
    let Some(awaiting) = planner.work.awaiting.clone() else {
        return fire(planner, claim.due_at, false, 0);
    };
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

/// The settlement of a planned fire that the broker confirmed at `at`, fired by `owner`.
pub fn fired(claim: &ClaimedTimer, fire: &Fire, at: Timestamp, owner: &str) -> Settlement {
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
    });
    let tracked = policy.is_some_and(Policy::tracks_completion);
    if tracked {
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
            None if policy.is_none() && claim.work.is_none() => Settlement::Reached,
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
        let mut skipped = Vec::new();
        let mut next = schedule.next(fire.accounted_until, count);
        while let Some(n) = next.filter(|n| fire_time(&claim.key, *n, policy) <= at) {
            if skipped.len() as u64 >= MAX_COUNTED_SKIPS {
                next = schedule.next(at, count);
                break;
            }
            skipped.push(n);
            next = schedule.next(n, count);
        }
        changes.extend(self::skipped(
            &claim.key,
            policy,
            &mut work,
            SkipReason::CatchUp,
            &skipped,
        ));
        next
    };
    let simple = policy.is_none() && claim.work.is_none() && changes.len() == 1;
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

/// A `TimerCompleted` for occurrence `occurrence` (`None`: the one-shot timer's, or the last
/// fired one) with `outcome` and `message`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub occurrence: Option<u32>,
    pub outcome: Option<Outcome>,
    pub message: Option<String>,
}

/// What a completion found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CompletionResult {
    /// The awaited occurrence completed (a buffered one, or nothing, fires next).
    Completed,
    /// It completed after its `completionTimeout` had already freed the series (recorded).
    Late,
    /// Its completion had arrived before: nothing changed.
    Duplicate,
    /// The timer never fired that occurrence: nothing changed.
    UnknownOccurrence,
    /// The event of that occurrence is being published right now: try again once it settled.
    Firing,
}

impl CompletionResult {
    pub const ALL: [CompletionResult; 5] = [
        CompletionResult::Completed,
        CompletionResult::Late,
        CompletionResult::Duplicate,
        CompletionResult::UnknownOccurrence,
        CompletionResult::Firing,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CompletionResult::Completed => "completed",
            CompletionResult::Late => "late",
            CompletionResult::Duplicate => "duplicate",
            CompletionResult::UnknownOccurrence => "unknown_occurrence",
            CompletionResult::Firing => "firing",
        }
    }
}

/// What a completion writes: the timer's new state, due time (= when it is claimable),
/// whether it finished, its work and its history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completed {
    pub result: CompletionResult,
    pub state: TimerState,
    pub due_at: Timestamp,
    pub finished: bool,
    pub work: Option<Work>,
    pub change: Option<Change>,
}

/// What `completion` at `now` does to `timer` (a live lease holds it when `firing`).
pub fn complete(timer: &Timer, firing: bool, completion: &Completion, now: Timestamp) -> Completed {
    let recurring = timer.recurrence.is_some();
    let latest = if recurring { timer.occurrences } else { 1 };
    let mut work = timer.work.clone().unwrap_or_default();
    let occurrence = completion.occurrence.unwrap_or(latest);
    let unchanged = |result| Completed {
        result,
        state: timer.state,
        due_at: timer.due_at,
        finished: false,
        work: None,
        change: None,
    };
    if firing {
        // An event of the timer is going out: the fire settles first (it may be the very
        // occurrence completed here, and its settlement would wait for it again).
        return unchanged(CompletionResult::Firing);
    }
    let awaited = work
        .awaiting
        .as_ref()
        .filter(|a| a.occurrence == occurrence)
        .cloned();
    let fired = if recurring {
        occurrence >= 1 && occurrence <= timer.occurrences
    } else {
        occurrence == 1 && (timer.reached_at.is_some() || awaited.is_some())
    };
    if !fired && awaited.is_none() {
        return unchanged(CompletionResult::UnknownOccurrence);
    }
    if work.completed.is_some_and(|c| c >= occurrence) && awaited.is_none() {
        return unchanged(CompletionResult::Duplicate);
    }
    let (result, fired_at) = match &awaited {
        Some(a) => (
            if a.deadline.is_some_and(|d| d < now) {
                CompletionResult::Late
            } else {
                CompletionResult::Completed
            },
            Some(a.fired_at),
        ),
        // Not waited for: a timer that waits for nothing or, with `overlap: allow`, only for
        // its latest fire (its duration is known for the latest fire only), or one whose
        // timeout freed it already.
        None => (
            if timer
                .policy
                .as_ref()
                .is_some_and(|p| p.overlap != Overlap::Allow)
            {
                CompletionResult::Late
            } else {
                CompletionResult::Completed
            },
            (occurrence == latest).then_some(timer.reached_at).flatten(),
        ),
    };
    work.completed = Some(work.completed.map_or(occurrence, |c| c.max(occurrence)));
    work.counts.completed = work.counts.completed.saturating_add(1);
    let change = Change::Completed {
        occurrence: recurring.then_some(occurrence),
        outcome: completion.outcome,
        message: completion.message.clone(),
        duration_ms: fired_at
            .map(|f| u64::try_from(now.duration_since(f).as_millis()).unwrap_or(u64::MAX)),
        late: result == CompletionResult::Late,
    };
    let mut state = timer.state;
    let mut finished = false;
    if awaited.is_some() {
        work.awaiting = None;
        if !recurring && matches!(timer.state, TimerState::Scheduled | TimerState::Paused) {
            // The one-shot timer's work is done (also when it was paused meanwhile: nothing
            // is left to fire).
            state = TimerState::Reached;
            finished = true;
        }
        // A buffered occurrence is due already: claimable at once.
        work.buffered &= timer.state == TimerState::Scheduled;
    }
    Completed {
        result,
        state,
        due_at: timer.due_at,
        finished,
        work: Some(work),
        change: Some(change),
    }
}

/// Durations as whole milliseconds.
mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_millis))
    }
}
