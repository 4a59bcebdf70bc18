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

mod completion;
mod due;
mod jitter;
mod planning;

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::model::Timestamp;

pub use completion::{complete, Completed, Completion, CompletionResult};
pub use jitter::{check_jitter, fire_time, jitter_offset};
pub use planning::{fired, plan, Fire, Plan};

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
