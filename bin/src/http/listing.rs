//! The control plane's read routes: a tenant's timers as pages with filters, and summaries per
//! tenant (through the store's [`TimerQueries`] ability). The query parameters and cursors are
//! read in [`params`](super::params).

use std::collections::BTreeMap;
use std::time::Duration;

use axum::extract::{Path, RawQuery, State};
use axum::{Extension, Json};
use serde::Serialize;
use timer_core::{Engine, PageAfter, TenantSummary, TimerQueries, TimerState, Timestamp};
use utoipa::ToSchema;

use crate::http::auth::{Principal, Tenants};
use crate::http::counted::FirstTenants;
use crate::http::error::{ApiError, ErrorBody};
use crate::http::params::{
    decode, encode, end_page, no_control, parse_limit, tenant_cursor, BadParameter, ListCursor,
    ListParams, TenantCursor, DEFAULT_LIMIT, MAX_LIMIT,
};
use crate::http::state::{AppState, TenantPath};
use crate::http::views::TimerView;

/// How far back `failedLast24h` counts.
const FAILED_WINDOW: Duration = Duration::from_secs(24 * 3600);

/// How far back `firedLastHour` counts.
const FIRED_WINDOW: Duration = Duration::from_secs(3600);

/// The query of `GET /v1/tenants/{tenant}/timers`, for the document (read by
/// [`ListParams::parse`], which also refuses unknown parameters).
#[allow(dead_code)]
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[into_params(rename_all = "camelCase")]
struct ListQuery {
    /// `scheduled`, `paused`, `reached`, `cancelled`, `failed`: repeated or comma-separated.
    state: Option<Vec<String>>,
    /// Of the serviceCallId.
    prefix: Option<String>,
    /// RFC 3339 or Unix milliseconds; inclusive.
    due_after: Option<String>,
    /// RFC 3339 or Unix milliseconds; exclusive.
    due_before: Option<String>,
    /// Only series (`true`) or only one-shot timers (`false`).
    recurring: Option<bool>,
    /// Only (`true`) or all but (`false`) the Scheduled timers whose last publish failed and
    /// which wait for their next attempt.
    retrying: Option<bool>,
    /// Page size: 1 to 1000, default 100.
    limit: Option<usize>,
    /// `nextCursor` of the page before, with the same tenant and filters.
    cursor: Option<String>,
}

/// A page of a tenant's timers, by due time then id, with filters.
#[utoipa::path(
    get,
    path = "/v1/tenants/{tenant}/timers",
    tag = "control",
    params(TenantPath, ListQuery),
    responses(
        (status = 200, description = "A page", body = TimerPage),
        (status = 400, description = "A bad parameter, or a cursor of another tenant or filter; `field` names it", body = ErrorBody),
    )
)]
pub async fn list_timers(
    State(app): State<AppState>,
    Path(TenantPath { tenant }): Path<TenantPath>,
    RawQuery(query): RawQuery,
) -> Result<Json<TimerPage>, ApiError> {
    let queries = app.engine.store().queries();
    let params = ListParams::parse(query.as_deref())?;
    let after = match params.cursor.as_deref() {
        Some(cursor) => Some(ListCursor::open(cursor, &tenant, &params.filter)?),
        None => None,
    };
    // One more than asked for tells whether there is a next page.
    let mut timers = queries
        .list(&tenant, &params.filter, after.as_ref(), params.limit + 1)
        .await?;
    let next = end_page(&mut timers, params.limit, |last| {
        let after = PageAfter {
            due_at: last.due_at,
            service_call_id: last.key.service_call_id.clone(),
        };
        encode(&ListCursor::new(&tenant, &params.filter, &after))
    });
    Ok(Json(TimerPage {
        timers: timers.iter().map(TimerView::of).collect(),
        next_cursor: next,
    }))
}

/// A tenant's counts per state, next due time and failures in the last 24 hours.
#[utoipa::path(
    get,
    path = "/v1/tenants/{tenant}/summary",
    tag = "control",
    params(TenantPath),
    responses(
        (status = 200, description = "The summary (zero counts for a tenant without timers)", body = SummaryView),
        (status = 400, description = "A query parameter: this route takes none (`limit` and `cursor` page `GET /v1/summary`)", body = ErrorBody),
    )
)]
pub async fn tenant_summary(
    State(app): State<AppState>,
    Path(TenantPath { tenant }): Path<TenantPath>,
    RawQuery(query): RawQuery,
) -> Result<Json<Option<SummaryView>>, ApiError> {
    // A typo, or a page of tenants asked of one tenant, is said, not ignored.
    let query = query.unwrap_or_default();
    if let Some((name, _)) = url::form_urlencoded::parse(query.as_bytes()).next() {
        return Err(BadParameter::owned(
            "query".into(),
            format!(
                "unknown parameter {name:?}: a tenant's summary takes none (limit and cursor \
                 page GET /v1/summary, every tenant's)"
            ),
        )
        .into());
    }
    let queries = app.engine.store().queries();
    let summaries = summaries(queries, app.engine.clock().now(), &[tenant]).await?;
    Ok(Json(summaries.first().map(summary_view)))
}

#[allow(dead_code)]
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
struct PageQuery {
    /// Page size: 1 to 1000, default 100.
    limit: Option<usize>,
    /// `nextCursor` of the page before.
    cursor: Option<String>,
}

/// Every tenant's summary, a page of tenants at a time.
#[utoipa::path(
    get,
    path = "/v1/summary",
    tag = "control",
    params(PageQuery),
    responses(
        (status = 200, description = "A page of tenants", body = SummaryPage),
        (status = 400, description = "A bad parameter; `field` names it", body = ErrorBody),
    )
)]
pub async fn all_summaries(
    State(app): State<AppState>,
    Extension(caller): Extension<Principal>,
    RawQuery(query): RawQuery,
) -> Result<Json<SummaryPage>, ApiError> {
    let queries = app.engine.store().queries();
    let mut limit = DEFAULT_LIMIT;
    let mut after: Option<String> = None;
    for (name, value) in url::form_urlencoded::parse(query.as_deref().unwrap_or("").as_bytes()) {
        match name.as_ref() {
            "limit" => limit = parse_limit(&value)?,
            "cursor" => {
                let tenant = decode::<TenantCursor>(&value)?.after_tenant;
                after = Some(no_control("cursor", tenant)?);
            }
            other => {
                return Err(BadParameter::new(
                    "query",
                    format!("unknown parameter {other:?} (known: limit, cursor)"),
                )
                .into())
            }
        }
    }
    let own_page = match &caller.tenants {
        // Every tenant: pages of the store's tenants.
        Tenants::All => None,
        // A key for some tenants sees those (with zero counts where there are no timers), in
        // pages of its own list.
        Tenants::Only(own) => Some(
            own.iter()
                .filter(|t| after.as_ref().is_none_or(|after| *t > after))
                .take(limit + 1)
                .cloned()
                .collect::<Vec<String>>(),
        ),
    };
    if after.is_none() && own_page.is_none() {
        // The first page, which the dashboard asks for every 2 seconds: from the shared count.
        let first = app
            .counts
            .first_tenants
            .get(|| count_first_tenants(app.engine.clone()))
            .await?;
        return Ok(Json(first_page(&first, limit)));
    }
    let mut tenants = match own_page {
        Some(own) => own,
        None => queries.tenants(after.as_deref(), limit + 1).await?,
    };
    let next = end_page(&mut tenants, limit, |last| tenant_cursor(last));
    let now = app.engine.clock().now();
    // Each tenant counted at most once per http.counts_max_age, whoever asks.
    let (summaries, counted_at) = app
        .counts
        .tenants
        .get(&tenants, now, |tenants| async move {
            summaries(queries, now, &tenants).await
        })
        .await?;
    Ok(Json(SummaryPage {
        tenants: summaries.iter().map(summary_view).collect(),
        next_cursor: next,
        counted_at: counted_at.to_rfc3339(),
    }))
}

/// The first page of `GET /v1/summary`, `limit` tenants long, from the shared count.
fn first_page(first: &FirstTenants, limit: usize) -> SummaryPage {
    let shown = &first.summaries[..limit.min(first.summaries.len())];
    let more = first.more || shown.len() < first.summaries.len();
    SummaryPage {
        tenants: shown.iter().map(summary_view).collect(),
        next_cursor: more
            .then(|| shown.last().map(|s| tenant_cursor(&s.tenant_id)))
            .flatten(),
        counted_at: first.counted_at.to_rfc3339(),
    }
}

async fn count_first_tenants(engine: Engine) -> timer_core::Result<FirstTenants> {
    let queries = engine.store().queries();
    let counted_at = engine.clock().now();
    let mut tenants = queries.tenants(None, MAX_LIMIT + 1).await?;
    let more = tenants.len() > MAX_LIMIT;
    tenants.truncate(MAX_LIMIT);
    Ok(FirstTenants {
        counted_at,
        summaries: summaries(queries, counted_at, &tenants).await?,
        more,
    })
}

/// The summaries of `tenants`, with the windows ending at `now`.
async fn summaries(
    queries: &dyn TimerQueries,
    now: Timestamp,
    tenants: &[String],
) -> timer_core::Result<Vec<TenantSummary>> {
    queries
        .summaries(
            tenants,
            now.saturating_sub(FAILED_WINDOW),
            now.saturating_sub(FIRED_WINDOW),
        )
        .await
}

fn summary_view(s: &TenantSummary) -> SummaryView {
    let counts = TimerState::ALL
        .iter()
        .map(|state| {
            let n = s.counts.get(state).copied().unwrap_or(0);
            (state.as_str().to_ascii_lowercase(), n)
        })
        .collect();
    SummaryView {
        tenant_id: s.tenant_id.clone(),
        counts,
        next_due_at: s.next_due_at.map(Timestamp::to_rfc3339),
        failed_last_24h: s.failed_since,
        fired_last_hour: s.fired_since,
    }
}

/// A page of a tenant's timers, by due time then id.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TimerPage {
    pub timers: Vec<TimerView>,
    /// Give it as `cursor` for the next page; null on the last one.
    #[schema(required = true)]
    pub next_cursor: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SummaryView {
    pub tenant_id: String,
    /// Timers per state: `scheduled`, `paused`, `reached`, `cancelled`, `failed`.
    pub counts: BTreeMap<String, u64>,
    #[schema(format = DateTime)]
    #[schema(required = true)]
    pub next_due_at: Option<String>,
    #[serde(rename = "failedLast24h")]
    pub failed_last_24h: u64,
    /// Timers that fired in the last hour (a series counts once, by its last fire).
    pub fired_last_hour: u64,
}

/// A page of tenants' summaries, by tenant id.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SummaryPage {
    pub tenants: Vec<SummaryView>,
    #[schema(required = true)]
    pub next_cursor: Option<String>,
    /// When these counts were taken: the first page is shared between requests for up to
    /// `http.counts_max_age`; a page after a cursor is counted for its request.
    #[schema(format = DateTime)]
    pub counted_at: String,
}
