//! What every handler shares: [`AppState`], the open event streams, and the path parameters.
//!
//! Below the handlers: it imports only the leaf modules (`counted`, `error`, `auth`, `config`).

use std::collections::HashMap;
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
    /// Cancelled when the instance begins to stop (`http.shutdown_delay` before `shutdown`).
    pub draining: CancellationToken,
    /// The counts `/v1/status` and `/v1/summary` share between requests.
    pub counts: Counts,
    /// Checks bearer tokens; `None`: the API has no authentication.
    pub auth: Option<Arc<Auth>>,
    /// The last health checks of `/readyz` (store, broker reachable), shared by its callers.
    pub ready: Arc<Cached<(bool, bool)>>,
    /// The open event streams and their limits.
    pub streams: Arc<EventStreams>,
    /// The tenants with a bulk action running.
    pub bulks: Arc<BulkRuns>,
    /// `telemetry.trace_url`: a trace's link, `{traceId}` to replace.
    pub trace_url: Option<Arc<str>>,
}

/// How many `GET /v1/events` streams may be open (`http.max_event_streams`), and of one key
/// (`http.max_event_streams_per_key`), how many bytes each may have waiting
/// (`http.event_stream_buffer`), and how many are open.
pub struct EventStreams {
    pub max: usize,
    pub per_key: usize,
    pub buffer: usize,
    open: std::sync::Mutex<Open>,
}

#[derive(Default)]
struct Open {
    all: usize,
    by_key: HashMap<Arc<str>, usize>,
}

/// Why a stream cannot open.
#[derive(Debug, PartialEq, Eq)]
pub enum StreamsFull {
    /// `http.max_event_streams` are open.
    All,
    /// `http.max_event_streams_per_key` of the caller's are.
    Key,
}

impl EventStreams {
    /// `max` streams (`http.max_event_streams`), `per_key` of one key, each with `buffer`
    /// bytes waiting at most (`http.event_stream_buffer`).
    pub fn new(max: usize, per_key: usize, buffer: usize) -> Arc<Self> {
        Arc::new(EventStreams {
            max,
            per_key,
            buffer,
            open: Default::default(),
        })
    }

    /// A place for one more stream of `key` (`None`: the API has no authentication, so no
    /// key to count by), held until it is dropped.
    pub fn open(self: &Arc<Self>, key: Option<&Arc<str>>) -> Result<OpenStream, StreamsFull> {
        let mut open = self.lock();
        if open.all >= self.max {
            return Err(StreamsFull::All);
        }
        if let Some(key) = key {
            let of_key = open.by_key.entry(key.clone()).or_default();
            if *of_key >= self.per_key {
                return Err(StreamsFull::Key);
            }
            *of_key += 1;
        }
        open.all += 1;
        Ok(OpenStream {
            streams: self.clone(),
            key: key.cloned(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Open> {
        // Counts changed in one step each: whole after a panic elsewhere.
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One open event stream's place.
pub struct OpenStream {
    streams: Arc<EventStreams>,
    key: Option<Arc<str>>,
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        let mut open = self.streams.lock();
        open.all = open.all.saturating_sub(1);
        if let Some(key) = &self.key {
            if let Some(n) = open.by_key.get_mut(key) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    open.by_key.remove(key);
                }
            }
        }
    }
}

/// The tenants with a bulk action running: one at a time per tenant, so that one tenant's many
/// bulk requests (each goes on after its client left) cannot fill the store's writes.
#[derive(Default)]
pub struct BulkRuns(std::sync::Mutex<std::collections::HashSet<String>>);

impl BulkRuns {
    /// `tenant`'s turn, held until it is dropped; `None` while it has one running.
    pub fn start(self: &Arc<Self>, tenant: &str) -> Option<BulkRun> {
        let mut running = self.lock();
        running
            .insert(tenant.to_owned())
            .then(|| BulkRun(self.clone(), tenant.to_owned()))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        // Changed in one step each: whole after a panic elsewhere.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A tenant's running bulk action ([`BulkRuns::start`]).
pub struct BulkRun(Arc<BulkRuns>, String);

impl Drop for BulkRun {
    fn drop(&mut self) {
        self.0.lock().remove(&self.1);
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
