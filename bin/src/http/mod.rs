//! The HTTP API: the router, and a module per resource with its handlers and bodies.
//!
//! Below the handlers sit the leaves they share: [`error`] (the one error type), [`state`] (the
//! state and path parameters), [`views`] (the bodies of a timer), [`params`] (query parameters
//! and cursors), [`counted`] (counts shared between requests), [`auth`] and [`site`] (requests
//! other sites' pages make a browser send). A leaf imports no
//! handler module and no module above `http`; `listener` serves the router over plain HTTP or
//! TLS.

pub mod actions;
pub mod auth;
pub mod batch;
pub mod bounds;
pub mod bulk;
pub mod counted;
pub mod embedded;
pub mod error;
pub mod events;
pub mod health;
pub mod history;
pub mod listener;
pub mod listing;
pub mod openapi;
pub mod params;
pub mod site;
pub mod state;
pub mod status;
pub mod timers;
pub mod traced;
pub mod ui;
pub mod views;

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Router;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;
use utoipa::OpenApi as _;
use utoipa_axum::router::{OpenApiRouter, UtoipaMethodRouter, UtoipaMethodRouterExt};
use utoipa_axum::routes;

use crate::config::Config;
use auth::Auth;
use error::ApiError;
use openapi::OpenApiJson;
use state::AppState;

/// The service's routes and the OpenAPI document describing them, built together: a route is
/// added with the `#[utoipa::path]` of its handler, so it cannot be missing from the document.
pub fn routes(
    config: &Config,
    auth: Option<Arc<Auth>>,
) -> (Router<AppState>, utoipa::openapi::OpenApi) {
    // Room for the largest command plus headers of a JSON body; a batch has a limit of its own.
    let body_limit = config.limits.command_bytes().saturating_add(1024);
    let batch_limit = config.limits.max_batch_bytes;
    let limited = |limit| RequestBodyLimitLayer::new(limit);
    let timeout =
        || TimeoutLayer::with_status_code(StatusCode::REQUEST_TIMEOUT, config.http.request_timeout);
    let api = OpenApiRouter::with_openapi(openapi::Document::openapi())
        .routes(routes!(timers::schedule).layer(limited(body_limit)))
        .routes(routes!(batch::schedule_batch).layer(limited(batch_limit)))
        .routes(routes!(timers::get_timer, timers::cancel_timer))
        // The timer whose id is `bulk`: its path is the bulk route's (documented as `{id}`'s).
        .route(
            "/v1/tenants/{tenant}/timers/bulk",
            axum::routing::get(timers::get_timer_bulk).delete(timers::cancel_timer_bulk),
        )
        .routes(routes!(listing::list_timers))
        .routes(routes!(actions::pause).layer(limited(body_limit)))
        .routes(routes!(actions::resume))
        .routes(routes!(actions::retry))
        .routes(routes!(actions::trigger))
        .routes(routes!(actions::complete).layer(limited(body_limit)))
        .routes(routes!(history::history))
        .routes(routes!(status::status))
        .routes(routes!(listing::tenant_summary))
        .routes(routes!(listing::all_summaries))
        .routes(routes!(embedded::send_command).layer(limited(body_limit)))
        .routes(routes!(embedded::dead_letters))
        .routes(routes!(openapi::openapi))
        // The event stream lives as long as the client wants, so it has no request timeout.
        .layer(timeout())
        .routes(routes!(events::events))
        // A bulk action runs to its end, page after page, however long that takes; its body
        // arrives in time.
        .routes(bulk_route(config, body_limit))
        // Inside the guard: a caller without access learns nothing of what the ids may be.
        .layer(axum::middleware::from_fn_with_state(
            Arc::new(config.limits.clone()),
            params::check_path_ids,
        ))
        // Before any handler, inside the guard: a write another site's page made a browser
        // send is refused, and audited as refused.
        .layer(axum::middleware::from_fn_with_state(
            Arc::new(site::Hosts::of(
                config.http.allowed_hosts.as_deref(),
                config.http.addr.ip().is_loopback(),
            )),
            site::guard,
        ))
        .layer(axum::middleware::from_fn_with_state(auth, auth::guard))
        // Outside the guard: a refused request is traced too.
        .layer(axum::middleware::from_fn(traced::traced));
    // Health and metrics stay open: probes and scrapers carry no token.
    let open = OpenApiRouter::new()
        .routes(routes!(health::healthz))
        .routes(routes!(health::readyz))
        .routes(routes!(status::metrics))
        .layer(timeout());
    let (router, document) = api.merge(open).split_for_parts();
    let router = router
        // The limits are these layers' (`limits.*_bytes`): axum's own default of 2 MiB a body
        // refused batches far below `limits.max_batch_bytes`.
        .layer(axum::extract::DefaultBodyLimit::disable())
        // No route takes a body larger than this; the routes that read one have their own.
        .layer(limited(body_limit.max(batch_limit)))
        // Outside the limit, so its own answer to a too-large Content-Length (plain text) also
        // becomes the JSON error body.
        .layer(axum::middleware::map_response(json_payload_too_large))
        .layer(TraceLayer::new_for_http());
    (router, document)
}

/// The bulk route: no request timeout (the action runs to its end), but its body, under the
/// body limit, must arrive within `http.request_timeout`.
fn bulk_route(config: &Config, body_limit: usize) -> UtoipaMethodRouter<AppState> {
    let in_time: UtoipaMethodRouter<AppState> = routes!(bulk::bulk).layer(
        axum::middleware::from_fn_with_state(config.http.request_timeout, bulk::body_in_time),
    );
    in_time.layer(RequestBodyLimitLayer::new(body_limit))
}

pub fn router(state: AppState, config: &Config) -> Router {
    let (router, document) = routes(config, state.auth.clone());
    // Serializing a document of plain strings and maps cannot fail.
    let mut json = serde_json::to_value(&document).unwrap_or_default();
    openapi::add_shared_answers(&mut json);
    bounds::constrain(&mut json, &config.limits);
    let json = serde_json::to_vec(&json).unwrap_or_default();
    let router = if config.http.ui {
        router.merge(ui::routes())
    } else {
        router
    };
    router
        .layer(axum::Extension(OpenApiJson(Bytes::from(json))))
        .with_state(state)
}

/// The body limit layer answers 413 in plain text; give it the JSON error shape of every other
/// error.
async fn json_payload_too_large(response: Response) -> Response {
    if response.status() != StatusCode::PAYLOAD_TOO_LARGE {
        return response;
    }
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "too_large",
        "request body exceeds its limit (limits.max_command_bytes, or limits.max_batch_bytes \
         for POST /v1/timers/batch)",
    )
    .into_response()
}
