//! The control actions on one timer: pause, resume, retry, trigger, complete.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use timer_core::engine::Triggered;
use timer_core::{Action, ControlOutcome, TimerKey};
use utoipa::ToSchema;

use crate::http::error::{ApiError, ErrorBody, ErrorDetail};
use crate::http::state::{AppState, PathTimer, TimerPath};
use crate::http::views::{TimerOutcome, TimerView, TriggerOutcome};

/// The optional body of `POST …/pause`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseBody {
    #[serde(default)]
    note: Option<String>,
}

/// Longest pause note, in bytes.
pub const MAX_NOTE_BYTES: usize = 1_024;

/// Refuses a pause note (of one timer or a bulk pause) over [`MAX_NOTE_BYTES`]: 400.
pub fn check_note(note: Option<&str>) -> Result<(), ApiError> {
    match note {
        Some(note) if note.len() > MAX_NOTE_BYTES => Err(ApiError::bad_request(
            "too_large",
            format!("a note has at most {MAX_NOTE_BYTES} bytes"),
        )
        .field("note")),
        _ => Ok(()),
    }
}

/// An optional JSON body: empty (or only whitespace) or `null` is `T::default()`.
pub fn optional_body<T: DeserializeOwned + Default>(body: &[u8]) -> serde_json::Result<T> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    Ok(serde_json::from_slice::<Option<T>>(body)?.unwrap_or_default())
}

/// The answer to an action on one timer: 200 with the outcome and the timer as it is now when
/// the action changed it or found it as asked; 409 when the timer is finished or firing; 404.
async fn answer(
    app: &AppState,
    key: &TimerKey,
    outcome: ControlOutcome,
) -> Result<Response, ApiError> {
    // Each 409 as the document says: the outcome, the timer as it is, and why.
    let conflict = match outcome {
        ControlOutcome::NotFound => return Err(ApiError::no_such_timer()),
        ControlOutcome::Firing => Some(
            "the timer's event is being published right now; nothing changed (try again once \
             it fired)",
        ),
        ControlOutcome::AlreadyReached
        | ControlOutcome::AlreadyCancelled
        | ControlOutcome::AlreadyFailed => {
            Some("the timer is finished (Reached, Cancelled or Failed); nothing changed")
        }
        _ => None,
    };
    let status = match conflict {
        Some(_) => StatusCode::CONFLICT,
        None => StatusCode::OK,
    };
    let timer = app.engine.store().get(key).await?;
    let timer = timer.as_ref().map(TimerView::of);
    let error = conflict.map(|why| ErrorDetail::new(outcome.as_str(), None, why));
    let body = TimerOutcome {
        outcome: outcome.as_str(),
        timer,
        error,
    };
    Ok((status, Json(body)).into_response())
}

async fn act(app: &AppState, key: TimerKey, action: Action) -> Result<Response, ApiError> {
    let outcomes = app
        .engine
        .control(std::slice::from_ref(&key), &action)
        .await?;
    let outcome = outcomes
        .first()
        .copied()
        .unwrap_or(ControlOutcome::NotFound);
    answer(app, &key, outcome).await
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
    )
)]
pub async fn pause(
    State(app): State<AppState>,
    PathTimer(key): PathTimer,
    body: Bytes,
) -> Result<Response, ApiError> {
    let body: PauseBody = optional_body(&body).map_err(|e| {
        ApiError::invalid_json(format!("the body is not {{\"note\": \"…\"}} ({e})"))
    })?;
    check_note(body.note.as_deref())?;
    act(&app, key, Action::Pause { note: body.note }).await
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
    )
)]
pub async fn resume(
    State(app): State<AppState>,
    PathTimer(key): PathTimer,
) -> Result<Response, ApiError> {
    act(&app, key, Action::Resume).await
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
        (status = 429, description = "The tenant is over its rate (`limits.rate`: a retry fires, so it counts as a schedule); `Retry-After` says when", body = ErrorBody),
    )
)]
pub async fn retry(
    State(app): State<AppState>,
    PathTimer(key): PathTimer,
) -> Result<Response, ApiError> {
    app.engine.within_rate_of(&key.tenant_id).await?;
    act(&app, key, Action::Retry).await
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
    )
)]
pub async fn complete(
    State(app): State<AppState>,
    PathTimer(key): PathTimer,
    body: Bytes,
) -> Result<Response, ApiError> {
    let body: CompleteBody = optional_body(&body)
        .map_err(|e| ApiError::invalid_json(format!("the body is not {COMPLETE_BODY} ({e})")))?;
    let completion = timer_core::wire::completion_fields(
        body.occurrence,
        body.outcome.as_deref(),
        body.message,
        "",
    )?;
    act(&app, key, Action::Complete(completion)).await
}

/// Fires one extra occurrence now: a `DueTimeReached` with `"trigger": "manual"` and an id of
/// its own; the schedule does not move. Scheduled and Paused timers only.
#[utoipa::path(
    post,
    path = "/v1/tenants/{tenant}/timers/{id}/trigger",
    tag = "control",
    params(TimerPath),
    responses(
        (status = 200, description = "The broker confirmed the event (an HTTP target: took the call)", body = TriggerOutcome),
        (status = 400, description = "The timer's target is refused now (`invalid_target`, field `target`): it was taken under other `targets` patterns; its due fire gives it up the same way", body = ErrorBody),
        (status = 409, description = "Finished (`already_reached`, …) or firing right now (`firing`)", body = TimerOutcome),
        (status = 429, description = "The tenant is over its rate (`limits.rate`: a trigger fires, so it counts as a schedule); `Retry-After` says when", body = ErrorBody),
        (status = 503, description = "The broker did not confirm in time, or the HTTP target did not take the call (its answer in the message)", body = ErrorBody),
    )
)]
pub async fn trigger(
    State(app): State<AppState>,
    PathTimer(key): PathTimer,
) -> Result<Response, ApiError> {
    app.engine.within_rate_of(&key.tenant_id).await?;
    match app.engine.trigger(&key).await? {
        Triggered::Fired { event_id, at } => Ok(Json(TriggerOutcome {
            outcome: "triggered",
            event_id: event_id.to_string(),
            at: at.to_rfc3339(),
        })
        .into_response()),
        Triggered::Refused(outcome) => answer(&app, &key, outcome).await,
        Triggered::NotCarried(refused) => Err(refused.into()),
    }
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
