//! The probes: `/healthz` (the process answers) and `/readyz` (the store, the broker and the
//! engine's tasks are up), and the bounded health check `GET /v1/status` shares with them.

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use timer_core::Error;
use utoipa::ToSchema;

use crate::http::state::AppState;

/// `GET /readyz`: each part's kind and whether it is `ok`.
#[derive(Debug, Serialize, ToSchema)]
pub struct Readiness {
    pub store: Probe,
    pub broker: Probe,
    /// The engine's tasks (kind `engine`): `unavailable` while one that panicked waits to be
    /// started again.
    pub engine: Probe,
    /// `true` once this instance began to stop: it still serves and fires for
    /// `http.shutdown_delay`, answering 503 here so that it is taken out of the rotation.
    pub draining: bool,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Probe {
    pub kind: &'static str,
    /// `ok` or `unavailable`; why is in the log and in `GET /v1/status` (not told to anonymous
    /// callers).
    pub status: &'static str,
}

/// Liveness: the process answers.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    security(()),
    responses((status = 200, description = "`ok`", content_type = "text/plain", body = String))
)]
pub async fn healthz() -> &'static str {
    "ok"
}

/// Readiness: the store and the broker answer, this instance is a live member of the store's
/// instances, every engine task runs, and it is not stopping (`draining`). Anyone may ask, so the answer says only which part is
/// `unavailable`, never why (errors name hosts and users): the reasons are in the log and in
/// `GET /v1/status`. The checks run at most once per [`READY_MAX_AGE`], whatever the number
/// of callers, so polling cannot make the service reconnect to its broker over and over.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    security(()),
    responses(
        (status = 200, description = "Every part is `ok`", body = Readiness),
        (status = 503, description = "A part is `unavailable` (the reason is in the log and `GET /v1/status`), or the instance is `draining`", body = Readiness),
    )
)]
pub async fn readyz(State(app): State<AppState>) -> Response {
    let engine = app.engine.clone();
    let checked = app.ready.get(|| async move {
        let (store, broker) = tokio::join!(
            answers_within(engine.store().health(), "store"),
            answers_within(engine.broker().health(), "broker"),
        );
        for (part, result) in [("store", &store), ("broker", &broker)] {
            if let Err(e) = result {
                tracing::warn!(part, error = %e.chain(), "not ready");
            }
        }
        Ok::<_, std::convert::Infallible>((store.is_ok(), broker.is_ok()))
    });
    let (store, broker) = match checked.await {
        Ok(parts) => *parts,
        Err(never) => match never {},
    };
    // Reachable is not enough: cut off for a moment, the instance stops firing until it has
    // joined the store's live instances again.
    let store = store && app.engine.is_member();
    let engine = app.engine.tasks_down().is_empty();
    let draining = app.draining.is_cancelled();
    let show = |ok: bool| if ok { "ok" } else { "unavailable" };
    let status = if store && broker && engine && !draining {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = Readiness {
        store: Probe {
            kind: app.engine.store().name(),
            status: show(store),
        },
        broker: Probe {
            kind: app.engine.broker().name(),
            status: show(broker),
        },
        engine: Probe {
            kind: "engine",
            status: show(engine),
        },
        draining,
    };
    (status, Json(body)).into_response()
}

/// How long `/readyz` answers from its last health checks.
pub const READY_MAX_AGE: Duration = Duration::from_secs(1);

/// How long `/readyz` waits for the store's and the broker's health check: a server cut off
/// without a close answers nothing (a TCP connection can wait minutes before it fails).
pub const READY_WITHIN: Duration = Duration::from_secs(2);

/// `health` as it answers within [`READY_WITHIN`]; an error naming the `part` otherwise
/// (`/readyz`, `/v1/status`).
pub(super) async fn answers_within(
    health: impl std::future::Future<Output = Result<(), Error>>,
    part: &str,
) -> Result<(), Error> {
    tokio::time::timeout(READY_WITHIN, health)
        .await
        .unwrap_or_else(|_| {
            Err(Error::unavailable(format!(
                "{part}: no answer to the health check within {} s",
                READY_WITHIN.as_secs()
            )))
        })
}
