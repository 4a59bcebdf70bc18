//! The `delay` workload: delayed messages through the broker's own delay ingress, their
//! lateness at three destinations (see the module doc of `bench`).

use std::collections::HashMap;
use std::time::Duration;

use anyhow::bail;
use timer_core::plugin::{DelayedMessage, DelayedUntil};

use super::rig::{arrival_figures, now_ms, progress, start_loaded, Preload};
use super::Run;
use crate::config::Config;

/// How long after it was sent a delayed message of the delay workload is due.
const DELAY_LEAD_MS: i64 = 2_000;

pub(super) async fn delay_run(
    config: &Config,
    n: usize,
    over: Duration,
    pending: usize,
) -> anyhow::Result<Run> {
    let preload = Preload {
        far: pending,
        message_bytes: 1024,
        any_target: true,
        ..Preload::default()
    };
    let (rig, rss) = start_loaded(config, preload).await?;
    let mut targets = Vec::new();
    for name in ["bench-d0", "bench-d1", "bench-d2"] {
        match rig.client.make_target(name).await? {
            Some(target) => targets.push(target),
            None => bail!("the {} broker takes no targets", config.broker.kind()),
        }
    }
    // Batches every 100 ms, evenly over `over`; the messages are due evenly too (one every
    // `span / n` ms, `DELAY_LEAD_MS` after the batch that carries them is sent), so the rate
    // is the same at the ingress and at the destinations, with no herd every 100 ms.
    let batches = usize::try_from(over.as_millis() / 100).unwrap_or(1).max(1);
    let span = i64::try_from(over.as_millis()).unwrap_or(i64::MAX).max(1);
    let start = now_ms();
    let mut due = vec![0i64; n];
    let bar = progress(n, "sending");
    for b in 0..batches {
        let at = start + b as i64 * 100;
        if let Ok(wait) = u64::try_from(at - now_ms()) {
            tokio::time::sleep(Duration::from_millis(wait)).await;
        }
        let messages: Vec<DelayedMessage> = (b * n / batches..(b + 1) * n / batches)
            .map(|i| {
                due[i] = start + DELAY_LEAD_MS + i as i64 * span / n as i64;
                DelayedMessage {
                    target: targets[i % targets.len()].clone(),
                    id: Some(format!("d{i:08}")),
                    tenant: None,
                    when: DelayedUntil::AtMs(due[i]),
                    body: vec![b'x'; 1024],
                    headers: [("x-seq".to_owned(), i.to_string())].into(),
                }
            })
            .collect();
        if !rig.client.send_delayed(&messages).await? {
            bail!(
                "the {} broker has no delay ingress (nats, rabbitmq and kafka have one)",
                config.broker.kind()
            );
        }
        bar.inc(messages.len() as u64);
    }
    let rate = n as f64 / ((now_ms() - start).max(1) as f64 / 1_000.0);
    bar.finish_and_clear();
    // Read the destinations only once the last message is due: reading them (NATS reads each
    // stream whole) while the service fires took the cores the fires are measured on.
    let last_due = due.iter().copied().max().unwrap_or(start);
    if let Ok(wait) = u64::try_from(last_due + 100 - now_ms()) {
        tokio::time::sleep(Duration::from_millis(wait)).await;
    }
    // Then until every message is there (or two minutes after that).
    let end = tokio::time::Instant::now() + Duration::from_millis((DELAY_LEAD_MS + 120_000) as u64);
    let bar = progress(n, "arriving");
    let mut first = HashMap::new();
    let copies = loop {
        let mut all = Vec::new();
        for target in &targets {
            all.extend(rig.client.read_target(target).await?);
        }
        let copies = all.len();
        for m in all {
            let seq = m.headers.get("x-seq").and_then(|s| s.parse::<usize>().ok());
            if let (Some(seq), Some(arrived)) = (seq, m.arrived_ms) {
                // A message that arrived twice counts from its first arrival.
                let earliest = first.entry(seq).or_insert(arrived);
                *earliest = (*earliest).min(arrived);
            }
        }
        bar.set_position(first.len() as u64);
        if first.len() >= n || tokio::time::Instant::now() > end {
            break copies;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    bar.finish_and_clear();
    // The service's part: when it fired each message (handed it to the broker) after its due
    // time; the rest of the lateness is the broker's, up to where the arrival is stamped.
    let fired = rig.engine.last_minute();
    rig.stop().await;
    let lateness: Vec<i64> = first
        .iter()
        .filter_map(|(seq, arrived)| Some(arrived - due.get(*seq)?))
        .collect();
    let mut figures = arrival_figures(lateness, "messages", n, copies);
    figures.extend([
        ("sent", "messages/s", rate),
        ("pending messages", "timers", pending as f64),
    ]);
    let ms = |p: Option<u64>| p.map_or(f64::NAN, |p| p as f64);
    figures.extend([
        ("fired p50", "ms", ms(fired.p50_ms)),
        ("fired p99", "ms", ms(fired.p99_ms)),
    ]);
    figures.extend(rss.figures());
    Ok(figures)
}
