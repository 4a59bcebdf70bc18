//! The checks of a decoded command against [`Limits`]: ids, due time and horizon, payload size and
//! depth, recurrence and policy fields, completion fields.

use std::time::Duration;

use super::decode::{Command, WireCommand, WireDuration};
use super::outbound::{completion_message, message_of, target_of};
use super::reasons::{Reason, Rejection};
use super::{truncate, TIMER_COMPLETED};
use crate::config::Limits;
use crate::model::{NewTimer, TimerKey, Timestamp};
use crate::policy::{self, CatchUp, Completion, Outcome, Overlap, Policy, Work};
use crate::recurrence::{Recurrence, Schedule};
use crate::trace::{TraceContext, TraceHeaders};
use serde_json::value::RawValue;

/// How long a completion's `message` may be: longer ones are cut (a completion is never
/// refused for its message).
pub const MAX_COMPLETION_MESSAGE_BYTES: usize = 1024;

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

pub(super) fn validate_completion(
    mut cmd: WireCommand<'_>,
    prefix: &str,
    limits: &Limits,
) -> Result<Command, Rejection> {
    let occurrence = cmd.occurrence.take();
    let outcome = cmd.outcome.take();
    let message = completion_message(cmd.message.take(), &|name| format!("{prefix}{name}"))?;
    let key = validate_key(cmd, TIMER_COMPLETED, prefix, limits)?;
    let completion = completion_fields(occurrence, outcome.as_deref(), message, prefix)?;
    Ok(Command::Complete(key, completion))
}

/// A `CancelTimer`, `PauseTimer`, `ResumeTimer` or `TimerCompleted` (`kind`) names its timer and
/// nothing else a `ScheduleTimer` would carry (a completion's own fields are taken out first).
pub(super) fn validate_key(
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
        ("dueInMs", cmd.due_in_ms.is_some()),
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
        ("target", cmd.target.is_some()),
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
    if cmd.due_at.is_some() || cmd.due_time_ms.is_some() || cmd.due_in_ms.is_some() {
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

pub(super) fn validate(
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
    let trace = trace_of(&cmd);
    if let Some(name) = [
        ("occurrence", cmd.occurrence.is_some()),
        ("outcome", cmd.outcome.is_some()),
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
    let due_at = match (cmd.due_at, cmd.due_time_ms, cmd.due_in_ms) {
        _ if recurring.is_some() => (
            recurring.as_ref().map_or(now, |(_, first)| *first),
            field("cron"),
        ),
        (None, None, None) => {
            return Err(Rejection::new(
                Reason::MissingField,
                Some(&field("dueAt")),
                "dueAt (RFC 3339 with offset), dueTimeMs (epoch milliseconds), dueInMs \
                 (milliseconds from now) or cron (a recurring timer) is required",
            ))
        }
        (Some(text), None, None) => (parse_time(&text, &field("dueAt"))?, field("dueAt")),
        (None, Some(ms), None) => (Timestamp::from_millis(ms), field("dueTimeMs")),
        (None, None, Some(ms)) => {
            let after = u64::try_from(ms).map_err(|_| {
                Rejection::new(
                    Reason::InvalidTime,
                    Some(&field("dueInMs")),
                    format!("{ms} is negative; give the milliseconds from now, 0 or more"),
                )
            })?;
            (
                now.saturating_add(std::time::Duration::from_millis(after)),
                field("dueInMs"),
            )
        }
        _ => {
            return Err(Rejection::new(
                Reason::InvalidTime,
                Some(&field("dueAt")),
                "give one of dueAt, dueTimeMs and dueInMs",
            ))
        }
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
    let target = target_of(cmd.target, &field)?;
    let message = message_of(cmd.message, &field, limits)?;
    if message.is_some() && payload.is_some() {
        return Err(Rejection::new(
            Reason::InvalidJson,
            Some(&field("message")),
            "a message goes out in place of the event, whose payload this is: give one of them",
        ));
    }
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
        target,
        message,
        trace,
    })
}

/// The command's own trace context, when it gives a well-formed one (a malformed one is
/// ignored, never a rejection: `crate::trace`).
fn trace_of(cmd: &WireCommand<'_>) -> Option<TraceContext> {
    let text = |raw: &RawValue| serde_json::from_str::<String>(raw.get()).ok();
    let traceparent = cmd.traceparent?;
    let headers = TraceHeaders {
        // Not a string: its JSON text, which no check passes.
        traceparent: Some(text(traceparent).unwrap_or_else(|| traceparent.get().to_owned())),
        tracestate: cmd.tracestate.and_then(text),
    };
    TraceContext::carried(&headers, "command")
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
pub fn check_id(value: String, field: &str, limits: &Limits) -> Result<String, Rejection> {
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
pub(super) fn json_depth(json: &str) -> usize {
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
