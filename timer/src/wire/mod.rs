#![doc = include_str!("README.md")]

mod decode;
mod events;
mod outbound;
mod reasons;
mod validate;

#[cfg(test)]
mod doc_tests;

pub use decode::{addressed, decode_command, decode_schedule, Addressed, Command};
pub use events::{
    event_id, manual_event_id, refired_event_id, DueTimeReached, DueTimeReachedEnvelope, Envelope,
    TimerFailed, TimerFailedEnvelope, MANUAL_TRIGGER, TIMER_FAILED,
};
pub use outbound::{MAX_HEADERS, MAX_HEADER_NAME_BYTES, MAX_HEADER_VALUE_BYTES, MAX_TARGET_BYTES};
pub use reasons::{Reason, Rejection};
pub use validate::{check_id, completion_fields, MAX_COMPLETION_MESSAGE_BYTES, MAX_PAYLOAD_DEPTH};

pub const SCHEDULE_TIMER: &str = "ScheduleTimer";
pub const CANCEL_TIMER: &str = "CancelTimer";
pub const PAUSE_TIMER: &str = "PauseTimer";
pub const RESUME_TIMER: &str = "ResumeTimer";
pub const TIMER_COMPLETED: &str = "TimerCompleted";
pub const DUE_TIME_REACHED: &str = "DueTimeReached";

fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

#[cfg(test)]
mod tests;
