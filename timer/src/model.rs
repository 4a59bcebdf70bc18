//! Domain types: timers, their keys and states, and time in UTC milliseconds.

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, TimeZone, Utc};
use serde::{Deserialize, Serialize};

pub use crate::outbound::{Message, Target};
pub use crate::policy::{Policy, Work};
pub use crate::recurrence::Recurrence;
pub use crate::trace::TraceContext;

/// A point in time: UTC milliseconds since the Unix epoch. Every store keeps time in this form,
/// so comparisons are exact to the millisecond whatever offset a command was written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Timestamp(i64);

impl Timestamp {
    /// The latest instant the service accepts (year 9999): RFC 3339 can still print it.
    pub const MAX: Timestamp = Timestamp(253_402_300_799_999);
    pub const EPOCH: Timestamp = Timestamp(0);

    pub const fn from_millis(ms: i64) -> Self {
        Timestamp(ms)
    }

    pub const fn as_millis(self) -> i64 {
        self.0
    }

    pub fn from_datetime<Tz: TimeZone>(at: &DateTime<Tz>) -> Self {
        Timestamp(at.timestamp_millis())
    }

    pub fn to_datetime(self) -> DateTime<Utc> {
        DateTime::<Utc>::from_timestamp_millis(self.0).unwrap_or(DateTime::<Utc>::MAX_UTC)
    }

    /// RFC 3339 in UTC with milliseconds, e.g. `2026-11-23T12:00:00.250Z`.
    pub fn to_rfc3339(self) -> String {
        self.to_datetime()
            .to_rfc3339_opts(SecondsFormat::Millis, true)
    }

    pub fn saturating_add(self, d: Duration) -> Self {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Timestamp(self.0.saturating_add(ms))
    }

    pub fn saturating_sub(self, d: Duration) -> Self {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Timestamp(self.0.saturating_sub(ms))
    }

    /// How far `self` lies after `earlier`; zero when it does not.
    pub fn duration_since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(u64::try_from(self.0.saturating_sub(earlier.0)).unwrap_or(0))
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_rfc3339())
    }
}

/// The identity of a timer: one per `(tenantId, serviceCallId)`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TimerKey {
    pub tenant_id: String,
    pub service_call_id: String,
}

impl TimerKey {
    pub fn new(tenant_id: impl Into<String>, service_call_id: impl Into<String>) -> Self {
        TimerKey {
            tenant_id: tenant_id.into(),
            service_call_id: service_call_id.into(),
        }
    }
}

impl fmt::Display for TimerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.tenant_id, self.service_call_id)
    }
}

/// The states a user sees. A claim is a lease on a `Scheduled` row, not a state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TimerState {
    Scheduled,
    Reached,
    Cancelled,
    /// Publishing failed `engine.max_attempts` times; a `TimerFailed` dead letter went out.
    Failed,
    /// Held by an operator: it does not fire until resumed. A recurring series keeps its
    /// cadence; the occurrences that fall into the pause are skipped.
    Paused,
}

impl TimerState {
    /// The stable small integer stores keep on disk.
    pub const fn code(self) -> i64 {
        match self {
            TimerState::Scheduled => 0,
            TimerState::Reached => 1,
            TimerState::Cancelled => 2,
            TimerState::Failed => 3,
            TimerState::Paused => 4,
        }
    }

    pub fn from_code(code: i64) -> Option<Self> {
        match code {
            0 => Some(TimerState::Scheduled),
            1 => Some(TimerState::Reached),
            2 => Some(TimerState::Cancelled),
            3 => Some(TimerState::Failed),
            4 => Some(TimerState::Paused),
            _ => None,
        }
    }

    /// Every state, in code order.
    pub const ALL: [TimerState; 5] = [
        TimerState::Scheduled,
        TimerState::Reached,
        TimerState::Cancelled,
        TimerState::Failed,
        TimerState::Paused,
    ];

    /// Whether the timer is done for good (Reached, Cancelled, Failed): only these are purged.
    pub const fn is_finished(self) -> bool {
        matches!(
            self,
            TimerState::Reached | TimerState::Cancelled | TimerState::Failed
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TimerState::Scheduled => "Scheduled",
            TimerState::Reached => "Reached",
            TimerState::Cancelled => "Cancelled",
            TimerState::Failed => "Failed",
            TimerState::Paused => "Paused",
        }
    }
}

/// A validated request to schedule (or reschedule) a timer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewTimer {
    pub key: TimerKey,
    pub due_at: Timestamp,
    pub correlation_id: Option<String>,
    /// Opaque JSON text given by the caller, echoed back in the event.
    pub payload: Option<String>,
    /// Set for a recurring timer; `due_at` is then its first occurrence.
    pub recurrence: Option<Recurrence>,
    /// Completion, overlap, catch-up and jitter, when the command gave any.
    pub policy: Option<Policy>,
    /// What the engine records from the start: the first occurrence of a jittered series.
    pub work: Option<Work>,
    /// Where its fires go in place of the events destination.
    pub target: Option<Target>,
    /// What its fires send in place of the `DueTimeReached` envelope.
    pub message: Option<Message>,
    /// The trace it was scheduled in: every fire carries it (`crate::trace`).
    pub trace: Option<TraceContext>,
}

impl NewTimer {
    /// A one-shot timer of `key` due at `due_at`, with nothing else set (no payload,
    /// correlation id, recurrence, policy, target, message or trace).
    pub fn new(key: TimerKey, due_at: Timestamp) -> Self {
        NewTimer {
            key,
            due_at,
            correlation_id: None,
            payload: None,
            recurrence: None,
            policy: None,
            work: None,
            target: None,
            message: None,
            trace: None,
        }
    }
}

/// A timer as a store holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timer {
    pub key: TimerKey,
    pub due_at: Timestamp,
    pub state: TimerState,
    pub registered_at: Timestamp,
    pub reached_at: Option<Timestamp>,
    pub correlation_id: Option<String>,
    pub payload: Option<String>,
    /// Failed publish attempts so far.
    pub attempts: u32,
    pub last_error: Option<String>,
    /// Owner of the live or last lease, if any.
    pub lease_owner: Option<String>,
    /// When the row may next be claimed (lease expiry or retry time); at or after `due_at`.
    pub available_at: Timestamp,
    /// Set for a recurring timer; `due_at` is then its next occurrence.
    pub recurrence: Option<Recurrence>,
    /// Occurrences of a recurring timer that fired so far.
    pub occurrences: u32,
    pub policy: Option<Policy>,
    /// What the engine recorded about its fires (an occurrence awaiting its completion, ...).
    pub work: Option<Work>,
    /// Where its fires go in place of the events destination.
    pub target: Option<Target>,
    /// What its fires send in place of the `DueTimeReached` envelope.
    pub message: Option<Message>,
    /// The trace it was scheduled in: every fire carries it (`crate::trace`).
    pub trace: Option<TraceContext>,
}

impl Timer {
    /// The row a first schedule of `new` writes at `now`: Scheduled, claimable at its due time,
    /// no attempt, lease or occurrence yet.
    pub fn registered(new: NewTimer, now: Timestamp) -> Self {
        Timer {
            key: new.key,
            due_at: new.due_at,
            state: TimerState::Scheduled,
            registered_at: now,
            reached_at: None,
            correlation_id: new.correlation_id,
            payload: new.payload,
            attempts: 0,
            last_error: None,
            lease_owner: None,
            available_at: new.due_at,
            recurrence: new.recurrence,
            occurrences: 0,
            policy: new.policy,
            work: new.work,
            target: new.target,
            message: new.message,
            trace: new.trace,
        }
    }

    /// Scheduled after a failed publish, waiting for its next attempt.
    pub fn is_retrying(&self) -> bool {
        self.state == TimerState::Scheduled && self.attempts > 0
    }
}

/// A row leased to this instance by [`crate::Store::claim_due`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedTimer {
    pub key: TimerKey,
    pub due_at: Timestamp,
    pub registered_at: Timestamp,
    pub correlation_id: Option<String>,
    pub payload: Option<String>,
    pub attempts: u32,
    /// Bumped by every reschedule: `mark_reached` only marks the revision that was fired.
    pub revision: i64,
    pub recurrence: Option<Recurrence>,
    /// Occurrences of a recurring timer that fired before this one.
    pub occurrences: u32,
    pub policy: Option<Policy>,
    pub work: Option<Work>,
    pub target: Option<Target>,
    pub message: Option<Message>,
    pub trace: Option<TraceContext>,
}

impl ClaimedTimer {
    /// The trace id of its context, for log lines; empty without one.
    pub fn trace_id(&self) -> &str {
        self.trace.as_ref().map_or("", TraceContext::trace_id)
    }
}

/// What `schedule` did with one timer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum ScheduleOutcome {
    /// A new timer.
    Created,
    /// An existing Scheduled or Paused timer got the new due time (reschedule); a Paused one
    /// stays Paused.
    Updated,
    /// The timer already fired; nothing changed.
    AlreadyReached,
    /// The timer was cancelled; nothing changed.
    AlreadyCancelled,
    /// The timer failed; nothing changed.
    AlreadyFailed,
}

/// What `cancel` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum CancelOutcome {
    Cancelled,
    AlreadyReached,
    AlreadyCancelled,
    AlreadyFailed,
    /// An instance holds a live lease on it: its event is being published right now. Nothing
    /// changed; the fire completes (or, if it fails, the timer can be cancelled afterwards).
    Firing,
    NotFound,
}

/// What a control action ([`crate::control::Action`]) did with one timer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ControlOutcome {
    Paused,
    Resumed,
    Cancelled,
    /// A Failed timer is Scheduled again.
    Retried,
    /// Retry of a timer that is not Failed (Scheduled or Paused).
    NotFailed,
    /// Pause of a timer that is Paused already.
    AlreadyPaused,
    /// Resume of a timer that is Scheduled (not paused).
    NotPaused,
    AlreadyReached,
    AlreadyCancelled,
    AlreadyFailed,
    /// An instance holds a live lease on it (its event is being published): nothing changed;
    /// try again once the fire settled.
    Firing,
    NotFound,
    /// A completion for the awaited occurrence (or, without a policy, the latest one).
    Completed,
    /// A completion that came after its `completionTimeout` or after the series moved on:
    /// recorded, nothing else changed.
    CompletedLate,
    /// A completion that arrived before: nothing changed.
    AlreadyCompleted,
    /// A completion for an occurrence the timer never fired: nothing changed.
    UnknownOccurrence,
}

impl ControlOutcome {
    /// Whether the action changed the timer.
    pub const fn changed(self) -> bool {
        matches!(
            self,
            ControlOutcome::Paused
                | ControlOutcome::Resumed
                | ControlOutcome::Cancelled
                | ControlOutcome::Retried
                | ControlOutcome::Completed
                | ControlOutcome::CompletedLate
        )
    }

    /// The outcome for a timer in a state the action leaves alone.
    pub const fn finished(state: TimerState) -> Option<Self> {
        match state {
            TimerState::Reached => Some(ControlOutcome::AlreadyReached),
            TimerState::Cancelled => Some(ControlOutcome::AlreadyCancelled),
            TimerState::Failed => Some(ControlOutcome::AlreadyFailed),
            TimerState::Scheduled | TimerState::Paused => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ControlOutcome::Paused => "paused",
            ControlOutcome::Resumed => "resumed",
            ControlOutcome::Cancelled => "cancelled",
            ControlOutcome::Retried => "retried",
            ControlOutcome::NotFailed => "not_failed",
            ControlOutcome::AlreadyPaused => "already_paused",
            ControlOutcome::NotPaused => "not_paused",
            ControlOutcome::AlreadyReached => "already_reached",
            ControlOutcome::AlreadyCancelled => "already_cancelled",
            ControlOutcome::AlreadyFailed => "already_failed",
            ControlOutcome::Firing => "firing",
            ControlOutcome::NotFound => "not_found",
            ControlOutcome::Completed => "completed",
            ControlOutcome::CompletedLate => "completed_late",
            ControlOutcome::AlreadyCompleted => "already_completed",
            ControlOutcome::UnknownOccurrence => "unknown_occurrence",
        }
    }
}

impl From<CancelOutcome> for ControlOutcome {
    fn from(o: CancelOutcome) -> Self {
        match o {
            CancelOutcome::Cancelled => ControlOutcome::Cancelled,
            CancelOutcome::AlreadyReached => ControlOutcome::AlreadyReached,
            CancelOutcome::AlreadyCancelled => ControlOutcome::AlreadyCancelled,
            CancelOutcome::AlreadyFailed => ControlOutcome::AlreadyFailed,
            CancelOutcome::Firing => ControlOutcome::Firing,
            CancelOutcome::NotFound => ControlOutcome::NotFound,
        }
    }
}

impl From<ControlOutcome> for CancelOutcome {
    /// A cancel applied as a control action, as `Store::cancel` says it.
    fn from(o: ControlOutcome) -> Self {
        match o {
            ControlOutcome::AlreadyReached => CancelOutcome::AlreadyReached,
            ControlOutcome::AlreadyCancelled => CancelOutcome::AlreadyCancelled,
            ControlOutcome::AlreadyFailed => CancelOutcome::AlreadyFailed,
            ControlOutcome::Firing => CancelOutcome::Firing,
            ControlOutcome::NotFound => CancelOutcome::NotFound,
            _ => CancelOutcome::Cancelled,
        }
    }
}

/// A lease on claimed rows: who holds them and until when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub owner: String,
    pub until: Timestamp,
}

/// The rows a claim may take: every row claimable at `now` (`available_at <= now`), and the
/// rows first due by `ahead` (`available_at = due_at <= ahead`: claimable at their own due
/// time, not a retry's, a lease's or a paced turn's later one), which the engine holds until
/// their due time. A claim at `now` alone takes `Due::at(now)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Due {
    pub now: Timestamp,
    pub ahead: Timestamp,
}

impl Due {
    /// What is claimable at `now`, nothing ahead.
    pub fn at(now: Timestamp) -> Self {
        Due { now, ahead: now }
    }

    /// What is claimable at `now`, and what is first due up to `ahead` later.
    pub fn ahead(now: Timestamp, ahead: std::time::Duration) -> Self {
        Due {
            now,
            ahead: now.saturating_add(ahead),
        }
    }

    /// Whether a Scheduled row with these times is in the window.
    pub fn takes(&self, available_at: Timestamp, due_at: Timestamp) -> bool {
        available_at <= self.now || (available_at == due_at && available_at <= self.ahead)
    }
}

impl From<Timestamp> for Due {
    fn from(now: Timestamp) -> Self {
        Due::at(now)
    }
}

#[cfg(test)]
impl ClaimedTimer {
    /// A one-shot claim of `key`, due at the epoch, with nothing else set: tests change what
    /// they need.
    pub(crate) fn for_tests(key: TimerKey) -> Self {
        ClaimedTimer {
            key,
            due_at: Timestamp::EPOCH,
            registered_at: Timestamp::EPOCH,
            correlation_id: None,
            payload: None,
            attempts: 0,
            revision: 0,
            recurrence: None,
            occurrences: 0,
            policy: None,
            work: None,
            target: None,
            message: None,
            trace: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_keeps_milliseconds_in_utc() {
        let t = Timestamp::from_millis(1_700_000_000_123);
        assert_eq!(t.to_rfc3339(), "2023-11-14T22:13:20.123Z");
        assert_eq!(Timestamp::MAX.to_rfc3339(), "9999-12-31T23:59:59.999Z");
    }

    #[test]
    fn arithmetic_saturates() {
        let t = Timestamp::from_millis(i64::MAX - 1);
        assert_eq!(
            t.saturating_add(Duration::from_secs(5)).as_millis(),
            i64::MAX
        );
        assert_eq!(
            Timestamp::from_millis(5).duration_since(Timestamp::from_millis(9)),
            Duration::ZERO
        );
    }

    #[test]
    fn state_codes_round_trip() {
        for s in TimerState::ALL {
            assert_eq!(TimerState::from_code(s.code()), Some(s));
        }
        assert_eq!(TimerState::from_code(7), None);
    }
}
