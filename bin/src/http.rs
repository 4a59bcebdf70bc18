//! The HTTP API: schedule/get/cancel timers, the event stream, health and metrics.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, RawQuery, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::Stream;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;
use serde_json::{json, Value};
use timer_brokers::memory::MemoryHub;
use timer_core::engine::metric;
use timer_core::{
    CancelOutcome, Engine, Error, ErrorKind, Reason, Rejection, ScheduleOutcome, Scheduled, Timer,
    TimerKey,
};
use tokio_stream::wrappers::errors::BroadcastStreamRecvError;
use tokio_stream::wrappers::BroadcastStream;
use tokio_util::sync::CancellationToken;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;

use crate::config::Config;

#[derive(Clone)]
pub struct AppState {
    pub engine: Engine,
    pub metrics: Option<PrometheusHandle>,
    pub memory_hub: Option<MemoryHub>,
    pub shutdown: CancellationToken,
}

pub fn router(state: AppState, config: &Config) -> Router {
    // Room for the largest command plus headers of a JSON body; a batch has a limit of its own.
    let body_limit = config.limits.max_message_bytes + 1024;
    let batch_limit = config.limits.max_batch_bytes;
    let limited = |limit| RequestBodyLimitLayer::new(limit);
    let api = Router::new()
        .route("/v1/timers", post(schedule).layer(limited(body_limit)))
        .route(
            "/v1/timers/batch",
            post(crate::batch::schedule_batch).layer(limited(batch_limit)),
        )
        .route(
            "/v1/tenants/{tenant}/timers/{id}",
            get(get_timer).delete(cancel_timer),
        )
        .route(
            "/v1/tenants/{tenant}/timers",
            get(crate::control::list_timers),
        )
        .route(
            "/v1/tenants/{tenant}/timers/{id}/pause",
            post(crate::actions::pause).layer(limited(body_limit)),
        )
        .route(
            "/v1/tenants/{tenant}/timers/{id}/resume",
            post(crate::actions::resume),
        )
        .route(
            "/v1/tenants/{tenant}/timers/{id}/trigger",
            post(crate::actions::trigger),
        )
        .route(
            "/v1/tenants/{tenant}/timers/{id}/history",
            get(crate::actions::history),
        )
        .route("/v1/status", get(crate::actions::status))
        .route(
            "/v1/tenants/{tenant}/summary",
            get(crate::control::tenant_summary),
        )
        .route("/v1/summary", get(crate::control::all_summaries))
        .route(
            "/v1/commands",
            post(send_command).layer(limited(body_limit)),
        )
        .route("/v1/dead-letters", get(dead_letters))
        // The event stream lives as long as the client wants, so it has no request timeout.
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            config.http.request_timeout,
        ))
        .route("/v1/events", get(events))
        // A bulk action runs to its end, page after page, however long that takes.
        .route(
            "/v1/tenants/{tenant}/timers/bulk",
            post(crate::actions::bulk).layer(limited(body_limit)),
        )
        .layer(axum::middleware::from_fn_with_state(
            config.http.token.clone().map(Arc::<str>::from),
            require_token,
        ));
    // Health and metrics stay open: probes and scrapers carry no token.
    let open = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            config.http.request_timeout,
        ));
    Router::new()
        .merge(api)
        .merge(open)
        // No route takes a body larger than this; the routes that read one have their own.
        .layer(limited(body_limit.max(batch_limit)))
        // Outside the limit, so its own answer to a too-large Content-Length (plain text) also
        // becomes the JSON error body.
        .layer(axum::middleware::map_response(json_payload_too_large))
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}

/// With `http.token` set, a request needs `Authorization: Bearer <token>`; compared in constant
/// time, so the answer time says nothing about how much of a guess was right.
async fn require_token(
    State(token): State<Option<Arc<str>>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(token) = token else {
        return next.run(request).await;
    };
    let given = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if bool::from(subtle::ConstantTimeEq::ct_eq(
        given.as_bytes(),
        token.as_bytes(),
    )) {
        return next.run(request).await;
    }
    let mut response = error_body(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        None,
        "missing or wrong bearer token (see http.token)",
    );
    response.headers_mut().insert(
        axum::http::header::WWW_AUTHENTICATE,
        axum::http::HeaderValue::from_static("Bearer"),
    );
    response
}

pub(crate) fn error_body(
    status: StatusCode,
    reason: &str,
    field: Option<&str>,
    message: &str,
) -> Response {
    let mut error = json!({ "reason": reason, "message": message });
    if let Some(field) = field {
        error["field"] = json!(field);
    }
    (status, Json(json!({ "error": error }))).into_response()
}

/// The body limit layer answers 413 in plain text; give it the JSON error shape of every other
/// error.
async fn json_payload_too_large(response: Response) -> Response {
    if response.status() != StatusCode::PAYLOAD_TOO_LARGE {
        return response;
    }
    error_body(
        StatusCode::PAYLOAD_TOO_LARGE,
        "too_large",
        None,
        "request body exceeds its limit (limits.max_message_bytes, or limits.max_batch_bytes \
         for POST /v1/timers/batch)",
    )
}

fn rejection(r: &Rejection) -> Response {
    error_body(
        StatusCode::BAD_REQUEST,
        r.reason.as_str(),
        r.field.as_deref(),
        &r.message,
    )
}

pub(crate) fn server_error(e: &Error) -> Response {
    let status = match e.kind() {
        ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        ErrorKind::Invalid => StatusCode::BAD_REQUEST,
        ErrorKind::NotFound => StatusCode::NOT_FOUND,
        ErrorKind::Conflict => StatusCode::CONFLICT,
        // A store without the ability a route needs (listing, pausing, history).
        ErrorKind::Unsupported => StatusCode::NOT_IMPLEMENTED,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    error_body(status, e.kind().as_str(), None, &e.chain())
}

pub fn timer_view(t: &Timer) -> Value {
    let payload = t
        .payload
        .as_deref()
        .and_then(|p| serde_json::from_str::<Value>(p).ok());
    json!({
        "tenantId": t.key.tenant_id,
        "serviceCallId": t.key.service_call_id,
        "state": t.state.as_str(),
        "dueAt": t.due_at.to_rfc3339(),
        "dueTimeMs": t.due_at.as_millis(),
        "registeredAt": t.registered_at.to_rfc3339(),
        "reachedAt": t.reached_at.map(|r| r.to_rfc3339()),
        "attempts": t.attempts,
        "lastError": t.last_error,
        "correlationId": t.correlation_id,
        "payload": payload,
        // Recurring timers: the pattern, and how many occurrences fired (dueAt is the next).
        "recurrence": t.recurrence.as_ref().map(|r| json!({
            "cron": r.cron,
            "timeZone": r.time_zone,
            "endAt": r.end_at.map(|at| at.to_rfc3339()),
            "maxOccurrences": r.max_occurrences,
        })),
        "occurrences": t.recurrence.as_ref().map(|_| t.occurrences),
    })
}

/// The outcome code of a stored schedule, as the API names it (`outcome`, and the reason of a
/// 409).
pub(crate) fn outcome_code(outcome: ScheduleOutcome) -> &'static str {
    match outcome {
        ScheduleOutcome::Created => "created",
        ScheduleOutcome::Updated => "updated",
        ScheduleOutcome::AlreadyReached => "already_reached",
        ScheduleOutcome::AlreadyCancelled => "already_cancelled",
        ScheduleOutcome::AlreadyFailed => "already_failed",
    }
}

async fn schedule(State(app): State<AppState>, body: Bytes) -> Response {
    let timer = match app.engine.admit_schedule(&body) {
        Ok(t) => t,
        Err(r) => return rejection(&r),
    };
    let key = timer.key.clone();
    let (status, outcome) = match app.engine.schedule_one(timer).await {
        Ok(Scheduled::Stored(outcome)) => {
            let status = match outcome {
                ScheduleOutcome::Created => StatusCode::CREATED,
                ScheduleOutcome::Updated => StatusCode::OK,
                _ => StatusCode::CONFLICT,
            };
            (status, outcome_code(outcome))
        }
        Ok(Scheduled::Refused(r)) => {
            let status = match r.reason {
                Reason::TenantLimit => StatusCode::TOO_MANY_REQUESTS,
                _ => StatusCode::BAD_REQUEST,
            };
            return error_body(status, r.reason.as_str(), r.field.as_deref(), &r.message);
        }
        Err(e) => return server_error(&e),
    };
    let timer = match app.engine.store().get(&key).await {
        Ok(t) => t.as_ref().map(timer_view),
        Err(e) => return server_error(&e),
    };
    let mut body = json!({ "outcome": outcome, "timer": timer });
    if status == StatusCode::CONFLICT {
        let message = match outcome {
            "already_reached" => "the timer already fired; nothing changed",
            "already_failed" => "the timer failed (engine.max_attempts publishes); nothing changed",
            _ => "the timer was cancelled; nothing changed",
        };
        body["error"] = json!({ "reason": outcome, "message": message });
    }
    (status, Json(body)).into_response()
}

async fn get_timer(
    State(app): State<AppState>,
    Path((tenant, id)): Path<(String, String)>,
    RawQuery(query): RawQuery,
) -> Response {
    let next = match crate::control::next_parameter(query.as_deref()) {
        Ok(next) => next,
        Err(bad) => return bad.response(),
    };
    match app.engine.store().get(&TimerKey::new(tenant, id)).await {
        Ok(Some(t)) => {
            let mut view = timer_view(&t);
            if let Some(n) = next {
                let now = app.engine.clock().now();
                view["nextOccurrences"] = crate::control::next_occurrences(&t, now, n);
            }
            Json(view).into_response()
        }
        Ok(None) => error_body(StatusCode::NOT_FOUND, "not_found", None, "no such timer"),
        Err(e) => server_error(&e),
    }
}

async fn cancel_timer(
    State(app): State<AppState>,
    Path((tenant, id)): Path<(String, String)>,
) -> Response {
    match app.engine.cancel(&TimerKey::new(tenant, id)).await {
        Ok(CancelOutcome::Cancelled) => Json(json!({ "outcome": "cancelled" })).into_response(),
        Ok(CancelOutcome::AlreadyCancelled) => {
            Json(json!({ "outcome": "already_cancelled" })).into_response()
        }
        Ok(CancelOutcome::AlreadyReached) => error_body(
            StatusCode::CONFLICT,
            "already_reached",
            None,
            "the timer already fired",
        ),
        Ok(CancelOutcome::AlreadyFailed) => error_body(
            StatusCode::CONFLICT,
            "already_failed",
            None,
            "the timer failed (engine.max_attempts publishes)",
        ),
        Ok(CancelOutcome::Firing) => error_body(
            StatusCode::CONFLICT,
            "firing",
            None,
            "the timer's event is being published right now; it fires once (retry the cancel \
             if you need it gone should the publish fail)",
        ),
        Ok(CancelOutcome::NotFound) => {
            error_body(StatusCode::NOT_FOUND, "not_found", None, "no such timer")
        }
        Err(e) => server_error(&e),
    }
}

/// Feeds a raw command into the in-process broker: the broker path of the embedded setup.
async fn send_command(State(app): State<AppState>, body: Bytes) -> Response {
    let Some(hub) = &app.memory_hub else {
        return error_body(
            StatusCode::NOT_FOUND,
            "unsupported",
            None,
            "POST /v1/commands feeds the in-process broker; with another broker, publish \
             commands to it directly",
        );
    };
    match hub.send_command(body.to_vec()) {
        Ok(()) => (StatusCode::ACCEPTED, Json(json!({ "outcome": "queued" }))).into_response(),
        Err(e) => server_error(&e),
    }
}

async fn dead_letters(State(app): State<AppState>) -> Response {
    let Some(hub) = &app.memory_hub else {
        return error_body(
            StatusCode::NOT_FOUND,
            "unsupported",
            None,
            "dead letters of a real broker are on its dead-letter destination",
        );
    };
    match hub.dead_letters() {
        Ok(letters) => Json(json!({ "deadLetters": letters })).into_response(),
        Err(e) => server_error(&e),
    }
}

#[derive(Deserialize)]
struct EventsQuery {
    tenant: Option<String>,
}

async fn events(
    State(app): State<AppState>,
    Query(query): Query<EventsQuery>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let stream = BroadcastStream::new(app.engine.subscribe());
    let stream = tokio_stream::StreamExt::filter_map(stream, move |item| match item {
        Ok(fired) if query.tenant.as_ref().is_none_or(|t| *t == fired.tenant_id) => {
            Some(Ok(Event::default()
                .event("DueTimeReached")
                .data(fired.json.clone())))
        }
        Ok(_) => None,
        // A slow client skipped events; say so rather than pretend.
        Err(BroadcastStreamRecvError::Lagged(n)) => {
            Some(Ok(Event::default().event("lagged").data(n.to_string())))
        }
    });
    // End the stream at shutdown, so graceful shutdown is not held open by watchers.
    let stream = futures::StreamExt::take_until(stream, app.shutdown.clone().cancelled_owned());
    Sse::new(stream).keep_alive(KeepAlive::default())
}

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(app): State<AppState>) -> Response {
    let (store, broker) = tokio::join!(app.engine.store().health(), app.engine.broker().health());
    let show = |r: &Result<(), Error>| match r {
        Ok(()) => json!("ok"),
        Err(e) => json!(e.chain()),
    };
    let status = if store.is_ok() && broker.is_ok() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "store": { "kind": app.engine.store().name(), "status": show(&store) },
        "broker": { "kind": app.engine.broker().name(), "status": show(&broker) },
    });
    (status, Json(body)).into_response()
}

async fn metrics(State(app): State<AppState>) -> Response {
    match &app.metrics {
        Some(handle) => handle.render().into_response(),
        None => error_body(
            StatusCode::NOT_FOUND,
            "unsupported",
            None,
            "metrics recorder not installed",
        ),
    }
}

/// Keeps the `timer.pending` (Scheduled) and `timer.paused` gauges current (a count is too costly for every scrape on a big store).
pub async fn pending_gauge(engine: Engine, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        if let Ok(n) = engine.store().scheduled_count().await {
            metrics::gauge!(metric::PENDING).set(n as f64);
        }
        if let Ok(Some(n)) = engine.paused_count().await {
            metrics::gauge!(metric::PAUSED).set(n as f64);
        }
    }
}
