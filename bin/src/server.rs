//! The one place a server is assembled from its config: what `run` serves, what `check-config`
//! checks and what `bench` measures are the same store, broker, engine, access rules, TLS and
//! router.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use timer_brokers::memory::MemoryHub;
use timer_core::engine::metric;
use timer_core::{Engine, Error, SystemClock};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::{Config, LogFormat};
use crate::http::auth::Auth;
use crate::http::counted::{Cached, Counts};
use crate::http::health::READY_MAX_AGE;
use crate::http::listener::{self, Listening};
use crate::http::state::{AppState, EventStreams};
use crate::telemetry::Telemetry;

/// What a config needs besides its values to serve the API: its access rules (keys read, JWKS
/// file read) and its TLS settings (certificates and key read). Building them is also how
/// `check-config` finds a bad key hash or an unreadable certificate.
pub struct Prepared {
    pub auth: Option<Arc<Auth>>,
    pub tls: Option<rustls::ServerConfig>,
}

/// Reads and checks what the API needs of `config` beyond its values.
pub fn prepare(config: &Config) -> Result<Prepared, Error> {
    crate::telemetry::ca_of(&config.telemetry)?;
    Ok(Prepared {
        auth: Auth::from_config(&config.http)?.map(Arc::new),
        tls: listener::server_config(&config.http)?,
    })
}

/// What the API serves besides the engine.
pub struct Serving {
    pub engine: Engine,
    pub auth: Option<Arc<Auth>>,
    /// The recorder `/metrics` renders; `None`: 404.
    pub metrics: Option<PrometheusHandle>,
    /// The memory broker's hub (`/v1/commands`, `/v1/dead-letters`); `None` for another broker.
    pub memory_hub: Option<MemoryHub>,
    pub shutdown: CancellationToken,
    /// Cancelled at the first signal, `http.shutdown_delay` before `shutdown`: `/readyz`
    /// answers 503 from then on.
    pub draining: CancellationToken,
    /// How long counts are shared (`http.counts_max_age`, unless the bench measures another).
    pub counts_max_age: Duration,
}

/// The API's router on `engine`, with the config's routes, limits and dashboard.
pub fn app(config: &Config, serving: Serving) -> Router {
    let state = AppState {
        engine: serving.engine,
        metrics: serving.metrics,
        memory_hub: serving.memory_hub,
        shutdown: serving.shutdown,
        draining: serving.draining,
        counts: Counts::new(serving.counts_max_age),
        ready: Cached::new("readiness", READY_MAX_AGE),
        streams: EventStreams::new(
            config.http.max_event_streams,
            config.http.max_event_streams_per_key,
            config.http.event_stream_buffer,
        ),
        bulks: Default::default(),
        auth: serving.auth,
        trace_url: config.telemetry.trace_url.as_deref().map(Arc::from),
    };
    crate::http::router(state, config)
}

/// `timer-service run`: serves until SIGINT or SIGTERM, then stops the engine and lets open
/// requests finish.
pub async fn run(config: Config) -> anyhow::Result<()> {
    init_logging(&config)?;
    let metrics = init_metrics()?;
    let prepared = prepare(&config)?;
    let store = config.store.open().await?;
    let (broker, memory_hub) = crate::plugins::broker(config.broker.as_ref()).await?;
    let engine = Engine::new(
        store,
        broker,
        Arc::new(SystemClock),
        config.engine.clone(),
        config.limits.clone(),
    )
    .with_release(this_release())?;
    let engine = crate::plugins::with_caller(engine, &config)?;
    let telemetry = Telemetry::start(&config.telemetry, engine.instance_id())?;
    let engine = match &telemetry {
        Some(telemetry) => engine.with_tracer(telemetry.tracer())?,
        None => engine,
    };
    let listener = tokio::net::TcpListener::bind(config.http.addr)
        .await
        .with_context(|| format!("cannot listen on http.addr {}", config.http.addr))?;
    // A name another running instance holds stops the start here, with its error.
    engine.join().await?;
    let shutdown = CancellationToken::new();
    let draining = CancellationToken::new();
    let engine_task = engine.start(shutdown.clone());
    tokio::spawn(pending_gauge(engine.clone(), shutdown.clone()));
    let https = prepared.tls.is_some();
    let app = app(
        &config,
        Serving {
            engine: engine.clone(),
            auth: prepared.auth,
            metrics: Some(metrics),
            memory_hub,
            shutdown: shutdown.clone(),
            draining: draining.clone(),
            counts_max_age: config.http.counts_max_age,
        },
    );
    info!(
        addr = %config.http.addr,
        https,
        store = engine.store().name(),
        broker = engine.broker().name(),
        instance = engine.instance_id(),
        "timer-service running"
    );
    tokio::spawn(signal(
        draining,
        shutdown.clone(),
        config.http.shutdown_delay,
    ));
    let limits = Listening::of(&config.http);
    if let Err(e) = listener::serve(listener, app, prepared.tls, limits, shutdown.clone()).await {
        error!(error = %e, "HTTP server failed");
        shutdown.cancel();
    }
    engine_task.await.context("engine task")?;
    if let Some(telemetry) = telemetry {
        let (exported, dropped) = telemetry.stop().await;
        info!(
            exported,
            dropped, "spans exported and dropped since the start"
        );
    }
    info!("stopped");
    Ok(())
}

fn init_logging(config: &Config) -> anyhow::Result<()> {
    // RUST_LOG, when set and not empty, in place of log.level.
    let filter = match std::env::var("RUST_LOG") {
        Ok(filter) if !filter.trim().is_empty() => crate::config::log_filter("RUST_LOG", &filter)?,
        _ => crate::config::log_filter("log.level", &config.log.level)?,
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = match config.log.format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
    Ok(())
}

fn init_metrics() -> anyhow::Result<PrometheusHandle> {
    // Seconds: from 1 ms (the precision we promise) to a minute.
    const BUCKETS: &[f64] = &[
        0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
    ];
    let handle = PrometheusBuilder::new()
        .set_buckets(BUCKETS)
        .context("metrics buckets")?
        .install_recorder()
        .context("installing the metrics recorder")?;
    metric::describe();
    #[cfg(feature = "webhook")]
    timer_brokers::webhook::metric::describe();
    Ok(handle)
}

/// On SIGINT or SIGTERM, cancels `draining`, then `shutdown` once `delay` has passed
/// (`http.shutdown_delay`); a second one ends the process at once (exit code 128 + the signal's
/// number), as a shutdown waiting for a stuck store or request would otherwise wait for it. As
/// after a crash, what was being fired fires again when its lease ends, and commands a broker
/// delivered and nobody acknowledged are delivered again.
async fn signal(draining: CancellationToken, shutdown: CancellationToken, delay: Duration) {
    let (first, _) = next_signal().await;
    if delay.is_zero() {
        info!("{first}: shutting down (send it again to stop at once)");
    } else {
        info!(
            "{first}: draining, /readyz answers 503 for http.shutdown_delay ({delay:?}), then \
             shutting down (send it again to stop at once)"
        );
    }
    tokio::spawn(drain(draining, shutdown, delay));
    let (name, code) = next_signal().await;
    warn!(
        "{name} again: stopping at once; timers being fired fire again when their leases end, \
         and commands not yet acknowledged are delivered again"
    );
    std::process::exit(code);
}

/// Cancels `draining` at once and `shutdown` once `delay` has passed.
async fn drain(draining: CancellationToken, shutdown: CancellationToken, delay: Duration) {
    draining.cancel();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
        info!("drained: shutting down");
    }
    shutdown.cancel();
}

/// The next SIGINT or SIGTERM: its name and the exit code it ends a process with.
async fn next_signal() -> (&'static str, i32) {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => ("SIGINT", 130),
        _ = term => ("SIGTERM", 143),
    }
}
/// This build: the release and the git revision (`bin/build.rs`), as the instance list shows it.
pub fn this_release() -> timer_core::Release {
    timer_core::Release {
        version: env!("CARGO_PKG_VERSION").to_owned(),
        revision: env!("SERVICE_REVISION").to_owned(),
    }
}

/// Keeps the `timer.pending` (Scheduled) and `timer.paused` gauges current (a count is too costly for every scrape on a big store).
pub async fn pending_gauge(engine: Engine, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        if let Ok(n) = engine.store().scheduled_count().await {
            metrics::gauge!(metric::PENDING).set(n as f64);
        }
        if let Ok(n) = engine.paused_count().await {
            metrics::gauge!(metric::PAUSED).set(n as f64);
        }
    }
}

#[cfg(test)]
mod tests;
