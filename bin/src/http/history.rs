//! A timer's history of changes, page by page.

use axum::extract::{RawQuery, State};
use axum::Json;
use serde::Serialize;
use timer_core::{Change, HistoryEntry};
use utoipa::ToSchema;

use crate::http::error::{ApiError, ErrorBody};
use crate::http::params::{count, BadParameter};
use crate::http::state::{AppState, PathTimer, TimerPath};

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

/// Default and largest page of a history.
const DEFAULT_HISTORY_PAGE: usize = 100;

pub const MAX_HISTORY_PAGE: usize = 1_000;

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
    )
)]
pub async fn history(
    State(app): State<AppState>,
    PathTimer(key): PathTimer,
    RawQuery(query): RawQuery,
) -> Result<Json<HistoryPage>, ApiError> {
    let mut limit = DEFAULT_HISTORY_PAGE;
    let mut after = 0u64;
    for (name, value) in url::form_urlencoded::parse(query.as_deref().unwrap_or("").as_bytes()) {
        match name.as_ref() {
            "limit" => limit = count("limit", &value, MAX_HISTORY_PAGE)?,
            "cursor" => {
                after = value.parse::<u64>().map_err(|_| {
                    BadParameter::new("cursor", "not a cursor this service gave out (nextCursor)")
                })?
            }
            other => {
                return Err(BadParameter::owned(
                    "query".into(),
                    format!("unknown parameter {other:?} (known: limit, cursor)"),
                )
                .into())
            }
        }
    }
    // One more than asked for tells whether there is a next page.
    let Some(mut entries) = app.engine.history(&key, after, limit + 1).await? else {
        return Err(ApiError::no_such_timer());
    };
    let next = (entries.len() > limit).then(|| {
        entries.truncate(limit);
        entries.last().map(|e| e.seq.to_string())
    });
    Ok(Json(HistoryPage {
        history: entries.iter().map(HistoryView::of).collect(),
        next_cursor: next.flatten(),
    }))
}
