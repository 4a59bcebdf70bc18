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
use axum::http::{HeaderMap, StatusCode};
use axum::Extension;
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use timer_core::{NewTimer, Reason, Rejection, Scheduled};
use utoipa::ToSchema;

use crate::http::auth::{tenant_named, Principal, Tenants};
use crate::http::error::{ApiError, ErrorBody, ErrorDetail, RejectedItem};
use crate::http::state::{trace_headers, AppState};
use crate::http::timers::outcome_code;
use crate::http::views::ScheduleTimer;

/// The body as read: each command is decoded by the engine's admission, as `POST /v1/timers`'s.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Commands<'a> {
    #[serde(borrow)]
    commands: Vec<&'a RawValue>,
}

fn rejection_detail(r: &Rejection, field: Option<String>) -> ErrorDetail {
    ErrorDetail {
        field,
        ..ErrorDetail::new(r.reason.as_str(), None, &r.message)
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
    request_body = Batch,
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
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<BatchResults>, ApiError> {
    let trace = trace_headers(&headers);
    let batch: Commands = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request(
            Reason::InvalidJson.as_str(),
            format!("the body must be {{\"commands\": [...]}}: {e}"),
        )
        .field("commands")
    })?;
    let max = app.engine.limits().max_batch;
    if batch.commands.len() > max {
        return Err(ApiError::bad_request(
            Reason::TooLarge.as_str(),
            format!(
                "{} commands, the limit is {max} (limits.max_batch)",
                batch.commands.len()
            ),
        )
        .field("commands"));
    }
    // A tenant the key may not use refuses the whole batch, as a refused item does; asked
    // before the commands are checked, so their refusals tell nothing of another tenant.
    let limited = caller.tenants != Tenants::All;
    let forbidden_of = |named: Vec<(usize, String)>| -> Vec<RejectedItem> {
        named
            .into_iter()
            .filter(|(_, tenant)| !caller.may_use(tenant))
            .map(|(i, tenant)| RejectedItem {
                index: i,
                error: ErrorDetail::new(
                    "forbidden",
                    Some(&item_field(i, Some("tenantId"))),
                    &format!("key {:?} may not use tenant {tenant:?}", caller.name),
                ),
            })
            .collect()
    };
    let named = batch
        .commands
        .iter()
        .enumerate()
        .filter(|_| limited)
        .filter_map(|(i, item)| Some((i, tenant_named(item.get().as_bytes())?)))
        .collect();
    let forbidden = forbidden_of(named);
    if !forbidden.is_empty() {
        return Err(refused_whole(forbidden, batch.commands.len()));
    }
    let mut timers: Vec<NewTimer> = Vec::with_capacity(batch.commands.len());
    let mut admitted: Vec<usize> = Vec::with_capacity(batch.commands.len());
    let mut refused: Vec<(usize, Rejection)> = Vec::new();
    for (i, item) in batch.commands.iter().enumerate() {
        match app.engine.admit_schedule(item.get().as_bytes(), &trace) {
            Ok(timer) => {
                timers.push(timer);
                admitted.push(i);
            }
            Err(r) => refused.push((i, r)),
        }
    }
    // A tenant the key may not use that the first read did not find (it reads as the
    // decoder does; this is the decoder's word): refused the same way.
    let named = admitted
        .iter()
        .zip(&timers)
        .filter(|_| limited)
        .map(|(i, t)| (*i, t.key.tenant_id.clone()))
        .collect();
    let forbidden = forbidden_of(named);
    if !forbidden.is_empty() {
        return Err(refused_whole(forbidden, batch.commands.len()));
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
        return Err(ApiError::bad_request(r.reason.as_str(), message)
            .field(field)
            .rejected(rejected));
    }
    app.engine.within_rate(&timers).await?;
    let scheduled = app.engine.schedule(&timers).await?;
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
    Ok(Json(BatchResults { results }))
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

/// `POST /v1/timers/batch`.
#[derive(Debug, Serialize, ToSchema)]
pub struct Batch {
    /// Up to `limits.max_batch` (default 1,000).
    pub commands: Vec<ScheduleTimer>,
}

/// 403 for a batch with commands of tenants the key may not use (`forbidden`, not empty):
/// nothing of it is written.
fn refused_whole(forbidden: Vec<RejectedItem>, commands: usize) -> ApiError {
    let (message, field) = match forbidden.first() {
        Some(first) => (
            format!(
                "{} of {commands} commands name a tenant this key may not use, nothing was \
                 written; the first: {}",
                forbidden.len(),
                first.error.message
            ),
            first.error.field.clone().unwrap_or_default(),
        ),
        None => (String::new(), String::new()),
    };
    ApiError::new(StatusCode::FORBIDDEN, "forbidden", message)
        .field(field)
        .rejected(forbidden)
}
