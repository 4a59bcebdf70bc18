//! `POST /v1/timers/batch`: many `ScheduleTimer` commands in one request and one transaction.
//!
//! The body is `{"commands": [...]}`, each item what `POST /v1/timers` takes. Every item is
//! decoded first; when any is refused, the answer is 400 naming the first refused item's field
//! (`commands[3].dueAt`) and listing every refused item, and nothing is written. Otherwise all of
//! them go to the store in one transaction, and the answer has one result per item, in order.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use timer_core::{NewTimer, Reason, Rejection, Scheduled};

use crate::http::{error_body, outcome_code, server_error, AppState};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Batch<'a> {
    #[serde(borrow)]
    commands: Vec<&'a RawValue>,
}

fn rejection_json(r: &Rejection, field: Option<String>) -> Value {
    let mut error = json!({ "reason": r.reason.as_str(), "message": r.message });
    if let Some(field) = field {
        error["field"] = json!(field);
    }
    json!({ "error": error })
}

/// `commands[i]` or `commands[i].field`.
fn item_field(i: usize, field: Option<&str>) -> String {
    match field {
        Some(field) => format!("commands[{i}].{field}"),
        None => format!("commands[{i}]"),
    }
}

pub async fn schedule_batch(State(app): State<AppState>, body: Bytes) -> Response {
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
    let mut refused: Vec<(usize, Rejection)> = Vec::new();
    for (i, item) in batch.commands.iter().enumerate() {
        match app.engine.admit_schedule(item.get().as_bytes()) {
            Ok(timer) => timers.push(timer),
            Err(r) => refused.push((i, r)),
        }
    }
    if let Some((first, r)) = refused.first() {
        let field = item_field(*first, r.field.as_deref());
        let rejected: Vec<Value> = refused
            .iter()
            .map(|(i, r)| {
                let mut item = rejection_json(r, r.field.as_ref().map(|f| item_field(*i, Some(f))));
                item["index"] = json!(i);
                item
            })
            .collect();
        let message = format!(
            "{} of {} commands refused, nothing was written; the first: {}",
            refused.len(),
            batch.commands.len(),
            r.message
        );
        let mut body = json!({
            "error": { "reason": r.reason.as_str(), "field": field, "message": message },
            "rejected": rejected,
        });
        if r.field.is_none() {
            body["error"]["field"] = json!(item_field(*first, None));
        }
        return (StatusCode::BAD_REQUEST, Json(body)).into_response();
    }
    let scheduled = match app.engine.schedule(&timers).await {
        Ok(scheduled) => scheduled,
        Err(e) => return server_error(&e),
    };
    let results: Vec<Value> = timers
        .iter()
        .zip(&scheduled)
        .map(|(timer, scheduled)| {
            let mut result = match scheduled {
                Scheduled::Stored(outcome) => json!({ "outcome": outcome_code(*outcome) }),
                Scheduled::Refused(r) => rejection_json(r, r.field.clone()),
            };
            result["tenantId"] = json!(timer.key.tenant_id);
            result["serviceCallId"] = json!(timer.key.service_call_id);
            result
        })
        .collect();
    Json(json!({ "results": results })).into_response()
}
