//! The broker × store matrix (issue #10): one binary built with every feature, and the same
//! end-to-end run for every pair of store (memory, sqlite, postgres) and broker (memory, nats,
//! rabbitmq, kafka), chosen by configuration (environment variables) only.
//!
//! Each run: 200 timers over HTTP due within the next 2 s plus one cancelled before it is due;
//! every timer's `DueTimeReached` confirmed by the broker and seen once on the event stream, the
//! cancelled one never; then a clean stop. A pair whose server is not there is skipped with the
//! reason (a failure under `TIMER_TEST_REQUIRE=1`; `bash scripts/test.sh` starts them all).

use std::path::Path;
use std::time::Duration;

use futures::StreamExt;
use libtest_mimic::Arguments;
use serde_json::json;
use timer_conformance::e2e::{count_by_key, percentiles, Service};
use timer_conformance::fixtures::{
    KAFKA_BROKERS_VAR, NATS_URL_VAR, POSTGRES_URL_VAR, RABBITMQ_URL_VAR,
};
use timer_conformance::{server_trial, wait_for};

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");
const STORES: &[&str] = &["memory", "sqlite", "postgres"];
const BROKERS: &[&str] = &["memory", "nats", "rabbitmq", "kafka"];

fn main() {
    let mut args = Arguments::from_args();
    // Each run starts a service and loads its servers; two at a time keep a 2-core box sane.
    args.test_threads.get_or_insert(2);
    let mut trials = Vec::new();
    for store in STORES {
        for broker in BROKERS {
            let missing = [needs(store), needs(broker)]
                .into_iter()
                .flatten()
                .find(|var| std::env::var(var).is_err())
                .map(|var| format!("{var} is not set (bash scripts/test.sh starts every server)"));
            let (store, broker) = (*store, *broker);
            trials.push(server_trial(
                &format!("matrix::{store}_store_with_{broker}_broker"),
                missing,
                move || run_pair(store, broker),
            ));
        }
    }
    libtest_mimic::run(&args, trials).exit();
}

/// The environment variable naming the test server a plugin needs, if any.
fn needs(kind: &str) -> Option<&'static str> {
    match kind {
        "postgres" => Some(POSTGRES_URL_VAR),
        "nats" => Some(NATS_URL_VAR),
        "rabbitmq" => Some(RABBITMQ_URL_VAR),
        "kafka" => Some(KAFKA_BROKERS_VAR),
        _ => None,
    }
}

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_default()
}

/// The whole configuration of one pair, as `TIMER_*` variables; names are fresh per run.
fn environment(dir: &Path, store: &str, broker: &str, id: &str) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("TIMER_STORE__KIND", store.to_owned()),
        ("TIMER_BROKER__KIND", broker.to_owned()),
        ("TIMER_ENGINE__POLL_INTERVAL", "1s".to_owned()),
    ];
    match store {
        "sqlite" => env.push((
            "TIMER_STORE__URL",
            format!("sqlite://{}", dir.join("timers.db").display()),
        )),
        "postgres" => {
            env.push(("TIMER_STORE__URL", var(POSTGRES_URL_VAR)));
            env.push(("TIMER_STORE__SCHEMA", format!("matrix_{id}")));
        }
        _ => {}
    }
    match broker {
        "nats" => env.extend([
            ("TIMER_BROKER__URL", var(NATS_URL_VAR)),
            ("TIMER_BROKER__COMMANDS_STREAM", format!("MC_{id}")),
            (
                "TIMER_BROKER__COMMANDS_SUBJECT",
                format!("m{id}.commands.>"),
            ),
            ("TIMER_BROKER__CONSUMER", format!("m{id}")),
            ("TIMER_BROKER__EVENTS_STREAM", format!("ME_{id}")),
            ("TIMER_BROKER__EVENTS_SUBJECT", format!("m{id}.events")),
            ("TIMER_BROKER__DEAD_LETTER_STREAM", format!("MD_{id}")),
            ("TIMER_BROKER__DEAD_LETTER_SUBJECT", format!("m{id}.dead")),
        ]),
        "rabbitmq" => env.extend([
            ("TIMER_BROKER__URL", var(RABBITMQ_URL_VAR)),
            ("TIMER_BROKER__COMMANDS_QUEUE", format!("m{id}.commands")),
            ("TIMER_BROKER__EVENTS_EXCHANGE", format!("m{id}.events")),
            ("TIMER_BROKER__DEAD_LETTER_EXCHANGE", format!("m{id}.dead")),
            ("TIMER_BROKER__DEAD_LETTER_QUEUE", format!("m{id}.dead")),
        ]),
        "kafka" => env.extend([
            ("TIMER_BROKER__BROKERS", var(KAFKA_BROKERS_VAR)),
            ("TIMER_BROKER__GROUP_ID", format!("m{id}")),
            ("TIMER_BROKER__COMMANDS_TOPIC", format!("m{id}.commands")),
            ("TIMER_BROKER__EVENTS_TOPIC", format!("m{id}.events")),
            ("TIMER_BROKER__DEAD_LETTER_TOPIC", format!("m{id}.dead")),
        ]),
        _ => {}
    }
    env
}

/// The RabbitMQ names `environment` gives the service for run `id`.
fn rabbitmq_config(id: &str) -> timer_brokers::rabbitmq::RabbitmqConfig {
    timer_brokers::rabbitmq::RabbitmqConfig {
        url: var(RABBITMQ_URL_VAR),
        commands_queue: format!("m{id}.commands"),
        events_exchange: format!("m{id}.events"),
        dead_letter_exchange: format!("m{id}.dead"),
        dead_letter_queue: format!("m{id}.dead"),
        ..Default::default()
    }
}

/// RabbitMQ returns events no queue is bound to (and the service retries them): bind a queue
/// first, as a consumer of the events would.
async fn prepare(broker: &str, id: &str) {
    if broker == "rabbitmq" {
        timer_brokers::rabbitmq::declare_sink(&rabbitmq_config(id))
            .await
            .expect("bind a queue to the events exchange");
    }
}

async fn clean_up(broker: &str, id: &str) {
    match broker {
        "rabbitmq" => {
            let _ = timer_brokers::rabbitmq::delete_topology(&rabbitmq_config(id)).await;
        }
        "nats" => {
            let config = timer_brokers::nats::NatsConfig {
                url: var(NATS_URL_VAR),
                commands_stream: format!("MC_{id}"),
                events_stream: format!("ME_{id}"),
                dead_letter_stream: format!("MD_{id}"),
                ..Default::default()
            };
            let _ = timer_brokers::nats::delete_streams(&config).await;
        }
        // Kafka topics stay: tansu breaks when a topic is deleted (see README).
        _ => {}
    }
}

async fn run_pair(store: &str, broker: &str) {
    const N: usize = 200;
    let id = &uuid::Uuid::new_v4().simple().to_string()[..12];
    let dir = tempfile::tempdir().expect("tempdir");
    prepare(broker, id).await;
    let service = Service::start(
        Path::new(BIN),
        dir.path(),
        &environment(dir.path(), store, broker, id),
    )
    .await;
    let (_, ready) = service.get("/readyz").await;
    assert_eq!(ready["store"]["kind"], store, "{ready}");
    assert_eq!(ready["broker"]["kind"], broker, "{ready}");
    let events = service.events().await;
    let now = chrono::Utc::now().timestamp_millis();
    // One timer cancelled before it is due: it must never fire.
    let cancelled_due = now + 4_000;
    let doomed = json!({"tenantId": "m", "serviceCallId": "cancelled", "dueTimeMs": cancelled_due});
    assert_eq!(service.post("/v1/timers", doomed.to_string()).await.0, 201);
    let (status, v) = service.delete("/v1/tenants/m/timers/cancelled").await;
    assert_eq!(
        (status, v["outcome"].as_str()),
        (200, Some("cancelled")),
        "{v}"
    );
    let statuses: Vec<u16> = futures::stream::iter(0..N)
        .map(|i| {
            let body = json!({"tenantId": format!("m{}", i % 5), "serviceCallId": format!("c{i}"),
                              "dueTimeMs": now + 500 + (i as i64 * 1_500) / N as i64});
            let service = &service;
            async move { service.post("/v1/timers", body.to_string()).await.0 }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    assert!(statuses.iter().all(|s| *s == 201), "{statuses:?}");
    if events.wait(N, Duration::from_secs(60)).await.is_none() {
        panic!(
            "{store} + {broker}: {} of {N} fired; log:\n{}",
            events.len(),
            service.log_text()
        );
    }
    // Watch until past the cancelled timer's due time (and a poll interval): a fire of it, or
    // of anything twice, would show up as one event more.
    let quiet_ms = (cancelled_due + 1_500 - chrono::Utc::now().timestamp_millis()).max(0);
    let extra = wait_for(Duration::from_millis(quiet_ms as u64), || async {
        (events.len() > N).then_some(())
    })
    .await;
    assert!(extra.is_none(), "one event more than timers scheduled");
    let fired = events.snapshot();
    let counts = count_by_key(&fired);
    assert_eq!(counts.len(), N, "every timer fired");
    assert!(counts.values().all(|n| *n == 1), "each once: {counts:?}");
    assert!(
        !counts.keys().any(|k| k.contains("cancelled")),
        "the cancelled timer did not fire"
    );
    let late: Vec<i64> = fired
        .iter()
        .map(|e| {
            let due = chrono::DateTime::parse_from_rfc3339(
                e.envelope["payload"]["dueAt"].as_str().unwrap_or_default(),
            )
            .map(|d| d.timestamp_millis())
            .unwrap_or(0);
            e.envelope["timestampMs"].as_i64().unwrap_or(0) - due
        })
        .collect();
    let (p50, p99, max) = percentiles(late);
    println!("{store} + {broker}: {N} fired once each, lateness ms p50 {p50} p99 {p99} max {max}");
    assert_eq!(service.terminate().await, Some(0), "a clean stop");
    clean_up(broker, id).await;
}
