//! The rig of a run: engines on a fresh store and broker, the timers a workload schedules, and
//! the watcher that times their events.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use timer_brokers::memory::{HubConfig, MemoryConfig, MemoryHub};
use timer_core::plugin::{BrokerConfig, Isolated, StoreConfig, TestClient};
use timer_core::{Engine, NewTimer, Store, SystemClock, TimerKey, Timestamp, TraceContext};
use tokio_util::sync::CancellationToken;

use crate::config::Config;

/// Engines on one fresh store for one run, and the store and broker resources of the run,
/// removed after it. With several instances each engine has its own store handle (its own pool)
/// on the same data, as separate processes would; timers are scheduled through the first.
pub(super) struct Rig {
    pub(super) engine: Engine,
    pub(super) engines: Vec<Engine>,
    pub(super) hub: Option<MemoryHub>,
    pub(super) shutdown: CancellationToken,
    pub(super) tasks: Vec<tokio::task::JoinHandle<()>>,
    pub(super) store: Isolated<dyn StoreConfig>,
    pub(super) broker: Isolated<dyn BrokerConfig>,
    /// Holds the broker's resources ready for the run (RabbitMQ's events need a bound queue).
    pub(super) client: Arc<dyn TestClient>,
    /// Events of the first engine from before it started.
    pub(super) first_events: timer_core::engine::Subscription,
    /// When the engines were started.
    pub(super) started: Instant,
    /// Schedules/s of the preload, when there was one.
    pub(super) preload_rate: f64,
}

/// What to put in the store before the engines start.
#[derive(Clone, Copy, Default)]
pub(super) struct Preload {
    /// Timers due tomorrow and later.
    pub(super) far: usize,
    /// Timers already due.
    pub(super) due_now: usize,
    /// All in the tenant [`LIST_TENANT`] (else spread over 16 tenants).
    pub(super) one_tenant: bool,
    /// The far timers carry a message of this many bytes for a target (0: none).
    pub(super) message_bytes: usize,
    /// The engines may send to any target (`targets.allow = ["*"]`), whatever the config says.
    pub(super) any_target: bool,
    /// The engines may call HTTP targets on 127.0.0.1 at this port (`targets.allow` has that
    /// origin, `webhooks.allow_private_networks = true`), whatever the config says.
    pub(super) calls_to_loopback: Option<u16>,
}

/// The tenant the list workload fills.
pub(super) const LIST_TENANT: &str = "bench-list";

impl Rig {
    pub(super) async fn stop(self) {
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
pub(super) async fn fresh_stores(
    config: &dyn StoreConfig,
    instances: usize,
) -> anyhow::Result<(Vec<Arc<dyn Store>>, Isolated<dyn StoreConfig>)> {
    if instances > 1 && !config.shared() {
        bail!(
            "--instances needs a store several instances share (postgres), not {}",
            config.kind()
        );
    }
    let isolated = config.isolated("bench")?;
    let mut stores = Vec::new();
    for _ in 0..instances {
        stores.push(isolated.config.open().await?);
    }
    Ok((stores, isolated))
}

/// Broker resources of its own on the configured server (streams, queues, topics), and a client
/// that keeps them ready. The memory broker keeps no events for reading back.
pub(super) async fn fresh_broker(
    config: &dyn BrokerConfig,
) -> anyhow::Result<(Isolated<dyn BrokerConfig>, Arc<dyn TestClient>)> {
    let mut isolated = config.isolated("bench")?;
    if let Some(memory) = isolated.config.as_any().downcast_ref::<HubConfig>() {
        isolated = Isolated::new(Box::new(HubConfig::new(MemoryConfig {
            retain: 1,
            ..memory.config.clone()
        })));
    }
    let client = isolated.config.test_client().await?;
    Ok((isolated, client))
}

pub(super) async fn start_rig(config: &Config, instances: usize) -> anyhow::Result<Rig> {
    start_rig_with(config, instances, Preload::default()).await
}

/// Fills `store` in batches of 10,000 (never holding them all); returns schedules/s.
pub(super) async fn preload(store: &Arc<dyn Store>, preload: Preload) -> anyhow::Result<f64> {
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
                if preload.message_bytes > 0 {
                    let mut fields = serde_json::Map::new();
                    fields.insert("queue".into(), "bench-far".into());
                    timer.target = Some(timer_core::Target::new(fields));
                    timer.message = Some(timer_core::Message {
                        body: vec![b'x'; preload.message_bytes],
                        meta: timer_core::MessageMeta::default(),
                    });
                }
                if preload.one_tenant {
                    timer.key.tenant_id = LIST_TENANT.to_owned();
                }
                timer
            })
            .collect();
        store
            .schedule(&batch, Timestamp::from_millis(now_ms()))
            .await?;
        bar.inc(batch.len() as u64);
        i = end;
    }
    bar.finish_and_clear();
    Ok(total as f64 / started.elapsed().as_secs_f64())
}

pub(super) async fn start_rig_with(
    config: &Config,
    instances: usize,
    load: Preload,
) -> anyhow::Result<Rig> {
    let (stores, store) = fresh_stores(config.store.as_ref(), instances.max(1)).await?;
    let preload_rate = preload(&stores[0], load).await?;
    let (broker, client) = fresh_broker(config.broker.as_ref()).await?;
    let shutdown = CancellationToken::new();
    let mut limits = config.limits.clone();
    if load.any_target {
        limits.targets = timer_core::config::TargetRules {
            allow: vec!["*".into()],
            tenants: Default::default(),
        };
    }
    if let Some(port) = load.calls_to_loopback {
        limits
            .targets
            .allow
            .push(format!("http://127.0.0.1:{port}"));
    }
    let mut engines = Vec::new();
    for store in stores {
        let connected = broker.config.connect().await?;
        let engine = Engine::new(
            store,
            connected,
            Arc::new(SystemClock),
            config.engine.clone(),
            limits.clone(),
        )
        .with_release(crate::server::this_release())?;
        let engine = if load.calls_to_loopback.is_some() {
            crate::plugins::with_loopback_caller(engine, config)?
        } else {
            crate::plugins::with_caller(engine, config)?
        };
        // The provider `bench::run` installed for `[telemetry]`.
        let engine = match &config.telemetry.otlp_endpoint {
            Some(_) => engine.with_tracer(opentelemetry::global::tracer("timer-service"))?,
            None => engine,
        };
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

pub(super) fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

pub(super) fn progress(len: usize, what: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(len as u64), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template("{msg:>12} [{bar:30}] {pos}/{len} {per_sec}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(what.to_owned());
    bar
}

pub(super) fn timer(i: usize, due_ms: i64) -> NewTimer {
    let key = TimerKey::new(format!("bench-{}", i % 16), format!("t{i:08}"));
    NewTimer {
        // As every admitted timer has one.
        trace: Some(TraceContext::fresh()),
        ..NewTimer::new(key, Timestamp::from_millis(due_ms))
    }
}

/// Schedules in batches of 1,000 through the engine (as the ingest task does).
pub(super) async fn schedule_all(engine: &Engine, timers: Vec<NewTimer>) -> anyhow::Result<()> {
    let bar = progress(timers.len(), "scheduling");
    for chunk in timers.chunks(1_000) {
        engine.schedule(chunk).await?;
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    Ok(())
}

/// How many bytes of events a bench watcher may have waiting: a herd of a million (about 400
/// bytes each) while the watcher catches up.
pub(super) const WATCH_BUDGET: usize = 1 << 30;

/// What a watcher of the engine's confirmed events saw.
pub(super) struct Watched {
    /// (receive time − due time) in ms per event.
    pub(super) lateness: Vec<i64>,
    /// (tenant, due time, receive time) in ms per event, when asked for.
    pub(super) fires: Vec<(String, i64, i64)>,
    pub(super) last_receive_ms: i64,
    pub(super) distinct: usize,
    pub(super) duplicates: usize,
    pub(super) lagged: u64,
}

/// Watches the events of every engine until `n` distinct timers fired or `deadline` passes;
/// with `by_tenant`, keeps each event's tenant, due and receive time too.
pub(super) async fn watch(
    engines: &[Engine],
    n: usize,
    deadline: Duration,
    by_tenant: bool,
) -> Watched {
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
        fires: Vec::new(),
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
        let tenant = v["tenantId"].as_str().unwrap_or_default();
        if by_tenant {
            out.fires.push((tenant.to_owned(), due, received));
        }
        let key = format!("{tenant}/{}", v["aggregateId"].as_str().unwrap_or_default());
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

/// The figures of a workload that times arrivals: lateness p50, p90, p99 and max of
/// `lateness` (arrival − due, one per `what` that arrived), how many were early, how many of
/// `n` never arrived, and how many arrivals were repeats (`arrivals` in all).
pub(super) fn arrival_figures(
    mut lateness: Vec<i64>,
    what: &'static str,
    n: usize,
    arrivals: usize,
) -> super::Run {
    lateness.sort_unstable();
    let arrived = lateness.len();
    vec![
        ("p50", "ms", percentile(&lateness, 0.50)),
        ("p90", "ms", percentile(&lateness, 0.90)),
        ("p99", "ms", percentile(&lateness, 0.99)),
        ("max", "ms", percentile(&lateness, 1.0)),
        (
            "early",
            what,
            lateness.iter().filter(|l| **l < 0).count() as f64,
        ),
        ("missing", what, n.saturating_sub(arrived) as f64),
        ("duplicates", what, arrivals.saturating_sub(arrived) as f64),
    ]
}

pub(super) fn percentile(sorted: &[i64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize] as f64
}

pub(super) async fn wait_pending(
    store: &Arc<dyn Store>,
    n: u64,
    bar: &ProgressBar,
) -> anyhow::Result<()> {
    let end = Instant::now() + Duration::from_secs(600);
    loop {
        let pending = store.scheduled_count().await?;
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

/// The resident memory of this process (service and load generator together), in MiB.
pub(super) fn rss_mib() -> f64 {
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

/// The process's RSS around loading a store: before its rig started, and once the store held
/// what the rig preloaded.
pub(super) struct Rss {
    before: f64,
    loaded: f64,
}

impl Rss {
    /// The run's RSS figures: before, loaded, and now (after the workload).
    pub(super) fn figures(&self) -> [(&'static str, &'static str, f64); 3] {
        [
            ("RSS before", "MiB", self.before),
            ("RSS loaded", "MiB", self.loaded),
            ("RSS after", "MiB", rss_mib()),
        ]
    }
}

/// A rig of one engine whose store holds `preload`, and the RSS around loading it.
pub(super) async fn start_loaded(config: &Config, preload: Preload) -> anyhow::Result<(Rig, Rss)> {
    let before = rss_mib();
    let rig = start_rig_with(config, 1, preload).await?;
    let loaded = rss_mib();
    Ok((rig, Rss { before, loaded }))
}
