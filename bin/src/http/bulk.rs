//! Bulk actions: cancel, pause, resume or retry every timer of a tenant that a filter matches.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Path, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use opentelemetry::trace::FutureExt as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use timer_core::Action;
use tracing::Instrument as _;
use utoipa::ToSchema;

use crate::http::actions::check_note;
use crate::http::error::{ApiError, ErrorBody};
use crate::http::params::{BadParameter, ListParams};
use crate::http::state::{AppState, TenantPath};

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
    /// One state or several (`scheduled`, `paused`, `reached`, `cancelled`, `failed`); not
    /// empty (leave it out for any state).
    pub state: Option<Vec<String>>,
    /// Of the serviceCallId; not empty (leave it out for any id).
    pub prefix: Option<String>,
    #[schema(format = DateTime)]
    pub due_after: Option<String>,
    #[schema(format = DateTime)]
    pub due_before: Option<String>,
    pub recurring: Option<bool>,
    /// Only (`true`) or all but (`false`) the Scheduled timers whose last publish failed.
    pub retrying: Option<bool>,
}

/// The actions a bulk request may ask for.
pub const ACTIONS: [&str; 4] = ["cancel", "pause", "resume", "retry"];

/// Timers a bulk action reads and changes per transaction.
pub const BULK_PAGE: usize = 1_000;

/// The body of `POST /v1/tenants/{tenant}/timers/bulk`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BulkBody {
    action: String,
    /// Absent or `null`: every timer of the tenant.
    #[serde(default)]
    filter: Option<serde_json::Map<String, Value>>,
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
        // `null`: as if the filter were not given.
        if value.is_null() {
            continue;
        }
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
        // In a list an empty filter means "any"; here, where a client that builds the filter
        // from a selection would act on every timer when nothing is selected, it is refused.
        // A state's words are also split on commas (`"paused,failed"`): `","` names none.
        let names_none = |w: &&Value| match w.as_str() {
            Some(text) if name == "state" => text.split(',').all(str::is_empty),
            Some(text) => text.is_empty(),
            None => false,
        };
        if words.is_empty() || words.iter().any(names_none) {
            return Err(BadParameter::owned(
                format!("filter.{name}"),
                format!(
                    "empty: a bulk action's {name} must name something (leave it out, or null, \
                     to act on timers of any {name})"
                ),
            ));
        }
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
/// (1,000 timers per transaction); answers how many matched and changed. The action has no
/// request timeout and goes on to the end when the client leaves; its body must arrive within
/// `http.request_timeout` ([`body_in_time`]).
#[utoipa::path(
    post,
    path = "/v1/tenants/{tenant}/timers/bulk",
    tag = "control",
    params(TenantPath),
    request_body = BulkRequest,
    responses(
        (status = 200, description = "Done", body = BulkOutcome),
        (status = 400, description = "A bad action or filter; `field` names it (`action`, `filter.state`, …)", body = ErrorBody),
        (status = 408, description = "`timeout`: the body did not arrive within `http.request_timeout`", body = ErrorBody),
        (status = 409, description = "`bulk_running`: a bulk action of this tenant is running (one at a time per tenant)", body = ErrorBody),
    )
)]
pub async fn bulk(
    State(app): State<AppState>,
    Path(TenantPath { tenant }): Path<TenantPath>,
    body: Bytes,
) -> Result<Json<BulkOutcome>, ApiError> {
    let body: BulkBody = serde_json::from_slice(&body).map_err(|e| {
        ApiError::invalid_json(format!(
            "the body is not {{\"action\": \"cancel\"|\"pause\"|\"resume\"|\"retry\", \
             \"filter\": {{…}}}} ({e})"
        ))
    })?;
    check_note(body.note.as_deref())?;
    let action = match body.action.as_str() {
        "cancel" => Action::Cancel,
        "pause" => Action::Pause { note: body.note },
        "resume" => Action::Resume,
        "retry" => Action::Retry,
        other => {
            return Err(ApiError::bad_request(
                "invalid_parameter",
                format!("{other:?} is not an action ({})", ACTIONS.join(", ")),
            )
            .field("action"))
        }
    };
    let params = bulk_filter(&body.filter.unwrap_or_default())?;
    let turn = app.bulks.start(&tenant).ok_or_else(|| {
        ApiError::conflict(
            "bulk_running",
            format!(
                "a bulk action of tenant {tenant} is running (one at a time per tenant); try \
                 again when it has ended"
            ),
        )
    })?;
    let engine = app.engine.clone();
    let name = action.as_str();
    // Its own task, in the request's trace: a client that leaves does not stop it halfway
    // through a page, and the tenant's turn is held until it ends.
    let run = tokio::spawn(
        async move {
            let _turn = turn;
            engine
                .bulk(&tenant, &params.filter, &action, BULK_PAGE)
                .await
        }
        .with_current_context()
        .in_current_span(),
    );
    let bulk = run.await.map_err(|e| {
        ApiError::from(timer_core::Error::internal(format!(
            "the bulk action stopped: {e}"
        )))
    })??;
    Ok(Json(BulkOutcome {
        action: name,
        matched: bulk.matched,
        changed: bulk.changed,
        pages: bulk.pages,
        outcomes: bulk.outcomes,
    }))
}

/// Reads a request's whole body within `deadline` (`http.request_timeout`) before its handler
/// runs, for a route without a request timeout: a client that sends its body a byte at a time
/// would otherwise hold a connection (of `http.max_connections`) for as long as it likes.
pub async fn body_in_time(
    State(deadline): State<Duration>,
    request: Request,
    next: Next,
) -> Response {
    let (parts, body) = request.into_parts();
    // Under the route's body limit: one over it is refused as 413, as on every route.
    let read = Bytes::from_request(Request::from_parts(parts.clone(), body), &());
    match tokio::time::timeout(deadline, read).await {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Ok(Err(refused)) => refused.into_response(),
        Err(_) => ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "timeout",
            format!(
                "the request body did not arrive within {} (http.request_timeout)",
                humantime::format_duration(deadline)
            ),
        )
        .into_response(),
    }
}
