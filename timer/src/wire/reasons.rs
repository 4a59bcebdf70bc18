//! Why a command is refused: the [`Reason`] codes and the [`Rejection`] that carries one.

use serde::Serialize;

/// Why a command was refused, as a stable code: a metric label, the `reason` of an HTTP error
/// and the start of a dead letter's reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The command is larger than `limits.max_command_bytes`.
    TooLarge,
    /// Not JSON, or a field of the wrong type.
    InvalidJson,
    /// An envelope `type` other than `ScheduleTimer`, `CancelTimer`, `PauseTimer`,
    /// `ResumeTimer` or `TimerCompleted`.
    UnknownType,
    /// A required field is absent.
    MissingField,
    /// An id is empty, too long, or holds control characters.
    InvalidId,
    /// A due time that is not a valid instant.
    InvalidTime,
    /// A due time beyond `limits.max_horizon`.
    TooFar,
    /// A payload larger than `limits.max_payload_bytes`, or a message larger than
    /// `limits.max_message_bytes`.
    PayloadTooLarge,
    /// A cron pattern, time zone, end or count that does not work.
    InvalidRecurrence,
    /// An `overlap`, `completionTimeout`, `catchUp`, `catchUpLimit`, `catchUpWindow` or
    /// `jitter` that does not work, or a `TimerCompleted` field that does not.
    InvalidPolicy,
    /// A command this path does not take (a `CancelTimer` on `POST /v1/timers`).
    NotAcceptedHere,
    /// The tenant has `limits.max_pending_per_tenant` Scheduled or Paused timers already.
    TenantLimit,
    /// A `target` that is not an object, that the configured broker cannot publish to (another
    /// broker's kind, a field it does not know), or that is not the service's to use.
    InvalidTarget,
}

impl Reason {
    /// Every reason, for dashboards, docs and tests.
    pub const ALL: &'static [Reason] = &[
        Reason::TooLarge,
        Reason::InvalidJson,
        Reason::UnknownType,
        Reason::MissingField,
        Reason::InvalidId,
        Reason::InvalidTime,
        Reason::TooFar,
        Reason::PayloadTooLarge,
        Reason::InvalidRecurrence,
        Reason::InvalidPolicy,
        Reason::NotAcceptedHere,
        Reason::TenantLimit,
        Reason::InvalidTarget,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::TooLarge => "too_large",
            Reason::InvalidJson => "invalid_json",
            Reason::UnknownType => "unknown_type",
            Reason::MissingField => "missing_field",
            Reason::InvalidId => "invalid_id",
            Reason::InvalidTime => "invalid_time",
            Reason::TooFar => "too_far",
            Reason::PayloadTooLarge => "payload_too_large",
            Reason::InvalidRecurrence => "invalid_recurrence",
            Reason::InvalidPolicy => "invalid_policy",
            Reason::NotAcceptedHere => "not_accepted_here",
            Reason::TenantLimit => "tenant_limit",
            Reason::InvalidTarget => "invalid_target",
        }
    }
}

impl PartialEq<&str> for Reason {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Reason {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// Why a command was refused: its [`Reason`], the offending field when there is one, and a
/// message for humans.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Rejection {
    pub reason: Reason,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    pub message: String,
}

impl Rejection {
    pub fn new(reason: Reason, field: Option<&str>, message: impl Into<String>) -> Self {
        Rejection {
            reason,
            field: field.map(str::to_owned),
            message: message.into(),
        }
    }
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.field {
            Some(field) => write!(f, "{} ({}): {}", field, self.reason, self.message),
            None => write!(f, "{}: {}", self.reason, self.message),
        }
    }
}

impl std::error::Error for Rejection {}
