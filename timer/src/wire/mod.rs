#![doc = include_str!("README.md")]

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use uuid::Uuid;

use std::time::Duration;

use crate::config::Limits;
use crate::model::{ClaimedTimer, NewTimer, Timer, TimerKey, Timestamp};
use crate::policy::{self, CatchUp, Completion, Outcome, Overlap, Policy, Work};
use crate::recurrence::{Recurrence, Schedule};

#[cfg(test)]
mod doc_tests;

pub const SCHEDULE_TIMER: &str = "ScheduleTimer";
pub const CANCEL_TIMER: &str = "CancelTimer";
pub const PAUSE_TIMER: &str = "PauseTimer";
pub const RESUME_TIMER: &str = "ResumeTimer";
pub const TIMER_COMPLETED: &str = "TimerCompleted";
pub const DUE_TIME_REACHED: &str = "DueTimeReached";

/// Why a command was refused, as a stable code: a metric label, the `reason` of an HTTP error
/// and the start of a dead letter's reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The command is larger than `limits.max_message_bytes`.
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
    /// A payload larger than `limits.max_payload_bytes`.
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

/// A decoded command.
// A command lives for one message; boxing the schedule would allocate for every one of them.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Schedule a timer, or move a Scheduled one (same key).
    Schedule(NewTimer),
    /// Cancel a Scheduled or Paused timer.
    Cancel(TimerKey),
    /// Pause a Scheduled timer.
    Pause(TimerKey),
    /// Resume a Paused timer.
    Resume(TimerKey),
    /// The work a fire triggered is done.
    Complete(TimerKey, Completion),
}

impl Command {
    /// The timer the command is about.
    pub fn key(&self) -> &TimerKey {
        match self {
            Command::Schedule(timer) => &timer.key,
            Command::Cancel(key)
            | Command::Pause(key)
            | Command::Resume(key)
            | Command::Complete(key, _) => key,
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireCommand<'a> {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    tenant_id: Option<String>,
    #[serde(default)]
    service_call_id: Option<String>,
    #[serde(default)]
    due_at: Option<String>,
    #[serde(default)]
    due_time_ms: Option<i64>,
    #[serde(default)]
    correlation_id: Option<String>,
    #[serde(borrow, default)]
    payload: Option<&'a RawValue>,
    #[serde(default)]
    cron: Option<String>,
    #[serde(default)]
    time_zone: Option<String>,
    #[serde(default)]
    end_at: Option<String>,
    #[serde(default)]
    max_occurrences: Option<u32>,
    #[serde(default)]
    overlap: Option<String>,
    #[serde(default)]
    completion_timeout: Option<WireDuration>,
    #[serde(default)]
    catch_up: Option<String>,
    #[serde(default)]
    catch_up_limit: Option<i64>,
    #[serde(default)]
    catch_up_window: Option<WireDuration>,
    #[serde(default)]
    jitter: Option<WireDuration>,
    #[serde(default)]
    occurrence: Option<i64>,
    #[serde(default)]
    outcome: Option<String>,
    #[serde(default)]
    message: Option<String>,
}

/// A duration as a command gives it: text (`"30s"`, `"1h 30m"`, `"500ms"`) or milliseconds.
#[derive(Deserialize)]
#[serde(untagged)]
enum WireDuration {
    Millis(i64),
    Text(String),
}

impl WireDuration {
    fn parse(self, field: &str) -> Result<Duration, Rejection> {
        match self {
            WireDuration::Millis(ms) => u64::try_from(ms).map(Duration::from_millis).map_err(|_| {
                Rejection::new(
                    Reason::InvalidPolicy,
                    Some(field),
                    format!("{ms} is negative; give milliseconds of at least 0, or text like \"30s\""),
                )
            }),
            WireDuration::Text(text) => humantime::parse_duration(text.trim()).map_err(|e| {
                Rejection::new(
                    Reason::InvalidPolicy,
                    Some(field),
                    format!(
                        "{:?} is not a duration ({e}); give text like \"30s\", \"5m\", \"1h 30m\", or \
                         milliseconds",
                        truncate(&text, 64)
                    ),
                )
            }),
        }
    }
}

/// How long a completion's `message` may be: longer ones are cut (a completion is never
/// refused for its message).
pub const MAX_COMPLETION_MESSAGE_BYTES: usize = 1024;

fn parse<'a>(bytes: &'a [u8], prefix: &str) -> Result<WireCommand<'a>, Rejection> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let cmd: WireCommand<'a> = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        // serde_path_to_error prints "." for the root and "?" where it lost track.
        let field = (path != "." && !path.contains('?')).then(|| format!("{prefix}{path}"));
        Rejection {
            reason: Reason::InvalidJson,
            field,
            message: e.into_inner().to_string(),
        }
    })?;
    de.end()
        .map_err(|e| Rejection::new(Reason::InvalidJson, None, e.to_string()))?;
    Ok(cmd)
}

/// Decodes and validates one `ScheduleTimer` command (the HTTP API's `POST /v1/timers`); a
/// `CancelTimer` is refused here with `not_accepted_here`.
pub fn decode_schedule(
    bytes: &[u8],
    limits: &Limits,
    now: Timestamp,
) -> Result<NewTimer, Rejection> {
    let over_http = match decode_command(bytes, limits, now)? {
        Command::Schedule(timer) => return Ok(timer),
        Command::Cancel(_) => {
            "a CancelTimer is not accepted here (DELETE \
             /v1/tenants/{tenantId}/timers/{serviceCallId} cancels over HTTP)"
        }
        Command::Pause(_) => {
            "a PauseTimer is not accepted here (POST \
             /v1/tenants/{tenantId}/timers/{serviceCallId}/pause pauses over HTTP)"
        }
        Command::Resume(_) => {
            "a ResumeTimer is not accepted here (POST \
             /v1/tenants/{tenantId}/timers/{serviceCallId}/resume resumes over HTTP)"
        }
        Command::Complete(..) => {
            "a TimerCompleted is not accepted here (POST \
             /v1/tenants/{tenantId}/timers/{serviceCallId}/complete completes over HTTP)"
        }
    };
    Err(Rejection::new(
        Reason::NotAcceptedHere,
        Some("type"),
        over_http,
    ))
}

/// Decodes and validates one command from the broker: `ScheduleTimer`, `CancelTimer`,
/// `PauseTimer`, `ResumeTimer` or `TimerCompleted`. `now`
/// bounds the due-time horizon and anchors the first occurrence of a recurring timer.
pub fn decode_command(bytes: &[u8], limits: &Limits, now: Timestamp) -> Result<Command, Rejection> {
    if bytes.len() > limits.max_message_bytes {
        return Err(Rejection::new(
            Reason::TooLarge,
            None,
            format!(
                "command is {} bytes, the limit is {} (limits.max_message_bytes)",
                bytes.len(),
                limits.max_message_bytes
            ),
        ));
    }
    let outer = parse(bytes, "")?;
    let kind: &'static str = match outer.kind.as_deref() {
        None | Some(SCHEDULE_TIMER) => SCHEDULE_TIMER,
        Some(CANCEL_TIMER) => CANCEL_TIMER,
        Some(PAUSE_TIMER) => PAUSE_TIMER,
        Some(RESUME_TIMER) => RESUME_TIMER,
        Some(TIMER_COMPLETED) => TIMER_COMPLETED,
        Some(kind) => {
            return Err(Rejection::new(
                Reason::UnknownType,
                Some("type"),
                format!(
                    "unknown command type {kind:?} (known: {SCHEDULE_TIMER}, {CANCEL_TIMER}, \
                     {PAUSE_TIMER}, {RESUME_TIMER}, {TIMER_COMPLETED})"
                ),
            ))
        }
    };
    // An envelope: `type` given and the command inside `payload`.
    let is_envelope = outer.kind.is_some() && outer.service_call_id.is_none();
    let (command, prefix) = if !is_envelope {
        (outer, "")
    } else {
        let Some(inner_raw) = outer.payload else {
            return Err(Rejection::new(
                Reason::MissingField,
                Some("payload"),
                format!(
                    "an envelope of type {kind} needs the command in `payload` (or give \
                     `serviceCallId` at the top level)"
                ),
            ));
        };
        let mut inner = parse(inner_raw.get().as_bytes(), "payload")?;
        match (&outer.tenant_id, &inner.tenant_id) {
            (Some(a), Some(b)) if a != b => {
                return Err(Rejection::new(
                    Reason::InvalidId,
                    Some("payload.tenantId"),
                    format!("tenantId {b:?} differs from the envelope's {a:?}"),
                ))
            }
            (Some(a), None) => inner.tenant_id = Some(a.clone()),
            _ => {}
        }
        if inner.correlation_id.is_none() {
            inner.correlation_id = outer.correlation_id;
        }
        (inner, "payload.")
    };
    match kind {
        CANCEL_TIMER => validate_key(command, kind, prefix, limits).map(Command::Cancel),
        PAUSE_TIMER => validate_key(command, kind, prefix, limits).map(Command::Pause),
        RESUME_TIMER => validate_key(command, kind, prefix, limits).map(Command::Resume),
        TIMER_COMPLETED => validate_completion(command, prefix, limits),
        _ => validate(command, prefix, limits, now).map(Command::Schedule),
    }
}

/// The completion fields of a `TimerCompleted` (or of the body of `POST .../complete`):
/// `occurrence` (1 or more), `outcome` (`succeeded` or `failed`), `message` (cut to
/// [`MAX_COMPLETION_MESSAGE_BYTES`]).
pub fn completion_fields(
    occurrence: Option<i64>,
    outcome: Option<&str>,
    message: Option<String>,
    prefix: &str,
) -> Result<Completion, Rejection> {
    let field = |name: &str| format!("{prefix}{name}");
    let occurrence = match occurrence {
        None => None,
        Some(n) => Some(u32::try_from(n).ok().filter(|n| *n >= 1).ok_or_else(|| {
            Rejection::new(
                Reason::InvalidPolicy,
                Some(&field("occurrence")),
                format!(
                    "{n} is not an occurrence number (the event's payload.occurrence, 1 or more)"
                ),
            )
        })?),
    };
    let outcome = match outcome {
        None => None,
        Some("succeeded") => Some(Outcome::Succeeded),
        Some("failed") => Some(Outcome::Failed),
        Some(other) => {
            return Err(Rejection::new(
                Reason::InvalidPolicy,
                Some(&field("outcome")),
                format!(
                    "{:?} is not an outcome (succeeded, failed)",
                    truncate(other, 64)
                ),
            ))
        }
    };
    let message = message.map(|m| truncate_bytes(&m, MAX_COMPLETION_MESSAGE_BYTES).to_owned());
    Ok(Completion {
        occurrence,
        outcome,
        message,
    })
}

fn validate_completion(
    mut cmd: WireCommand<'_>,
    prefix: &str,
    limits: &Limits,
) -> Result<Command, Rejection> {
    let occurrence = cmd.occurrence.take();
    let outcome = cmd.outcome.take();
    let message = cmd.message.take();
    let key = validate_key(cmd, TIMER_COMPLETED, prefix, limits)?;
    let completion = completion_fields(occurrence, outcome.as_deref(), message, prefix)?;
    Ok(Command::Complete(key, completion))
}

/// A `CancelTimer`, `PauseTimer`, `ResumeTimer` or `TimerCompleted` (`kind`) names its timer and
/// nothing else a `ScheduleTimer` would carry (a completion's own fields are taken out first).
fn validate_key(
    cmd: WireCommand<'_>,
    kind: &str,
    prefix: &str,
    limits: &Limits,
) -> Result<TimerKey, Rejection> {
    let field = |name: &str| format!("{prefix}{name}");
    let tenant_id = required_id(cmd.tenant_id, &field("tenantId"), limits)?;
    let service_call_id = required_id(cmd.service_call_id, &field("serviceCallId"), limits)?;
    if let Some(id) = cmd.correlation_id {
        check_id(id, &field("correlationId"), limits)?;
    }
    let extra = [
        ("dueAt", cmd.due_at.is_some()),
        ("dueTimeMs", cmd.due_time_ms.is_some()),
        ("cron", cmd.cron.is_some()),
        ("timeZone", cmd.time_zone.is_some()),
        ("endAt", cmd.end_at.is_some()),
        ("maxOccurrences", cmd.max_occurrences.is_some()),
        ("payload", cmd.payload.is_some()),
        ("overlap", cmd.overlap.is_some()),
        ("completionTimeout", cmd.completion_timeout.is_some()),
        ("catchUp", cmd.catch_up.is_some()),
        ("catchUpLimit", cmd.catch_up_limit.is_some()),
        ("catchUpWindow", cmd.catch_up_window.is_some()),
        ("jitter", cmd.jitter.is_some()),
        ("occurrence", cmd.occurrence.is_some()),
        ("outcome", cmd.outcome.is_some()),
        ("message", cmd.message.is_some()),
    ];
    if let Some((name, _)) = extra.iter().find(|(_, given)| *given) {
        let takes = if kind == TIMER_COMPLETED {
            "tenantId, serviceCallId, correlationId, occurrence, outcome and message"
        } else {
            "only tenantId, serviceCallId and correlationId"
        };
        return Err(Rejection::new(
            Reason::InvalidJson,
            Some(&field(name)),
            format!("a {kind} takes {takes}"),
        ));
    }
    Ok(TimerKey {
        tenant_id,
        service_call_id,
    })
}

/// Parses an RFC 3339 time with offset.
fn parse_time(text: &str, field: &str) -> Result<Timestamp, Rejection> {
    chrono::DateTime::parse_from_rfc3339(text)
        .map(|t| Timestamp::from_datetime(&t))
        .map_err(|e| {
            Rejection::new(
                Reason::InvalidTime,
                Some(field),
                format!(
                    "{:?} is not an RFC 3339 timestamp with offset ({e})",
                    truncate(text, 64)
                ),
            )
        })
}

/// The recurrence of a `ScheduleTimer` with `cron`, and its first occurrence.
fn recurrence(
    cmd: &mut WireCommand<'_>,
    field: &dyn Fn(&str) -> String,
    limits: &Limits,
    now: Timestamp,
) -> Result<Option<(Recurrence, Timestamp)>, Rejection> {
    let Some(cron) = cmd.cron.take() else {
        let stray = [
            ("timeZone", cmd.time_zone.is_some()),
            ("endAt", cmd.end_at.is_some()),
            ("maxOccurrences", cmd.max_occurrences.is_some()),
        ];
        if let Some((name, _)) = stray.iter().find(|(_, given)| *given) {
            return Err(Rejection::new(
                Reason::InvalidRecurrence,
                Some(&field(name)),
                "only a recurring timer (with `cron`) takes this field",
            ));
        }
        return Ok(None);
    };
    if cmd.due_at.is_some() || cmd.due_time_ms.is_some() {
        return Err(Rejection::new(
            Reason::InvalidRecurrence,
            Some(&field("cron")),
            "give either a due time (dueAt, dueTimeMs) or a cron pattern, not both",
        ));
    }
    let time_zone = cmd.time_zone.take().unwrap_or_else(|| "UTC".to_owned());
    for (name, value) in [("cron", &cron), ("timeZone", &time_zone)] {
        if value.len() > limits.max_id_bytes {
            return Err(Rejection::new(
                Reason::InvalidRecurrence,
                Some(&field(name)),
                format!(
                    "is {} bytes, the limit is {} (limits.max_id_bytes)",
                    value.len(),
                    limits.max_id_bytes
                ),
            ));
        }
    }
    let end_at = match cmd.end_at.take() {
        Some(text) => Some(parse_time(&text, &field("endAt"))?),
        None => None,
    };
    let recurrence = Recurrence {
        cron,
        time_zone,
        end_at,
        max_occurrences: cmd.max_occurrences,
    };
    let schedule = recurrence
        .schedule()
        .map_err(|e| Rejection::new(Reason::InvalidRecurrence, Some(&field(e.field)), e.message))?;
    let Some(first) = schedule.first(now) else {
        return Err(Rejection::new(
            Reason::InvalidRecurrence,
            Some(&field("cron")),
            "the pattern has no occurrence from now on (before endAt, and within the years the \
             cron library computes)",
        ));
    };
    Ok(Some((recurrence, first)))
}

fn validate(
    mut cmd: WireCommand<'_>,
    prefix: &str,
    limits: &Limits,
    now: Timestamp,
) -> Result<NewTimer, Rejection> {
    let field = |name: &str| format!("{prefix}{name}");
    let tenant_id = required_id(cmd.tenant_id.take(), &field("tenantId"), limits)?;
    let service_call_id = required_id(cmd.service_call_id.take(), &field("serviceCallId"), limits)?;
    let correlation_id = match cmd.correlation_id.take() {
        Some(id) => Some(check_id(id, &field("correlationId"), limits)?),
        None => None,
    };
    if let Some(name) = [
        ("occurrence", cmd.occurrence.is_some()),
        ("outcome", cmd.outcome.is_some()),
        ("message", cmd.message.is_some()),
    ]
    .iter()
    .find_map(|(name, given)| given.then_some(*name))
    {
        return Err(Rejection::new(
            Reason::InvalidJson,
            Some(&field(name)),
            "only a TimerCompleted takes this field",
        ));
    }
    let recurring = recurrence(&mut cmd, &field, limits, now)?;
    let policy = policy_of(&mut cmd, &field, limits, recurring.as_ref())?;
    let due_at = match (cmd.due_at, cmd.due_time_ms) {
        _ if recurring.is_some() => (
            recurring.as_ref().map_or(now, |(_, first)| *first),
            field("cron"),
        ),
        (Some(_), Some(_)) => {
            return Err(Rejection::new(
                Reason::InvalidTime,
                Some(&field("dueAt")),
                "give either dueAt or dueTimeMs, not both",
            ))
        }
        (None, None) => return Err(Rejection::new(
            Reason::MissingField,
            Some(&field("dueAt")),
            "dueAt (RFC 3339 with offset), dueTimeMs (epoch milliseconds) or cron (a recurring \
                 timer) is required",
        )),
        (Some(text), None) => (parse_time(&text, &field("dueAt"))?, field("dueAt")),
        (None, Some(ms)) => (Timestamp::from_millis(ms), field("dueTimeMs")),
    };
    let (due_at, due_field) = due_at;
    if due_at < Timestamp::EPOCH {
        return Err(Rejection::new(
            Reason::InvalidTime,
            Some(&due_field),
            format!(
                "due time {} ms lies before 1970-01-01T00:00:00Z",
                due_at.as_millis()
            ),
        ));
    }
    let horizon = now.saturating_add(limits.max_horizon).min(Timestamp::MAX);
    if due_at > horizon {
        return Err(Rejection::new(
            Reason::TooFar,
            Some(&due_field),
            format!(
                "due time lies after {} (limits.max_horizon = {})",
                horizon,
                humantime::format_duration(limits.max_horizon)
            ),
        ));
    }
    let payload = match cmd.payload {
        Some(raw) if raw.get().len() > limits.max_payload_bytes => {
            return Err(Rejection::new(
                Reason::PayloadTooLarge,
                Some(&field("payload")),
                format!(
                    "payload is {} bytes, the limit is {} (limits.max_payload_bytes)",
                    raw.get().len(),
                    limits.max_payload_bytes
                ),
            ))
        }
        Some(raw) => {
            // Raw values skip serde_json's nesting limit; consumers parsing the echoed payload
            // would hit it, so apply one here.
            if json_depth(raw.get()) > MAX_PAYLOAD_DEPTH {
                return Err(Rejection::new(
                    Reason::InvalidJson,
                    Some(&field("payload")),
                    format!("payload nests deeper than {MAX_PAYLOAD_DEPTH} levels"),
                ));
            }
            Some(raw.get().to_owned())
        }
        None => None,
    };
    let key = TimerKey {
        tenant_id,
        service_call_id,
    };
    // A jittered series is due at its first occurrence's fire time; its work remembers the
    // occurrence itself.
    let jitter = policy.as_ref().and_then(|p| p.jitter);
    let work = jitter.filter(|_| recurring.is_some()).map(|_| Work {
        nominal: Some(due_at),
        ..Work::default()
    });
    let due_at = match &recurring {
        Some(_) => policy::fire_time(&key, due_at, policy.as_ref()),
        None => due_at,
    };
    Ok(NewTimer {
        key,
        due_at,
        correlation_id,
        payload,
        recurrence: recurring.map(|(r, _)| r),
        policy,
        work,
    })
}

/// The policy fields of a `ScheduleTimer`, checked, with their defaults filled in; `None` when
/// it gives none.
fn policy_of(
    cmd: &mut WireCommand<'_>,
    field: &dyn Fn(&str) -> String,
    limits: &Limits,
    recurring: Option<&(Recurrence, Timestamp)>,
) -> Result<Option<Policy>, Rejection> {
    let invalid = |name: &str, message: String| {
        Rejection::new(Reason::InvalidPolicy, Some(&field(name)), message)
    };
    if recurring.is_none() {
        let stray = [
            ("overlap", cmd.overlap.is_some()),
            ("catchUp", cmd.catch_up.is_some()),
            ("catchUpLimit", cmd.catch_up_limit.is_some()),
            ("catchUpWindow", cmd.catch_up_window.is_some()),
            ("jitter", cmd.jitter.is_some()),
        ];
        if let Some((name, _)) = stray.iter().find(|(_, given)| *given) {
            return Err(invalid(
                name,
                "only a recurring timer (with `cron`) takes this field; a one-shot timer takes \
                 completionTimeout"
                    .into(),
            ));
        }
    }
    let duration =
        |value: Option<WireDuration>, name: &str| -> Result<Option<Duration>, Rejection> {
            let Some(value) = value else { return Ok(None) };
            let d = value.parse(&field(name))?;
            if d > limits.max_horizon {
                return Err(invalid(
                    name,
                    format!(
                        "{} is longer than limits.max_horizon ({})",
                        humantime::format_duration(d),
                        humantime::format_duration(limits.max_horizon)
                    ),
                ));
            }
            Ok(Some(d))
        };
    let overlap = match cmd.overlap.take() {
        None => None,
        Some(name) => Some(
            Overlap::ALL
                .into_iter()
                .find(|o| o.as_str() == name)
                .ok_or_else(|| {
                    invalid(
                        "overlap",
                        format!(
                            "{:?} is not an overlap policy (allow, skip, bufferOne)",
                            truncate(&name, 64)
                        ),
                    )
                })?,
        ),
    };
    let catch_up = match cmd.catch_up.take() {
        None => None,
        Some(name) => Some(
            CatchUp::ALL
                .into_iter()
                .find(|c| c.as_str() == name)
                .ok_or_else(|| {
                    invalid(
                        "catchUp",
                        format!(
                            "{:?} is not a catch-up policy (once, skip, all)",
                            truncate(&name, 64)
                        ),
                    )
                })?,
        ),
    };
    let completion_timeout = duration(cmd.completion_timeout.take(), "completionTimeout")?;
    if completion_timeout == Some(Duration::ZERO) {
        return Err(invalid("completionTimeout", "must be longer than 0".into()));
    }
    let catch_up_window = duration(cmd.catch_up_window.take(), "catchUpWindow")?;
    if catch_up_window.is_some_and(|w| w < Duration::from_secs(1)) {
        return Err(invalid(
            "catchUpWindow",
            "must be at least 1s (an occurrence is a few milliseconds late even on time)".into(),
        ));
    }
    let jitter = duration(cmd.jitter.take(), "jitter")?.filter(|j| !j.is_zero());
    let catch_up_limit = match cmd.catch_up_limit.take() {
        None => None,
        Some(_) if catch_up != Some(CatchUp::All) => {
            return Err(invalid(
                "catchUpLimit",
                "only `catchUp: all` takes a limit".into(),
            ))
        }
        Some(n) => Some(
            u32::try_from(n)
                .ok()
                .filter(|n| (1..=policy::MAX_CATCH_UP_LIMIT).contains(n))
                .ok_or_else(|| {
                    invalid(
                        "catchUpLimit",
                        format!("{n} is not between 1 and {}", policy::MAX_CATCH_UP_LIMIT),
                    )
                })?,
        ),
    };
    if let (Some(jitter), Some((recurrence, first))) = (jitter, recurring) {
        let schedule: Schedule = recurrence.schedule().map_err(|e| {
            Rejection::new(Reason::InvalidRecurrence, Some(&field(e.field)), e.message)
        })?;
        if let Err(gap) = policy::check_jitter(&schedule, *first, jitter) {
            return Err(invalid(
                "jitter",
                format!(
                    "{} is not shorter than the shortest gap between two occurrences ({}), so \
                     occurrences would change places",
                    humantime::format_duration(jitter),
                    humantime::format_duration(gap)
                ),
            ));
        }
    }
    if overlap.is_none()
        && completion_timeout.is_none()
        && catch_up.is_none()
        && catch_up_window.is_none()
        && jitter.is_none()
    {
        return Ok(None);
    }
    let overlap = overlap.unwrap_or_default();
    let completion_timeout = match overlap {
        Overlap::Skip | Overlap::BufferOne => {
            Some(completion_timeout.unwrap_or(policy::DEFAULT_COMPLETION_TIMEOUT))
        }
        Overlap::Allow => completion_timeout,
    };
    let catch_up_limit = match catch_up {
        Some(CatchUp::All) => Some(catch_up_limit.unwrap_or(policy::DEFAULT_CATCH_UP_LIMIT)),
        _ => None,
    };
    Ok(Some(Policy {
        overlap,
        completion_timeout,
        catch_up,
        catch_up_limit,
        catch_up_window,
        jitter,
    }))
}

fn required_id(value: Option<String>, field: &str, limits: &Limits) -> Result<String, Rejection> {
    match value {
        Some(v) => check_id(v, field, limits),
        None => Err(Rejection::new(
            Reason::MissingField,
            Some(field),
            "is required",
        )),
    }
}

/// Ids are non-empty, at most `max_id_bytes` long, and free of control characters (they end up
/// in logs, subjects and routing keys).
fn check_id(value: String, field: &str, limits: &Limits) -> Result<String, Rejection> {
    if value.is_empty() {
        return Err(Rejection::new(
            Reason::InvalidId,
            Some(field),
            "must not be empty",
        ));
    }
    if value.len() > limits.max_id_bytes {
        return Err(Rejection::new(
            Reason::InvalidId,
            Some(field),
            format!(
                "is {} bytes, the limit is {} (limits.max_id_bytes)",
                value.len(),
                limits.max_id_bytes
            ),
        ));
    }
    if let Some(pos) = value.chars().position(char::is_control) {
        return Err(Rejection::new(
            Reason::InvalidId,
            Some(field),
            format!("contains a control character at position {pos}"),
        ));
    }
    Ok(value)
}

/// Deepest nesting of arrays and objects a payload may have.
pub const MAX_PAYLOAD_DEPTH: usize = 64;

/// Nesting depth of valid JSON text (brackets inside strings do not count).
fn json_depth(json: &str) -> usize {
    let (mut depth, mut max, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for b in json.bytes() {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                max = max.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

/// `s` cut to at most `max` bytes, at a character boundary.
fn truncate_bytes(s: &str, max: usize) -> &str {
    let mut end = max.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// Namespace of the name-based part of event ids (a fixed random UUID; never change it).
const EVENT_ID_NAMESPACE: Uuid = Uuid::from_u128(0x6c1f_4a2e_93b7_4d0a_8e55_0b3c_d2f1_7a64);

/// The envelope id of a timer's fire: a UUIDv7 whose timestamp is the due time (ids sort by due
/// time) and whose other 74 bits come from a SHA-1 name hash of tenant, service call id,
/// revision and due time. The same fire always gets the same id; a rescheduled timer gets a new
/// one.
pub fn event_id(timer: &ClaimedTimer) -> Uuid {
    refired_event_id(timer, 0)
}

/// [`event_id`] of the `refire`-th fire again of a one-shot timer whose work did not complete
/// in time (0: the first fire, whose id is [`event_id`]): a new id for each, so a broker's
/// de-duplication does not drop it.
pub fn refired_event_id(timer: &ClaimedTimer, refire: u32) -> Uuid {
    let mut name = format!(
        "{}\u{0}{}\u{0}{}\u{0}{}",
        timer.key.tenant_id,
        timer.key.service_call_id,
        timer.revision,
        timer.due_at.as_millis()
    );
    if refire > 0 {
        name.push_str(&format!("\u{0}refire\u{0}{refire}"));
    }
    let hash = Uuid::new_v5(&EVENT_ID_NAMESPACE, name.as_bytes()).into_bytes();
    let mut bits = [0u8; 10];
    bits.copy_from_slice(&hash[..10]);
    let millis = u64::try_from(timer.due_at.as_millis()).unwrap_or(0);
    uuid::Builder::from_unix_timestamp_millis(millis, &bits).into_uuid()
}

/// The envelope our events and dead letters travel in: a UUID id, the `type`, tenant and
/// aggregate (the serviceCallId), and `causationId` always null because time, not a message,
/// caused it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Envelope<P> {
    pub id: Uuid,
    #[serde(rename = "type")]
    pub kind: String,
    pub tenant_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
    pub causation_id: Option<String>,
    pub aggregate_id: String,
    pub timestamp_ms: i64,
    pub payload: P,
}

/// The `DueTimeReached` event, as published and as consumers read it.
pub type DueTimeReachedEnvelope = Envelope<DueTimeReached>;

/// The `TimerFailed` dead letter sent when a timer's publish failed `engine.max_attempts`
/// times.
pub type TimerFailedEnvelope = Envelope<TimerFailed>;

impl<P: Serialize> Envelope<P> {
    fn about(timer: &ClaimedTimer, id: Uuid, kind: &str, at: Timestamp, payload: P) -> Self {
        Envelope {
            id,
            kind: kind.to_owned(),
            tenant_id: timer.key.tenant_id.clone(),
            correlation_id: timer.correlation_id.clone(),
            causation_id: None,
            aggregate_id: timer.key.service_call_id.clone(),
            timestamp_ms: at.as_millis(),
            payload,
        }
    }

    pub fn to_json(&self) -> Vec<u8> {
        // Serializing owned strings, numbers and valid raw JSON cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DueTimeReached {
    pub tenant_id: String,
    pub service_call_id: String,
    pub due_at: String,
    pub reached_at: String,
    /// For a recurring timer: which occurrence this is (1 for the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub occurrence: Option<u32>,
    /// `manual` for an extra fire asked for by `POST …/trigger` (it is not an occurrence and
    /// did not move the schedule); absent for a fire at the due time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger: Option<String>,
    /// A one-shot timer with a `completionTimeout` fired again because no `TimerCompleted`
    /// came in time: the how-manyth time (absent for the first fire).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refire: Option<u32>,
    /// The command's opaque payload, echoed back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<Box<RawValue>>,
}

/// The `trigger` of a manual fire.
pub const MANUAL_TRIGGER: &str = "manual";

/// The envelope id of a manual trigger of `key` at `at`: like [`event_id`], a UUIDv7 with `at`
/// as its time and a name hash of the key and `at`, distinct from any scheduled fire's id.
pub fn manual_event_id(key: &TimerKey, at: Timestamp) -> Uuid {
    let name = format!(
        "{}\u{0}{}\u{0}{MANUAL_TRIGGER}\u{0}{}",
        key.tenant_id,
        key.service_call_id,
        at.as_millis()
    );
    let hash = Uuid::new_v5(&EVENT_ID_NAMESPACE, name.as_bytes()).into_bytes();
    let mut bits = [0u8; 10];
    bits.copy_from_slice(&hash[..10]);
    let millis = u64::try_from(at.as_millis()).unwrap_or(0);
    uuid::Builder::from_unix_timestamp_millis(millis, &bits).into_uuid()
}

impl Envelope<DueTimeReached> {
    /// The event for a claimed timer. Its id is [`event_id`]: every fire of the same timer
    /// revision carries the same id, so a repeat (after a crash between publish and mark, or a
    /// publish retried after an outage) is dropped by the broker's de-duplication and is
    /// recognisable to consumers.
    pub fn for_timer(timer: &ClaimedTimer, reached_at: Timestamp) -> Self {
        Self::for_fire(timer, reached_at, 0)
    }

    /// [`for_timer`](Self::for_timer) for the `refire`-th fire again of a one-shot timer
    /// ([`refired_event_id`]; 0 is the first fire).
    pub fn for_fire(timer: &ClaimedTimer, reached_at: Timestamp, refire: u32) -> Self {
        // A payload was valid JSON when accepted; a store that hands back something else is
        // corrupt, and the event still goes out without it rather than not at all.
        let payload = timer.payload.as_ref().and_then(|p| {
            RawValue::from_string(p.clone())
                .map_err(|e| tracing::error!(timer = %timer.key, error = %e, "stored payload is not JSON; dropped from event"))
                .ok()
        });
        let id = refired_event_id(timer, refire);
        Self::about(
            timer,
            id,
            DUE_TIME_REACHED,
            reached_at,
            DueTimeReached {
                tenant_id: timer.key.tenant_id.clone(),
                service_call_id: timer.key.service_call_id.clone(),
                due_at: timer.due_at.to_rfc3339(),
                reached_at: reached_at.to_rfc3339(),
                occurrence: timer
                    .recurrence
                    .as_ref()
                    .map(|_| timer.occurrences.saturating_add(1)),
                trigger: None,
                refire: (refire > 0).then_some(refire),
                payload,
            },
        )
    }

    /// The event of a manual trigger of `timer` at `at`: due and reached at `at`, with
    /// `"trigger": "manual"`, its id [`manual_event_id`].
    pub fn manual(timer: &Timer, at: Timestamp) -> Self {
        Envelope {
            id: manual_event_id(&timer.key, at),
            kind: DUE_TIME_REACHED.to_owned(),
            tenant_id: timer.key.tenant_id.clone(),
            correlation_id: timer.correlation_id.clone(),
            causation_id: None,
            aggregate_id: timer.key.service_call_id.clone(),
            timestamp_ms: at.as_millis(),
            payload: DueTimeReached {
                tenant_id: timer.key.tenant_id.clone(),
                service_call_id: timer.key.service_call_id.clone(),
                due_at: at.to_rfc3339(),
                reached_at: at.to_rfc3339(),
                occurrence: None,
                trigger: Some(MANUAL_TRIGGER.to_owned()),
                refire: None,
                payload: timer
                    .payload
                    .as_ref()
                    .and_then(|p| RawValue::from_string(p.clone()).ok()),
            },
        }
    }
}

pub const TIMER_FAILED: &str = "TimerFailed";

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TimerFailed {
    pub tenant_id: String,
    pub service_call_id: String,
    pub due_at: String,
    pub failed_at: String,
    pub attempts: u32,
    pub last_error: String,
    /// For a recurring timer: the occurrence that could not be published (1 for the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub occurrence: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<Box<RawValue>>,
}

impl Envelope<TimerFailed> {
    /// The dead letter for `timer`, whose `attempts`-th publish failed with `error`. Its id is
    /// derived from the fire's id, so a repeat carries the same one.
    pub fn for_timer(timer: &ClaimedTimer, at: Timestamp, attempts: u32, error: &str) -> Self {
        let fire = event_id(timer);
        let id = Uuid::new_v5(&fire, TIMER_FAILED.as_bytes());
        Self::about(
            timer,
            id,
            TIMER_FAILED,
            at,
            TimerFailed {
                tenant_id: timer.key.tenant_id.clone(),
                service_call_id: timer.key.service_call_id.clone(),
                due_at: timer.due_at.to_rfc3339(),
                failed_at: at.to_rfc3339(),
                attempts,
                last_error: error.to_owned(),
                occurrence: timer
                    .recurrence
                    .as_ref()
                    .map(|_| timer.occurrences.saturating_add(1)),
                payload: timer
                    .payload
                    .as_ref()
                    .and_then(|p| RawValue::from_string(p.clone()).ok()),
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn every_reason_has_its_own_code() {
        let mut codes: Vec<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), Reason::ALL.len());
        assert_eq!(
            serde_json::to_string(&Reason::TooFar).unwrap(),
            "\"too_far\""
        );
    }

    const NOW: Timestamp = Timestamp::from_millis(1_800_000_000_000);

    fn decode(s: &str) -> Result<NewTimer, Rejection> {
        decode_schedule(s.as_bytes(), &Limits::default(), NOW)
    }

    #[test]
    fn bare_command_with_offset() {
        let t = decode(
            r#"{"tenantId":"t1","serviceCallId":"c1","dueAt":"2027-01-15T10:00:00.250+02:00"}"#,
        )
        .unwrap();
        assert_eq!(t.key, TimerKey::new("t1", "c1"));
        assert_eq!(t.due_at.to_rfc3339(), "2027-01-15T08:00:00.250Z");
        assert_eq!(t.correlation_id, None);
        assert_eq!(t.payload, None);
    }

    #[test]
    fn due_time_ms_and_payload() {
        let t = decode(r#"{"tenantId":"t","serviceCallId":"c","dueTimeMs":1800000000500,"correlationId":"corr","payload":{"a":[1,2]}}"#).unwrap();
        assert_eq!(t.due_at.as_millis(), 1_800_000_000_500);
        assert_eq!(t.correlation_id.as_deref(), Some("corr"));
        assert_eq!(t.payload.as_deref(), Some(r#"{"a":[1,2]}"#));
    }

    #[test]
    fn envelope_form() {
        let t = decode(r#"{"id":"x","type":"ScheduleTimer","tenantId":"t","correlationId":"k","timestampMs":1,"payload":{"serviceCallId":"c","dueTimeMs":5,"payload":"opaque"}}"#).unwrap();
        assert_eq!(t.key, TimerKey::new("t", "c"));
        assert_eq!(t.correlation_id.as_deref(), Some("k"));
        assert_eq!(t.payload.as_deref(), Some(r#""opaque""#));
    }

    #[test]
    fn envelope_tenant_mismatch() {
        let e = decode(r#"{"type":"ScheduleTimer","tenantId":"a","payload":{"tenantId":"b","serviceCallId":"c","dueTimeMs":5}}"#).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("payload.tenantId"));
    }

    #[test]
    fn rejections_name_the_field() {
        let cases = [
            (
                r#"{"tenantId":"t","dueTimeMs":5}"#,
                "missing_field",
                Some("serviceCallId"),
            ),
            (
                r#"{"tenantId":"","serviceCallId":"c","dueTimeMs":5}"#,
                "invalid_id",
                Some("tenantId"),
            ),
            (
                r#"{"tenantId":"t\u0007","serviceCallId":"c","dueTimeMs":5}"#,
                "invalid_id",
                Some("tenantId"),
            ),
            (
                r#"{"tenantId":"t","serviceCallId":"c"}"#,
                "missing_field",
                Some("dueAt"),
            ),
            (
                r#"{"tenantId":"t","serviceCallId":"c","dueAt":"tomorrow"}"#,
                "invalid_time",
                Some("dueAt"),
            ),
            (
                r#"{"tenantId":"t","serviceCallId":"c","dueAt":"2027-01-15T10:00:00"}"#,
                "invalid_time",
                Some("dueAt"),
            ),
            (
                r#"{"tenantId":"t","serviceCallId":"c","dueTimeMs":-1}"#,
                "invalid_time",
                Some("dueTimeMs"),
            ),
            (
                r#"{"tenantId":"t","serviceCallId":"c","dueTimeMs":99999999999999999}"#,
                "too_far",
                Some("dueTimeMs"),
            ),
            (
                r#"{"tenantId":"t","serviceCallId":"c","dueTimeMs":1e30}"#,
                "invalid_json",
                Some("dueTimeMs"),
            ),
            (
                r#"{"tenantId":5,"serviceCallId":"c","dueTimeMs":5}"#,
                "invalid_json",
                Some("tenantId"),
            ),
            (
                r#"{"type":"CancelEverything","tenantId":"t"}"#,
                "unknown_type",
                Some("type"),
            ),
            (
                r#"{"type":"ScheduleTimer","tenantId":"t"}"#,
                "missing_field",
                Some("payload"),
            ),
            // serde reports a duplicate at the object, naming the key in the message.
            (
                r#"{"tenantId":"t","tenantId":"u","serviceCallId":"c","dueTimeMs":5}"#,
                "invalid_json",
                None,
            ),
            (
                r#"{"tenantId":"t","serviceCallId":"c","dueTimeMs":5} trailing"#,
                "invalid_json",
                None,
            ),
            ("not json", "invalid_json", None),
            ("{not json", "invalid_json", None),
            ("", "invalid_json", None),
        ];
        for (input, reason, field) in cases {
            let e = decode(input).expect_err(input);
            assert_eq!(e.reason, reason, "{input}: {e}");
            assert_eq!(e.field.as_deref(), field, "{input}: {e}");
        }
    }

    #[test]
    fn limits_apply() {
        let limits = Limits {
            max_message_bytes: 200,
            max_id_bytes: 4,
            max_payload_bytes: 8,
            max_horizon: Duration::from_secs(60),
            ..Limits::default()
        };
        let d = |s: &str| decode_schedule(s.as_bytes(), &limits, NOW).unwrap_err();
        assert_eq!(
            d(r#"{"tenantId":"toolong","serviceCallId":"c","dueTimeMs":5}"#).reason,
            "invalid_id"
        );
        assert_eq!(
            d(r#"{"tenantId":"t","serviceCallId":"c","dueTimeMs":5,"payload":"123456789"}"#).reason,
            "payload_too_large"
        );
        assert_eq!(
            d(&format!(
                r#"{{"tenantId":"t","serviceCallId":"c","dueTimeMs":{}}}"#,
                NOW.as_millis() + 61_000
            ))
            .reason,
            "too_far"
        );
        assert_eq!(d(&" ".repeat(201)).reason, "too_large");
    }

    #[test]
    fn invalid_utf8_and_deep_json_are_rejected() {
        assert_eq!(
            decode_schedule(b"{\"tenantId\":\"\xff\"}", &Limits::default(), NOW)
                .unwrap_err()
                .reason,
            "invalid_json"
        );
        let deep = format!(
            r#"{{"tenantId":"t","serviceCallId":"c","dueTimeMs":5,"payload":{}{}}}"#,
            "[".repeat(10_000),
            "]".repeat(10_000)
        );
        assert_eq!(decode(&deep).unwrap_err().reason, "invalid_json");
    }

    #[test]
    fn json_depth_ignores_strings() {
        assert_eq!(json_depth(r#"{"a":[1,{"b":"[[[{"}],"c":"\\\"]"}"#), 3);
        assert_eq!(json_depth("5"), 0);
    }

    fn decode_any(s: &str) -> Result<Command, Rejection> {
        super::decode_command(s.as_bytes(), &Limits::default(), NOW)
    }

    #[test]
    fn cancel_bare_and_in_an_envelope() {
        let key = TimerKey::new("t", "c");
        assert_eq!(
            decode_any(r#"{"type":"CancelTimer","tenantId":"t","serviceCallId":"c"}"#).unwrap(),
            Command::Cancel(key.clone())
        );
        assert_eq!(
            decode_any(r#"{"type":"CancelTimer","tenantId":"t","payload":{"serviceCallId":"c"}}"#)
                .unwrap(),
            Command::Cancel(key)
        );
        let e = decode_any(
            r#"{"type":"CancelTimer","tenantId":"t","serviceCallId":"c","dueTimeMs":5}"#,
        )
        .unwrap_err();
        assert_eq!(e.field.as_deref(), Some("dueTimeMs"), "{e}");
        let e = decode_any(r#"{"type":"CancelTimer","tenantId":"t"}"#).unwrap_err();
        assert_eq!(e.reason, "missing_field");
        // The HTTP API's schedule endpoint takes no cancels.
        let e = decode(r#"{"type":"CancelTimer","tenantId":"t","serviceCallId":"c"}"#).unwrap_err();
        assert_eq!(e.reason, "not_accepted_here");
        let e = decode_any(r#"{"type":"Nope","tenantId":"t","serviceCallId":"c"}"#).unwrap_err();
        assert!(e.message.contains("CancelTimer"), "{e}");
    }

    #[test]
    fn cron_timers_start_at_their_first_occurrence() {
        // NOW = 2027-01-15T08:00:00Z; 09:30 in Berlin (UTC+1 in winter) is 08:30Z.
        let t = decode(r#"{"tenantId":"t","serviceCallId":"c","cron":"30 9 * * *","timeZone":"Europe/Berlin","maxOccurrences":3}"#).unwrap();
        assert_eq!(t.due_at.to_rfc3339(), "2027-01-15T08:30:00.000Z");
        let r = t.recurrence.unwrap();
        assert_eq!(r.time_zone, "Europe/Berlin");
        assert_eq!(r.max_occurrences, Some(3));
        // The time zone defaults to UTC.
        let t = decode(r#"{"tenantId":"t","serviceCallId":"c","cron":"0 12 * * *"}"#).unwrap();
        assert_eq!(t.due_at.to_rfc3339(), "2027-01-15T12:00:00.000Z");
    }

    #[test]
    fn cron_mistakes_are_rejected_naming_the_field() {
        let cases = [
            (
                r#"{"tenantId":"t","serviceCallId":"c","cron":"* * * * *","dueTimeMs":5}"#,
                "cron",
            ),
            (
                r#"{"tenantId":"t","serviceCallId":"c","cron":"99 * * * *"}"#,
                "cron",
            ),
            (
                r#"{"tenantId":"t","serviceCallId":"c","cron":"* * * * *","timeZone":"Nowhere/Land"}"#,
                "timeZone",
            ),
            (
                r#"{"tenantId":"t","serviceCallId":"c","dueTimeMs":5,"timeZone":"UTC"}"#,
                "timeZone",
            ),
            (
                r#"{"tenantId":"t","serviceCallId":"c","cron":"* * * * *","maxOccurrences":0}"#,
                "maxOccurrences",
            ),
            (
                r#"{"tenantId":"t","serviceCallId":"c","cron":"0 0 1 1 *","endAt":"2026-01-01T00:00:00Z"}"#,
                "cron",
            ),
            (
                r#"{"tenantId":"t","serviceCallId":"c","cron":"* * * * *","endAt":"soon"}"#,
                "endAt",
            ),
        ];
        for (input, field) in cases {
            let e = decode(input).unwrap_err();
            assert_eq!(e.field.as_deref(), Some(field), "{input}: {e}");
        }
    }

    #[test]
    fn recurring_events_say_which_occurrence() {
        let timer = ClaimedTimer {
            key: TimerKey::new("t", "c"),
            due_at: Timestamp::from_millis(1_000),
            registered_at: Timestamp::from_millis(0),
            correlation_id: None,
            payload: None,
            attempts: 0,
            revision: 4,
            recurrence: Some(Recurrence {
                cron: "* * * * * *".into(),
                time_zone: "UTC".into(),
                end_at: None,
                max_occurrences: None,
            }),
            occurrences: 4,
            policy: None,
            work: None,
        };
        let ev = DueTimeReachedEnvelope::for_timer(&timer, Timestamp::from_millis(1_002));
        assert_eq!(ev.payload.occurrence, Some(5));
        let failed = TimerFailedEnvelope::for_timer(&timer, Timestamp::from_millis(9), 3, "down");
        let v: serde_json::Value = serde_json::from_slice(&failed.to_json()).unwrap();
        assert_eq!(v["type"], "TimerFailed");
        assert_eq!(v["payload"]["attempts"], 3);
        assert_eq!(v["payload"]["lastError"], "down");
        assert_eq!(v["payload"]["occurrence"], 5);
        assert_eq!(
            failed.id,
            TimerFailedEnvelope::for_timer(&timer, Timestamp::from_millis(99), 3, "x").id,
            "a repeat carries the same id"
        );
    }

    #[test]
    fn event_envelope_shape() {
        let timer = ClaimedTimer {
            key: TimerKey::new("t", "c"),
            due_at: Timestamp::from_millis(1_000),
            registered_at: Timestamp::from_millis(0),
            correlation_id: Some("corr".into()),
            payload: Some(r#"{"x":1}"#.into()),
            attempts: 0,
            revision: 0,
            recurrence: None,
            occurrences: 0,
            policy: None,
            work: None,
        };
        let ev = DueTimeReachedEnvelope::for_timer(&timer, Timestamp::from_millis(1_005));
        let v: serde_json::Value = serde_json::from_slice(&ev.to_json()).unwrap();
        assert_eq!(v["type"], "DueTimeReached");
        assert_eq!(v["id"].as_str().unwrap(), ev.id.to_string());
        assert_eq!(ev.id.get_version_num(), 7);
        // Same timer revision: same id, whenever it fires; another revision or key: another id.
        let again = DueTimeReachedEnvelope::for_timer(&timer, Timestamp::from_millis(9_999));
        assert_eq!(again.id, ev.id);
        let moved = ClaimedTimer {
            revision: 1,
            ..timer.clone()
        };
        assert_ne!(
            DueTimeReachedEnvelope::for_timer(&moved, Timestamp::from_millis(1_005)).id,
            ev.id
        );
        let other = ClaimedTimer {
            key: TimerKey::new("t", "d"),
            ..timer.clone()
        };
        assert_ne!(event_id(&other), ev.id);
        let (secs, nanos) = ev.id.get_timestamp().expect("v7 timestamp").to_unix();
        assert_eq!(
            secs * 1000 + u64::from(nanos) / 1_000_000,
            1_000,
            "timestamp = due time"
        );
        assert_eq!(v["tenantId"], "t");
        assert_eq!(v["aggregateId"], "c");
        assert_eq!(v["correlationId"], "corr");
        assert!(v["causationId"].is_null());
        assert_eq!(v["timestampMs"], 1_005);
        assert_eq!(v["payload"]["dueAt"], "1970-01-01T00:00:01.000Z");
        assert_eq!(v["payload"]["reachedAt"], "1970-01-01T00:00:01.005Z");
        assert_eq!(v["payload"]["serviceCallId"], "c");
        assert_eq!(v["payload"]["payload"]["x"], 1);
    }
}
