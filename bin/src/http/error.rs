//! The one error type of the HTTP API: every handler answers `Result<_, ApiError>`, and every
//! error answer is built here, `{"error": {"reason", "message", "field"?, "requestId"?}}`.
//!
//! What an answer reveals is decided in [`ApiError::into_response`]: a client error (4xx) says
//! what is wrong with the request. A 5xx carries a `requestId` (also in the `x-request-id`
//! header) and the log line with the whole error chain carries the same id. A 500 says nothing
//! more: its cause is ours, and its chain may name hosts, users and files. A 503 also says why
//! (the disk is full, the in-process broker's queue is full, the store cannot be reached), since
//! that tells the client whether and when to try again.
//!
//! This module imports nothing else of the binary.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use timer_core::engine::Throttled;
use timer_core::{Error, ErrorKind, Rejection};
use utoipa::ToSchema;

/// Every error: `{"error": {"reason", "message", "field"?, "requestId"?}}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ErrorDetail {
    /// A stable code to branch on (`invalid_parameter`, `not_found`, `firing`, …).
    pub reason: String,
    /// The request field at fault (`state`, `commands[3].dueAt`, `filter.prefix`), when one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// What is wrong, for a person.
    pub message: String,
    /// Of a 5xx answer: the id under which the service's log has the details.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

impl ErrorDetail {
    pub fn new(reason: &str, field: Option<&str>, message: &str) -> Self {
        ErrorDetail {
            reason: reason.to_owned(),
            field: field.map(str::to_owned),
            message: message.to_owned(),
            request_id: None,
        }
    }
}

/// An item of a request that was refused, by its position (`POST /v1/timers/batch`).
#[derive(Debug, Serialize, ToSchema)]
pub struct RejectedItem {
    /// Position in `commands`.
    pub index: usize,
    pub error: ErrorDetail,
}

/// The body of an error answer: [`ErrorBody`], with the refused items of a batch.
#[derive(Serialize)]
struct Body {
    error: ErrorDetail,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    rejected: Vec<RejectedItem>,
}

/// An error answer: its status, its body's detail, and what only the log may see (boxed: a
/// handler's `Result` stays small).
#[derive(Debug)]
pub struct ApiError(Box<Parts>);

#[derive(Debug)]
struct Parts {
    status: StatusCode,
    detail: ErrorDetail,
    /// The refused items of a batch, each with its error; `detail` names the first.
    rejected: Vec<RejectedItem>,
    /// `Retry-After`, in seconds.
    retry_after: Option<u64>,
    /// The error chain of a 5xx, for the log.
    chain: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, reason: &str, message: impl AsRef<str>) -> Self {
        ApiError(Box::new(Parts {
            status,
            detail: ErrorDetail::new(reason, None, message.as_ref()),
            rejected: Vec::new(),
            retry_after: None,
            chain: None,
        }))
    }

    /// 400 with this reason.
    pub fn bad_request(reason: &str, message: impl AsRef<str>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, reason, message)
    }

    /// 400 `invalid_json`: a body that is not the JSON the route reads.
    pub fn invalid_json(message: impl AsRef<str>) -> Self {
        Self::bad_request("invalid_json", message)
    }

    /// 404 `not_found` for the timer of the path.
    pub fn no_such_timer() -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", "no such timer")
    }

    /// 409 with this reason (the outcome that refused the request).
    pub fn conflict(reason: &str, message: impl AsRef<str>) -> Self {
        Self::new(StatusCode::CONFLICT, reason, message)
    }

    /// The request field at fault.
    pub fn field(mut self, field: impl Into<String>) -> Self {
        self.0.detail.field = Some(field.into());
        self
    }

    /// The refused items of a request of many (a batch).
    pub fn rejected(mut self, items: Vec<RejectedItem>) -> Self {
        self.0.rejected = items;
        self
    }

    /// Asks the client to wait this long before it tries again.
    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.0.retry_after = Some(seconds.max(1));
        self
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        let status = match e.kind() {
            ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Invalid => StatusCode::BAD_REQUEST,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::Conflict => StatusCode::CONFLICT,
            // A store without the ability a route needs (listing, pausing, history).
            ErrorKind::Unsupported => StatusCode::NOT_IMPLEMENTED,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let chain = e.chain();
        let mut error = ApiError::new(status, e.kind().as_str(), &chain);
        if status.is_server_error() {
            error.0.chain = Some(chain);
        }
        error
    }
}

impl From<Rejection> for ApiError {
    fn from(r: Rejection) -> Self {
        let error = ApiError::bad_request(r.reason.as_str(), &r.message);
        match r.field {
            Some(field) => error.field(field),
            None => error,
        }
    }
}

/// 429 for requests over their tenant's rate (`limits.rate`): reason `rate_limited`, field
/// `tenantId`, and `Retry-After` in whole seconds (at least 1) when waiting helps; without it, the
/// request asked for more at once than the tenant's burst and never fits.
impl From<Throttled> for ApiError {
    fn from(throttled: Throttled) -> Self {
        let error = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limited",
            throttled.to_string(),
        )
        .field("tenantId");
        match throttled.retry_after {
            Some(after) => error.retry_after(after.as_millis().div_ceil(1000) as u64),
            None => error,
        }
    }
}

/// The message of a 500: its cause is in the log, under the request id.
const INTERNAL: &str = "an internal error; the service's log has the details under this requestId";

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut parts = *self.0;
        let request_id = parts.status.is_server_error().then(|| {
            let id = uuid::Uuid::new_v4().simple().to_string();
            let error = parts.chain.as_deref().unwrap_or(&parts.detail.message);
            let status = parts.status.as_u16();
            if parts.status == StatusCode::INTERNAL_SERVER_ERROR {
                tracing::error!(request_id = %id, status, error, "internal error answered");
                parts.detail.message = INTERNAL.to_owned();
            } else {
                // Unavailable, unsupported: the server is fine, a part of it is not (or not yet).
                tracing::warn!(request_id = %id, status, error, "error answered");
            }
            parts.detail.request_id = Some(id.clone());
            id
        });
        let body = Body {
            error: parts.detail,
            rejected: parts.rejected,
        };
        let mut response = (parts.status, Json(body)).into_response();
        let headers = response.headers_mut();
        if let Some(seconds) = parts.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if let Some(id) = request_id.and_then(|id| HeaderValue::from_str(&id).ok()) {
            headers.insert("x-request-id", id);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body(response: Response) -> serde_json::Value {
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .expect("an in-memory body");
        serde_json::from_slice(&bytes).expect("a JSON body")
    }

    #[tokio::test]
    async fn a_500_carries_a_request_id_and_no_internal_text() {
        let cause = Error::internal("reading row 7 of timers at db.internal:5432 as user svc")
            .with_source(std::io::Error::other("password authentication failed"));
        let response = ApiError::from(cause).into_response();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let header = response
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .expect("an x-request-id header");
        let v = body(response).await;
        assert_eq!(v["error"]["requestId"], header.as_str(), "{v}");
        assert_eq!(v["error"]["reason"], "internal", "{v}");
        let text = v.to_string();
        for secret in ["db.internal", "svc", "password", "row 7"] {
            assert!(!text.contains(secret), "{secret} leaks: {text}");
        }
    }

    #[tokio::test]
    async fn a_503_says_why_and_a_400_has_no_request_id() {
        let full = Error::unavailable("writing timers")
            .with_source(std::io::Error::other("database or disk is full"));
        let v = body(ApiError::from(full).into_response()).await;
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains("full"),
            "{v}"
        );
        assert!(v["error"]["requestId"].is_string(), "{v}");

        let response = ApiError::bad_request("invalid_parameter", "no")
            .field("limit")
            .into_response();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        assert!(response.headers().get("x-request-id").is_none());
        let v = body(response).await;
        assert_eq!(v["error"]["field"], "limit", "{v}");
        assert!(v["error"].get("requestId").is_none(), "{v}");
    }
}
