//! The middleware on every API route ([`guard`]): authenticates, applies the route's rule, and
//! writes the audit line of every write.

use std::sync::Arc;

use axum::extract::rejection::RawPathParamsRejection;
use axum::extract::{FromRequestParts, MatchedPath, RawPathParams, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::{reads, rule, Auth, Forbidden, Principal, Rule};
use crate::http::error::ApiError;

/// The middleware on every API route: authenticates, applies the route's [`Rule`], passes the
/// [`Principal`] on, and writes the audit line of a write.
pub async fn guard(
    State(auth): State<Option<Arc<Auth>>>,
    request: Request,
    next: Next,
) -> Response {
    let (mut parts, body) = request.into_parts();
    let matched = parts.extensions.get::<MatchedPath>().cloned();
    let params = RawPathParams::from_request_parts(&mut parts, &()).await;
    let mut request = Request::from_parts(parts, body);
    let principal = match &auth {
        None => Principal::anonymous(),
        Some(auth) => {
            let bearer = request
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            let checked = match bearer {
                Some(bearer) => auth.authenticate(bearer.trim()),
                None => Err("missing bearer token (Authorization: Bearer …)".into()),
            };
            match checked {
                Ok(principal) => principal,
                Err(why) => return unauthorized(&why),
            }
        }
    };
    // A `{tenant}` or `{id}` whose percent-encoding is not UTF-8 is no id: refused (400) as the
    // id check refuses one. The caller is authenticated by then, and learns nothing of others.
    let (params, not_utf8) = match params {
        Ok(params) => (Some(params), None),
        Err(RawPathParamsRejection::InvalidUtf8InPathParam(e)) => (None, Some(e.body_text())),
        // A route without parameters in its path.
        Err(_) => (None, None),
    };
    let method = request.method().clone();
    let Some(path) = matched.as_ref().map(|m| m.as_str().to_owned()) else {
        // No route matched: the 404 says nothing more than that.
        return next.run(request).await;
    };
    let param = |wanted: &str| {
        let params = params.as_ref()?;
        let (_, value) = params.iter().find(|(name, _)| *name == wanted)?;
        Some(value.to_owned())
    };
    let (tenant, id) = (param("tenant"), param("id"));
    let checked = match rule(&method, &path) {
        None => Err(Forbidden::new("this route has no access rule")),
        Some(Rule::Authenticated) => Ok(()),
        Some(Rule::Each(scope)) => principal.need(scope),
        Some(Rule::Tenant(scope)) => principal.need(scope).and_then(|()| match &tenant {
            Some(tenant) => principal.need_tenant(tenant, None),
            None => Err(Forbidden::new("this route has no tenant in its path")),
        }),
    };
    let name = principal.name.clone();
    request.extensions_mut().insert(principal);
    // A client that goes away drops this future at its next wait: its write still gets a line.
    let write = !reads(&method);
    let unanswered = write.then(|| Unanswered {
        key: &name,
        method: &method,
        path: &path,
        tenant: tenant.as_deref(),
        id: id.as_deref(),
    });
    let response = match (not_utf8, checked) {
        (Some(why), _) => ApiError::bad_request("invalid_id", why).into_response(),
        (None, Ok(())) => next.run(request).await,
        (None, Err(refused)) => ApiError::from(refused).into_response(),
    };
    // Answered: the audit line below says how.
    std::mem::forget(unanswered);
    if write {
        audit(&name, &method, &path, tenant, id, response).await
    } else {
        response
    }
}

/// The audit line of a write whose client went away before it was answered (the request's
/// future was dropped), with outcome `unanswered`: it may have been done or not (a bulk
/// action goes on in a task of its own).
struct Unanswered<'a> {
    key: &'a str,
    method: &'a Method,
    path: &'a str,
    tenant: Option<&'a str>,
    id: Option<&'a str>,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        tracing::info!(
            target: "timer_service::audit",
            key = %self.key,
            tenant = self.tenant,
            action = action(self.method, self.path),
            id = self.id,
            outcome = "unanswered",
            "api write"
        );
    }
}

fn unauthorized(why: &str) -> Response {
    let mut response = ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", why).into_response();
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// Largest answer whose outcome the audit line reads; a larger one is logged by its status.
const AUDIT_BODY_LIMIT: usize = 1 << 20;

/// Writes the audit line of a write: who, which tenant, what, and how it ended (the answer's
/// `outcome`, or its error `reason`), and gives the answer back unchanged.
async fn audit(
    key: &str,
    method: &Method,
    path: &str,
    tenant: Option<String>,
    id: Option<String>,
    response: Response,
) -> Response {
    use axum::body::HttpBody as _;
    let (parts, body) = response.into_parts();
    // Only an answer already in memory and small is read (every write route's JSON is); any
    // other is passed on untouched and logged by its status.
    let small = body
        .size_hint()
        .exact()
        .is_some_and(|n| n <= AUDIT_BODY_LIMIT as u64);
    let (body, json) = if small {
        match axum::body::to_bytes(body, AUDIT_BODY_LIMIT).await {
            Ok(bytes) => {
                let json: Option<serde_json::Value> = serde_json::from_slice(&bytes).ok();
                (axum::body::Body::from(bytes), json)
            }
            // An in-memory body of known size does not fail.
            Err(_) => (axum::body::Body::empty(), None),
        }
    } else {
        (body, None)
    };
    let outcome = json.as_ref().and_then(|v| {
        v.get("outcome")
            .or_else(|| v.pointer("/error/reason"))
            .and_then(|o| o.as_str())
            .map(str::to_owned)
    });
    // The tenant and id of `POST /v1/timers` and `/v1/commands` are in their bodies: the
    // handler names them, refused or not.
    let named = parts
        .extensions
        .get::<timer_core::wire::Addressed>()
        .cloned()
        .unwrap_or_default();
    let tenant = tenant.or(named.tenant_id).or_else(|| {
        json.as_ref()
            .and_then(|v| v.pointer("/timer/tenantId"))
            .and_then(|t| t.as_str())
            .map(str::to_owned)
    });
    let id = id.or(named.service_call_id);
    tracing::info!(
        target: "timer_service::audit",
        key = %key,
        tenant = tenant.as_deref(),
        action = action(method, path),
        id = id.as_deref(),
        status = parts.status.as_u16(),
        outcome = outcome.as_deref(),
        "api write"
    );
    Response::from_parts(parts, body)
}

/// The audit name of a write route.
fn action(method: &Method, path: &str) -> &'static str {
    match (method.as_str(), path) {
        ("POST", "/v1/timers") => "schedule",
        ("POST", "/v1/timers/batch") => "schedule_batch",
        ("POST", "/v1/commands") => "command",
        ("DELETE", _) => "cancel",
        (_, p) if p.ends_with("/pause") => "pause",
        (_, p) if p.ends_with("/resume") => "resume",
        (_, p) if p.ends_with("/retry") => "retry",
        (_, p) if p.ends_with("/trigger") => "trigger",
        (_, p) if p.ends_with("/complete") => "complete",
        (_, p) if p.ends_with("/bulk") => "bulk",
        _ => "other",
    }
}
