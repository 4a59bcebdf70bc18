//! The control plane's rules, shared by every store: what pausing, resuming and cancelling do
//! to a timer ([`transition`]), and what a timer's history records ([`Change`]). A store reads
//! the row, asks [`transition`], writes what it says and its changes in one transaction.

use serde::{Deserialize, Serialize};

use crate::model::{ClaimedTimer, ControlOutcome, Timer, TimerState, Timestamp, Work};
use crate::policy::{self, Completion, CompletionResult, Outcome, Policy, SkipReason};
use crate::recurrence::Skipped;
use crate::store::Settlement;

/// History entries kept per timer unless `engine.history_per_timer` says otherwise.
pub const DEFAULT_HISTORY: usize = 100;

/// A control action on a timer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Scheduled → Paused: it does not fire until resumed. The note goes into the history.
    Pause { note: Option<String> },
    /// Paused → Scheduled: a one-shot timer keeps its due time (fires at once when it passed);
    /// a series continues with its next occurrence at or after now, skipping the ones that fell
    /// into the pause, or with `catchUp` `once` or `all` keeps its due time and catches up.
    Resume,
    /// Scheduled or Paused → Cancelled.
    Cancel,
    /// Failed → Scheduled: published again at once, as if new (attempts back to 0, the last
    /// error cleared). It keeps its due time, so the lateness of the fire shows how long it
    /// was failed; a series goes on from the occurrence that failed.
    Retry,
    /// The work an occurrence's event triggered is done (`TimerCompleted`): what
    /// [`policy::complete`] says.
    Complete(Completion),
}

impl Action {
    /// `pause`, `resume`, `cancel`, `retry`: the action's name in the API and in metrics.
    pub fn as_str(&self) -> &'static str {
        match self {
            Action::Pause { .. } => "pause",
            Action::Resume => "resume",
            Action::Cancel => "cancel",
            Action::Retry => "retry",
            Action::Complete(_) => "complete",
        }
    }
}

/// One change in a timer's history. Serialized as JSON with a `type` tag, as the stores keep it
/// and the API shows it (`{"type":"fired","dueAt":"…","latenessMs":3,…}`).
// Each variant renames its own fields (`rename_all_fields` says the same once, but the OpenAPI
// derive does not read it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Change {
    /// The timer was created by a `ScheduleTimer` with this due time.
    #[serde(rename_all = "camelCase")]
    Created {
        #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
        #[serde(with = "rfc3339")]
        due_at: Timestamp,
    },
    /// A `ScheduleTimer` for the existing timer was applied; this is the due time it gave.
    #[serde(rename_all = "camelCase")]
    Rescheduled {
        #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
        #[serde(with = "rfc3339")]
        due_at: Timestamp,
    },
    #[serde(rename_all = "camelCase")]
    Paused {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        note: Option<String>,
    },
    /// Resumed; it is due at `dueAt` (absent when a series ended during the pause and
    /// finished with the resume).
    #[serde(rename_all = "camelCase")]
    Resumed {
        #[serde(
            default,
            skip_serializing_if = "Option::is_none",
            with = "rfc3339::option"
        )]
        #[cfg_attr(
            feature = "openapi",
            schema(value_type = Option<String>, format = DateTime)
        )]
        due_at: Option<Timestamp>,
    },
    /// Occurrences of a series that never fire: `count` of them (at least, when `atLeast`),
    /// the first and the last (their fire times), and why (`pause` when absent: entries written
    /// before the other reasons existed).
    #[serde(rename_all = "camelCase")]
    Skipped {
        count: u64,
        #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
        #[serde(with = "rfc3339")]
        first: Timestamp,
        #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
        #[serde(with = "rfc3339")]
        last: Timestamp,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        at_least: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<SkipReason>,
    },
    /// An occurrence due while the previous one's work ran waits for it (`overlap:
    /// bufferOne`); it fires when that completes or times out.
    #[serde(rename_all = "camelCase")]
    Buffered {
        #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
        #[serde(with = "rfc3339")]
        due_at: Timestamp,
    },
    /// The work of an occurrence fired at `firedAt` did not complete within the
    /// `completionTimeout`: the series is free again, a one-shot timer fires again.
    #[serde(rename_all = "camelCase")]
    TimedOut {
        occurrence: u32,
        #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
        #[serde(with = "rfc3339")]
        fired_at: Timestamp,
    },
    /// A `TimerCompleted` arrived: for `occurrence` (absent for a one-shot timer), how the work
    /// ended, and how long it took since the fire (when known). `late`: after its
    /// `completionTimeout`, or after the series moved on.
    #[serde(rename_all = "camelCase")]
    Completed {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        occurrence: Option<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        outcome: Option<Outcome>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        message: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        duration_ms: Option<u64>,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        late: bool,
    },
    /// An extra `DueTimeReached` with `"trigger": "manual"` went out; the schedule did not move.
    #[serde(rename_all = "camelCase")]
    Triggered {
        event_id: String,
    },
    /// Its `DueTimeReached` went out: for the occurrence due at `dueAt`, `latenessMs` after it,
    /// by `instance`.
    #[serde(rename_all = "camelCase")]
    Fired {
        #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
        #[serde(with = "rfc3339")]
        due_at: Timestamp,
        lateness_ms: u64,
        instance: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        occurrence: Option<u32>,
        /// It was missed and fired late, with later occurrences due behind it.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        caught_up: bool,
        /// A one-shot timer fired again because its work did not complete in time: the
        /// how-manyth time.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        refire: Option<u32>,
        /// How an HTTP target answered the call: `hooks.acme.com:443 answered 200 OK in 12 ms`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        answer: Option<String>,
    },
    /// A publish failed; it is retried.
    #[serde(rename_all = "camelCase")]
    PublishFailed {
        attempt: u32,
        error: String,
    },
    /// The last allowed publish failed: the timer became Failed and a `TimerFailed` went out.
    #[serde(rename_all = "camelCase")]
    GivenUp {
        attempts: u32,
        error: String,
    },
    Cancelled,
    /// A Failed timer was scheduled again by a `retry`.
    Retried,
}

impl Change {
    /// The JSON text stores keep.
    pub fn to_json(&self) -> String {
        // Strings, numbers and timestamps cannot fail to serialize.
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn from_json(text: &str) -> crate::Result<Self> {
        serde_json::from_str(text).map_err(|e| {
            crate::Error::internal(format!("a stored history entry is not readable: {text}"))
                .with_source(e)
        })
    }

    /// What settling `claim` as `settlement` by `owner` at `at` records; `None` for a lease
    /// given back without an error (nothing happened to the timer).
    pub fn of_settlement(
        claim: &ClaimedTimer,
        settlement: &Settlement,
        owner: &str,
        at: Timestamp,
    ) -> Option<Change> {
        let attempt = claim.attempts.saturating_add(1);
        match settlement {
            Settlement::Reached | Settlement::Next(_) => Some(Change::Fired {
                due_at: claim.due_at,
                lateness_ms: u64::try_from(at.duration_since(claim.due_at).as_millis())
                    .unwrap_or(u64::MAX),
                instance: owner.to_owned(),
                occurrence: claim
                    .recurrence
                    .as_ref()
                    .map(|_| claim.occurrences.saturating_add(1)),
                caught_up: false,
                refire: None,
                answer: None,
            }),
            Settlement::Failed(error) => Some(Change::GivenUp {
                attempts: attempt,
                error: error.clone(),
            }),
            Settlement::Retry {
                error: Some(error), ..
            } => Some(Change::PublishFailed {
                attempt,
                error: error.clone(),
            }),
            Settlement::Retry { error: None, .. } => None,
            // Its changes are spelled out: `Step::changes`.
            Settlement::Step(_) => None,
        }
    }
}

impl From<Skipped> for Change {
    fn from(s: Skipped) -> Self {
        Change::Skipped {
            count: s.count,
            first: s.first,
            last: s.last,
            at_least: s.at_least,
            reason: Some(SkipReason::Pause),
        }
    }
}

/// One entry of a timer's history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryEntry {
    /// Numbers the timer's changes from 1, in order; never reused while the timer exists.
    pub seq: u64,
    pub at: Timestamp,
    pub change: Change,
}

/// What a control action does to one timer: the outcome and, when it changes the timer, how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    pub outcome: ControlOutcome,
    /// `None` when nothing changes.
    pub write: Option<Write>,
}

/// The new state of a timer a control action changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    pub state: TimerState,
    /// Its due time, also when it becomes claimable (a resumed series moves on; otherwise
    /// unchanged). A changed due time bumps the revision.
    pub due_at: Timestamp,
    /// Set when the timer finishes here (Cancelled, or a series that ended during its pause);
    /// `None` keeps when it finished, if it had (a completion of a Reached timer), except that
    /// a timer Scheduled again is finished no more.
    pub finished_at: Option<Timestamp>,
    /// What its history records, in order.
    pub changes: Vec<Change>,
    /// Whether its publish attempts start again from 0 (and its last error is cleared).
    pub reset_attempts: bool,
    /// `Some(work)`: its work becomes this (`Some(None)`: nothing kept); `None`: unchanged.
    pub work: Option<Option<Work>>,
}

/// What `action` at `now` does to `timer`, which a live lease holds when `firing`.
pub fn transition(timer: &Timer, firing: bool, action: &Action, now: Timestamp) -> Transition {
    let unchanged = |outcome| Transition {
        outcome,
        write: None,
    };
    if let Action::Complete(completion) = action {
        return completed(policy::complete(timer, firing, completion, now), now);
    }
    if let (Action::Retry, TimerState::Failed) = (action, timer.state) {
        // A one-shot timer given up because its work never completed fires again as new: the
        // fire it waited for is forgotten (the counts stay).
        let work = timer
            .work
            .as_ref()
            .filter(|w| w.awaiting.is_some())
            .map(|w| {
                Work {
                    awaiting: None,
                    ..w.clone()
                }
                .stored()
            });
        return Transition {
            outcome: ControlOutcome::Retried,
            write: Some(Write {
                state: TimerState::Scheduled,
                due_at: timer.due_at,
                finished_at: None,
                changes: vec![Change::Retried],
                reset_attempts: true,
                work,
            }),
        };
    }
    if let Some(finished) = ControlOutcome::finished(timer.state) {
        return unchanged(finished);
    }
    let paused = timer.state == TimerState::Paused;
    let write = |outcome, state, due_at, finished_at, changes| Transition {
        outcome,
        write: Some(Write {
            state,
            due_at,
            finished_at,
            changes,
            reset_attempts: false,
            work: None,
        }),
    };
    match action {
        // Scheduled or Paused: not Failed.
        Action::Retry => unchanged(ControlOutcome::NotFailed),
        Action::Pause { .. } if paused => unchanged(ControlOutcome::AlreadyPaused),
        Action::Resume if !paused => unchanged(ControlOutcome::NotPaused),
        // A Paused row holds no lease; a Scheduled one may be firing right now.
        Action::Pause { .. } | Action::Cancel if firing && !paused => {
            unchanged(ControlOutcome::Firing)
        }
        Action::Pause { note } => write(
            ControlOutcome::Paused,
            TimerState::Paused,
            timer.due_at,
            None,
            vec![Change::Paused { note: note.clone() }],
        ),
        Action::Cancel => write(
            ControlOutcome::Cancelled,
            TimerState::Cancelled,
            timer.due_at,
            Some(now),
            vec![Change::Cancelled],
        ),
        // Handled above.
        Action::Complete(_) => unchanged(ControlOutcome::NotFound),
        Action::Resume => {
            let schedule = timer.recurrence.as_ref().and_then(|r| r.schedule().ok());
            let policy = timer.policy.as_ref();
            let mut work = timer.work.clone().unwrap_or_default();
            let resumed = match schedule {
                // `catchUp` `once` or `all`: caught up as after downtime, from its due time.
                Some(_) if Policy::catches_up_after_pause(policy) => crate::recurrence::Resumed {
                    next: Some(timer.due_at),
                    skipped: None,
                },
                Some(schedule) => {
                    let nominal = work.nominal.unwrap_or(timer.due_at);
                    let mut resumed = schedule.resume(nominal, now);
                    // Its cron time is kept when it fires jittered, also when the jitter came
                    // after it was stored (no nominal time kept yet).
                    let jittered =
                        work.nominal.is_some() || policy.is_some_and(|p| p.jitter.is_some());
                    work.nominal = resumed.next.filter(|_| jittered);
                    resumed.next = resumed
                        .next
                        .map(|next| policy::fire_time(&timer.key, next, policy));
                    resumed
                }
                // A one-shot timer keeps its due time, passed or not.
                None => crate::recurrence::Resumed {
                    next: Some(timer.due_at),
                    skipped: None,
                },
            };
            let mut changes: Vec<Change> = resumed.skipped.map(Change::from).into_iter().collect();
            changes.push(Change::Resumed {
                due_at: resumed.next,
            });
            let moved = work.nominal != timer.work.as_ref().and_then(|w| w.nominal);
            let with_work = |mut t: Transition| {
                if let Some(w) = t.write.as_mut().filter(|_| moved) {
                    w.work = Some(work.clone().stored());
                }
                t
            };
            match resumed.next {
                Some(next) => with_work(write(
                    ControlOutcome::Resumed,
                    TimerState::Scheduled,
                    next,
                    None,
                    changes,
                )),
                // The series ended while paused: it is done, as if its last occurrence fired.
                None => write(
                    ControlOutcome::Resumed,
                    TimerState::Reached,
                    timer.due_at,
                    Some(now),
                    changes,
                ),
            }
        }
    }
}

/// The transition of a completion.
fn completed(done: policy::Completed, now: Timestamp) -> Transition {
    let outcome = match done.result {
        CompletionResult::Completed => ControlOutcome::Completed,
        CompletionResult::Late => ControlOutcome::CompletedLate,
        CompletionResult::Duplicate => ControlOutcome::AlreadyCompleted,
        CompletionResult::UnknownOccurrence => ControlOutcome::UnknownOccurrence,
        CompletionResult::Firing => ControlOutcome::Firing,
    };
    let Some(change) = done.change else {
        return Transition {
            outcome,
            write: None,
        };
    };
    Transition {
        outcome,
        write: Some(Write {
            state: done.state,
            due_at: done.due_at,
            finished_at: done.finished.then_some(now),
            changes: vec![change],
            reset_attempts: false,
            work: Some(done.work.and_then(Work::stored)),
        }),
    }
}

/// Serde of a [`Timestamp`] as RFC 3339 text in UTC with milliseconds.
pub mod rfc3339 {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::model::Timestamp;

    pub fn serialize<S: Serializer>(at: &Timestamp, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&at.to_rfc3339())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Timestamp, D::Error> {
        let text = String::deserialize(d)?;
        chrono::DateTime::parse_from_rfc3339(&text)
            .map(|at| Timestamp::from_datetime(&at))
            .map_err(serde::de::Error::custom)
    }

    pub mod option {
        use serde::{Deserialize, Deserializer, Serializer};

        use crate::model::Timestamp;

        pub fn serialize<S: Serializer>(at: &Option<Timestamp>, s: S) -> Result<S::Ok, S::Error> {
            match at {
                Some(at) => super::serialize(at, s),
                None => s.serialize_none(),
            }
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Timestamp>, D::Error> {
            #[derive(Deserialize)]
            struct Wrapped(#[serde(with = "super")] Timestamp);
            Ok(Option::<Wrapped>::deserialize(d)?.map(|Wrapped(at)| at))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{NewTimer, Recurrence, TimerKey};

    fn timer(state: TimerState, due: i64, recurrence: Option<&str>) -> Timer {
        let new = NewTimer {
            recurrence: recurrence.map(|cron| Recurrence {
                cron: cron.into(),
                time_zone: "UTC".into(),
                end_at: None,
                max_occurrences: None,
            }),
            ..NewTimer::new(TimerKey::new("t", "a"), Timestamp::from_millis(due))
        };
        Timer {
            state,
            ..Timer::registered(new, Timestamp::EPOCH)
        }
    }

    const NOW: Timestamp = Timestamp::from_millis(10_000);

    #[test]
    fn each_action_from_each_state() {
        use ControlOutcome as O;
        let pause = Action::Pause { note: None };
        let cases = [
            (TimerState::Scheduled, false, &pause, O::Paused),
            (TimerState::Scheduled, true, &pause, O::Firing),
            (TimerState::Paused, false, &pause, O::AlreadyPaused),
            (TimerState::Scheduled, false, &Action::Resume, O::NotPaused),
            (TimerState::Paused, false, &Action::Resume, O::Resumed),
            (TimerState::Scheduled, true, &Action::Cancel, O::Firing),
            (TimerState::Paused, false, &Action::Cancel, O::Cancelled),
            (TimerState::Reached, false, &pause, O::AlreadyReached),
            (
                TimerState::Cancelled,
                false,
                &Action::Resume,
                O::AlreadyCancelled,
            ),
            (TimerState::Failed, false, &Action::Cancel, O::AlreadyFailed),
            (TimerState::Failed, false, &Action::Retry, O::Retried),
            (TimerState::Scheduled, false, &Action::Retry, O::NotFailed),
            // A Scheduled timer is not Failed, leased or not.
            (TimerState::Scheduled, true, &Action::Retry, O::NotFailed),
            (TimerState::Paused, false, &Action::Retry, O::NotFailed),
            (
                TimerState::Reached,
                false,
                &Action::Retry,
                O::AlreadyReached,
            ),
            (
                TimerState::Cancelled,
                false,
                &Action::Retry,
                O::AlreadyCancelled,
            ),
        ];
        for (state, firing, action, want) in cases {
            let got = transition(&timer(state, 5_000, None), firing, action, NOW);
            assert_eq!(
                got.outcome, want,
                "{action:?} on {state:?} (firing: {firing})"
            );
            assert_eq!(
                got.write.is_some(),
                want.changed(),
                "{action:?} on {state:?}"
            );
        }
    }

    #[test]
    fn a_resumed_one_shot_timer_keeps_its_passed_due_time() {
        let got = transition(
            &timer(TimerState::Paused, 5_000, None),
            false,
            &Action::Resume,
            NOW,
        );
        let write = got.write.unwrap();
        assert_eq!(write.state, TimerState::Scheduled);
        assert_eq!(write.due_at, Timestamp::from_millis(5_000));
        assert_eq!(
            write.changes,
            [Change::Resumed {
                due_at: Some(Timestamp::from_millis(5_000))
            }]
        );
    }

    #[test]
    fn a_resumed_series_records_what_it_skipped() {
        // Every second from 5 s; resumed at 10 s: 5..9 skipped, 10 next.
        let paused = timer(TimerState::Paused, 5_000, Some("* * * * * *"));
        let write = transition(&paused, false, &Action::Resume, NOW)
            .write
            .unwrap();
        assert_eq!(write.due_at, NOW);
        assert_eq!(
            write.changes,
            [
                Change::Skipped {
                    count: 5,
                    first: Timestamp::from_millis(5_000),
                    last: Timestamp::from_millis(9_000),
                    at_least: false,
                    reason: Some(SkipReason::Pause),
                },
                Change::Resumed { due_at: Some(NOW) },
            ]
        );
    }

    /// A series sent again with a jitter, then paused and resumed, keeps its cron time: the
    /// claim fires it at that time plus its offset, not that plus a second offset.
    #[test]
    fn a_resumed_series_with_a_new_jitter_keeps_its_cron_time() {
        let mut paused = timer(TimerState::Paused, 5_000, Some("* * * * * *"));
        paused.policy = Some(Policy {
            jitter: Some(std::time::Duration::from_millis(500)),
            ..Policy::default()
        });
        let write = transition(&paused, false, &Action::Resume, NOW)
            .write
            .unwrap();
        let work = write.work.flatten().expect("its work");
        assert_eq!(work.nominal, Some(NOW));
        assert_eq!(
            write.due_at,
            policy::fire_time(&paused.key, NOW, paused.policy.as_ref())
        );
    }

    #[test]
    fn changes_round_trip_as_tagged_json() {
        let fired = Change::Fired {
            due_at: Timestamp::from_millis(1_000),
            lateness_ms: 3,
            instance: "i-1".into(),
            occurrence: Some(2),
            caught_up: false,
            refire: None,
            answer: None,
        };
        assert_eq!(
            fired.to_json(),
            r#"{"type":"fired","dueAt":"1970-01-01T00:00:01.000Z","latenessMs":3,"instance":"i-1","occurrence":2}"#
        );
        for change in [
            fired,
            Change::Paused {
                note: Some("weekend".into()),
            },
            Change::Resumed { due_at: None },
            Change::Cancelled,
            Change::PublishFailed {
                attempt: 1,
                error: "down".into(),
            },
        ] {
            assert_eq!(Change::from_json(&change.to_json()).unwrap(), change);
        }
        assert!(Change::from_json("{\"type\":\"unknown\"}").is_err());
    }
}
