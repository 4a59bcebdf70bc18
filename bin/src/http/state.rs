//! What every handler shares: [`AppState`], the open event streams, and the path parameters.
//!
//! Below the handlers: it imports only the leaf modules (`counted`, `error`, `auth`, `config`).

use std::sync::Arc;

use axum::extract::{FromRequestParts, Path};
use axum::http::request::Parts;
use axum::http::HeaderMap;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;
use timer_brokers::memory::MemoryHub;
use timer_core::{Engine, TimerKey, TraceHeaders};
use tokio_util::sync::CancellationToken;

use crate::http::auth::Auth;
use crate::http::counted::{Cached, Counts};
use crate::http::error::ApiError;

/// The W3C trace context headers of a request (`traceparent`, `tracestate`); a value that is
/// not text counts as absent.
pub fn trace_headers(headers: &HeaderMap) -> TraceHeaders {
    TraceHeaders::from_pairs(
        headers
            .iter()
            .filter_map(|(name, value)| Some((name.as_str(), value.to_str().ok()?))),
    )
}

#[derive(Clone)]
pub struct AppState {
    pub engine: Engine,
    pub metrics: Option<PrometheusHandle>,
    pub memory_hub: Option<MemoryHub>,
    pub shutdown: CancellationToken,
    /// The counts `/v1/status` and `/v1/summary` share between requests.
    pub counts: Counts,
    /// Checks bearer tokens; `None`: the API has no authentication.
    pub auth: Option<Arc<Auth>>,
    /// The last health checks of `/readyz` (store, broker reachable), shared by its callers.
    pub ready: Arc<Cached<(bool, bool)>>,
    /// The open event streams and their limits.
    pub streams: Arc<EventStreams>,
    /// `telemetry.trace_url`: a trace's link, `{traceId}` to replace.
    pub trace_url: Option<Arc<str>>,
}

/// How many `GET /v1/events` streams may be open (`http.max_event_streams`), how many bytes
/// each may have waiting (`http.event_stream_buffer`), and how many are open.
pub struct EventStreams {
    pub max: usize,
    pub buffer: usize,
    open: std::sync::atomic::AtomicUsize,
}

impl EventStreams {
    /// `max` streams (`http.max_event_streams`), each with `buffer` bytes waiting at most
    /// (`http.event_stream_buffer`).
    pub fn new(max: usize, buffer: usize) -> Arc<Self> {
        Arc::new(EventStreams {
            max,
            buffer,
            open: Default::default(),
        })
    }

    /// A place for one more stream, held until it is dropped; `None` when all are taken.
    pub fn open(self: &Arc<Self>) -> Option<OpenStream> {
        use std::sync::atomic::Ordering;
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()
            .map(|_| OpenStream(self.clone()))
    }
}

/// One open event stream's place.
pub struct OpenStream(Arc<EventStreams>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0
            .open
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Path parameters of the routes on one timer.
#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
pub struct TimerPath {
    /// The tenant (`tenantId`).
    pub tenant: String,
    /// The timer's `serviceCallId`.
    pub id: String,
}

/// The timer a route's `{tenant}/{id}` names, as the handler's argument (the ids were checked
/// against the limits before, by `params::check_path_ids`).
pub struct PathTimer(pub TimerKey);

impl<S: Send + Sync> FromRequestParts<S> for PathTimer {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Path(TimerPath { tenant, id }) = Path::<TimerPath>::from_request_parts(parts, state)
            .await
            .map_err(|e| ApiError::bad_request("invalid_id", e.body_text()))?;
        Ok(PathTimer(TimerKey::new(tenant, id)))
    }
}

/// Path parameter of the routes on one tenant.
#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
pub struct TenantPath {
    /// The tenant (`tenantId`).
    pub tenant: String,
}
