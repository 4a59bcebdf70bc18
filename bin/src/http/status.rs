//! How the instance is: `GET /v1/status` (for operators) and `/metrics` (for Prometheus); the
//! probes are in `health.rs`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::Serialize;
use timer_core::{Engine, TimerState};
use tracing::warn;
use utoipa::ToSchema;

use crate::http::counted::Totals;
use crate::http::error::{ApiError, ErrorBody};
use crate::http::health::{answers_within, READY_WITHIN};
use crate::http::state::AppState;

/// `GET /v1/status`.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    /// This instance's release.
    pub version: &'static str,
    /// The git revision this instance was built from (`unknown` when built outside git).
    pub revision: &'static str,
    pub instance_id: String,
    pub store: Health,
    pub broker: Health,
    /// The engine's tasks that panicked and wait to be started again, with what happened
    /// (empty while every task runs; `/readyz` answers 503 meanwhile).
    pub tasks_down: Vec<TaskDown>,
    pub timers: Counts,
    /// The timers due now that no instance has claimed yet (of every instance, from the
    /// store, counted with `timers`): who waits. Null when the count failed.
    #[schema(required = true)]
    pub backlog: Option<BacklogView>,
    #[schema(format = DateTime)]
    #[schema(required = true)]
    pub next_due_at: Option<String>,
    pub last_minute: LastMinute,
    /// The minutes of the last hour in which this instance fired, oldest first (the current
    /// minute too, so far); minutes without fires are left out.
    pub last_hour: Vec<MinuteView>,
    /// The live instances, this one included, ordered by id: every instance on the store's
    /// list (PostgreSQL), or this one alone. Null when the store could not list them.
    #[schema(required = true)]
    pub instances: Option<Vec<InstanceView>>,
}

/// One live instance.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct InstanceView {
    /// Its `engine.instance_id` (or the name it made itself).
    pub id: String,
    /// Its release; null for an instance of 0.1.0, which does not say.
    #[schema(required = true)]
    pub version: Option<String>,
    /// The git revision it was built from; null with `version`.
    #[schema(required = true)]
    pub revision: Option<String>,
    /// When it joined the store's live instances (its start, or when it joined again after a
    /// lost connection).
    #[schema(format = DateTime)]
    pub started_at: String,
    /// When it last told the store it is alive (about every second; null for 0.1.0).
    #[schema(format = DateTime)]
    #[schema(required = true)]
    pub last_seen_at: Option<String>,
    /// The timers it holds leases on now: claimed, being fired, not settled yet.
    pub leases: u64,
}

impl InstanceView {
    pub fn of(i: timer_core::LiveInstance) -> Self {
        let (version, revision) = match i.release {
            Some(r) => (Some(r.version), Some(r.revision)),
            None => (None, None),
        };
        InstanceView {
            id: i.id,
            version,
            revision,
            started_at: i.started_at.to_rfc3339(),
            last_seen_at: i.last_seen_at.map(|t| t.to_rfc3339()),
            leases: i.leases,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TaskDown {
    /// `ingest`, `firing`, `purge`, `membership` or `take-over`.
    pub task: &'static str,
    pub error: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// The plugin: `sqlite`, `postgres`, `memory`, `nats`, …
    pub kind: &'static str,
    pub healthy: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Counts from the store; null where it cannot count (or the count failed).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Counts {
    #[schema(required = true)]
    pub pending: Option<u64>,
    #[schema(required = true)]
    pub paused: Option<u64>,
    #[schema(required = true)]
    pub failed: Option<u64>,
    /// When these counts were taken: they are shared between requests for up to
    /// `http.counts_max_age`. Null when there are no counts.
    #[schema(format = DateTime)]
    #[schema(required = true)]
    pub counted_at: Option<String>,
}

/// The due backlog: Scheduled timers whose time came (due, or a retry's or an expired lease's)
/// and that no instance has claimed yet.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct BacklogView {
    /// Timers waiting, of all tenants.
    pub due: u64,
    /// Tenants with a timer waiting.
    pub tenants: u64,
    /// The tenants waiting longest (at most 20), longest first.
    pub by_tenant: Vec<TenantBacklogView>,
    /// When this was counted (as `timers.countedAt`).
    #[schema(format = DateTime)]
    pub counted_at: String,
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantBacklogView {
    pub tenant_id: String,
    /// Its timers waiting.
    pub due: u64,
    /// The time the longest waiting one came due: the tenant waits since then.
    #[schema(format = DateTime)]
    pub due_since: String,
}

/// Most tenants `GET /v1/status` lists in `backlog.byTenant` and in `lastMinute.byTenant`.
pub const STATUS_TENANTS: usize = 20;

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct LastMinute {
    /// Timers this instance fired in the last 60 seconds.
    pub fired: u64,
    pub lateness_ms: Percentiles,
    /// Tenants whose timers this instance fired in the last 60 seconds.
    pub tenants: u64,
    /// The most late of those tenants (at most 20), by lateness p99, then by
    /// their most late fire.
    pub by_tenant: Vec<TenantMinuteView>,
}

/// One tenant's fires of the last minute on this instance.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantMinuteView {
    pub tenant_id: String,
    pub fired: u64,
    /// From a sample of each second's first fires (100 per tenant).
    pub lateness_ms: Percentiles,
    /// The lateness of its most late fire.
    pub max_lateness_ms: u64,
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MinuteView {
    /// The minute's start.
    #[schema(format = DateTime)]
    pub start: String,
    pub fired: u64,
    pub lateness_ms: Percentiles,
}

impl MinuteView {
    pub fn of(m: &timer_core::engine::MinuteFires) -> Self {
        MinuteView {
            start: m.start.to_rfc3339(),
            fired: m.fired,
            lateness_ms: Percentiles {
                p50: m.p50_ms,
                p99: m.p99_ms,
            },
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Percentiles {
    #[schema(required = true)]
    pub p50: Option<u64>,
    #[schema(required = true)]
    pub p99: Option<u64>,
}

/// Prometheus metrics (`docs/src/operations/metrics.md` lists them).
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    security(()),
    responses(
        (status = 200, description = "Prometheus text format", content_type = "text/plain", body = String),
        (status = 404, description = "No metrics recorder (metrics.enabled = false)", body = ErrorBody),
    )
)]
pub async fn metrics(State(app): State<AppState>) -> Result<String, ApiError> {
    match &app.metrics {
        Some(handle) => Ok(handle.render()),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "unsupported",
            "metrics recorder not installed",
        )),
    }
}

/// Counts [`Totals`]; fails if a count fails.
async fn count_totals(engine: Engine) -> timer_core::Result<Totals> {
    let counted_at = engine.clock().now();
    let queries = engine.store().queries();
    let (pending, paused, failed, backlog) = tokio::join!(
        queries.count(TimerState::Scheduled),
        queries.count(TimerState::Paused),
        queries.count(TimerState::Failed),
        queries.backlog(counted_at, STATUS_TENANTS),
    );
    Ok(Totals {
        counted_at,
        pending: pending?,
        paused: paused?,
        failed: failed?,
        backlog: backlog?,
    })
}

/// This instance, its store and broker with their health, and what they hold.
#[utoipa::path(
    get,
    path = "/v1/status",
    tag = "operations",
    responses((status = 200, description = "The status (also when a part is unhealthy)", body = Status))
)]
pub async fn status(State(app): State<AppState>) -> Json<Status> {
    let engine = &app.engine;
    let store = engine.store();
    let broker = engine.broker();
    let (store_health, broker_health) = tokio::join!(
        answers_within(store.health(), "store"),
        answers_within(broker.health(), "broker"),
    );
    let health = |kind: &'static str, result: timer_core::Result<()>| Health {
        kind,
        healthy: result.is_ok(),
        error: result.err().map(|e| e.chain()),
    };
    let (totals, next_due, instances) = tokio::join!(
        app.counts.totals.get(|| count_totals(app.engine.clone())),
        store.next_due_at(),
        tokio::time::timeout(READY_WITHIN, engine.instances()),
    );
    let instances = match instances {
        Ok(Ok(list)) => Some(list.into_iter().map(InstanceView::of).collect()),
        Ok(Err(e)) => {
            warn!(error = %e.chain(), "status: listing the live instances failed");
            None
        }
        Err(_) => {
            warn!("status: listing the live instances did not answer in time");
            None
        }
    };
    let minute = engine.last_minute();
    let (tenants_minute, tenants_fired) = engine.last_minute_by_tenant(STATUS_TENANTS);
    Json(Status {
        version: env!("CARGO_PKG_VERSION"),
        revision: env!("SERVICE_REVISION"),
        instance_id: engine.instance_id().to_owned(),
        store: health(store.name(), store_health),
        broker: health(broker.name(), broker_health),
        tasks_down: engine
            .tasks_down()
            .into_iter()
            .map(|(task, error)| TaskDown { task, error })
            .collect(),
        backlog: totals.as_ref().ok().map(|totals| BacklogView {
            due: totals.backlog.due,
            tenants: totals.backlog.tenants,
            by_tenant: totals
                .backlog
                .by_tenant
                .iter()
                .map(|t| TenantBacklogView {
                    tenant_id: t.tenant_id.clone(),
                    due: t.due,
                    due_since: t.since.to_rfc3339(),
                })
                .collect(),
            counted_at: totals.counted_at.to_rfc3339(),
        }),
        timers: match totals {
            Ok(totals) => Counts {
                pending: Some(totals.pending),
                paused: Some(totals.paused),
                failed: Some(totals.failed),
                counted_at: Some(totals.counted_at.to_rfc3339()),
            },
            Err(_) => Counts {
                pending: None,
                paused: None,
                failed: None,
                counted_at: None,
            },
        },
        next_due_at: next_due.ok().flatten().map(|t| t.to_rfc3339()),
        last_minute: LastMinute {
            fired: minute.fired,
            lateness_ms: Percentiles {
                p50: minute.p50_ms,
                p99: minute.p99_ms,
            },
            tenants: tenants_fired as u64,
            by_tenant: tenants_minute
                .into_iter()
                .map(|t| TenantMinuteView {
                    tenant_id: t.tenant_id,
                    fired: t.fired,
                    lateness_ms: Percentiles {
                        p50: t.p50_ms,
                        p99: t.p99_ms,
                    },
                    max_lateness_ms: t.max_ms,
                })
                .collect(),
        },
        last_hour: engine.last_hour().iter().map(MinuteView::of).collect(),
        instances,
    })
}
