//! The control plane's read routes: a tenant's timers as pages with filters, summaries per
//! tenant (through the store's [`TimerQueries`] ability), and a timer's next occurrences.
//!
//! A page ends with an opaque `nextCursor`: base64url of a small JSON object holding the tenant,
//! the filters and the last timer's position (due time, id). The next page starts after that
//! position (keyset pagination), so writes between pages never repeat or skip a timer that was
//! there all along. A cursor is only good for the tenant and filters it came from.

use std::time::Duration;

use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use timer_core::{
    Engine, Error, PageAfter, TenantSummary, Timer, TimerFilter, TimerQueries, TimerState,
    Timestamp,
};

use crate::api::{ErrorBody, Occurrence, SummaryPage, SummaryView, TimerPage, TimerView};
use crate::auth::{Principal, Tenants};
use crate::http::{error_body, server_error, AppState, TenantPath};

/// Default and largest page size.
const DEFAULT_LIMIT: usize = 100;
const MAX_LIMIT: usize = 1000;

/// How far back `failedLast24h` counts.
const FAILED_WINDOW: Duration = Duration::from_secs(24 * 3600);

/// How far back `firedLastHour` counts.
const FIRED_WINDOW: Duration = Duration::from_secs(3600);

/// A query parameter that cannot be used: 400 naming it.
#[derive(Debug, PartialEq, Eq)]
pub struct BadParameter {
    pub field: String,
    pub message: String,
}

impl BadParameter {
    pub fn new(field: &'static str, message: impl Into<String>) -> Self {
        Self::owned(field.to_owned(), message)
    }

    pub fn owned(field: String, message: impl Into<String>) -> Self {
        BadParameter {
            field,
            message: message.into(),
        }
    }

    /// The same problem, of a parameter given inside the object `parent` of a JSON body
    /// (`filter.state`; `filter` itself for an unknown one).
    pub fn within(self, parent: &str) -> Self {
        let field = match self.field.as_str() {
            "query" => parent.to_owned(),
            field => format!("{parent}.{field}"),
        };
        BadParameter { field, ..self }
    }

    pub fn response(&self) -> Response {
        error_body(
            StatusCode::BAD_REQUEST,
            "invalid_parameter",
            Some(&self.field),
            &self.message,
        )
    }
}

/// The parameters of `GET /v1/tenants/{tenant}/timers`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ListParams {
    pub filter: TimerFilter,
    pub limit: usize,
    pub cursor: Option<String>,
}

impl ListParams {
    /// Reads the query string: `state` (repeated or comma-separated), `prefix`, `dueAfter`,
    /// `dueBefore` (RFC 3339 with offset, or epoch milliseconds), `recurring`, `limit`, `cursor`.
    /// An unknown parameter is refused, so a typo does not silently list everything.
    pub fn parse(query: Option<&str>) -> Result<ListParams, BadParameter> {
        let mut params = ListParams {
            limit: DEFAULT_LIMIT,
            ..ListParams::default()
        };
        for (name, value) in url::form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            match name.as_ref() {
                "state" => {
                    for word in value.split(',').filter(|w| !w.is_empty()) {
                        let state = parse_state(word)?;
                        if !params.filter.states.contains(&state) {
                            params.filter.states.push(state);
                        }
                    }
                }
                "prefix" => params.filter.prefix = Some(value.into_owned()),
                "dueAfter" => params.filter.due_after = Some(parse_time("dueAfter", &value)?),
                "dueBefore" => params.filter.due_before = Some(parse_time("dueBefore", &value)?),
                "recurring" => params.filter.recurring = Some(parse_bool("recurring", &value)?),
                "retrying" => params.filter.retrying = Some(parse_bool("retrying", &value)?),
                "limit" => params.limit = parse_limit(&value)?,
                "cursor" => params.cursor = Some(value.into_owned()),
                other => {
                    return Err(BadParameter::new(
                        "query",
                        format!(
                            "unknown parameter {other:?} (known: state, prefix, dueAfter, \
                             dueBefore, recurring, retrying, limit, cursor)"
                        ),
                    ))
                }
            }
        }
        params.filter.states.sort_by_key(|s| s.code());
        Ok(params)
    }
}

fn parse_state(word: &str) -> Result<TimerState, BadParameter> {
    TimerState::ALL
        .into_iter()
        .find(|s| s.as_str().eq_ignore_ascii_case(word))
        .ok_or_else(|| {
            let known: Vec<String> = TimerState::ALL
                .iter()
                .map(|s| s.as_str().to_lowercase())
                .collect();
            BadParameter::new(
                "state",
                format!("{word:?} is not a state ({})", known.join(", ")),
            )
        })
}

fn parse_time(field: &'static str, value: &str) -> Result<Timestamp, BadParameter> {
    if let Ok(ms) = value.parse::<i64>() {
        return Ok(Timestamp::from_millis(ms));
    }
    chrono::DateTime::parse_from_rfc3339(value)
        .map(|t| Timestamp::from_datetime(&t))
        .map_err(|e| {
            BadParameter::new(
                field,
                format!("{value:?} is neither an RFC 3339 time with offset nor epoch milliseconds ({e})"),
            )
        })
}

fn parse_bool(field: &'static str, value: &str) -> Result<bool, BadParameter> {
    match value {
        "true" => Ok(true),
        "false" => Ok(false),
        other => Err(BadParameter::new(
            field,
            format!("{other:?} is neither true nor false"),
        )),
    }
}

fn parse_limit(value: &str) -> Result<usize, BadParameter> {
    count("limit", value, MAX_LIMIT)
}

/// A count parameter from 1 to `max`.
pub(crate) fn count(field: &'static str, value: &str, max: usize) -> Result<usize, BadParameter> {
    value
        .parse::<usize>()
        .ok()
        .filter(|n| (1..=max).contains(n))
        .ok_or_else(|| {
            BadParameter::new(field, format!("{value:?} is not a number from 1 to {max}"))
        })
}

/// Most occurrences `?next=` shows.
const MAX_NEXT: usize = 100;

/// The `next` parameter of `GET /v1/tenants/{tenant}/timers/{id}` (the only one it takes).
pub fn next_parameter(query: Option<&str>) -> Result<Option<usize>, BadParameter> {
    let mut next = None;
    for (name, value) in url::form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        if name != "next" {
            return Err(BadParameter::new(
                "query",
                format!("unknown parameter {name:?} (known: next)"),
            ));
        }
        next = Some(count("next", &value, MAX_NEXT)?);
    }
    Ok(next)
}

/// Up to `n` coming fire times of `timer`, each in UTC and on the wall clock of its time zone:
/// a Scheduled series' next occurrences, a Scheduled one-shot timer's due time, nothing for a
/// finished timer.
pub fn next_occurrences(timer: &Timer, now: Timestamp, n: usize) -> Vec<Occurrence> {
    if timer.state != TimerState::Scheduled {
        return Vec::new();
    }
    let Some(recurrence) = &timer.recurrence else {
        let at = timer.due_at.to_rfc3339();
        return vec![Occurrence {
            utc: at.clone(),
            local: at,
        }];
    };
    let Ok(schedule) = recurrence.schedule() else {
        return Vec::new();
    };
    schedule
        .upcoming(timer.due_at, timer.occurrences, now, n)
        .into_iter()
        .map(|at| Occurrence {
            utc: at.to_rfc3339(),
            local: schedule.local_rfc3339(at),
        })
        .collect()
}

/// What a list cursor holds: the page's tenant and filters, and where the next page starts.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
struct ListCursor {
    tenant: String,
    states: Vec<i64>,
    prefix: Option<String>,
    due_after: Option<i64>,
    due_before: Option<i64>,
    recurring: Option<bool>,
    // Absent from cursors given out before the filter existed.
    #[serde(default)]
    retrying: Option<bool>,
    due_at: i64,
    id: String,
}

impl ListCursor {
    fn new(tenant: &str, filter: &TimerFilter, after: &PageAfter) -> Self {
        ListCursor {
            tenant: tenant.to_owned(),
            states: filter.states.iter().map(|s| s.code()).collect(),
            prefix: filter.prefix.clone(),
            due_after: filter.due_after.map(Timestamp::as_millis),
            due_before: filter.due_before.map(Timestamp::as_millis),
            recurring: filter.recurring,
            retrying: filter.retrying,
            due_at: after.due_at.as_millis(),
            id: after.service_call_id.clone(),
        }
    }

    /// Where the next page of `tenant` with `filter` starts, if `cursor` is one of theirs.
    fn open(cursor: &str, tenant: &str, filter: &TimerFilter) -> Result<PageAfter, BadParameter> {
        let decoded: ListCursor = decode(cursor)?;
        let after = PageAfter {
            due_at: Timestamp::from_millis(decoded.due_at),
            service_call_id: decoded.id.clone(),
        };
        if decoded != ListCursor::new(tenant, filter, &after) {
            return Err(BadParameter::new(
                "cursor",
                "the cursor belongs to another tenant or to other filters; list again without it",
            ));
        }
        Ok(after)
    }
}

/// What a summary cursor holds: the last tenant of the page.
#[derive(Debug, Serialize, Deserialize)]
struct TenantCursor {
    after_tenant: String,
}

fn encode(value: &impl Serialize) -> String {
    URL_SAFE_NO_PAD.encode(serde_json::to_vec(value).unwrap_or_default())
}

fn decode<T: for<'de> Deserialize<'de>>(cursor: &str) -> Result<T, BadParameter> {
    URL_SAFE_NO_PAD
        .decode(cursor)
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .ok_or_else(|| {
            BadParameter::new("cursor", "not a cursor this service gave out (nextCursor)")
        })
}

/// Cuts `items`, read with one more than `limit` asked for, to the page, and gives the cursor
/// of the next page (made from the page's last item) when there is one.
fn end_page<T>(items: &mut Vec<T>, limit: usize, cursor: impl Fn(&T) -> String) -> Option<String> {
    if items.len() <= limit {
        return None;
    }
    items.truncate(limit);
    items.last().map(cursor)
}

fn unsupported(store: &str) -> Response {
    server_error(&cannot_list(store))
}

/// What a store without [`TimerQueries`] answers (501 `unsupported` over HTTP).
fn cannot_list(store: &str) -> Error {
    Error::unsupported(format!("the {store} store cannot list or count timers"))
}

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
        (status = 501, description = "The store cannot list", body = ErrorBody),
    )
)]
pub async fn list_timers(
    State(app): State<AppState>,
    Path(TenantPath { tenant }): Path<TenantPath>,
    RawQuery(query): RawQuery,
) -> Response {
    let store = app.engine.store();
    let Some(queries) = store.queries() else {
        return unsupported(store.name());
    };
    let params = match ListParams::parse(query.as_deref()) {
        Ok(params) => params,
        Err(bad) => return bad.response(),
    };
    let after = match params.cursor.as_deref() {
        Some(cursor) => match ListCursor::open(cursor, &tenant, &params.filter) {
            Ok(after) => Some(after),
            Err(bad) => return bad.response(),
        },
        None => None,
    };
    // One more than asked for tells whether there is a next page.
    let mut timers = match queries
        .list(&tenant, &params.filter, after.as_ref(), params.limit + 1)
        .await
    {
        Ok(timers) => timers,
        Err(e) => return server_error(&e),
    };
    let next = end_page(&mut timers, params.limit, |last| {
        let after = PageAfter {
            due_at: last.due_at,
            service_call_id: last.key.service_call_id.clone(),
        };
        encode(&ListCursor::new(&tenant, &params.filter, &after))
    });
    Json(TimerPage {
        timers: timers.iter().map(TimerView::of).collect(),
        next_cursor: next,
    })
    .into_response()
}

/// A tenant's counts per state, next due time and failures in the last 24 hours.
#[utoipa::path(
    get,
    path = "/v1/tenants/{tenant}/summary",
    tag = "control",
    params(TenantPath),
    responses(
        (status = 200, description = "The summary (zero counts for a tenant without timers)", body = SummaryView),
        (status = 501, description = "The store cannot count", body = ErrorBody),
    )
)]
pub async fn tenant_summary(
    State(app): State<AppState>,
    Path(TenantPath { tenant }): Path<TenantPath>,
) -> Response {
    let store = app.engine.store();
    let Some(queries) = store.queries() else {
        return unsupported(store.name());
    };
    match summaries(queries, app.engine.clock().now(), &[tenant]).await {
        Ok(summaries) => Json(summaries.first().map(summary_view)).into_response(),
        Err(e) => server_error(&e),
    }
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
        (status = 501, description = "The store cannot count", body = ErrorBody),
    )
)]
pub async fn all_summaries(
    State(app): State<AppState>,
    Extension(caller): Extension<Principal>,
    RawQuery(query): RawQuery,
) -> Response {
    let store = app.engine.store();
    let Some(queries) = store.queries() else {
        return unsupported(store.name());
    };
    let mut limit = DEFAULT_LIMIT;
    let mut after: Option<String> = None;
    for (name, value) in url::form_urlencoded::parse(query.as_deref().unwrap_or("").as_bytes()) {
        let parsed = match name.as_ref() {
            "limit" => parse_limit(&value).map(|n| limit = n),
            "cursor" => decode::<TenantCursor>(&value).map(|c| after = Some(c.after_tenant)),
            other => Err(BadParameter::new(
                "query",
                format!("unknown parameter {other:?} (known: limit, cursor)"),
            )),
        };
        if let Err(bad) = parsed {
            return bad.response();
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
            .await;
        return match first {
            Ok(first) => Json(first.page(limit)).into_response(),
            Err(e) => server_error(&e),
        };
    }
    let mut tenants = match own_page {
        Some(own) => own,
        None => match queries.tenants(after.as_deref(), limit + 1).await {
            Ok(tenants) => tenants,
            Err(e) => return server_error(&e),
        },
    };
    let next = end_page(&mut tenants, limit, |last| tenant_cursor(last));
    let now = app.engine.clock().now();
    // Each tenant counted at most once per http.counts_max_age, whoever asks.
    let counted = app
        .counts
        .tenants
        .get(&tenants, now, |tenants| async move {
            summaries(queries, now, &tenants).await
        })
        .await;
    match counted {
        Ok((summaries, counted_at)) => Json(SummaryPage {
            tenants: summaries.iter().map(summary_view).collect(),
            next_cursor: next,
            counted_at: counted_at.to_rfc3339(),
        })
        .into_response(),
        Err(e) => server_error(&e),
    }
}

fn tenant_cursor(tenant: &str) -> String {
    encode(&TenantCursor {
        after_tenant: tenant.to_owned(),
    })
}

/// The summaries of the first [`MAX_LIMIT`] tenants, the largest first page there is.
pub struct FirstTenants {
    counted_at: Timestamp,
    summaries: Vec<TenantSummary>,
    /// Whether there are tenants after these.
    more: bool,
}

impl FirstTenants {
    fn page(&self, limit: usize) -> SummaryPage {
        let shown = &self.summaries[..limit.min(self.summaries.len())];
        let more = self.more || shown.len() < self.summaries.len();
        SummaryPage {
            tenants: shown.iter().map(summary_view).collect(),
            next_cursor: more
                .then(|| shown.last().map(|s| tenant_cursor(&s.tenant_id)))
                .flatten(),
            counted_at: self.counted_at.to_rfc3339(),
        }
    }
}

async fn count_first_tenants(engine: Engine) -> timer_core::Result<FirstTenants> {
    let store = engine.store();
    let Some(queries) = store.queries() else {
        return Err(cannot_list(store.name()));
    };
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_parameters_are_read_and_checked() {
        let p = ListParams::parse(Some(
            "state=failed,Scheduled&state=failed&prefix=order-&dueAfter=2027-01-01T00:00:00Z\
             &dueBefore=1800000000000&recurring=false&limit=5",
        ))
        .expect("valid");
        assert_eq!(p.filter.states, [TimerState::Scheduled, TimerState::Failed]);
        assert_eq!(p.filter.prefix.as_deref(), Some("order-"));
        assert_eq!(
            p.filter.due_after,
            Some(Timestamp::from_millis(1_798_761_600_000))
        );
        assert_eq!(
            p.filter.due_before,
            Some(Timestamp::from_millis(1_800_000_000_000))
        );
        assert_eq!(p.filter.recurring, Some(false));
        assert_eq!(p.limit, 5);
        assert_eq!(ListParams::parse(None).expect("empty").limit, DEFAULT_LIMIT);
        let refused = [
            ("state=bogus", "state"),
            ("limit=0", "limit"),
            ("limit=1001", "limit"),
            ("limit=ten", "limit"),
            ("dueAfter=tomorrow", "dueAfter"),
            ("dueBefore=2027-01-01T00:00:00", "dueBefore"),
            ("recurring=yes", "recurring"),
            ("stat=failed", "query"),
        ];
        for (query, field) in refused {
            let e = ListParams::parse(Some(query)).expect_err(query);
            assert_eq!(e.field, field, "{query}: {}", e.message);
        }
    }

    #[test]
    fn a_cursor_is_good_only_for_its_tenant_and_filters() {
        let filter = TimerFilter {
            states: vec![TimerState::Scheduled],
            ..TimerFilter::default()
        };
        let after = PageAfter {
            due_at: Timestamp::from_millis(7),
            service_call_id: "x".into(),
        };
        let cursor = encode(&ListCursor::new("acme", &filter, &after));
        assert_eq!(ListCursor::open(&cursor, "acme", &filter), Ok(after));
        let other = TimerFilter::default();
        for (tenant, filter) in [("other", &filter), ("acme", &other)] {
            let e = ListCursor::open(&cursor, tenant, filter).expect_err("refused");
            assert_eq!(e.field, "cursor");
        }
        for junk in ["", "!!", "e30"] {
            let e = ListCursor::open(junk, "acme", &filter).expect_err(junk);
            assert_eq!(e.field, "cursor", "{junk}");
        }
    }
}
