//! The bodies of the HTTP API as types. The handlers answer with these, and the OpenAPI
//! document (`GET /v1/openapi.json`) is generated from the same types and from the handlers'
//! `#[utoipa::path]` attributes, so the document says what the service sends.
//!
//! Times are RFC 3339 strings in UTC; `…Ms` fields are milliseconds.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use timer_core::policy::{CatchUp, Counts as WorkCounts, Policy, Work};
use timer_core::{Change, HistoryEntry, Timer, Timestamp};
use utoipa::{OpenApi, ToSchema};

/// Every error: `{"error": {"reason", "message", "field"?}}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// A stable code to branch on (`invalid_parameter`, `not_found`, `firing`, …).
    pub reason: String,
    /// The request field at fault (`state`, `commands[3].dueAt`, `filter.prefix`), when one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// What is wrong, for a person.
    pub message: String,
}

impl ErrorDetail {
    pub fn new(reason: &str, field: Option<&str>, message: &str) -> Self {
        ErrorDetail {
            reason: reason.to_owned(),
            field: field.map(str::to_owned),
            message: message.to_owned(),
        }
    }
}

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

/// A page of a tenant's timers, by due time then id.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TimerPage {
    pub timers: Vec<TimerView>,
    /// Give it as `cursor` for the next page; null on the last one.
    #[schema(required = true)]
    pub next_cursor: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SummaryView {
    pub tenant_id: String,
    /// Timers per state: `scheduled`, `paused`, `reached`, `cancelled`, `failed`.
    pub counts: BTreeMap<String, u64>,
    #[schema(format = DateTime)]
    #[schema(required = true)]
    pub next_due_at: Option<String>,
    #[serde(rename = "failedLast24h")]
    pub failed_last_24h: u64,
    /// Timers that fired in the last hour (a series counts once, by its last fire).
    pub fired_last_hour: u64,
}

/// A page of tenants' summaries, by tenant id.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SummaryPage {
    pub tenants: Vec<SummaryView>,
    #[schema(required = true)]
    pub next_cursor: Option<String>,
    /// When these counts were taken: the first page is shared between requests for up to
    /// `http.counts_max_age`; a page after a cursor is counted for its request.
    #[schema(format = DateTime)]
    pub counted_at: String,
}

/// One result of a batch, in the order of the commands: an `outcome`, or the `error` that
/// refused this item (a tenant over its limit).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct BatchResult {
    pub tenant_id: String,
    pub service_call_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcome: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorDetail>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct BatchResults {
    pub results: Vec<BatchResult>,
}

/// A refused batch: nothing was written. With refused items, `error` names the first and
/// `rejected` has them all; a body that is not a batch has only `error`.
#[derive(Debug, Serialize, ToSchema)]
pub struct BatchRefused {
    pub error: ErrorDetail,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rejected: Vec<RejectedItem>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RejectedItem {
    /// Position in `commands`.
    pub index: usize,
    pub error: ErrorDetail,
}

/// What a bulk action did.
#[derive(Debug, Serialize, ToSchema)]
pub struct BulkOutcome {
    /// `cancel`, `pause` or `resume`.
    pub action: &'static str,
    /// Timers the filter matched.
    pub matched: u64,
    /// Timers the action changed.
    pub changed: u64,
    /// Pages applied, each a transaction of its own.
    pub pages: u64,
    /// How many timers ended with each outcome (`paused`, `already_paused`, `firing`, …).
    pub outcomes: BTreeMap<&'static str, u64>,
}

/// One change of a timer: `seq`, `at`, and the change's `type` with its fields.
#[derive(Debug, Serialize, ToSchema)]
pub struct HistoryView {
    /// Numbers the timer's changes from 1; the cursor of the next page is the last `seq`.
    pub seq: u64,
    #[schema(format = DateTime)]
    pub at: String,
    #[serde(flatten)]
    pub change: Change,
}

impl HistoryView {
    pub fn of(entry: &HistoryEntry) -> Self {
        HistoryView {
            seq: entry.seq,
            at: entry.at.to_rfc3339(),
            change: entry.change.clone(),
        }
    }
}

/// A page of a timer's history, oldest first.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct HistoryPage {
    pub history: Vec<HistoryView>,
    #[schema(required = true)]
    pub next_cursor: Option<String>,
}

/// `GET /v1/status`.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    pub version: &'static str,
    pub instance_id: String,
    pub store: Health,
    pub broker: Health,
    /// The engine's tasks that panicked and wait to be started again, with what happened
    /// (empty while every task runs; `/readyz` answers 503 meanwhile).
    pub tasks_down: Vec<TaskDown>,
    pub timers: Counts,
    #[schema(format = DateTime)]
    #[schema(required = true)]
    pub next_due_at: Option<String>,
    pub last_minute: LastMinute,
    /// The minutes of the last hour in which this instance fired, oldest first (the current
    /// minute too, so far); minutes without fires are left out.
    pub last_hour: Vec<MinuteView>,
    /// Other live instances, where the store keeps a register of them (none does yet: null).
    #[schema(required = true)]
    pub instances: Option<Vec<String>>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TaskDown {
    /// `ingest`, `firing`, `purge`, `membership` or `take-over`.
    pub task: &'static str,
    pub error: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// The plugin: `sqlite`, `postgres`, `memory`, `nats`, …
    pub kind: &'static str,
    pub healthy: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Counts from the store; null where it cannot count (or the count failed).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Counts {
    #[schema(required = true)]
    pub pending: Option<u64>,
    #[schema(required = true)]
    pub paused: Option<u64>,
    #[schema(required = true)]
    pub failed: Option<u64>,
    /// When these counts were taken: they are shared between requests for up to
    /// `http.counts_max_age`. Null when there are no counts.
    #[schema(format = DateTime)]
    #[schema(required = true)]
    pub counted_at: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct LastMinute {
    /// Timers this instance fired in the last 60 seconds.
    pub fired: u64,
    pub lateness_ms: Percentiles,
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MinuteView {
    /// The minute's start.
    #[schema(format = DateTime)]
    pub start: String,
    pub fired: u64,
    pub lateness_ms: Percentiles,
}

impl MinuteView {
    pub fn of(m: &timer_core::engine::MinuteFires) -> Self {
        MinuteView {
            start: m.start.to_rfc3339(),
            fired: m.fired,
            lateness_ms: Percentiles {
                p50: m.p50_ms,
                p99: m.p99_ms,
            },
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Percentiles {
    #[schema(required = true)]
    pub p50: Option<u64>,
    #[schema(required = true)]
    pub p99: Option<u64>,
}

/// `GET /readyz`: each part's kind and whether it is `ok`.
#[derive(Debug, Serialize, ToSchema)]
pub struct Readiness {
    pub store: Probe,
    pub broker: Probe,
    /// The engine's tasks (kind `engine`): `unavailable` while one that panicked waits to be
    /// started again.
    pub engine: Probe,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Probe {
    pub kind: &'static str,
    /// `ok` or `unavailable`; why is in the log and in `GET /v1/status` (not told to anonymous
    /// callers).
    pub status: &'static str,
}

/// `GET /v1/dead-letters` (in-process broker): commands it could not take, with the reason.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetters {
    pub dead_letters: Vec<DeadLetterView>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DeadLetterView {
    pub body: String,
    pub reason: String,
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
}

/// `POST /v1/timers/batch`.
#[derive(Debug, Serialize, ToSchema)]
pub struct Batch {
    /// Up to `limits.max_batch` (default 1,000).
    pub commands: Vec<ScheduleTimer>,
}

/// `POST …/pause` (the body is optional).
#[derive(Debug, Serialize, ToSchema)]
pub struct PauseRequest {
    /// Goes into the history; at most 1 KiB.
    pub note: Option<String>,
}

/// `POST …/complete` (the body is optional).
#[derive(Debug, Serialize, ToSchema)]
pub struct CompleteRequest {
    /// The event's `payload.occurrence`; absent: the last fired one (a one-shot timer's only).
    pub occurrence: Option<u32>,
    /// `succeeded` or `failed`.
    pub outcome: Option<String>,
    /// Goes into the history; cut at 1 KiB.
    pub message: Option<String>,
}

/// `POST /v1/tenants/{tenant}/timers/bulk`.
#[derive(Debug, Serialize, ToSchema)]
pub struct BulkRequest {
    /// `cancel`, `pause`, `resume` or `retry`.
    pub action: String,
    pub filter: Option<BulkFilter>,
    /// For `pause`: the note in every paused timer's history.
    pub note: Option<String>,
}

/// The list's filters, as JSON.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct BulkFilter {
    /// One state or several (`scheduled`, `paused`, `reached`, `cancelled`, `failed`).
    pub state: Option<Vec<String>>,
    /// Of the serviceCallId.
    pub prefix: Option<String>,
    #[schema(format = DateTime)]
    pub due_after: Option<String>,
    #[schema(format = DateTime)]
    pub due_before: Option<String>,
    pub recurring: Option<bool>,
    /// Only (`true`) or all but (`false`) the Scheduled timers whose last publish failed.
    pub retrying: Option<bool>,
}

/// The document's frame; the routes add their paths and schemas (`http::router`).
#[derive(OpenApi)]
#[openapi(
    info(
        title = "timer-service",
        description = "Durable timers: schedule one, and a DueTimeReached goes out on your \
                       broker when it is due. With authentication on (`http.token`, \
                       `http.keys` or `http.jwt`), every route but /healthz, /readyz and \
                       /metrics needs `Authorization: Bearer <key or JWT>`: 401 without a \
                       valid one, 403 for a tenant or scope the key does not have."
    ),
    components(schemas(ErrorBody)),
    modifiers(&BearerToken),
    security(("bearer" = []))
)]
pub struct Document;

/// Adds the answers of the authentication middleware (401, 403) to every operation that needs
/// a bearer token (those without `security: [{}]`), where the handler did not list them.
pub fn add_auth_answers(document: &mut serde_json::Value) {
    let Some(paths) = document["paths"].as_object_mut() else {
        return;
    };
    let error = |description: &str| {
        serde_json::json!({
            "description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
        })
    };
    for item in paths.values_mut() {
        let Some(item) = item.as_object_mut() else {
            continue;
        };
        for operation in item.values_mut() {
            let open = operation["security"].as_array().is_some_and(|s| {
                s.iter()
                    .any(|r| r.as_object().is_some_and(|r| r.is_empty()))
            });
            let Some(responses) = operation
                .get_mut("responses")
                .and_then(|r| r.as_object_mut())
            else {
                continue;
            };
            if open {
                continue;
            }
            responses.entry("401").or_insert_with(|| {
                error("No bearer token, or one that is unknown, expired or not valid here")
            });
            responses.entry("403").or_insert_with(|| {
                error("The key may not use this tenant, or lacks the scope (read, write, admin) the route needs")
            });
        }
    }
}

/// The `bearer` security scheme the document's `security` names (`http.token`, `http.keys`,
/// `http.jwt`).
struct BearerToken;

impl utoipa::Modify for BearerToken {
    fn modify(&self, document: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
        let components = document.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
        );
    }
}
