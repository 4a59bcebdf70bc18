//! The query parameters of the read routes (a list's filters and paging, `next`) and the
//! cursors of their pages.
//!
//! A page ends with an opaque `nextCursor`: base64url of a small JSON object holding the tenant,
//! the filters and the last timer's position (due time, id). The next page starts after that
//! position (keyset pagination), so writes between pages never repeat or skip a timer that was
//! there all along. A cursor is only good for the tenant and filters it came from.

use std::sync::Arc;

use axum::extract::rejection::RawPathParamsRejection;
use axum::extract::{RawPathParams, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use timer_core::wire::check_id;
use timer_core::{Limits, PageAfter, TimerFilter, TimerState, Timestamp};

use crate::http::error::ApiError;

/// The middleware on the API routes: a `{tenant}` or `{id}` of the path must be an id as the
/// wire contract has them (1 to `limits.max_id_bytes` bytes, no control character), or the
/// request is refused, 400 `invalid_id` naming it, before a handler or the store sees it.
pub async fn check_path_ids(
    State(limits): State<Arc<Limits>>,
    params: Result<RawPathParams, RawPathParamsRejection>,
    request: Request,
    next: Next,
) -> Response {
    // No parameters in the route's path; or a segment that is not UTF-8, which the access
    // guard (outside this layer) already refused as no id.
    let Ok(params) = params else {
        return next.run(request).await;
    };
    for (name, value) in &params {
        if matches!(name, "tenant" | "id") {
            if let Err(refused) = check_id(value.to_owned(), name, &limits) {
                return ApiError::from(refused).into_response();
            }
        }
    }
    next.run(request).await
}

/// Default and largest page size.
pub const DEFAULT_LIMIT: usize = 100;
pub const MAX_LIMIT: usize = 1000;

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
}

/// 400 `invalid_parameter`, naming the parameter.
impl From<BadParameter> for ApiError {
    fn from(bad: BadParameter) -> Self {
        ApiError::bad_request("invalid_parameter", bad.message).field(bad.field)
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
                "prefix" => params.filter.prefix = Some(no_control("prefix", value.into_owned())?),
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

pub fn parse_limit(value: &str) -> Result<usize, BadParameter> {
    count("limit", value, MAX_LIMIT)
}

/// A count parameter from 1 to `max`.
pub fn count(field: &'static str, value: &str, max: usize) -> Result<usize, BadParameter> {
    value
        .parse::<usize>()
        .ok()
        .filter(|n| (1..=max).contains(n))
        .ok_or_else(|| {
            BadParameter::new(field, format!("{value:?} is not a number from 1 to {max}"))
        })
}

/// Most occurrences `?next=` shows.
pub const MAX_NEXT: usize = 100;

/// The parameters of `GET /v1/tenants/{tenant}/timers/{id}`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct TimerParameters {
    /// `next=N`: add the next N fire times.
    pub next: Option<usize>,
    /// `body=true`: add a message's body (in base64).
    pub body: bool,
}

/// The `next` and `body` parameters of `GET /v1/tenants/{tenant}/timers/{id}` (the only ones
/// it takes).
pub fn timer_parameters(query: Option<&str>) -> Result<TimerParameters, BadParameter> {
    let mut parameters = TimerParameters::default();
    for (name, value) in url::form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        match name.as_ref() {
            "next" => parameters.next = Some(count("next", &value, MAX_NEXT)?),
            "body" => parameters.body = parse_bool("body", &value)?,
            _ => {
                return Err(BadParameter::new(
                    "query",
                    format!("unknown parameter {name:?} (known: next, body)"),
                ))
            }
        }
    }
    Ok(parameters)
}

/// What a list cursor holds: the page's tenant and filters, and where the next page starts.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ListCursor {
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
    pub fn new(tenant: &str, filter: &TimerFilter, after: &PageAfter) -> Self {
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
    pub fn open(
        cursor: &str,
        tenant: &str,
        filter: &TimerFilter,
    ) -> Result<PageAfter, BadParameter> {
        let decoded: ListCursor = decode(cursor)?;
        let id = no_control("cursor", decoded.id.clone())?;
        let after = PageAfter {
            due_at: Timestamp::from_millis(decoded.due_at),
            service_call_id: id,
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
pub struct TenantCursor {
    pub after_tenant: String,
}

/// `value`, when it has no control character (no id has one, and a database may refuse one:
/// PostgreSQL takes no NUL in text).
pub fn no_control(field: &'static str, value: String) -> Result<String, BadParameter> {
    match value.chars().position(char::is_control) {
        Some(at) => Err(BadParameter::new(
            field,
            format!("contains a control character at position {at}; no id has one"),
        )),
        None => Ok(value),
    }
}

pub fn encode(value: &impl Serialize) -> String {
    URL_SAFE_NO_PAD.encode(serde_json::to_vec(value).unwrap_or_default())
}

pub fn decode<T: for<'de> Deserialize<'de>>(cursor: &str) -> Result<T, BadParameter> {
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
pub fn end_page<T>(
    items: &mut Vec<T>,
    limit: usize,
    cursor: impl Fn(&T) -> String,
) -> Option<String> {
    if items.len() <= limit {
        return None;
    }
    items.truncate(limit);
    items.last().map(cursor)
}

pub fn tenant_cursor(tenant: &str) -> String {
    encode(&TenantCursor {
        after_tenant: tenant.to_owned(),
    })
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
            ("prefix=a%00b", "prefix"),
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
        let nul = PageAfter {
            due_at: Timestamp::from_millis(7),
            service_call_id: "x\0".into(),
        };
        let crafted = encode(&ListCursor::new("acme", &filter, &nul));
        let e = ListCursor::open(&crafted, "acme", &filter).expect_err("a NUL in its id");
        assert_eq!(e.field, "cursor");
        for junk in ["", "!!", "e30"] {
            let e = ListCursor::open(junk, "acme", &filter).expect_err(junk);
            assert_eq!(e.field, "cursor", "{junk}");
        }
    }
}
