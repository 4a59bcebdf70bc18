//! `GET /v1/events`: the fires of this instance as Server-Sent Events.

use std::convert::Infallible;

use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use timer_core::wire::check_id;

use crate::http::auth::Principal;
use crate::http::error::{ApiError, ErrorBody};
use crate::http::params::BadParameter;
use crate::http::state::{AppState, StreamsFull};

/// The query of `GET /v1/events`, for the document (read by [`tenant_of_query`], which also
/// refuses unknown and repeated parameters).
#[allow(dead_code)]
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// Only this tenant's events.
    pub tenant: Option<String>,
}

/// The `tenant` of the query, read as the other routes read theirs: at most once, and no
/// other parameter (a typo such as `tenants=` must not stream every tenant the caller may read).
fn tenant_of_query(query: Option<&str>) -> Result<Option<String>, BadParameter> {
    let mut tenant = None;
    for (name, value) in url::form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        match name.as_ref() {
            "tenant" if tenant.is_none() => tenant = Some(value.into_owned()),
            "tenant" => {
                return Err(BadParameter::new(
                    "tenant",
                    "given more than once; give one tenant, or none for every tenant the \
                     caller may read",
                ))
            }
            other => {
                return Err(BadParameter::new(
                    "query",
                    format!("unknown parameter {other:?} (known: tenant)"),
                ))
            }
        }
    }
    Ok(tenant)
}

/// Server-sent events: each `DueTimeReached` this instance publishes (event `DueTimeReached`,
/// data its JSON) of the tenants the caller may read. A reader slower than its events, with
/// `http.event_stream_buffer` bytes of them waiting, gets `lagged` (how many of its events it
/// missed) and the stream ends: connect again to go on. A stream also ends when the caller's JWT
/// expires. At most `http.max_event_streams` are open at once (503 beyond).
#[utoipa::path(
    get,
    path = "/v1/events",
    tag = "embedded",
    params(EventsQuery),
    responses(
        (status = 200, description = "An event stream, until the caller lags, its JWT expires or the service stops", content_type = "text/event-stream", body = String),
        (status = 503, description = "`http.max_event_streams` streams are open, or `http.max_event_streams_per_key` of the caller's key; `Retry-After` says when to try again", body = ErrorBody),
    )
)]
pub async fn events(
    State(app): State<AppState>,
    Extension(caller): Extension<Principal>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let only = tenant_of_query(query.as_deref())?;
    if let Some(tenant) = &only {
        check_id(tenant.clone(), "tenant", app.engine.limits())?;
        caller.need_tenant(tenant, Some("tenant"))?;
    }
    // Counted by key only where there are keys to tell apart.
    let key = app
        .auth
        .as_ref()
        .filter(|auth| auth.tells_apart())
        .map(|_| &caller.name);
    let open = app.streams.open(key).map_err(|full| {
        let message = match full {
            StreamsFull::All => format!(
                "{} event streams are open, as many as http.max_event_streams allows; try again \
                 later",
                app.streams.max
            ),
            StreamsFull::Key => format!(
                "{} event streams of key {} are open, as many as \
                 http.max_event_streams_per_key allows; close one",
                app.streams.per_key, caller.name
            ),
        };
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message).retry_after(5)
    })?;
    // Until its credential expires (a JWT's exp): it was checked once, when the stream began.
    let expires = caller.expires_at.and_then(|at| {
        let left = at
            .duration_since(std::time::SystemTime::now())
            .unwrap_or_default();
        tokio::time::Instant::now().checked_add(left)
    });
    let shows =
        move |tenant: &str| only.as_deref().is_none_or(|t| t == tenant) && caller.may_use(tenant);
    let events = app.engine.subscribe(app.streams.buffer, Box::new(shows));
    let stream = futures::stream::unfold(Some((events, open)), |state| async move {
        let (mut events, open) = state?;
        match events.recv().await {
            Some(fired) => {
                let event = Event::default()
                    .event("DueTimeReached")
                    .data(fired.json.clone());
                Some((Ok::<_, Infallible>(event), Some((events, open))))
            }
            // Dropped for reading too slowly: say so, and end (the client connects again).
            None => events.lagged().map(|missed| {
                let event = Event::default().event("lagged").data(missed.to_string());
                (Ok(event), None)
            }),
        }
    });
    // End the stream at shutdown, so graceful shutdown is not held open by watchers.
    let stream = futures::StreamExt::take_until(stream, app.shutdown.clone().cancelled_owned());
    let stream = futures::StreamExt::take_until(stream, async move {
        match expires {
            Some(at) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_names_one_tenant_at_most_and_nothing_else() {
        assert_eq!(tenant_of_query(None), Ok(None));
        assert_eq!(
            tenant_of_query(Some("tenant=a%2Eb")),
            Ok(Some("a.b".into()))
        );
        let twice = tenant_of_query(Some("tenant=a&tenant=b")).unwrap_err();
        assert_eq!(twice.field, "tenant", "{}", twice.message);
        let typo = tenant_of_query(Some("tenants=acme")).unwrap_err();
        assert_eq!(typo.field, "query");
        assert!(typo.message.contains("\"tenants\""), "{}", typo.message);
    }
}
