//! Decoding a command: its JSON read into the wire form (`WireCommand`), the envelope unwrapped,
//! and the command of each `type` handed to its checks (`validate.rs`) to become a [`Command`].

use serde::Deserialize;
use serde_json::value::RawValue;

use std::time::Duration;

use super::reasons::{Reason, Rejection};
use super::validate::{validate, validate_completion, validate_key};
use super::{truncate, CANCEL_TIMER, PAUSE_TIMER, RESUME_TIMER, SCHEDULE_TIMER, TIMER_COMPLETED};
use crate::config::Limits;
use crate::model::{NewTimer, TimerKey, Timestamp};
use crate::policy::Completion;

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
pub(super) struct WireCommand<'a> {
    #[serde(rename = "type", default)]
    pub(super) kind: Option<String>,
    #[serde(default)]
    pub(super) tenant_id: Option<String>,
    #[serde(default)]
    pub(super) service_call_id: Option<String>,
    #[serde(default)]
    pub(super) due_at: Option<String>,
    #[serde(default)]
    pub(super) due_time_ms: Option<i64>,
    #[serde(default)]
    pub(super) due_in_ms: Option<i64>,
    #[serde(default)]
    pub(super) correlation_id: Option<String>,
    #[serde(borrow, default)]
    pub(super) payload: Option<&'a RawValue>,
    #[serde(default)]
    pub(super) cron: Option<String>,
    #[serde(default)]
    pub(super) time_zone: Option<String>,
    #[serde(default)]
    pub(super) end_at: Option<String>,
    #[serde(default)]
    pub(super) max_occurrences: Option<u32>,
    #[serde(default)]
    pub(super) overlap: Option<String>,
    #[serde(default)]
    pub(super) completion_timeout: Option<WireDuration>,
    #[serde(default)]
    pub(super) catch_up: Option<String>,
    #[serde(default)]
    pub(super) catch_up_limit: Option<i64>,
    #[serde(default)]
    pub(super) catch_up_window: Option<WireDuration>,
    #[serde(default)]
    pub(super) jitter: Option<WireDuration>,
    #[serde(default)]
    pub(super) occurrence: Option<i64>,
    #[serde(default)]
    pub(super) outcome: Option<String>,
    /// A `TimerCompleted`'s text, or a `ScheduleTimer`'s own message (an object).
    #[serde(borrow, default)]
    pub(super) message: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub(super) target: Option<&'a RawValue>,
    /// W3C trace context (`crate::trace`): any JSON is taken, a malformed value ignored.
    #[serde(borrow, default)]
    pub(super) traceparent: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub(super) tracestate: Option<&'a RawValue>,
}

/// A duration as a command gives it: text (`"30s"`, `"1h 30m"`, `"500ms"`) or milliseconds.
#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum WireDuration {
    Millis(i64),
    Text(String),
}

impl WireDuration {
    pub(super) fn parse(self, field: &str) -> Result<Duration, Rejection> {
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
    if bytes.len() > limits.command_bytes() {
        return Err(Rejection::new(
            Reason::TooLarge,
            None,
            format!(
                "command is {} bytes, the limit is {} (limits.max_command_bytes)",
                bytes.len(),
                limits.command_bytes()
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
        if inner.traceparent.is_none() {
            (inner.traceparent, inner.tracestate) = (outer.traceparent, outer.tracestate);
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

/// Whom a command is for: its tenant and service call id as [`decode_command`] reads them (an
/// envelope's from its `payload`, the tenant from the envelope where the payload gives none),
/// with nothing else of it read or checked. `None` for what a body that is not such JSON does
/// not give.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Addressed {
    pub tenant_id: Option<String>,
    pub service_call_id: Option<String>,
}

/// [`Addressed`] of a command's bytes: asked before the command is checked (the HTTP API
/// refuses a key another tenant's command before that tenant's rules answer, and audits whom
/// a refused command was for).
pub fn addressed(bytes: &[u8]) -> Addressed {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Names<'a> {
        #[serde(rename = "type", default)]
        kind: Option<serde::de::IgnoredAny>,
        #[serde(default)]
        tenant_id: Option<String>,
        #[serde(default)]
        service_call_id: Option<String>,
        #[serde(borrow, default)]
        payload: Option<&'a RawValue>,
    }
    let Ok(outer) = serde_json::from_slice::<Names>(bytes) else {
        return Addressed::default();
    };
    // An envelope, as `decode_command` tells one: `type` given, no `serviceCallId` beside it.
    let inner = match (&outer.kind, &outer.service_call_id, outer.payload) {
        (Some(_), None, Some(payload)) => serde_json::from_str::<Names>(payload.get()).ok(),
        _ => None,
    };
    match inner {
        Some(inner) => Addressed {
            tenant_id: outer.tenant_id.or(inner.tenant_id),
            service_call_id: inner.service_call_id,
        },
        None => Addressed {
            tenant_id: outer.tenant_id,
            service_call_id: outer.service_call_id,
        },
    }
}

#[cfg(test)]
mod addressed_tests {
    use super::*;

    #[test]
    fn a_command_is_addressed_as_the_decoder_reads_it() {
        let plain = br#"{"tenantId":"acme","serviceCallId":"a","dueInMs":1}"#;
        assert_eq!(
            addressed(plain),
            Addressed {
                tenant_id: Some("acme".into()),
                service_call_id: Some("a".into()),
            }
        );
        // An envelope: the names inside its payload; the envelope's tenant where it gives one.
        let envelope =
            br#"{"type":"ScheduleTimer","payload":{"tenantId":"b\u0061d","serviceCallId":"x"}}"#;
        assert_eq!(addressed(envelope).tenant_id.as_deref(), Some("bad"));
        assert_eq!(addressed(envelope).service_call_id.as_deref(), Some("x"));
        let outer = br#"{"type":"CancelTimer","tenantId":"acme","payload":{"serviceCallId":"x"}}"#;
        assert_eq!(addressed(outer).tenant_id.as_deref(), Some("acme"));
        // Not an envelope: `serviceCallId` beside `type` (the payload is the timer's own).
        let own = br#"{"type":"ScheduleTimer","tenantId":"acme","serviceCallId":"a","payload":{"tenantId":"other"}}"#;
        assert_eq!(addressed(own).tenant_id.as_deref(), Some("acme"));
        for junk in [&b"[1]"[..], b"not json", br#"{"tenantId":5}"#] {
            assert_eq!(addressed(junk), Addressed::default());
        }
    }
}
