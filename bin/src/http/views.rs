//! A timer as the API shows it ([`TimerView`], with its policy, work and recurrence), the
//! command that schedules one, and the outcomes of the routes on one timer: the bodies the
//! routes of several resources share. A body only one resource uses lives with its handlers.
//! The OpenAPI document is generated from these types and the handlers' `#[utoipa::path]`
//! attributes, so it says what the service sends.
//!
//! Times are RFC 3339 strings in UTC; `…Ms` fields are milliseconds.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine as _;
use serde::Serialize;
use serde_json::Value;
use timer_core::policy::{CatchUp, Counts as WorkCounts, Policy, Work};
use timer_core::{Timer, Timestamp};
use utoipa::ToSchema;

use crate::http::error::ErrorDetail;

/// A timer as the API shows it.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TimerView {
    pub tenant_id: String,
    pub service_call_id: String,
    /// `Scheduled`, `Paused`, `Reached`, `Cancelled` or `Failed`.
    pub state: &'static str,
    /// When it fires (a series: its next occurrence).
    #[schema(format = DateTime)]
    pub due_at: String,
    pub due_time_ms: i64,
    #[schema(format = DateTime)]
    pub registered_at: String,
    #[schema(format = DateTime)]
    #[schema(required = true)]
    pub reached_at: Option<String>,
    /// Publishes tried for the current occurrence.
    pub attempts: u32,
    #[schema(required = true)]
    pub last_error: Option<String>,
    /// When a Scheduled timer whose last publish failed is tried again; null otherwise.
    #[schema(format = DateTime)]
    #[schema(required = true)]
    pub next_attempt_at: Option<String>,
    #[schema(required = true)]
    pub correlation_id: Option<String>,
    /// The JSON the `ScheduleTimer` carried, given back in `DueTimeReached`.
    #[schema(required = true)]
    pub payload: Option<Value>,
    /// A series' pattern; null for a one-shot timer.
    #[schema(required = true)]
    pub recurrence: Option<RecurrenceView>,
    /// A series' occurrences fired so far; null for a one-shot timer.
    #[schema(required = true)]
    pub occurrences: Option<u32>,
    /// With `?next=N`: the next fire times.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_occurrences: Option<Vec<Occurrence>>,
    /// The policies its `ScheduleTimer` gave (durations in milliseconds); null without any.
    #[schema(required = true)]
    pub policy: Option<PolicyView>,
    /// What the policies did: the fire awaiting its completion, a buffered occurrence, counts;
    /// null while nothing was recorded.
    #[schema(required = true)]
    pub work: Option<WorkView>,
    /// Where its fires go, in the broker's own terms, as its `ScheduleTimer` gave it; null: the
    /// events destination.
    #[schema(required = true, value_type = Option<Object>)]
    pub target: Option<Value>,
    /// Its own message, sent in place of the event; null: the event.
    #[schema(required = true)]
    pub message: Option<MessageView>,
    /// The W3C trace context it was scheduled in, which its fires carry; null for a timer
    /// stored before trace contexts were kept.
    #[schema(required = true)]
    pub traceparent: Option<String>,
    /// The vendor trace state scheduled with `traceparent`, which its fires carry too; absent
    /// without one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
    /// The trace id of `traceparent` (32 hex digits).
    #[schema(required = true)]
    pub trace_id: Option<String>,
    /// A link to the trace in a tracing UI (`telemetry.trace_url`); only on
    /// `GET /v1/tenants/{tenant}/timers/{id}` when configured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_url: Option<String>,
}

/// A timer's own message: its size, content type and headers; the body only on request
/// (`?body=true`).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MessageView {
    /// Bytes of its body.
    pub size_bytes: usize,
    #[schema(required = true)]
    pub content_type: Option<String>,
    pub headers: BTreeMap<String, String>,
    /// The body in standard base64, with `?body=true`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body_base64: Option<String>,
}

impl TimerView {
    pub fn of(t: &Timer) -> Self {
        let payload = t
            .payload
            .as_deref()
            .and_then(|p| serde_json::from_str::<Value>(p).ok());
        TimerView {
            tenant_id: t.key.tenant_id.clone(),
            service_call_id: t.key.service_call_id.clone(),
            state: t.state.as_str(),
            due_at: t.due_at.to_rfc3339(),
            due_time_ms: t.due_at.as_millis(),
            registered_at: t.registered_at.to_rfc3339(),
            reached_at: t.reached_at.map(Timestamp::to_rfc3339),
            attempts: t.attempts,
            last_error: t.last_error.clone(),
            next_attempt_at: t.is_retrying().then(|| t.available_at.to_rfc3339()),
            correlation_id: t.correlation_id.clone(),
            payload,
            recurrence: t.recurrence.as_ref().map(|r| RecurrenceView {
                cron: r.cron.clone(),
                time_zone: r.time_zone.clone(),
                end_at: r.end_at.map(Timestamp::to_rfc3339),
                max_occurrences: r.max_occurrences,
            }),
            occurrences: t.recurrence.as_ref().map(|_| t.occurrences),
            next_occurrences: None,
            policy: t.policy.as_ref().map(PolicyView::of),
            work: t.work.as_ref().map(|w| WorkView::of(w, t.due_at)),
            target: t
                .target
                .as_ref()
                .map(|target| Value::Object(target.fields().clone())),
            message: t.message.as_ref().map(|m| MessageView {
                size_bytes: m.body.len(),
                content_type: m.meta.content_type.clone(),
                headers: m.meta.headers.clone(),
                body_base64: None,
            }),
            traceparent: t.trace.as_ref().map(|c| c.traceparent().to_owned()),
            tracestate: t
                .trace
                .as_ref()
                .and_then(|c| c.tracestate().map(str::to_owned)),
            trace_id: t.trace.as_ref().map(|c| c.trace_id().to_owned()),
            trace_url: None,
        }
    }

    /// Adds the body of `t`'s message (`?body=true`).
    pub fn add_message_body(&mut self, t: &Timer) {
        if let (Some(view), Some(message)) = (self.message.as_mut(), t.message.as_ref()) {
            view.body_base64 =
                Some(base64::engine::general_purpose::STANDARD.encode(&message.body));
        }
    }
}

fn millis(d: Option<Duration>) -> Option<u64> {
    d.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A timer's policies, named as in `ScheduleTimer` (durations with `Ms`).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyView {
    /// `allow`, `skip` or `bufferOne`.
    pub overlap: &'static str,
    /// `completionTimeout`; null: completions are not waited for (`overlap: allow`).
    #[schema(required = true)]
    pub completion_timeout_ms: Option<u64>,
    /// `once`, `skip` or `all`; null: `once` after downtime, a resume skips.
    #[schema(required = true)]
    pub catch_up: Option<&'static str>,
    #[schema(required = true)]
    pub catch_up_limit: Option<u32>,
    #[schema(required = true)]
    pub catch_up_window_ms: Option<u64>,
    #[schema(required = true)]
    pub jitter_ms: Option<u64>,
}

impl PolicyView {
    fn of(p: &Policy) -> Self {
        PolicyView {
            overlap: p.overlap.as_str(),
            completion_timeout_ms: millis(p.completion_timeout),
            catch_up: p.catch_up.map(CatchUp::as_str),
            catch_up_limit: p.catch_up_limit,
            catch_up_window_ms: millis(p.catch_up_window),
            jitter_ms: millis(p.jitter),
        }
    }
}

/// What a timer's policies did.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkView {
    /// The fired occurrence whose completion is awaited.
    #[schema(required = true)]
    pub awaiting: Option<AwaitingView>,
    /// The occurrence at `dueAt` waits for the awaited one to complete (`bufferOne`); null
    /// when none does.
    #[schema(format = DateTime)]
    #[schema(required = true)]
    pub buffered: Option<String>,
    /// The last occurrence whose completion arrived.
    #[schema(required = true)]
    pub last_completed: Option<u32>,
    /// The cron time the jittered `dueAt` stands for.
    #[schema(format = DateTime)]
    #[schema(required = true)]
    pub nominal_due_at: Option<String>,
    pub counts: WorkCounts,
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AwaitingView {
    /// The event's `payload.occurrence` (1 for a one-shot timer).
    pub occurrence: u32,
    #[schema(format = DateTime)]
    pub due_at: String,
    #[schema(format = DateTime)]
    pub fired_at: String,
    /// When it counts as timed out.
    #[schema(format = DateTime)]
    #[schema(required = true)]
    pub deadline: Option<String>,
    /// A one-shot timer fired again because its work did not complete in time: how often.
    pub refires: u32,
}

impl WorkView {
    fn of(w: &Work, due_at: Timestamp) -> Self {
        WorkView {
            awaiting: w.awaiting.as_ref().map(|a| AwaitingView {
                occurrence: a.occurrence,
                due_at: a.due_at.to_rfc3339(),
                fired_at: a.fired_at.to_rfc3339(),
                deadline: a.deadline.map(Timestamp::to_rfc3339),
                refires: a.refires,
            }),
            buffered: w.buffered.then(|| due_at.to_rfc3339()),
            last_completed: w.completed,
            nominal_due_at: w.nominal.map(Timestamp::to_rfc3339),
            counts: w.counts.clone(),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RecurrenceView {
    pub cron: String,
    /// IANA zone the cron pattern is read in.
    pub time_zone: String,
    #[schema(format = DateTime)]
    #[schema(required = true)]
    pub end_at: Option<String>,
    #[schema(required = true)]
    pub max_occurrences: Option<u32>,
}

/// A coming fire time, in UTC and on the wall clock of the timer's zone.
#[derive(Debug, Serialize, ToSchema)]
pub struct Occurrence {
    #[schema(format = DateTime)]
    pub utc: String,
    #[schema(format = DateTime)]
    pub local: String,
}

/// What a request did to one timer, and the timer as it is now. A 409 carries `error` too.
#[derive(Debug, Serialize, ToSchema)]
pub struct TimerOutcome {
    /// `created`, `updated`, `paused`, `resumed`, `already_paused`, `already_reached`, …
    pub outcome: &'static str,
    #[schema(required = true)]
    pub timer: Option<TimerView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorDetail>,
}

/// An outcome without a timer (`cancelled`, `already_cancelled`, `queued`).
#[derive(Debug, Serialize, ToSchema)]
pub struct Outcome {
    pub outcome: &'static str,
}

/// `POST …/trigger`: the extra `DueTimeReached` went out.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TriggerOutcome {
    /// `triggered`.
    pub outcome: &'static str,
    /// The event's id (deterministic per timer and trigger time).
    pub event_id: String,
    #[schema(format = DateTime)]
    pub at: String,
}

/// A `ScheduleTimer` command, as `POST /v1/timers` and each item of a batch take it (the wire
/// contract in `timer/src/wire/README.md` has every rule). Give `dueAt` or `dueTimeMs`; `cron`
/// makes it a series.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScheduleTimer {
    /// `ScheduleTimer` (optional over HTTP).
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub tenant_id: String,
    pub service_call_id: String,
    #[schema(format = DateTime)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub due_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub due_time_ms: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
    /// Any JSON; handed back in `DueTimeReached`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cron: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub time_zone: Option<String>,
    #[schema(format = DateTime)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub end_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_occurrences: Option<u32>,
    /// `allow` (the default), `skip` or `bufferOne`: what a series does with an occurrence due
    /// while the work of the one before has not completed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overlap: Option<String>,
    /// How long the work of one fire may take: a duration (`"30s"`, `"1h 30m"`) or integer
    /// milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_timeout: Option<WireDuration>,
    /// `once`, `skip` or `all`: what a series does with the occurrences it missed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub catch_up: Option<String>,
    /// With `catchUp: all`: at most this many missed occurrences fire.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub catch_up_limit: Option<u32>,
    /// A missed occurrence older than this is skipped: a duration.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub catch_up_window: Option<WireDuration>,
    /// Each occurrence fires later than its cron time by less than this: a duration.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub jitter: Option<WireDuration>,
}

/// A duration of the wire contract: text such as `"30s"`, `"5m"`, `"1h 30m"`, or integer
/// milliseconds.
// Only the document uses it: a command is read by the wire decoder, not through this type.
#[allow(dead_code)]
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum WireDuration {
    Text(String),
    Millis(u64),
}
