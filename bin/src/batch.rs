//! `POST /v1/timers/batch`: many `ScheduleTimer` commands in one request and one transaction.
//!
//! The body is `{"commands": [...]}`, each item what `POST /v1/timers` takes. Every item is
//! decoded first; when any is refused, the answer is 400 naming the first refused item's field
//! (`commands[3].dueAt`) and listing every refused item, and nothing is written. Otherwise all of
//! them go to the store in one transaction, and the answer has one result per item, in order.
//! Before the store, the batch takes one schedule per command from its tenants' rate limits
//! (`limits.rate`); a tenant over its rate answers 429 and nothing is written.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use axum::Json;
use serde::Deserialize;
use serde_json::value::RawValue;
use timer_core::{NewTimer, Reason, Rejection, Scheduled};

use crate::api::{
    Batch as BatchBody, BatchRefused, BatchResult, BatchResults, ErrorBody, ErrorDetail,
    RejectedItem,
};
use crate::auth::Principal;
use crate::http::{error_body, outcome_code, server_error, too_fast, AppState};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Batch<'a> {
    #[serde(borrow)]
    commands: Vec<&'a RawValue>,
}

fn rejection_detail(r: &Rejection, field: Option<String>) -> ErrorDetail {
    ErrorDetail {
        reason: r.reason.as_str().to_owned(),
        field,
        message: r.message.clone(),
    }
}

/// `commands[i]` or `commands[i].field`.
fn item_field(i: usize, field: Option<&str>) -> String {
    match field {
        Some(field) => format!("commands[{i}].{field}"),
        None => format!("commands[{i}]"),
    }
}

/// Schedules many timers in one transaction: all of them, or none when any is refused.
#[utoipa::path(
    post,
    path = "/v1/timers/batch",
    tag = "timers",
    request_body = BatchBody,
    responses(
        (status = 200, description = "One result per command, in order", body = BatchResults),
        (status = 400, description = "Refused items (nothing was written), or a body that is not a batch, or over `limits.max_batch`", body = BatchRefused),
        (status = 403, description = "A command names a tenant the key may not use (`rejected` lists them); nothing was written", body = BatchRefused),
        (status = 413, description = "Over `limits.max_batch_bytes`", body = ErrorBody),
        (status = 429, description = "A tenant of the batch is over its rate limit (`rate_limited`, `Retry-After` in seconds), or has more commands in it than its burst (no `Retry-After`: send fewer at a time); nothing was written", body = ErrorBody),
        (status = 503, description = "The store is unavailable; nothing was written", body = ErrorBody),
    )
)]
pub async fn schedule_batch(
    State(app): State<AppState>,
    Extension(caller): Extension<Principal>,
    body: Bytes,
) -> Response {
    let batch: Batch = match serde_json::from_slice(&body) {
        Ok(batch) => batch,
        Err(e) => {
            return error_body(
                StatusCode::BAD_REQUEST,
                Reason::InvalidJson.as_str(),
                Some("commands"),
                &format!("the body must be {{\"commands\": [...]}}: {e}"),
            )
        }
    };
    let max = app.engine.limits().max_batch;
    if batch.commands.len() > max {
        return error_body(
            StatusCode::BAD_REQUEST,
            Reason::TooLarge.as_str(),
            Some("commands"),
            &format!(
                "{} commands, the limit is {max} (limits.max_batch)",
                batch.commands.len()
            ),
        );
    }
    let mut timers: Vec<NewTimer> = Vec::with_capacity(batch.commands.len());
    let mut admitted: Vec<usize> = Vec::with_capacity(batch.commands.len());
    let mut refused: Vec<(usize, Rejection)> = Vec::new();
    for (i, item) in batch.commands.iter().enumerate() {
        match app.engine.admit_schedule(item.get().as_bytes()) {
            Ok(timer) => {
                timers.push(timer);
                admitted.push(i);
            }
            Err(r) => refused.push((i, r)),
        }
    }
    // A tenant the key may not use refuses the whole batch, as a refused item does.
    let forbidden: Vec<RejectedItem> = timers
        .iter()
        .zip(admitted)
        .filter(|(timer, _)| !caller.may_use(&timer.key.tenant_id))
        .map(|(timer, i)| RejectedItem {
            index: i,
            error: ErrorDetail {
                reason: "forbidden".into(),
                field: Some(item_field(i, Some("tenantId"))),
                message: format!(
                    "key {:?} may not use tenant {:?}",
                    caller.name, timer.key.tenant_id
                ),
            },
        })
        .collect();
    if let Some(first) = forbidden.first() {
        let body = BatchRefused {
            error: ErrorDetail {
                message: format!(
                    "{} of {} commands name a tenant this key may not use, nothing was written; \
                     the first: {}",
                    forbidden.len(),
                    batch.commands.len(),
                    first.error.message
                ),
                ..first.error.clone()
            },
            rejected: forbidden,
        };
        return (StatusCode::FORBIDDEN, Json(body)).into_response();
    }
    if let Some((first, r)) = refused.first() {
        let field = item_field(*first, r.field.as_deref());
        let rejected: Vec<RejectedItem> = refused
            .iter()
            .map(|(i, r)| RejectedItem {
                index: *i,
                error: rejection_detail(r, r.field.as_ref().map(|f| item_field(*i, Some(f)))),
            })
            .collect();
        let message = format!(
            "{} of {} commands refused, nothing was written; the first: {}",
            refused.len(),
            batch.commands.len(),
            r.message
        );
        let body = BatchRefused {
            error: ErrorDetail {
                reason: r.reason.as_str().to_owned(),
                field: Some(field),
                message,
            },
            rejected,
        };
        return (StatusCode::BAD_REQUEST, Json(body)).into_response();
    }
    if let Err(throttled) = app.engine.within_rate(&timers) {
        return too_fast(&throttled);
    }
    let scheduled = match app.engine.schedule(&timers).await {
        Ok(scheduled) => scheduled,
        Err(e) => return server_error(&e),
    };
    let results = timers
        .iter()
        .zip(&scheduled)
        .map(|(timer, scheduled)| {
            let (outcome, error) = match scheduled {
                Scheduled::Stored(outcome) => (Some(outcome_code(*outcome)), None),
                Scheduled::Refused(r) => (None, Some(rejection_detail(r, r.field.clone()))),
            };
            BatchResult {
                tenant_id: timer.key.tenant_id.clone(),
                service_call_id: timer.key.service_call_id.clone(),
                outcome,
                error,
            }
        })
        .collect();
    Json(BatchResults { results }).into_response()
}
