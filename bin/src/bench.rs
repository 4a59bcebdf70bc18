//! `timer-service bench`: workloads against the configured store (a fresh temp SQLite file, a
//! fresh PostgreSQL schema, or memory) and broker, run in this process on the real engine and
//! the system clock. Prints a table of medians over `--runs`, or JSON with `--json`.
//!
//! Workloads:
//! - `lateness`: N timers due uniformly over the next S seconds; lateness = the moment a
//!   watcher of the engine's confirmed events receives the event − the due time.
//! - `herd`: N timers due in the same millisecond; time from due to the last event, fires/s.
//! - `ingest`: schedules/s through the broker path (commands → ingest task → store) and through
//!   the HTTP API (one timer per request, 64 in flight).
//! - `list`: `--pending` timers in one tenant, then `GET /v1/tenants/{tenant}/timers` pages
//!   (the first, one 90% deep by cursor, one with a prefix filter), each asked `--timers` times
//!   one after the other; their answer times.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use timer_brokers::memory::{HubConfig, MemoryConfig, MemoryHub};
use timer_core::plugin::{BrokerConfig, Isolated, StoreConfig, TestClient};
use timer_core::{Engine, NewTimer, Store, SystemClock, TimerKey, Timestamp};
use tokio_util::sync::CancellationToken;

use crate::client::ClientTls;
use crate::config::Config;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    Lateness,
    Herd,
    Ingest,
    /// `--pending` timers far in the future, then the lateness workload on top; RSS reported.
    Pending,
    /// `--pending` timers and one past due in the store, then the engine starts: time to the
    /// first fire.
    Restart,
    /// `--pending` timers in one tenant, then list pages over HTTP: answer times.
    List,
    All,
}

/// What `timer-service bench` measures, and how often.
#[derive(Debug, clap::Args)]
pub struct Options {
    #[arg(long, value_enum, default_value = "all")]
    pub workload: Workload,
    /// Timers per run (list: requests per page).
    #[arg(long, default_value_t = 10_000)]
    pub timers: usize,
    /// Lateness workload: spread the due times over this long.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub over: Duration,
    /// Runs per workload; the table shows the median.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Engines sharing the store (each with its own connection pool), as separate
    /// instances would; for lateness and herd.
    #[arg(long, default_value_t = 1)]
    pub instances: usize,
    /// Pending (far-future) timers for the pending, restart and list workloads.
    #[arg(long, default_value_t = 1_000_000)]
    pub pending: usize,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
    /// How the HTTP workloads' client speaks HTTPS, when the config sets http.tls_cert.
    #[command(flatten)]
    pub tls: crate::client::ClientTls,
}

/// One measured figure: the median of its runs, and every run.
#[derive(Debug, Serialize)]
pub struct Figure {
    pub workload: &'static str,
    pub store: String,
    pub broker: String,
    pub instances: usize,
    pub metric: &'static str,
    pub unit: &'static str,
    pub median: f64,
    pub runs: Vec<f64>,
}

/// Engines on one fresh store for one run, and the store and broker resources of the run,
/// removed after it. With several instances each engine has its own store handle (its own pool)
/// on the same data, as separate processes would; timers are scheduled through the first.
struct Rig {
    engine: Engine,
    engines: Vec<Engine>,
    hub: Option<MemoryHub>,
    shutdown: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    store: Isolated<dyn StoreConfig>,
    broker: Isolated<dyn BrokerConfig>,
    /// Holds the broker's resources ready for the run (RabbitMQ's events need a bound queue).
    client: Arc<dyn TestClient>,
    /// Events of the first engine from before it started.
    first_events: timer_core::engine::Subscription,
    /// When the engines were started.
    started: Instant,
    /// Schedules/s of the preload, when there was one.
    preload_rate: f64,
}

/// What to put in the store before the engines start.
#[derive(Clone, Copy, Default)]
struct Preload {
    /// Timers due tomorrow and later.
    far: usize,
    /// Timers already due.
    due_now: usize,
    /// All in the tenant [`LIST_TENANT`] (else spread over 16 tenants).
    one_tenant: bool,
}

/// The tenant the list workload fills.
const LIST_TENANT: &str = "bench-list";

impl Rig {
    async fn stop(self) {
        self.shutdown.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
        // Every broker client is gone before its streams or queues are deleted.
        drop(self.engine);
        drop(self.engines);
        drop(self.hub);
        drop(self.client);
        for result in [
            self.store.config.clean_up().await,
            self.broker.config.clean_up().await,
        ] {
            if let Err(e) = result {
                eprintln!("warning: cleaning up after the bench: {}", e.chain());
            }
        }
    }
}

/// A fresh store (never the configured data: a temp file, a schema of its own on the configured
/// server) and a second handle on it for every further instance.
async fn fresh_stores(
    config: &dyn StoreConfig,
    instances: usize,
) -> anyhow::Result<(Vec<Arc<dyn Store>>, Isolated<dyn StoreConfig>)> {
    let err = |e: timer_core::Error| anyhow::anyhow!(e.chain());
    if instances > 1 && !config.shared() {
        bail!(
            "--instances needs a store several instances share (postgres), not {}",
            config.kind()
        );
    }
    let isolated = config.isolated("bench").map_err(err)?;
    let mut stores = Vec::new();
    for _ in 0..instances {
        stores.push(isolated.config.open().await.map_err(err)?);
    }
    Ok((stores, isolated))
}

/// Broker resources of its own on the configured server (streams, queues, topics), and a client
/// that keeps them ready. The memory broker keeps no events for reading back.
async fn fresh_broker(
    config: &dyn BrokerConfig,
) -> anyhow::Result<(Isolated<dyn BrokerConfig>, Arc<dyn TestClient>)> {
    let err = |e: timer_core::Error| anyhow::anyhow!(e.chain());
    let mut isolated = config.isolated("bench").map_err(err)?;
    if let Some(memory) = isolated.config.as_any().downcast_ref::<HubConfig>() {
        isolated = Isolated::new(Box::new(HubConfig::new(MemoryConfig {
            retain: 1,
            ..memory.config.clone()
        })));
    }
    let client = isolated.config.test_client().await.map_err(err)?;
    Ok((isolated, client))
}

async fn start_rig(config: &Config, instances: usize) -> anyhow::Result<Rig> {
    start_rig_with(config, instances, Preload::default()).await
}

/// Fills `store` in batches of 10,000 (never holding them all); returns schedules/s.
async fn preload(store: &Arc<dyn Store>, preload: Preload) -> anyhow::Result<f64> {
    let total = preload.far + preload.due_now;
    if total == 0 {
        return Ok(0.0);
    }
    let bar = progress(total, "preloading");
    let now = now_ms();
    let started = Instant::now();
    let mut i = 0;
    while i < total {
        let end = (i + 10_000).min(total);
        let batch: Vec<NewTimer> = (i..end)
            .map(|k| {
                let due = if k < preload.due_now {
                    now - 1
                } else {
                    now + 86_400_000 + k as i64
                };
                let mut timer = timer(k, due);
                if preload.one_tenant {
                    timer.key.tenant_id = LIST_TENANT.to_owned();
                }
                timer
            })
            .collect();
        store
            .schedule(&batch, Timestamp::from_millis(now_ms()))
            .await
            .map_err(|e| anyhow::anyhow!(e.chain()))?;
        bar.inc(batch.len() as u64);
        i = end;
    }
    bar.finish_and_clear();
    Ok(total as f64 / started.elapsed().as_secs_f64())
}

async fn start_rig_with(config: &Config, instances: usize, load: Preload) -> anyhow::Result<Rig> {
    let (stores, store) = fresh_stores(config.store.as_ref(), instances.max(1)).await?;
    let preload_rate = preload(&stores[0], load).await?;
    let (broker, client) = fresh_broker(config.broker.as_ref()).await?;
    let shutdown = CancellationToken::new();
    let mut engines = Vec::new();
    for store in stores {
        let connected = broker
            .config
            .connect()
            .await
            .map_err(|e| anyhow::anyhow!(e.chain()))?;
        let engine = Engine::new(
            store,
            connected,
            Arc::new(SystemClock),
            config.engine.clone(),
            config.limits.clone(),
        );
        engines.push(engine);
    }
    let first_events = engines[0].subscribe(WATCH_BUDGET, Box::new(|_| true));
    let started = Instant::now();
    let tasks = engines.iter().map(|e| e.start(shutdown.clone())).collect();
    Ok(Rig {
        engine: engines[0].clone(),
        engines,
        hub: crate::plugins::memory_hub(broker.config.as_ref()),
        shutdown,
        tasks,
        store,
        broker,
        client,
        first_events,
        started,
        preload_rate,
    })
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

fn progress(len: usize, what: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(len as u64), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template("{msg:>12} [{bar:30}] {pos}/{len} {per_sec}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(what.to_owned());
    bar
}

fn timer(i: usize, due_ms: i64) -> NewTimer {
    NewTimer {
        key: TimerKey::new(format!("bench-{}", i % 16), format!("t{i:08}")),
        due_at: Timestamp::from_millis(due_ms),
        correlation_id: None,
        payload: None,
        recurrence: None,
        policy: None,
        work: None,
    }
}

/// Schedules in batches of 1,000 through the engine (as the ingest task does).
async fn schedule_all(engine: &Engine, timers: Vec<NewTimer>) -> anyhow::Result<()> {
    let bar = progress(timers.len(), "scheduling");
    for chunk in timers.chunks(1_000) {
        engine
            .schedule(chunk)
            .await
            .map_err(|e| anyhow::anyhow!(e.chain()))?;
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    Ok(())
}

/// How many bytes of events a bench watcher may have waiting: a herd of a million (about 400
/// bytes each) while the watcher catches up.
const WATCH_BUDGET: usize = 1 << 30;

/// What a watcher of the engine's confirmed events saw.
struct Watched {
    /// (receive time − due time) in ms per event.
    lateness: Vec<i64>,
    last_receive_ms: i64,
    distinct: usize,
    duplicates: usize,
    lagged: u64,
}

/// Watches the events of every engine until `n` distinct timers fired or `deadline` passes.
async fn watch(engines: &[Engine], n: usize, deadline: Duration) -> Watched {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut forwarders = Vec::new();
    for engine in engines {
        let mut events = engine.subscribe(WATCH_BUDGET, Box::new(|_| true));
        let tx = tx.clone();
        forwarders.push(tokio::spawn(async move {
            loop {
                let item = match events.recv().await {
                    Some(event) => Ok((now_ms(), event)),
                    None => match events.lagged() {
                        Some(k) => Err(k),
                        None => return,
                    },
                };
                let lagged = item.is_err();
                if tx.send(item).is_err() || lagged {
                    return;
                }
            }
        }));
    }
    drop(tx);
    let bar = progress(n, "firing");
    let mut seen: HashMap<String, usize> = HashMap::with_capacity(n);
    let mut out = Watched {
        lateness: Vec::with_capacity(n),
        last_receive_ms: 0,
        distinct: 0,
        duplicates: 0,
        lagged: 0,
    };
    let end = tokio::time::Instant::now() + deadline;
    while seen.len() < n {
        let (received, event) = match tokio::time::timeout_at(end, rx.recv()).await {
            Err(_) | Ok(None) => break,
            Ok(Some(Err(k))) => {
                out.lagged += k;
                continue;
            }
            Ok(Some(Ok(item))) => item,
        };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&event.json) else {
            continue;
        };
        let due = v["payload"]["dueAt"]
            .as_str()
            .and_then(|d| chrono::DateTime::parse_from_rfc3339(d).ok())
            .map(|d| d.timestamp_millis())
            .unwrap_or(received);
        out.lateness.push(received - due);
        out.last_receive_ms = received;
        let key = format!(
            "{}/{}",
            v["tenantId"].as_str().unwrap_or_default(),
            v["aggregateId"].as_str().unwrap_or_default()
        );
        let count = seen.entry(key).or_insert(0);
        *count += 1;
        if *count > 1 {
            out.duplicates += 1;
        } else {
            bar.inc(1);
        }
    }
    for f in forwarders {
        f.abort();
    }
    bar.finish_and_clear();
    out.distinct = seen.len();
    out
}

fn percentile(sorted: &[i64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize] as f64
}

/// Measured figures of one run, by metric.
type Run = Vec<(&'static str, &'static str, f64)>;

async fn lateness_run(
    config: &Config,
    n: usize,
    over: Duration,
    instances: usize,
) -> anyhow::Result<Run> {
    let rig = start_rig(config, instances).await?;
    lateness_on(rig, n, over).await
}

/// The resident memory of this process (service and load generator together), in MiB.
fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(f64::NAN)
}

async fn pending_run(
    config: &Config,
    n: usize,
    over: Duration,
    pending: usize,
) -> anyhow::Result<Run> {
    let rss_before = rss_mib();
    let rig = start_rig_with(
        config,
        1,
        Preload {
            far: pending,
            ..Preload::default()
        },
    )
    .await?;
    let rate = rig.preload_rate;
    let rss_loaded = rss_mib();
    let mut run = lateness_on(rig, n, over).await?;
    run.retain(|(metric, _, _)| {
        matches!(*metric, "p50" | "p99" | "max" | "missing" | "duplicates")
    });
    run.push(("pending timers", "timers", pending as f64));
    run.push(("preload", "schedules/s", rate));
    run.push(("RSS before", "MiB", rss_before));
    run.push(("RSS loaded", "MiB", rss_loaded));
    run.push(("RSS after", "MiB", rss_mib()));
    Ok(run)
}

async fn restart_run(config: &Config, pending: usize) -> anyhow::Result<Run> {
    let mut rig = start_rig_with(
        config,
        1,
        Preload {
            far: pending,
            due_now: 1,
            ..Preload::default()
        },
    )
    .await?;
    let first = tokio::time::timeout(Duration::from_secs(120), rig.first_events.recv()).await;
    let elapsed = rig.started.elapsed().as_secs_f64() * 1000.0;
    rig.stop().await;
    if !matches!(first, Ok(Some(_))) {
        bail!("no timer fired within 120 s of the start");
    }
    Ok(vec![
        ("pending timers", "timers", pending as f64),
        ("start to first fire", "ms", elapsed),
    ])
}

async fn lateness_on(rig: Rig, n: usize, over: Duration) -> anyhow::Result<Run> {
    let span = i64::try_from(over.as_millis()).unwrap_or(i64::MAX).max(1);
    // Time to schedule first (at a pessimistic 5,000/s), so no timer is scheduled after its due.
    let lead = 1_000 + (n as i64 / 5);
    let start = now_ms() + lead;
    let timers: Vec<NewTimer> = (0..n)
        .map(|i| timer(i, start + (i as i64 * span) / n as i64))
        .collect();
    let watcher = {
        let engines = rig.engines.clone();
        tokio::spawn(async move {
            watch(
                &engines,
                n,
                Duration::from_millis((lead + span) as u64) + Duration::from_secs(60),
            )
            .await
        })
    };
    schedule_all(&rig.engine, timers).await?;
    let mut w = watcher.await.context("watcher")?;
    rig.stop().await;
    w.lateness.sort_unstable();
    Ok(vec![
        ("p50", "ms", percentile(&w.lateness, 0.50)),
        ("p90", "ms", percentile(&w.lateness, 0.90)),
        ("p99", "ms", percentile(&w.lateness, 0.99)),
        ("max", "ms", percentile(&w.lateness, 1.0)),
        ("missing", "timers", (n - w.distinct) as f64),
        ("duplicates", "events", w.duplicates as f64),
        ("lagged", "events", w.lagged as f64),
    ])
}

async fn herd_run(config: &Config, n: usize, instances: usize) -> anyhow::Result<Run> {
    let rig = start_rig(config, instances).await?;
    let lead = 1_000 + (n as i64 / 5);
    let due = now_ms() + lead;
    let timers: Vec<NewTimer> = (0..n).map(|i| timer(i, due)).collect();
    let watcher = {
        let engines = rig.engines.clone();
        tokio::spawn(async move {
            watch(
                &engines,
                n,
                Duration::from_millis(lead as u64) + Duration::from_secs(120),
            )
            .await
        })
    };
    schedule_all(&rig.engine, timers).await?;
    let w = watcher.await.context("watcher")?;
    rig.stop().await;
    let last = (w.last_receive_ms - due).max(1) as f64;
    Ok(vec![
        ("due to last fire", "ms", last),
        ("fires/s", "1/s", (w.distinct as f64) * 1000.0 / last),
        ("missing", "timers", (n - w.distinct) as f64),
        ("duplicates", "events", w.duplicates as f64),
    ])
}

async fn wait_pending(store: &Arc<dyn Store>, n: u64, bar: &ProgressBar) -> anyhow::Result<()> {
    let end = Instant::now() + Duration::from_secs(600);
    loop {
        let pending = store
            .scheduled_count()
            .await
            .map_err(|e| anyhow::anyhow!(e.chain()))?;
        bar.set_position(pending);
        if pending >= n {
            return Ok(());
        }
        if Instant::now() > end {
            bail!("only {pending} of {n} commands stored after 10 minutes");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn ingest_run(config: &Config, n: usize, tls: &ClientTls) -> anyhow::Result<Run> {
    let far = now_ms() + 86_400_000;
    let mut run = Run::new();

    // Broker path: commands on the in-process broker, read, decoded and stored in batches.
    let rig = start_rig(config, 1).await?;
    if let Some(hub) = &rig.hub {
        let bodies: Vec<String> = (0..n).map(|i| ingest_command('b', i, far)).collect();
        let bar = progress(n, "broker path");
        let started = Instant::now();
        for body in bodies {
            hub.send_command(body)
                .map_err(|e| anyhow::anyhow!(e.chain()))?;
        }
        wait_pending(rig.engine.store(), n as u64, &bar).await?;
        bar.finish_and_clear();
        run.push((
            "broker path",
            "schedules/s",
            n as f64 / started.elapsed().as_secs_f64(),
        ));
    }
    rig.stop().await;

    // HTTP path: one timer per POST /v1/timers, 64 requests in flight.
    let rig = start_rig(config, 1).await?;
    let Served { base, client } = serve(&rig, config, tls).await?;
    let url = format!("{base}/v1/timers");
    let bar = progress(n, "http path");
    let started = Instant::now();
    let token = config.http.token.as_deref();
    let singles = (0..n).map(|i| (ingest_command('h', i, far), 1)).collect();
    let failures = post_all(&client, &url, token, singles, 64, &bar).await;
    let elapsed = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    if failures > 0 {
        rig.stop().await;
        bail!("{failures} of {n} HTTP schedules failed");
    }
    run.push(("http path", "schedules/s", n as f64 / elapsed));

    // HTTP batch path: POST /v1/timers/batch with limits.max_batch commands each, 4 in flight.
    let url = format!("{base}/v1/timers/batch");
    let per_batch = config.limits.max_batch.max(1);
    let bar = progress(n, "http batches");
    let started = Instant::now();
    let batches: Vec<(String, usize)> = (0..n)
        .collect::<Vec<_>>()
        .chunks(per_batch)
        .map(|batch| {
            let commands: Vec<String> =
                batch.iter().map(|i| ingest_command('m', *i, far)).collect();
            (
                format!(r#"{{"commands":[{}]}}"#, commands.join(",")),
                batch.len(),
            )
        })
        .collect();
    let failures = post_all(&client, &url, token, batches, 4, &bar).await;
    let elapsed = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    rig.stop().await;
    if failures > 0 {
        bail!("{failures} of {n} schedules in HTTP batches failed");
    }
    run.push(("http batch path", "schedules/s", n as f64 / elapsed));
    Ok(run)
}

/// Serves the HTTP API on the rig's first engine, on a free port of 127.0.0.1, until the rig
/// stops.
async fn serve(rig: &Rig, config: &Config, tls: &ClientTls) -> anyhow::Result<Served> {
    serve_counting(rig, config, tls, config.http.counts_max_age).await
}

/// The API a workload talks to: its root URL and a client for it.
struct Served {
    /// `http://127.0.0.1:port`, or `https://` with http.tls_cert.
    base: String,
    client: reqwest::Client,
}

/// [`serve`], with counts shared for `counts_max_age` instead of `http.counts_max_age`.
async fn serve_counting(
    rig: &Rig,
    config: &Config,
    tls: &ClientTls,
    counts_max_age: Duration,
) -> anyhow::Result<Served> {
    let auth =
        crate::auth::Auth::from_config(&config.http).map_err(|e| anyhow::anyhow!(e.chain()))?;
    if auth.is_some() && config.http.token.is_none() {
        bail!(
            "the bench's HTTP workloads authenticate with http.token; with only http.keys or \
             http.jwt set, set http.token too"
        );
    }
    let server_tls =
        crate::https::server_config(&config.http).map_err(|e| anyhow::anyhow!(e.chain()))?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("bind")?;
    let addr = listener.local_addr().context("addr")?;
    let scheme = if server_tls.is_some() {
        "https"
    } else {
        "http"
    };
    let state = crate::http::AppState {
        engine: rig.engine.clone(),
        metrics: None,
        memory_hub: rig.hub.clone(),
        shutdown: rig.shutdown.clone(),
        counts: crate::counted::Counts::new(counts_max_age),
        ready: crate::counted::Cached::new("readiness", crate::http::READY_MAX_AGE),
        streams: crate::http::EventStreams::new(&config.http),
        auth: auth.map(Arc::new),
    };
    let app = crate::http::router(state, config);
    tokio::spawn(crate::https::serve(
        listener,
        app,
        server_tls,
        crate::https::Listening::of(&config.http),
        rig.shutdown.clone(),
    ));
    Ok(Served {
        base: format!("{scheme}://{addr}"),
        client: tls.builder()?.build().context("an HTTP client")?,
    })
}

/// `pending` timers in one tenant, then `requests` GETs of each of three list pages, one
/// after the other: the first page, a page 90% deep (by the cursor of paging there), and the
/// first page of a prefix that 1% of the timers have. Answer times as the client sees them.
async fn list_run(
    config: &Config,
    pending: usize,
    requests: usize,
    tls: &ClientTls,
) -> anyhow::Result<Run> {
    let rig = start_rig_with(
        config,
        1,
        Preload {
            far: pending,
            one_tenant: true,
            ..Preload::default()
        },
    )
    .await?;
    let result = list_pages(&rig, config, pending, requests, tls).await;
    rig.stop().await;
    result
}

async fn list_pages(
    rig: &Rig,
    config: &Config,
    pending: usize,
    requests: usize,
    tls: &ClientTls,
) -> anyhow::Result<Run> {
    let Served { base: root, client } = serve(rig, config, tls).await?;
    let token = config.http.token.as_deref();
    let base = format!("{root}/v1/tenants/{LIST_TENANT}/timers");
    let get = |url: String| {
        let request = client.get(url);
        let request = match token {
            Some(token) => request.bearer_auth(token),
            None => request,
        };
        async move {
            let response = request.send().await.context("GET a list page")?;
            let status = response.status();
            let body: serde_json::Value = response.json().await.context("a JSON page")?;
            if !status.is_success() {
                bail!("the list answered {status}: {body}");
            }
            Ok(body)
        }
    };
    // Page there as a client would, 1,000 timers a page.
    let deep = pending * 9 / 10;
    let bar = progress(deep, "paging 90% in");
    let mut cursor: Option<String> = None;
    let mut seen = 0;
    while seen < deep {
        let url = match &cursor {
            Some(c) => format!("{base}?limit=1000&cursor={c}"),
            None => format!("{base}?limit=1000"),
        };
        let page = get(url).await?;
        let Some(next) = page["nextCursor"].as_str() else {
            bail!("the list ended after {seen} of {pending} timers");
        };
        cursor = Some(next.to_owned());
        seen += page["timers"].as_array().map_or(0, Vec::len);
        bar.set_position(seen as u64);
    }
    bar.finish_and_clear();
    let deep_cursor = cursor.unwrap_or_default();
    let mut run = Run::new();
    let pages = [
        (
            "first page p50",
            "first page p99",
            format!("{base}?limit=100"),
        ),
        (
            "deep page p50",
            "deep page p99",
            format!("{base}?limit=100&cursor={deep_cursor}"),
        ),
        // Ids are t00000000…: t0000 is the first 1% (up to 10,000 of 1,000,000).
        (
            "prefix page p50",
            "prefix page p99",
            format!("{base}?limit=100&prefix=t0000"),
        ),
    ];
    for (p50, p99, url) in pages {
        let (median, tail) = answer_times(
            requests,
            p50.trim_end_matches(" p50"),
            Duration::ZERO,
            || async {
                let page = get(url.clone()).await?;
                if page["timers"].as_array().is_none_or(Vec::is_empty) {
                    bail!("{url}: an empty page");
                }
                Ok(())
            },
        )
        .await?;
        run.push((p50, "ms", median));
        run.push((p99, "ms", tail));
    }
    // What the dashboard's overview asks every 2 s, both at once: the status and the first page
    // of tenant summaries (the 1M-timer tenant among them). The service shares one count for
    // `http.counts_max_age`, so time it both ways: as pollers see it (after a first request
    // that counted, one every 100 ms, while counts run in the background), and counting for
    // every request (a second server with `counts_max_age = 0s`).
    let overview = |root: String| {
        let get = &get;
        async move {
            let (status, summary) = tokio::join!(
                get(format!("{root}/v1/status")),
                get(format!("{root}/v1/summary?limit=100")),
            );
            status?;
            if summary?["tenants"].as_array().is_none_or(Vec::is_empty) {
                bail!("the summary lists no tenant");
            }
            Ok(())
        }
    };
    let shared = root.clone();
    overview(shared.clone()).await?;
    let (median, tail) =
        answer_times(requests, "overview", POLL_GAP, || overview(shared.clone())).await?;
    run.push(("overview p50", "ms", median));
    run.push(("overview p99", "ms", tail));
    // The second server's own client is not needed: the first one speaks to it as well.
    let counted = serve_counting(rig, config, tls, Duration::ZERO).await?.base;
    let (median, tail) = answer_times(
        requests.min(20),
        "overview, counting",
        Duration::ZERO,
        || overview(counted.clone()),
    )
    .await?;
    run.push(("overview counting p50", "ms", median));
    run.push(("overview counting p99", "ms", tail));
    run.push(("pending timers", "timers", pending as f64));
    run.push(("preload", "schedules/s", rig.preload_rate));
    Ok(run)
}

/// Between two requests of a poller in the overview bench.
const POLL_GAP: Duration = Duration::from_millis(100);

/// Runs `one` `requests` times, one after the other and `gap` apart, with a progress bar: p50
/// and p99 of how long each took, in ms.
async fn answer_times<F, Fut>(
    requests: usize,
    what: &str,
    gap: Duration,
    mut one: F,
) -> anyhow::Result<(f64, f64)>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let bar = progress(requests, what);
    let mut micros = Vec::with_capacity(requests);
    for _ in 0..requests {
        let started = Instant::now();
        one().await?;
        micros.push(i64::try_from(started.elapsed().as_micros()).unwrap_or(i64::MAX));
        bar.inc(1);
        if !gap.is_zero() {
            tokio::time::sleep(gap).await;
        }
    }
    bar.finish_and_clear();
    micros.sort_unstable();
    Ok((
        percentile(&micros, 0.5) / 1000.0,
        percentile(&micros, 0.99) / 1000.0,
    ))
}

/// The `i`-th command of an ingest run: 16 tenants, ids `<path><i>`, due at `far`.
fn ingest_command(path: char, i: usize, far: i64) -> String {
    format!(
        r#"{{"tenantId":"bench-{}","serviceCallId":"{path}{i:08}","dueTimeMs":{far}}}"#,
        i % 16
    )
}

/// POSTs every body to `url`, `in_flight` at once, each carrying the given number of schedules;
/// returns how many schedules were in a request that did not succeed.
async fn post_all(
    client: &reqwest::Client,
    url: &str,
    token: Option<&str>,
    requests: Vec<(String, usize)>,
    in_flight: usize,
    bar: &ProgressBar,
) -> usize {
    futures::stream::iter(requests)
        .map(|(body, schedules)| {
            let request = client
                .post(url)
                .header("content-type", "application/json")
                .body(body);
            let request = match token {
                Some(token) => request.bearer_auth(token),
                None => request,
            };
            async move {
                let ok = matches!(request.send().await, Ok(r) if r.status().is_success());
                bar.inc(schedules as u64);
                if ok {
                    0
                } else {
                    schedules
                }
            }
        })
        .buffer_unordered(in_flight)
        .fold(0usize, |acc, f| async move { acc + f })
        .await
}

fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub async fn run(config: Config, options: Options) -> anyhow::Result<()> {
    if options.timers == 0 || options.runs == 0 {
        bail!("--timers and --runs must be at least 1");
    }
    let store = config.store.kind();
    let broker = config.broker.kind();
    let workloads: &[Workload] = match options.workload {
        Workload::All => &[Workload::Lateness, Workload::Herd, Workload::Ingest],
        Workload::Lateness => &[Workload::Lateness],
        Workload::Herd => &[Workload::Herd],
        Workload::Ingest => &[Workload::Ingest],
        Workload::Pending => &[Workload::Pending],
        Workload::Restart => &[Workload::Restart],
        Workload::List => &[Workload::List],
    };
    let mut figures = Vec::new();
    for workload in workloads {
        let name = match workload {
            Workload::Lateness => "lateness",
            Workload::Herd => "herd",
            Workload::Pending => "pending",
            Workload::Restart => "restart",
            Workload::List => "list",
            _ => "ingest",
        };
        let mut runs: Vec<Run> = Vec::new();
        for i in 0..options.runs {
            if !options.json {
                eprintln!(
                    "{name} on {store} + {broker}: run {} of {}",
                    i + 1,
                    options.runs
                );
            }
            runs.push(match workload {
                Workload::Lateness => {
                    lateness_run(&config, options.timers, options.over, options.instances).await?
                }
                Workload::Herd => herd_run(&config, options.timers, options.instances).await?,
                Workload::Pending => {
                    pending_run(&config, options.timers, options.over, options.pending).await?
                }
                Workload::Restart => restart_run(&config, options.pending).await?,
                Workload::List => {
                    list_run(&config, options.pending, options.timers, &options.tls).await?
                }
                _ => ingest_run(&config, options.timers, &options.tls).await?,
            });
        }
        for (k, (metric, unit, _)) in runs[0].iter().enumerate() {
            let values: Vec<f64> = runs.iter().map(|r| r[k].2).collect();
            figures.push(Figure {
                workload: name,
                store: store.to_owned(),
                broker: broker.to_owned(),
                // Ingest always goes through one instance.
                instances: if matches!(
                    workload,
                    Workload::Ingest | Workload::Pending | Workload::Restart | Workload::List
                ) {
                    1
                } else {
                    options.instances
                },
                metric,
                unit,
                median: median(&values),
                runs: values,
            });
        }
    }
    if options.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&figures).context("json")?
        );
    } else {
        print_table(&figures, &options);
    }
    Ok(())
}

fn print_table(figures: &[Figure], options: &Options) {
    println!(
        "timers per run: {}, lateness spread: {}, runs: {} (median shown), instances: {}",
        options.timers,
        humantime::format_duration(options.over),
        options.runs,
        options.instances
    );
    println!(
        "{:<9} {:<9} {:<7} {:<17} {:>12}  {:<12} runs",
        "workload", "store", "broker", "metric", "median", "unit"
    );
    for f in figures {
        let runs: Vec<String> = f.runs.iter().map(|v| shown(f.unit, *v)).collect();
        println!(
            "{:<9} {:<9} {:<7} {:<17} {:>12}  {:<12} {}",
            f.workload,
            f.store,
            f.broker,
            f.metric,
            shown(f.unit, f.median),
            f.unit,
            runs.join(", ")
        );
    }
}

/// A figure as the table shows it: times below 100 ms that are not whole ms with a tenth, the
/// rest whole.
fn shown(unit: &str, value: f64) -> String {
    if unit == "ms" && value.abs() < 100.0 && value.fract() != 0.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.0}")
    }
}
