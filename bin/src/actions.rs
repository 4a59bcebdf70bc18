//! The control plane's write routes and the per-timer history: pause, resume, retry, trigger,
//! complete, bulk actions over a filter, a timer's history, and the instance status.

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use timer_core::engine::Triggered;
use timer_core::{Action, ControlOutcome, Engine, TimerKey, TimerState, Timestamp};

use crate::api::{
    BulkOutcome, BulkRequest, CompleteRequest, Counts, ErrorBody, ErrorDetail, Health, HistoryPage,
    HistoryView, LastMinute, MinuteView, PauseRequest, Percentiles, Status, TimerOutcome,
    TimerView, TriggerOutcome,
};
use crate::control::{BadParameter, ListParams};
use crate::http::{error_body, server_error, AppState, TenantPath, TimerPath};

/// Timers a bulk action reads and changes per transaction.
pub const BULK_PAGE: usize = 1_000;

/// Default and largest page of a history.
const DEFAULT_HISTORY_PAGE: usize = 100;
const MAX_HISTORY_PAGE: usize = 1_000;

/// The optional body of `POST …/pause`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseBody {
    #[serde(default)]
    note: Option<String>,
}

/// Longest pause note, in bytes.
const MAX_NOTE_BYTES: usize = 1_024;

/// The 400 for a pause note (of one timer or a bulk pause) over [`MAX_NOTE_BYTES`], if it is.
fn note_too_long(note: Option<&str>) -> Option<Response> {
    note.filter(|note| note.len() > MAX_NOTE_BYTES).map(|_| {
        error_body(
            StatusCode::BAD_REQUEST,
            "too_large",
            Some("note"),
            &format!("a note has at most {MAX_NOTE_BYTES} bytes"),
        )
    })
}

/// An optional JSON body: empty (or only whitespace) is `T::default()`.
fn optional_body<T: DeserializeOwned + Default>(body: &[u8]) -> serde_json::Result<T> {
    if body.iter().all(u8::is_ascii_whitespace) {
        Ok(T::default())
    } else {
        serde_json::from_slice(body)
    }
}

fn bad_json(field: Option<&str>, message: &str) -> Response {
    error_body(StatusCode::BAD_REQUEST, "invalid_json", field, message)
}

/// The answer to an action on one timer: 200 with the outcome and the timer as it is now when
/// the action changed it or found it as asked; 409 when the timer is finished or firing; 404.
async fn answer(app: &AppState, key: &TimerKey, outcome: ControlOutcome) -> Response {
    let status = match outcome {
        ControlOutcome::NotFound => {
            return error_body(StatusCode::NOT_FOUND, "not_found", None, "no such timer")
        }
        ControlOutcome::Firing => {
            return error_body(
                StatusCode::CONFLICT,
                "firing",
                None,
                "the timer's event is being published right now; nothing changed (try again \
                 once it fired)",
            )
        }
        ControlOutcome::AlreadyReached
        | ControlOutcome::AlreadyCancelled
        | ControlOutcome::AlreadyFailed => StatusCode::CONFLICT,
        _ => StatusCode::OK,
    };
    let timer = match app.engine.store().get(key).await {
        Ok(t) => t.as_ref().map(TimerView::of),
        Err(e) => return server_error(&e),
    };
    let error = (status == StatusCode::CONFLICT).then(|| {
        ErrorDetail::new(
            outcome.as_str(),
            None,
            "the timer is finished (Reached, Cancelled or Failed); nothing changed",
        )
    });
    let body = TimerOutcome {
        outcome: outcome.as_str(),
        timer,
        error,
    };
    (status, Json(body)).into_response()
}

async fn act(app: &AppState, key: TimerKey, action: Action) -> Response {
    match app
        .engine
        .control(std::slice::from_ref(&key), &action)
        .await
    {
        Ok(outcomes) => {
            let outcome = outcomes
                .first()
                .copied()
                .unwrap_or(ControlOutcome::NotFound);
            answer(app, &key, outcome).await
        }
        Err(e) => server_error(&e),
    }
}

/// Pauses a Scheduled timer: it does not fire until resumed.
#[utoipa::path(
    post,
    path = "/v1/tenants/{tenant}/timers/{id}/pause",
    tag = "control",
    params(TimerPath),
    request_body(content = Option<PauseRequest>, description = "Optional"),
    responses(
        (status = 200, description = "`paused`, or `already_paused`", body = TimerOutcome),
        (status = 409, description = "Finished (`already_reached`, …; with the timer) or firing right now (`firing`: retry)", body = TimerOutcome),
        (status = 400, description = "A bad body or a note over 1 KiB", body = ErrorBody),
        (status = 404, description = "No such timer", body = ErrorBody),
        (status = 501, description = "The store cannot pause", body = ErrorBody),
    )
)]
pub async fn pause(
    State(app): State<AppState>,
    Path(TimerPath { tenant, id }): Path<TimerPath>,
    body: Bytes,
) -> Response {
    let body: PauseBody = match optional_body(&body) {
        Ok(body) => body,
        Err(e) => return bad_json(None, &format!("the body is not {{\"note\": \"…\"}} ({e})")),
    };
    if let Some(too_long) = note_too_long(body.note.as_deref()) {
        return too_long;
    }
    act(
        &app,
        TimerKey::new(tenant, id),
        Action::Pause { note: body.note },
    )
    .await
}

/// Resumes a Paused timer. A one-shot timer keeps its due time (fires at once when it passed);
/// a series goes on with its first occurrence at or after now, and the history counts the ones
/// it skipped.
#[utoipa::path(
    post,
    path = "/v1/tenants/{tenant}/timers/{id}/resume",
    tag = "control",
    params(TimerPath),
    responses(
        (status = 200, description = "`resumed`, or `not_paused`", body = TimerOutcome),
        (status = 409, description = "Finished (`already_reached`, …)", body = TimerOutcome),
        (status = 404, description = "No such timer", body = ErrorBody),
        (status = 501, description = "The store cannot pause", body = ErrorBody),
    )
)]
pub async fn resume(
    State(app): State<AppState>,
    Path(TimerPath { tenant, id }): Path<TimerPath>,
) -> Response {
    act(&app, TimerKey::new(tenant, id), Action::Resume).await
}

/// Schedules a Failed timer again: published at once, with its attempts back to 0 and its last
/// error cleared. It keeps its due time (the fire's lateness shows how long it was failed); a
/// series goes on from the occurrence that failed.
#[utoipa::path(
    post,
    path = "/v1/tenants/{tenant}/timers/{id}/retry",
    tag = "control",
    params(TimerPath),
    responses(
        (status = 200, description = "`retried`, or `not_failed` (Scheduled or Paused)", body = TimerOutcome),
        (status = 409, description = "Finished otherwise (`already_reached`, `already_cancelled`)", body = TimerOutcome),
        (status = 404, description = "No such timer", body = ErrorBody),
        (status = 429, description = "The tenant is over its rate (`limits.rate`: a retry fires, so it counts as a schedule); `Retry-After` says when", body = ErrorBody),
        (status = 501, description = "The store cannot retry", body = ErrorBody),
    )
)]
pub async fn retry(
    State(app): State<AppState>,
    Path(TimerPath { tenant, id }): Path<TimerPath>,
) -> Response {
    if let Err(throttled) = app.engine.within_rate_of(&tenant) {
        return crate::http::too_fast(&throttled);
    }
    act(&app, TimerKey::new(tenant, id), Action::Retry).await
}

/// The optional body of `POST …/complete`: the fields of a `TimerCompleted` after its key.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CompleteBody {
    #[serde(default)]
    occurrence: Option<i64>,
    #[serde(default)]
    outcome: Option<String>,
    #[serde(default)]
    message: Option<String>,
}

/// The shape of `POST …/complete`'s body, for its 400.
const COMPLETE_BODY: &str =
    r#"{"occurrence": N, "outcome": "succeeded"|"failed", "message": "…"} (each optional)"#;

/// Reports that the work an occurrence's event triggered is done (what a `TimerCompleted`
/// command does on a broker): a series with `overlap` `skip` or `bufferOne` is free for its next
/// occurrence, a one-shot timer with a `completionTimeout` is not fired again. The history
/// records it with how long the work took.
#[utoipa::path(
    post,
    path = "/v1/tenants/{tenant}/timers/{id}/complete",
    tag = "control",
    params(TimerPath),
    request_body(content = Option<CompleteRequest>, description = "Optional: without an `occurrence`, the last fired one"),
    responses(
        (status = 200, description = "`completed`, `completed_late` (after its completionTimeout), `already_completed` or `unknown_occurrence` (nothing changed)", body = TimerOutcome),
        (status = 409, description = "An event of the timer is being published right now (`firing`: retry)", body = TimerOutcome),
        (status = 400, description = "A bad body: reason `invalid_json`, or `invalid_policy` naming the field (`occurrence`, `outcome`)", body = ErrorBody),
        (status = 404, description = "No such timer", body = ErrorBody),
        (status = 501, description = "The store cannot record completions", body = ErrorBody),
    )
)]
pub async fn complete(
    State(app): State<AppState>,
    Path(TimerPath { tenant, id }): Path<TimerPath>,
    body: Bytes,
) -> Response {
    let body: CompleteBody = match optional_body(&body) {
        Ok(body) => body,
        Err(e) => return bad_json(None, &format!("the body is not {COMPLETE_BODY} ({e})")),
    };
    let completion = match timer_core::wire::completion_fields(
        body.occurrence,
        body.outcome.as_deref(),
        body.message,
        "",
    ) {
        Ok(completion) => completion,
        Err(r) => return crate::http::rejection(&r),
    };
    act(
        &app,
        TimerKey::new(tenant, id),
        Action::Complete(completion),
    )
    .await
}

/// Fires one extra occurrence now: a `DueTimeReached` with `"trigger": "manual"` and an id of
/// its own; the schedule does not move. Scheduled and Paused timers only.
#[utoipa::path(
    post,
    path = "/v1/tenants/{tenant}/timers/{id}/trigger",
    tag = "control",
    params(TimerPath),
    responses(
        (status = 200, description = "The broker confirmed the event", body = TriggerOutcome),
        (status = 409, description = "Finished (`already_reached`, …) or firing right now (`firing`)", body = TimerOutcome),
        (status = 404, description = "No such timer", body = ErrorBody),
        (status = 429, description = "The tenant is over its rate (`limits.rate`: a trigger fires, so it counts as a schedule); `Retry-After` says when", body = ErrorBody),
        (status = 503, description = "The broker did not confirm in time", body = ErrorBody),
    )
)]
pub async fn trigger(
    State(app): State<AppState>,
    Path(TimerPath { tenant, id }): Path<TimerPath>,
) -> Response {
    if let Err(throttled) = app.engine.within_rate_of(&tenant) {
        return crate::http::too_fast(&throttled);
    }
    let key = TimerKey::new(tenant, id);
    match app.engine.trigger(&key).await {
        Ok(Triggered::Fired { event_id, at }) => Json(TriggerOutcome {
            outcome: "triggered",
            event_id: event_id.to_string(),
            at: at.to_rfc3339(),
        })
        .into_response(),
        Ok(Triggered::Refused(outcome)) => answer(&app, &key, outcome).await,
        Err(e) => server_error(&e),
    }
}

/// The body of `POST /v1/tenants/{tenant}/timers/bulk`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BulkBody {
    action: String,
    #[serde(default)]
    filter: serde_json::Map<String, Value>,
    /// For `pause`: the note every paused timer's history gets.
    #[serde(default)]
    note: Option<String>,
}

/// The filter of a bulk action: the list filters (`state`, `prefix`, `dueAfter`, `dueBefore`,
/// `recurring`, `retrying`) as a JSON object, read by the same rules as the list's query parameters.
fn bulk_filter(filter: &serde_json::Map<String, Value>) -> Result<ListParams, BadParameter> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    const KNOWN: [&str; 6] = [
        "state",
        "prefix",
        "dueAfter",
        "dueBefore",
        "recurring",
        "retrying",
    ];
    for (name, value) in filter {
        if matches!(name.as_str(), "limit" | "cursor") {
            return Err(BadParameter::owned(
                format!("filter.{name}"),
                "a bulk action goes through every matching timer: no limit or cursor",
            ));
        }
        if !KNOWN.contains(&name.as_str()) {
            return Err(BadParameter::owned(
                "filter".into(),
                format!("unknown filter {name:?} (known: {})", KNOWN.join(", ")),
            ));
        }
        let words: Vec<&Value> = match value {
            Value::Array(items) => items.iter().collect(),
            other => vec![other],
        };
        for word in words {
            let text = match word {
                Value::String(s) => s.clone(),
                Value::Number(n) => n.to_string(),
                Value::Bool(b) => b.to_string(),
                _ => {
                    return Err(BadParameter::owned(
                        format!("filter.{name}"),
                        "give a string, number or boolean (or, for state, a list of strings)",
                    ))
                }
            };
            pairs.push((name.clone(), text));
        }
    }
    let query = url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(&pairs)
        .finish();
    ListParams::parse(Some(&query)).map_err(|bad| bad.within("filter"))
}

/// Cancels, pauses or resumes every timer of the tenant that matches the filter, page by page
/// (1,000 timers per transaction); answers how many matched and changed. It has no request
/// timeout and goes on to the end when the client leaves.
#[utoipa::path(
    post,
    path = "/v1/tenants/{tenant}/timers/bulk",
    tag = "control",
    params(TenantPath),
    request_body = BulkRequest,
    responses(
        (status = 200, description = "Done", body = BulkOutcome),
        (status = 400, description = "A bad action or filter; `field` names it (`action`, `filter.state`, …)", body = ErrorBody),
        (status = 501, description = "The store cannot list or pause", body = ErrorBody),
    )
)]
pub async fn bulk(
    State(app): State<AppState>,
    Path(TenantPath { tenant }): Path<TenantPath>,
    body: Bytes,
) -> Response {
    let body: BulkBody = match serde_json::from_slice(&body) {
        Ok(body) => body,
        Err(e) => {
            return bad_json(
                None,
                &format!(
                    "the body is not {{\"action\": \"cancel\"|\"pause\"|\"resume\"|\"retry\", \
                     \"filter\": {{…}}}} ({e})"
                ),
            )
        }
    };
    if let Some(too_long) = note_too_long(body.note.as_deref()) {
        return too_long;
    }
    let action = match body.action.as_str() {
        "cancel" => Action::Cancel,
        "pause" => Action::Pause { note: body.note },
        "resume" => Action::Resume,
        "retry" => Action::Retry,
        other => {
            return error_body(
                StatusCode::BAD_REQUEST,
                "invalid_parameter",
                Some("action"),
                &format!("{other:?} is not an action (cancel, pause, resume, retry)"),
            )
        }
    };
    let params = match bulk_filter(&body.filter) {
        Ok(params) => params,
        Err(bad) => return bad.response(),
    };
    let engine = app.engine.clone();
    let name = action.as_str();
    // Its own task: a client that leaves does not stop it halfway through a page.
    let run = tokio::spawn(async move {
        engine
            .bulk(&tenant, &params.filter, &action, BULK_PAGE)
            .await
    });
    match run.await {
        Ok(Ok(bulk)) => Json(BulkOutcome {
            action: name,
            matched: bulk.matched,
            changed: bulk.changed,
            pages: bulk.pages,
            outcomes: bulk.outcomes,
        })
        .into_response(),
        Ok(Err(e)) => server_error(&e),
        Err(e) => error_body(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            None,
            &format!("the bulk action stopped: {e}"),
        ),
    }
}

/// A timer's history, oldest first: every change (created, rescheduled, paused, resumed,
/// skipped, buffered, triggered, fired, timed_out, completed, publish_failed, given_up, retried,
/// cancelled), up to `engine.history_per_timer` of the latest.
#[utoipa::path(
    get,
    path = "/v1/tenants/{tenant}/timers/{id}/history",
    tag = "control",
    params(
        TimerPath,
        ("limit" = Option<usize>, Query, description = "Page size: 1 to 1000, default 100"),
        ("cursor" = Option<String>, Query, description = "`nextCursor` of the page before"),
    ),
    responses(
        (status = 200, description = "A page", body = HistoryPage),
        (status = 400, description = "A bad parameter; `field` names it", body = ErrorBody),
        (status = 404, description = "No such timer", body = ErrorBody),
        (status = 501, description = "The store keeps no history", body = ErrorBody),
    )
)]
pub async fn history(
    State(app): State<AppState>,
    Path(TimerPath { tenant, id }): Path<TimerPath>,
    RawQuery(query): RawQuery,
) -> Response {
    let mut limit = DEFAULT_HISTORY_PAGE;
    let mut after = 0u64;
    for (name, value) in url::form_urlencoded::parse(query.as_deref().unwrap_or("").as_bytes()) {
        let parsed = match name.as_ref() {
            "limit" => crate::control::count("limit", &value, MAX_HISTORY_PAGE).map(|n| limit = n),
            "cursor" => value.parse::<u64>().map(|seq| after = seq).map_err(|_| {
                BadParameter::new("cursor", "not a cursor this service gave out (nextCursor)")
            }),
            other => Err(BadParameter::owned(
                "query".into(),
                format!("unknown parameter {other:?} (known: limit, cursor)"),
            )),
        };
        if let Err(bad) = parsed {
            return bad.response();
        }
    }
    let key = TimerKey::new(tenant, id);
    // One more than asked for tells whether there is a next page.
    match app.engine.history(&key, after, limit + 1).await {
        Ok(Some(mut entries)) => {
            let next = (entries.len() > limit).then(|| {
                entries.truncate(limit);
                entries.last().map(|e| e.seq.to_string())
            });
            Json(HistoryPage {
                history: entries.iter().map(HistoryView::of).collect(),
                next_cursor: next.flatten(),
            })
            .into_response()
        }
        Ok(None) => error_body(StatusCode::NOT_FOUND, "not_found", None, "no such timer"),
        Err(e) => server_error(&e),
    }
}

/// The store's timers by state: null where the store cannot count that state.
pub struct Totals {
    counted_at: Timestamp,
    pending: Option<u64>,
    paused: Option<u64>,
    failed: Option<u64>,
}

/// Counts [`Totals`]; fails if a count the store can make fails.
async fn count_totals(engine: Engine) -> timer_core::Result<Totals> {
    let counted_at = engine.clock().now();
    let store = engine.store();
    let Some(queries) = store.queries() else {
        return Ok(Totals {
            counted_at,
            pending: Some(store.scheduled_count().await?),
            paused: None,
            failed: None,
        });
    };
    let (pending, paused, failed) = tokio::join!(
        queries.count(TimerState::Scheduled),
        queries.count(TimerState::Paused),
        queries.count(TimerState::Failed),
    );
    Ok(Totals {
        counted_at,
        pending: Some(pending?),
        paused: Some(paused?),
        failed: Some(failed?),
    })
}

/// This instance, its store and broker with their health, and what they hold.
#[utoipa::path(
    get,
    path = "/v1/status",
    tag = "operations",
    responses((status = 200, description = "The status (also when a part is unhealthy)", body = Status))
)]
pub async fn status(State(app): State<AppState>) -> Response {
    let engine = &app.engine;
    let store = engine.store();
    let broker = engine.broker();
    let (store_health, broker_health) = tokio::join!(
        crate::http::answers_within(store.health(), "store"),
        crate::http::answers_within(broker.health(), "broker"),
    );
    let health = |kind: &'static str, result: timer_core::Result<()>| Health {
        kind,
        healthy: result.is_ok(),
        error: result.err().map(|e| e.chain()),
    };
    let (totals, next_due) = tokio::join!(
        app.counts.totals.get(|| count_totals(app.engine.clone())),
        store.next_due_at(),
    );
    let minute = engine.last_minute();
    Json(Status {
        version: env!("CARGO_PKG_VERSION"),
        instance_id: engine.instance_id().to_owned(),
        store: health(store.name(), store_health),
        broker: health(broker.name(), broker_health),
        tasks_down: engine
            .tasks_down()
            .into_iter()
            .map(|(task, error)| crate::api::TaskDown { task, error })
            .collect(),
        timers: match totals {
            Ok(totals) => Counts {
                pending: totals.pending,
                paused: totals.paused,
                failed: totals.failed,
                counted_at: Some(totals.counted_at.to_rfc3339()),
            },
            Err(_) => Counts {
                pending: None,
                paused: None,
                failed: None,
                counted_at: None,
            },
        },
        next_due_at: next_due.ok().flatten().map(|t| t.to_rfc3339()),
        last_minute: LastMinute {
            fired: minute.fired,
            lateness_ms: Percentiles {
                p50: minute.p50_ms,
                p99: minute.p99_ms,
            },
        },
        last_hour: engine.last_hour().iter().map(MinuteView::of).collect(),
        // No store keeps a register of live instances yet.
        instances: None,
    })
    .into_response()
}
