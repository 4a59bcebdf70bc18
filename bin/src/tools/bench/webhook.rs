//! The `webhook` workload: timers with an HTTP target, called on a receiver in this process on
//! 127.0.0.1; lateness = when the receiver got the call − the due time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use serde_json::{Map, Value};

use super::rig::{arrival_figures, now_ms, progress, schedule_all, start_rig_with, timer, Preload};
use super::Run;
use crate::config::Config;

/// When each call arrived (ms), by timer number, in arrival order.
type Arrivals = Arc<Mutex<Vec<(usize, i64)>>>;

async fn arrived(State(arrivals): State<Arrivals>, Path(i): Path<usize>) -> StatusCode {
    let at = now_ms();
    if let Ok(mut a) = arrivals.lock() {
        a.push((i, at));
    }
    StatusCode::NO_CONTENT
}

pub(super) async fn webhook_run(config: &Config, n: usize, over: Duration) -> anyhow::Result<Run> {
    let arrivals: Arrivals = Arc::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("the bench's receiver cannot listen on 127.0.0.1")?;
    let port = listener.local_addr()?.port();
    let app = axum::Router::new()
        .route("/bench/{i}", axum::routing::post(arrived))
        .with_state(arrivals.clone());
    let receiver = tokio::spawn(async move { axum::serve(listener, app).await });
    let rig = start_rig_with(
        config,
        1,
        Preload {
            calls_to_loopback: Some(port),
            ..Preload::default()
        },
    )
    .await?;
    let span = i64::try_from(over.as_millis()).unwrap_or(i64::MAX).max(1);
    // Time to schedule first (at a pessimistic 5,000/s), so no timer is scheduled after its due.
    let lead = 1_000 + (n as i64 / 5);
    let start = now_ms() + lead;
    let due: Vec<i64> = (0..n)
        .map(|i| start + (i as i64 * span) / n as i64)
        .collect();
    let timers = due
        .iter()
        .enumerate()
        .map(|(i, at)| {
            let mut t = timer(i, *at);
            let mut fields = Map::new();
            fields.insert(
                "url".into(),
                Value::String(format!("http://127.0.0.1:{port}/bench/{i}")),
            );
            t.target = Some(timer_core::Target::new(fields));
            t
        })
        .collect();
    schedule_all(&rig.engine, timers).await?;
    let end = tokio::time::Instant::now()
        + Duration::from_millis((lead + span) as u64)
        + Duration::from_secs(60);
    let bar = progress(n, "calling");
    let mut first: HashMap<usize, i64> = HashMap::with_capacity(n);
    let mut read = 0;
    loop {
        let batch: Vec<(usize, i64)> = arrivals
            .lock()
            .map(|a| a[read..].to_vec())
            .unwrap_or_default();
        read += batch.len();
        for (i, at) in batch {
            first.entry(i).or_insert(at);
        }
        bar.set_position(first.len() as u64);
        if first.len() >= n || tokio::time::Instant::now() > end {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bar.finish_and_clear();
    rig.stop().await;
    receiver.abort();
    let lateness: Vec<i64> = first
        .iter()
        .filter_map(|(i, at)| Some(at - due.get(*i)?))
        .collect();
    Ok(arrival_figures(lateness, "calls", n, read))
}
