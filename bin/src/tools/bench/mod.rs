//! `timer-service bench`: workloads against the configured store (a fresh temp SQLite file, a
//! fresh PostgreSQL schema, or memory) and broker, run in this process on the real engine and
//! the system clock. Prints a table of medians over `--runs`, or JSON with `--json`.
//!
//! Workloads:
//! - `lateness`: N timers due uniformly over the next S seconds; lateness = the moment a
//!   watcher of the engine's confirmed events receives the event − the due time.
//! - `herd`: N timers due in the same millisecond; time from due to the last event, fires/s.
//! - `fairness`: N timers of one tenant due in the same millisecond (the herd), and 8 other
//!   tenants with a timer each every 25 ms from just before the herd is due until `--over`
//!   after it (the trickle). The trickle's lateness while the herd drains (due before the
//!   herd's last fire), and the herd's drain time and fires/s.
//! - `ingest`: schedules/s through the broker path (commands → ingest task → store) and through
//!   the HTTP API (one timer per request, 64 in flight).
//! - `delay`: `--pending` far-future timers carrying a 1 KiB message each (RSS before and after
//!   loading them), then `--timers` delayed messages of 1 KiB sent evenly over `--over` through
//!   the broker's own delay ingress (RabbitMQ's delay exchange, NATS's delay subjects, Kafka's
//!   delay topic), due as evenly from 2 s after they were sent, to three destinations; lateness = when the
//!   message arrived at its destination − its due time, as the broker stamps the arrival (NATS:
//!   the stream's timestamp; Kafka: the record's, set when the service produced it; RabbitMQ:
//!   when the bench's consumer received it).
//! - `webhook`: N timers with an HTTP target due uniformly over the next S seconds, called on
//!   a receiver of the bench on 127.0.0.1; lateness = when the receiver got the call − the due
//!   time.
//! - `list`: `--pending` timers in one tenant, then `GET /v1/tenants/{tenant}/timers` pages
//!   (the first, one 90% deep by cursor, one with a prefix filter), each asked `--timers` times
//!   one after the other; their answer times.

use std::time::Duration;

use anyhow::{bail, Context};
use serde::Serialize;
use timer_core::{NewTimer, TimerKey};

use crate::cli::bench::{Options, Workload};
use crate::config::Config;

mod delay;
mod http;
mod rig;
mod webhook;

use delay::delay_run;
use http::*;
use rig::*;
use webhook::webhook_run;

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

/// Measured figures of one run, by metric.
pub(super) type Run = Vec<(&'static str, &'static str, f64)>;

async fn lateness_run(
    config: &Config,
    n: usize,
    over: Duration,
    instances: usize,
) -> anyhow::Result<Run> {
    let rig = start_rig(config, instances).await?;
    lateness_on(rig, n, over).await
}

async fn pending_run(
    config: &Config,
    n: usize,
    over: Duration,
    pending: usize,
) -> anyhow::Result<Run> {
    let preload = Preload {
        far: pending,
        ..Preload::default()
    };
    let (rig, rss) = start_loaded(config, preload).await?;
    let rate = rig.preload_rate;
    let mut run = lateness_on(rig, n, over).await?;
    run.retain(|(metric, _, _)| {
        matches!(*metric, "p50" | "p99" | "max" | "missing" | "duplicates")
    });
    run.push(("pending timers", "timers", pending as f64));
    run.push(("preload", "schedules/s", rate));
    run.extend(rss.figures());
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
                false,
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
                false,
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

/// The tenant of the fairness workload's herd, and how many others trickle beside it.
const HERD_TENANT: &str = "bench-herd";
const TRICKLE_TENANTS: usize = 8;
const TRICKLE_EVERY_MS: i64 = 25;

async fn fairness_run(
    config: &Config,
    n: usize,
    over: Duration,
    instances: usize,
) -> anyhow::Result<Run> {
    let rig = start_rig(config, instances).await?;
    let lead = 1_000 + (n as i64 / 5);
    let due = now_ms() + lead;
    let mut timers: Vec<NewTimer> = (0..n)
        .map(|i| NewTimer {
            key: TimerKey::new(HERD_TENANT, format!("h{i:08}")),
            ..timer(i, due)
        })
        .collect();
    let span = i64::try_from(over.as_millis()).unwrap_or(i64::MAX);
    let mut at = due - 100;
    let mut i = 0;
    while at <= due + span {
        for k in 0..TRICKLE_TENANTS {
            timers.push(NewTimer {
                key: TimerKey::new(format!("bench-small-{k}"), format!("s{i:08}")),
                ..timer(i, at)
            });
        }
        at += TRICKLE_EVERY_MS;
        i += 1;
    }
    let total = timers.len();
    let watcher = {
        let engines = rig.engines.clone();
        let deadline = Duration::from_millis((lead + span) as u64) + Duration::from_secs(120);
        tokio::spawn(async move { watch(&engines, total, deadline, true).await })
    };
    // The herd last: each batch commits its own, so the trickle is stored before anything is due.
    timers.reverse();
    schedule_all(&rig.engine, timers).await?;
    let w = watcher.await.context("watcher")?;
    rig.stop().await;
    let herd_last = w
        .fires
        .iter()
        .filter(|(tenant, _, _)| tenant == HERD_TENANT)
        .map(|(_, _, received)| *received)
        .max()
        .unwrap_or(due);
    let mut others: Vec<i64> = w
        .fires
        .iter()
        .filter(|(tenant, at, _)| tenant != HERD_TENANT && *at < herd_last)
        .map(|(_, at, received)| received - at)
        .collect();
    others.sort_unstable();
    let drain = (herd_last - due).max(1) as f64;
    let herd_fired = w.fires.iter().filter(|(t, _, _)| t == HERD_TENANT).count();
    Ok(vec![
        ("others p50", "ms", percentile(&others, 0.50)),
        ("others p99", "ms", percentile(&others, 0.99)),
        ("others max", "ms", percentile(&others, 1.0)),
        ("others measured", "timers", others.len() as f64),
        ("herd drain", "ms", drain),
        ("herd fires/s", "1/s", herd_fired as f64 * 1000.0 / drain),
        ("missing", "timers", (total - w.distinct) as f64),
        ("duplicates", "events", w.duplicates as f64),
    ])
}

pub(super) fn median(values: &[f64]) -> f64 {
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
    // With `[telemetry]` set, every engine of the bench makes and exports spans, as `run` does.
    let telemetry = crate::telemetry::Telemetry::start(&config.telemetry, "bench")?;
    let workloads: &[Workload] = match options.workload {
        Workload::All => &[Workload::Lateness, Workload::Herd, Workload::Ingest],
        Workload::Lateness => &[Workload::Lateness],
        Workload::Herd => &[Workload::Herd],
        Workload::Fairness => &[Workload::Fairness],
        Workload::Ingest => &[Workload::Ingest],
        Workload::Pending => &[Workload::Pending],
        Workload::Restart => &[Workload::Restart],
        Workload::List => &[Workload::List],
        Workload::Delay => &[Workload::Delay],
        Workload::Webhook => &[Workload::Webhook],
    };
    let mut figures = Vec::new();
    for workload in workloads {
        let name = match workload {
            Workload::Lateness => "lateness",
            Workload::Herd => "herd",
            Workload::Fairness => "fairness",
            Workload::Pending => "pending",
            Workload::Restart => "restart",
            Workload::List => "list",
            Workload::Delay => "delay",
            Workload::Webhook => "webhook",
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
                Workload::Fairness => {
                    fairness_run(&config, options.timers, options.over, options.instances).await?
                }
                Workload::Pending => {
                    pending_run(&config, options.timers, options.over, options.pending).await?
                }
                Workload::Restart => restart_run(&config, options.pending).await?,
                Workload::Delay => {
                    delay_run(&config, options.timers, options.over, options.pending).await?
                }
                Workload::Webhook => webhook_run(&config, options.timers, options.over).await?,
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
                    Workload::Ingest
                        | Workload::Pending
                        | Workload::Restart
                        | Workload::List
                        | Workload::Delay
                        | Workload::Webhook
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
    if let Some(telemetry) = telemetry {
        let (exported, dropped) = telemetry.stop().await;
        eprintln!("spans: {exported} exported, {dropped} dropped (telemetry.max_queued_spans full, or an export failed)");
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
