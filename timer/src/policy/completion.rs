//! What a `TimerCompleted` does to the timer as stored ([`complete`]).

use serde::Serialize;

use super::{Outcome, Overlap, Work};
use crate::control::Change;
use crate::model::{Timer, TimerState, Timestamp};

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
