//! The OpenAPI document: its frame ([`Document`]), the answers operations share (the
//! authentication middleware's, a missing timer's), and the route that serves it
//! (`GET /v1/openapi.json`). The routes add their paths and schemas (`http::routes`).

use axum::body::Bytes;
use axum::response::{IntoResponse, Response};
use utoipa::OpenApi;

use crate::http::error::ErrorBody;

/// The document's frame; the routes add their paths and schemas (`http::router`).
#[derive(OpenApi)]
#[openapi(
    info(
        title = "timer-service",
        description = "Durable timers: schedule one, and a DueTimeReached goes out on your \
                       broker when it is due. With authentication on (`http.token`, \
                       `http.keys` or `http.jwt`), every route but /healthz, /readyz and \
                       /metrics needs `Authorization: Bearer <key or JWT>`: 401 without a \
                       valid one, 403 for a tenant or scope the key does not have."
    ),
    components(schemas(ErrorBody)),
    modifiers(&BearerToken),
    security(("bearer" = []))
)]
pub struct Document;

/// Adds the answers every operation of a kind shares, where the handler did not list them: the
/// authentication middleware's (401, 403) to each that needs a bearer token (those without
/// `security: [{}]`), and 404 to each on one timer (a path with `{id}`: every such handler
/// answers 404 for a timer that does not exist).
pub fn add_shared_answers(document: &mut serde_json::Value) {
    let Some(paths) = document["paths"].as_object_mut() else {
        return;
    };
    let error = |description: &str| {
        serde_json::json!({
            "description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
        })
    };
    for (path, item) in paths.iter_mut() {
        let one_timer = path.contains("/timers/{id}");
        let Some(item) = item.as_object_mut() else {
            continue;
        };
        for operation in item.values_mut() {
            let open = operation["security"].as_array().is_some_and(|s| {
                s.iter()
                    .any(|r| r.as_object().is_some_and(|r| r.is_empty()))
            });
            let Some(responses) = operation
                .get_mut("responses")
                .and_then(|r| r.as_object_mut())
            else {
                continue;
            };
            if one_timer {
                responses
                    .entry("404")
                    .or_insert_with(|| error("No such timer"));
            }
            if open {
                continue;
            }
            responses.entry("401").or_insert_with(|| {
                error("No bearer token, or one that is unknown, expired or not valid here")
            });
            responses.entry("403").or_insert_with(|| {
                error("The key may not use this tenant, or lacks the scope (read, write, admin) the route needs; or a web page of another site sent it (cross_site, host_not_allowed)")
            });
        }
    }
}

/// The `bearer` security scheme the document's `security` names (`http.token`, `http.keys`,
/// `http.jwt`).
struct BearerToken;

impl utoipa::Modify for BearerToken {
    fn modify(&self, document: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
        let components = document.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
        );
    }
}

/// This API as an OpenAPI 3.1 document.
#[utoipa::path(
    get,
    path = "/v1/openapi.json",
    tag = "operations",
    responses((status = 200, description = "The document", content_type = "application/json", body = Object))
)]
pub async fn openapi(axum::Extension(document): axum::Extension<OpenApiJson>) -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        document.0,
    )
        .into_response()
}

/// The OpenAPI document, serialized once.
#[derive(Clone)]
pub struct OpenApiJson(pub Bytes);
