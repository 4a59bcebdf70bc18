//! What the service published, as a test reads it: its event stream's log, and figures off the
//! envelopes (timer, due time, lateness) and the metrics text.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

use super::now_ms;
use crate::wait_for;

/// One event as received, with the wall-clock time it arrived (epoch ms).
#[derive(Debug, Clone)]
pub struct Received {
    pub at_ms: i64,
    pub envelope: Value,
}

#[derive(Clone, Default)]
pub struct EventLog {
    inner: Arc<Mutex<Vec<Received>>>,
}

impl EventLog {
    pub(super) fn push(&self, envelope: Value) {
        let at_ms = now_ms();
        if let Ok(mut v) = self.inner.lock() {
            v.push(Received { at_ms, envelope });
        }
    }

    pub fn snapshot(&self) -> Vec<Received> {
        self.inner.lock().map(|v| v.clone()).unwrap_or_default()
    }

    pub fn len(&self) -> usize {
        self.inner.lock().map(|v| v.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Waits until at least `n` events arrived; returns them, or None at the deadline.
    pub async fn wait(&self, n: usize, deadline: Duration) -> Option<Vec<Received>> {
        wait_for(deadline, || async {
            (self.len() >= n).then(|| self.snapshot())
        })
        .await
    }
}

/// The timer a `DueTimeReached` envelope is about: `tenantId/aggregateId`.
pub fn timer_of(envelope: &Value) -> String {
    format!(
        "{}/{}",
        envelope["tenantId"].as_str().unwrap_or("?"),
        envelope["aggregateId"].as_str().unwrap_or("?")
    )
}

/// The due time of an envelope (`payload.dueAt`), epoch ms; 0 when it has none.
pub fn due_ms(envelope: &Value) -> i64 {
    chrono::DateTime::parse_from_rfc3339(envelope["payload"]["dueAt"].as_str().unwrap_or(""))
        .map(|d| d.timestamp_millis())
        .unwrap_or(0)
}

/// How late the service fired it: `timestampMs` − `payload.dueAt`, ms.
pub fn lateness_ms(envelope: &Value) -> i64 {
    envelope["timestampMs"].as_i64().unwrap_or(0) - due_ms(envelope)
}

/// The value of one series in a Prometheus text answer (`name` or `name{label="value"}`); 0 when
/// it is not there (a counter never incremented is not shown).
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .filter_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .find_map(|value| value.trim().parse().ok())
        .unwrap_or(0.0)
}

/// How many times each `tenantId/aggregateId` appears.
pub fn count_by_key(events: &[Received]) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for e in events {
        *counts.entry(timer_of(&e.envelope)).or_insert(0) += 1;
    }
    counts
}

/// p50/p99/max of how late events reached their reader: receive time − `payload.dueAt`, ms
/// (what a consumer sees, publish and delivery included).
pub fn lateness_at_reader(received: &[Received]) -> (i64, i64, i64) {
    percentiles(
        received
            .iter()
            .map(|r| r.at_ms - due_ms(&r.envelope))
            .collect(),
    )
}

/// The bound on the lateness p99 at a reader that every end-to-end test firing timers on time
/// asserts ([`on_time`]). Generous for a debug build on a busy 2-core machine (the figures
/// measured there are a few to some tens of ms), and far below what polling instead of waking
/// gives (`engine.poll_interval`: 5 s by default, 1 s in the matrix).
pub const ON_TIME_P99_MS: i64 = 500;

/// How late `received` reached their reader (receive time − `payload.dueAt`, publish and
/// delivery included), printed for `what`; panics when p99 is above [`ON_TIME_P99_MS`] or one
/// came early. Returns p50, p99 and max.
pub fn on_time(what: &str, received: &[Received]) -> (i64, i64, i64) {
    within(what, received, ON_TIME_P99_MS)
}

fn within(what: &str, received: &[Received], bound_ms: i64) -> (i64, i64, i64) {
    let late: Vec<i64> = received
        .iter()
        .map(|r| r.at_ms - due_ms(&r.envelope))
        .collect();
    let early = late.iter().filter(|l| **l < 0).count();
    let (p50, p99, max) = percentiles(late);
    println!(
        "{what}: {} events, lateness at the reader p50 {p50} ms, p99 {p99} ms, max {max} ms",
        received.len()
    );
    assert_eq!(
        early, 0,
        "{what}: {early} event(s) reached the reader before their due time"
    );
    assert!(
        p99 <= bound_ms,
        "{what}: lateness at the reader p99 {p99} ms (p50 {p50}, max {max}) is above \
         {bound_ms} ms: fires wait for a poll instead of their due time?"
    );
    (p50, p99, max)
}

/// p50/p99/max of a list of millisecond figures.
pub fn percentiles(mut values: Vec<i64>) -> (i64, i64, i64) {
    if values.is_empty() {
        return (0, 0, 0);
    }
    values.sort_unstable();
    let at = |p: f64| values[((values.len() - 1) as f64 * p).round() as usize];
    (at(0.50), at(0.99), at(1.0))
}
