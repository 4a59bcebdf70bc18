//! The HTTP API: schedule/get/cancel timers, the event stream, health and metrics.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, RawQuery, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;
use timer_brokers::memory::MemoryHub;
use timer_core::engine::metric;
use timer_core::{
    CancelOutcome, Engine, Error, ErrorKind, Reason, Rejection, ScheduleOutcome, Scheduled,
    TimerKey,
};
use tokio_util::sync::CancellationToken;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;
use utoipa::OpenApi as _;
use utoipa_axum::router::{OpenApiRouter, UtoipaMethodRouterExt};
use utoipa_axum::routes;

use crate::api::{
    DeadLetterView, DeadLetters, ErrorBody, ErrorDetail, Outcome, Probe, Readiness, ScheduleTimer,
    TimerOutcome, TimerView,
};

use crate::auth::{Auth, Principal};
use crate::config::Config;

#[derive(Clone)]
pub struct AppState {
    pub engine: Engine,
    pub metrics: Option<PrometheusHandle>,
    pub memory_hub: Option<MemoryHub>,
    pub shutdown: CancellationToken,
    /// The counts `/v1/status` and `/v1/summary` share between requests.
    pub counts: crate::counted::Counts,
    /// Checks bearer tokens; `None`: the API has no authentication.
    pub auth: Option<Arc<Auth>>,
    /// The last health checks of `/readyz` (store, broker reachable), shared by its callers.
    pub ready: Arc<crate::counted::Cached<(bool, bool)>>,
    /// The open event streams and their limits.
    pub streams: Arc<EventStreams>,
}

/// How many `GET /v1/events` streams may be open (`http.max_event_streams`), how many bytes
/// each may have waiting (`http.event_stream_buffer`), and how many are open.
pub struct EventStreams {
    pub max: usize,
    pub buffer: usize,
    open: std::sync::atomic::AtomicUsize,
}

impl EventStreams {
    pub fn new(http: &crate::config::HttpConfig) -> Arc<Self> {
        Arc::new(EventStreams {
            max: http.max_event_streams,
            buffer: http.event_stream_buffer,
            open: Default::default(),
        })
    }

    /// A place for one more stream, held until it is dropped; `None` when all are taken.
    fn open(self: &Arc<Self>) -> Option<OpenStream> {
        use std::sync::atomic::Ordering;
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()
            .map(|_| OpenStream(self.clone()))
    }
}

/// One open event stream's place.
struct OpenStream(Arc<EventStreams>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0
            .open
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Path parameters of the routes on one timer.
#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
pub struct TimerPath {
    /// The tenant (`tenantId`).
    pub tenant: String,
    /// The timer's `serviceCallId`.
    pub id: String,
}

/// Path parameter of the routes on one tenant.
#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
pub struct TenantPath {
    /// The tenant (`tenantId`).
    pub tenant: String,
}

/// The service's routes and the OpenAPI document describing them, built together: a route is
/// added with the `#[utoipa::path]` of its handler, so it cannot be missing from the document.
pub fn routes(
    config: &Config,
    auth: Option<Arc<Auth>>,
) -> (Router<AppState>, utoipa::openapi::OpenApi) {
    // Room for the largest command plus headers of a JSON body; a batch has a limit of its own.
    let body_limit = config.limits.max_message_bytes + 1024;
    let batch_limit = config.limits.max_batch_bytes;
    let limited = |limit| RequestBodyLimitLayer::new(limit);
    let timeout =
        || TimeoutLayer::with_status_code(StatusCode::REQUEST_TIMEOUT, config.http.request_timeout);
    let api = OpenApiRouter::with_openapi(crate::api::Document::openapi())
        .routes(routes!(schedule).layer(limited(body_limit)))
        .routes(routes!(crate::batch::schedule_batch).layer(limited(batch_limit)))
        .routes(routes!(get_timer, cancel_timer))
        .routes(routes!(crate::control::list_timers))
        .routes(routes!(crate::actions::pause).layer(limited(body_limit)))
        .routes(routes!(crate::actions::resume))
        .routes(routes!(crate::actions::retry))
        .routes(routes!(crate::actions::trigger))
        .routes(routes!(crate::actions::complete).layer(limited(body_limit)))
        .routes(routes!(crate::actions::history))
        .routes(routes!(crate::actions::status))
        .routes(routes!(crate::control::tenant_summary))
        .routes(routes!(crate::control::all_summaries))
        .routes(routes!(send_command).layer(limited(body_limit)))
        .routes(routes!(dead_letters))
        .routes(routes!(openapi))
        // The event stream lives as long as the client wants, so it has no request timeout.
        .layer(timeout())
        .routes(routes!(events))
        // A bulk action runs to its end, page after page, however long that takes.
        .routes(routes!(crate::actions::bulk).layer(limited(body_limit)))
        .layer(axum::middleware::from_fn_with_state(
            auth,
            crate::auth::guard,
        ));
    // Health and metrics stay open: probes and scrapers carry no token.
    let open = OpenApiRouter::new()
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(metrics))
        .layer(timeout());
    let (router, document) = api.merge(open).split_for_parts();
    let router = router
        // No route takes a body larger than this; the routes that read one have their own.
        .layer(limited(body_limit.max(batch_limit)))
        // Outside the limit, so its own answer to a too-large Content-Length (plain text) also
        // becomes the JSON error body.
        .layer(axum::middleware::map_response(json_payload_too_large))
        .layer(TraceLayer::new_for_http());
    (router, document)
}

pub fn router(state: AppState, config: &Config) -> Router {
    let (router, document) = routes(config, state.auth.clone());
    // Serializing a document of plain strings and maps cannot fail.
    let mut json = serde_json::to_value(&document).unwrap_or_default();
    crate::api::add_auth_answers(&mut json);
    let json = serde_json::to_vec(&json).unwrap_or_default();
    let router = if config.http.ui {
        router.merge(crate::ui::routes())
    } else {
        router
    };
    router
        .layer(axum::Extension(OpenApiJson(Bytes::from(json))))
        .with_state(state)
}

pub(crate) fn error_body(
    status: StatusCode,
    reason: &str,
    field: Option<&str>,
    message: &str,
) -> Response {
    let error = ErrorDetail::new(reason, field, message);
    (status, Json(ErrorBody { error })).into_response()
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

pub(crate) fn rejection(r: &Rejection) -> Response {
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

/// 429 for schedules over their tenant's rate (`limits.rate`): reason `rate_limited`, field
/// `tenantId`, and `Retry-After` in whole seconds (at least 1) when waiting helps; without it, the
/// request asked for more at once than the tenant's burst and never fits.
pub(crate) fn too_fast(throttled: &timer_core::engine::Throttled) -> Response {
    let mut response = error_body(
        StatusCode::TOO_MANY_REQUESTS,
        "rate_limited",
        Some("tenantId"),
        &throttled.to_string(),
    );
    if let Some(after) = throttled.retry_after {
        let seconds = after.as_millis().div_ceil(1000).max(1);
        response.headers_mut().insert(
            axum::http::header::RETRY_AFTER,
            axum::http::HeaderValue::from(seconds as u64),
        );
    }
    response
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

/// Schedules a timer, or moves a Scheduled one with the same key.
#[utoipa::path(
    post,
    path = "/v1/timers",
    tag = "timers",
    request_body = ScheduleTimer,
    responses(
        (status = 201, description = "Created", body = TimerOutcome),
        (status = 200, description = "Updated (same key, new due time or fields)", body = TimerOutcome),
        (status = 409, description = "The timer already fired, was cancelled or failed; nothing changed", body = TimerOutcome),
        (status = 400, description = "The command is refused; `field` names what is wrong", body = ErrorBody),
        (status = 429, description = "The tenant is over its rate limit (`rate_limited`, with a `Retry-After` header in seconds), or at its limit of pending timers (`tenant_limit`); nothing was written", body = ErrorBody),
        (status = 503, description = "The store is unavailable", body = ErrorBody),
    )
)]
async fn schedule(
    State(app): State<AppState>,
    Extension(caller): Extension<Principal>,
    body: Bytes,
) -> Response {
    let timer = match app.engine.admit_schedule(&body) {
        Ok(t) => t,
        Err(r) => return rejection(&r),
    };
    if let Err(refused) = caller.need_tenant(&timer.key.tenant_id, Some("tenantId")) {
        return refused.into_response();
    }
    if let Err(throttled) = app.engine.within_rate(std::slice::from_ref(&timer)) {
        return too_fast(&throttled);
    }
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
        Ok(t) => t.as_ref().map(TimerView::of),
        Err(e) => return server_error(&e),
    };
    let error = (status == StatusCode::CONFLICT).then(|| {
        let message = match outcome {
            "already_reached" => "the timer already fired; nothing changed",
            "already_failed" => "the timer failed (engine.max_attempts publishes); nothing changed",
            _ => "the timer was cancelled; nothing changed",
        };
        ErrorDetail::new(outcome, None, message)
    });
    let body = TimerOutcome {
        outcome,
        timer,
        error,
    };
    (status, Json(body)).into_response()
}

/// A timer; with `next=N`, its next N fire times too.
#[utoipa::path(
    get,
    path = "/v1/tenants/{tenant}/timers/{id}",
    tag = "timers",
    params(
        TimerPath,
        ("next" = Option<usize>, Query, description = "Add `nextOccurrences`: up to this many (at most 100) coming fire times"),
    ),
    responses(
        (status = 200, description = "The timer", body = TimerView),
        (status = 400, description = "A bad query parameter", body = ErrorBody),
        (status = 404, description = "No such timer", body = ErrorBody),
    )
)]
async fn get_timer(
    State(app): State<AppState>,
    Path(TimerPath { tenant, id }): Path<TimerPath>,
    RawQuery(query): RawQuery,
) -> Response {
    let next = match crate::control::next_parameter(query.as_deref()) {
        Ok(next) => next,
        Err(bad) => return bad.response(),
    };
    match app.engine.store().get(&TimerKey::new(tenant, id)).await {
        Ok(Some(t)) => {
            let mut view = TimerView::of(&t);
            if let Some(n) = next {
                let now = app.engine.clock().now();
                view.next_occurrences = Some(crate::control::next_occurrences(&t, now, n));
            }
            Json(view).into_response()
        }
        Ok(None) => error_body(StatusCode::NOT_FOUND, "not_found", None, "no such timer"),
        Err(e) => server_error(&e),
    }
}

/// Cancels a Scheduled or Paused timer.
#[utoipa::path(
    delete,
    path = "/v1/tenants/{tenant}/timers/{id}",
    tag = "timers",
    params(TimerPath),
    responses(
        (status = 200, description = "`cancelled`, or `already_cancelled`", body = Outcome),
        (status = 409, description = "It already fired or failed (`already_reached`, `already_failed`), or is firing right now (`firing`)", body = ErrorBody),
        (status = 404, description = "No such timer", body = ErrorBody),
    )
)]
async fn cancel_timer(
    State(app): State<AppState>,
    Path(TimerPath { tenant, id }): Path<TimerPath>,
) -> Response {
    match app.engine.cancel(&TimerKey::new(tenant, id)).await {
        Ok(CancelOutcome::Cancelled) => Json(Outcome {
            outcome: "cancelled",
        })
        .into_response(),
        Ok(CancelOutcome::AlreadyCancelled) => Json(Outcome {
            outcome: "already_cancelled",
        })
        .into_response(),
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
#[utoipa::path(
    post,
    path = "/v1/commands",
    tag = "embedded",
    request_body(content = Object, description = "A command as a broker carries it: ScheduleTimer, CancelTimer, PauseTimer, ResumeTimer or TimerCompleted (see the wire contract)"),
    responses(
        (status = 202, description = "`queued`: the in-process broker has it", body = Outcome),
        (status = 404, description = "Another broker is configured: publish to it", body = ErrorBody),
        (status = 503, description = "The in-process broker holds as many unacknowledged commands as it may, in all or of this tenant (`broker.max_queued`, `broker.max_queued_per_tenant`); `Retry-After` says when to send again", body = ErrorBody),
    )
)]
async fn send_command(
    State(app): State<AppState>,
    Extension(caller): Extension<Principal>,
    body: Bytes,
) -> Response {
    if caller.tenants != crate::auth::Tenants::All {
        // The broker path checks the command; here only its tenant is read, so a key limited to
        // some tenants cannot feed commands of others.
        let tenant = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v.get("tenantId")?.as_str().map(str::to_owned));
        let Some(tenant) = tenant else {
            return error_body(
                StatusCode::FORBIDDEN,
                "forbidden",
                Some("tenantId"),
                "a key limited to some tenants can only send commands with a tenantId",
            );
        };
        if let Err(refused) = caller.need_tenant(&tenant, Some("tenantId")) {
            return refused.into_response();
        }
    }
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
        Ok(()) => (StatusCode::ACCEPTED, Json(Outcome { outcome: "queued" })).into_response(),
        Err(e) => {
            // Full (broker.max_queued, broker.max_queued_per_tenant): the engine catches up.
            let mut response = server_error(&e);
            if e.kind() == ErrorKind::Unavailable {
                response.headers_mut().insert(
                    axum::http::header::RETRY_AFTER,
                    axum::http::HeaderValue::from(1u64),
                );
            }
            response
        }
    }
}

/// Commands the in-process broker could not take, with the reason.
#[utoipa::path(
    get,
    path = "/v1/dead-letters",
    tag = "embedded",
    responses(
        (status = 200, description = "Dead letters, oldest first", body = DeadLetters),
        (status = 404, description = "Another broker is configured: see its dead-letter destination", body = ErrorBody),
    )
)]
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
        Ok(letters) => Json(DeadLetters {
            dead_letters: letters
                .into_iter()
                .map(|l| DeadLetterView {
                    body: l.body,
                    reason: l.reason,
                })
                .collect(),
        })
        .into_response(),
        Err(e) => server_error(&e),
    }
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
struct EventsQuery {
    /// Only this tenant's events.
    tenant: Option<String>,
}

/// Server-sent events: each `DueTimeReached` this instance publishes (event `DueTimeReached`,
/// data its JSON) of the tenants the caller may read. A reader slower than its events, with
/// `http.event_stream_buffer` bytes of them waiting, gets `lagged` (how many of its events it
/// missed) and the stream ends: connect again to go on. A stream also ends when the caller's JWT
/// expires. At most `http.max_event_streams` are open at once (503 beyond).
#[utoipa::path(
    get,
    path = "/v1/events",
    tag = "embedded",
    params(EventsQuery),
    responses(
        (status = 200, description = "An event stream, until the caller lags, its JWT expires or the service stops", content_type = "text/event-stream", body = String),
        (status = 503, description = "`http.max_event_streams` streams are open; `Retry-After` says when to try again", body = ErrorBody),
    )
)]
async fn events(
    State(app): State<AppState>,
    Extension(caller): Extension<Principal>,
    Query(query): Query<EventsQuery>,
) -> Response {
    if let Some(tenant) = &query.tenant {
        if let Err(refused) = caller.need_tenant(tenant, Some("tenant")) {
            return refused.into_response();
        }
    }
    let Some(open) = app.streams.open() else {
        let mut response = error_body(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            None,
            &format!(
                "{} event streams are open, as many as http.max_event_streams allows; try again \
                 later",
                app.streams.max
            ),
        );
        response.headers_mut().insert(
            axum::http::header::RETRY_AFTER,
            axum::http::HeaderValue::from(5u64),
        );
        return response;
    };
    // Until its credential expires (a JWT's exp): it was checked once, when the stream began.
    let expires = caller.expires_at.and_then(|at| {
        let left = at
            .duration_since(std::time::SystemTime::now())
            .unwrap_or_default();
        tokio::time::Instant::now().checked_add(left)
    });
    let shows = move |tenant: &str| {
        query.tenant.as_deref().is_none_or(|t| t == tenant) && caller.may_use(tenant)
    };
    let events = app.engine.subscribe(app.streams.buffer, Box::new(shows));
    let stream = futures::stream::unfold(Some((events, open)), |state| async move {
        let (mut events, open) = state?;
        match events.recv().await {
            Some(fired) => {
                let event = Event::default()
                    .event("DueTimeReached")
                    .data(fired.json.clone());
                Some((Ok::<_, Infallible>(event), Some((events, open))))
            }
            // Dropped for reading too slowly: say so, and end (the client connects again).
            None => events.lagged().map(|missed| {
                let event = Event::default().event("lagged").data(missed.to_string());
                (Ok(event), None)
            }),
        }
    });
    // End the stream at shutdown, so graceful shutdown is not held open by watchers.
    let stream = futures::StreamExt::take_until(stream, app.shutdown.clone().cancelled_owned());
    let stream = futures::StreamExt::take_until(stream, async move {
        match expires {
            Some(at) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// Liveness: the process answers.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    security(()),
    responses((status = 200, description = "`ok`", content_type = "text/plain", body = String))
)]
async fn healthz() -> &'static str {
    "ok"
}

/// Readiness: the store and the broker answer, this instance is a live member of the store's
/// instances, and every engine task runs. Anyone may ask, so the answer says only which part is
/// `unavailable`, never why (errors name hosts and users): the reasons are in the log and in
/// `GET /v1/status`. The checks run at most once per [`READY_MAX_AGE`], whatever the number
/// of callers, so polling cannot make the service reconnect to its broker over and over.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    security(()),
    responses(
        (status = 200, description = "Every part is `ok`", body = Readiness),
        (status = 503, description = "A part is `unavailable` (the reason is in the log and `GET /v1/status`)", body = Readiness),
    )
)]
async fn readyz(State(app): State<AppState>) -> Response {
    let engine = app.engine.clone();
    let checked = app.ready.get(|| async move {
        let (store, broker) = tokio::join!(
            answers_within(engine.store().health(), "store"),
            answers_within(engine.broker().health(), "broker"),
        );
        for (part, result) in [("store", &store), ("broker", &broker)] {
            if let Err(e) = result {
                tracing::warn!(part, error = %e.chain(), "not ready");
            }
        }
        Ok::<_, std::convert::Infallible>((store.is_ok(), broker.is_ok()))
    });
    let (store, broker) = match checked.await {
        Ok(parts) => *parts,
        Err(never) => match never {},
    };
    // Reachable is not enough: cut off for a moment, the instance stops firing until it has
    // joined the store's live instances again.
    let store = store && app.engine.is_member();
    let engine = app.engine.tasks_down().is_empty();
    let show = |ok: bool| if ok { "ok" } else { "unavailable" };
    let status = if store && broker && engine {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = Readiness {
        store: Probe {
            kind: app.engine.store().name(),
            status: show(store),
        },
        broker: Probe {
            kind: app.engine.broker().name(),
            status: show(broker),
        },
        engine: Probe {
            kind: "engine",
            status: show(engine),
        },
    };
    (status, Json(body)).into_response()
}

/// How long `/readyz` answers from its last health checks.
pub const READY_MAX_AGE: Duration = Duration::from_secs(1);

/// How long `/readyz` waits for the store's and the broker's health check: a server cut off
/// without a close answers nothing (a TCP connection can wait minutes before it fails).
pub const READY_WITHIN: Duration = Duration::from_secs(2);

/// `health` as it answers within [`READY_WITHIN`]; an error naming the `part` otherwise
/// (`/readyz`, `/v1/status`).
pub(crate) async fn answers_within(
    health: impl std::future::Future<Output = Result<(), Error>>,
    part: &str,
) -> Result<(), Error> {
    tokio::time::timeout(READY_WITHIN, health)
        .await
        .unwrap_or_else(|_| {
            Err(Error::unavailable(format!(
                "{part}: no answer to the health check within {} s",
                READY_WITHIN.as_secs()
            )))
        })
}

/// Prometheus metrics (`docs/src/operations/metrics.md` lists them).
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    security(()),
    responses(
        (status = 200, description = "Prometheus text format", content_type = "text/plain", body = String),
        (status = 404, description = "No metrics recorder (metrics.enabled = false)", body = ErrorBody),
    )
)]
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

/// This API as an OpenAPI 3.1 document.
#[utoipa::path(
    get,
    path = "/v1/openapi.json",
    tag = "operations",
    responses((status = 200, description = "The document", content_type = "application/json", body = Object))
)]
async fn openapi(axum::Extension(document): axum::Extension<OpenApiJson>) -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        document.0,
    )
        .into_response()
}

/// The OpenAPI document, serialized once.
#[derive(Clone)]
struct OpenApiJson(Bytes);

/// Keeps the `timer.pending` (Scheduled) and `timer.paused` gauges current (a count is too costly for every scrape on a big store).
pub async fn pending_gauge(engine: Engine, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs(5));
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

#[cfg(test)]
mod tests;
