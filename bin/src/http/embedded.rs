//! The routes of the in-process broker (the embedded setup): `POST /v1/commands` feeds it a
//! command as a broker would carry it, `GET /v1/dead-letters` shows what it refused.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Serialize;
use timer_core::wire::addressed;
use timer_core::ErrorKind;
use utoipa::ToSchema;

use crate::http::auth::{audited, Principal, Tenants};
use crate::http::error::{ApiError, ErrorBody};
use crate::http::state::{trace_headers, AppState};
use crate::http::views::Outcome;

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

/// Feeds a raw command into the in-process broker: the broker path of the embedded setup.
#[utoipa::path(
    post,
    path = "/v1/commands",
    tag = "embedded",
    request_body(content = serde_json::Value, description = "A command as a broker carries it: ScheduleTimer, CancelTimer, PauseTimer, ResumeTimer or TimerCompleted (see the wire contract). Any body but an empty one is queued: one that is not a valid command becomes a dead letter (`GET /v1/dead-letters`), as on a broker.", content_type = "application/json"),
    responses(
        (status = 202, description = "`queued`: the in-process broker has it", body = Outcome),
        (status = 400, description = "No body (`invalid_json`)", body = ErrorBody),
        (status = 404, description = "Another broker is configured: publish to it", body = ErrorBody),
        (status = 503, description = "The in-process broker holds as many unacknowledged commands as it may, in all or of this tenant (`broker.max_queued`, `broker.max_queued_bytes`, `broker.max_queued_per_tenant`, `broker.max_queued_bytes_per_tenant`); `Retry-After` says when to send again", body = ErrorBody),
    )
)]
pub async fn send_command(
    State(app): State<AppState>,
    Extension(caller): Extension<Principal>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let command = addressed(&body);
    let answer = queue_command(app, caller, &headers, body, command.tenant_id.as_deref()).await;
    audited(command, answer)
}

async fn queue_command(
    app: AppState,
    caller: Principal,
    headers: &HeaderMap,
    body: Bytes,
    tenant: Option<&str>,
) -> Result<Response, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid_json(
            "the body is empty: send one command (a JSON object)",
        ));
    }
    if caller.tenants != Tenants::All {
        // The broker path checks the command; here only its tenant is read, so a key limited to
        // some tenants cannot feed commands of others.
        let Some(tenant) = tenant else {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                "a key limited to some tenants can only send commands with a tenantId",
            )
            .field("tenantId"));
        };
        caller.need_tenant(tenant, Some("tenantId"))?;
    }
    let hub = app.memory_hub.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "unsupported",
            "POST /v1/commands feeds the in-process broker; with another broker, publish \
             commands to it directly",
        )
    })?;
    match hub.send_traced(body.to_vec(), trace_headers(headers)) {
        Ok(()) => Ok((StatusCode::ACCEPTED, Json(Outcome { outcome: "queued" })).into_response()),
        // Full (broker.max_queued, max_queued_bytes, max_queued_per_tenant,
        // max_queued_bytes_per_tenant): the engine
        // catches up.
        Err(e) if e.kind() == ErrorKind::Unavailable => Err(ApiError::from(e).retry_after(1)),
        Err(e) => Err(e.into()),
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
pub async fn dead_letters(State(app): State<AppState>) -> Result<Json<DeadLetters>, ApiError> {
    let hub = app.memory_hub.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "unsupported",
            "dead letters of a real broker are on its dead-letter destination",
        )
    })?;
    Ok(Json(DeadLetters {
        dead_letters: hub
            .dead_letters()?
            .into_iter()
            .map(|l| DeadLetterView {
                body: l.body,
                reason: l.reason,
            })
            .collect(),
    }))
}
