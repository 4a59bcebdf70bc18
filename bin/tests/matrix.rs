//! The broker × store matrix: one binary built with every feature, and the same end-to-end run
//! for every pair of a store plugin and a broker plugin of the registries, chosen by
//! configuration only: the plugins' isolated sections written to a TOML file (`TIMER_CONFIG`).
//!
//! Each run: 200 timers over HTTP due within the next 3 s plus one cancelled before it is due;
//! every timer's `DueTimeReached` seen once on the event stream, on time at that reader
//! ([`on_time`]), and read back from the broker by its own consumer (the plugin's test client)
//! with its id; the cancelled one never; then a clean stop. One timer in ten has an HTTP target
//! instead: it is called on a receiver of the test (once, with its event id), beside whichever
//! broker, and is not on the broker. A pair whose server is not there is skipped with the
//! reason (a failure under `TIMER_TEST_REQUIRE=1`; `bash scripts/test.sh` starts them all).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use libtest_mimic::Arguments;
use serde_json::json;
use timer_conformance::e2e::{count_by_key, on_time, Received, Service};
use timer_conformance::{server_trial, wait_for};
use timer_core::plugin::{BrokerPlugin, StorePlugin, TestClient};

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");

/// The calls the test's receiver got: path and `webhook-id`, in order.
type Calls = Arc<Mutex<Vec<(String, String)>>>;

fn main() {
    let mut args = Arguments::from_args();
    // Each run starts a service and loads its servers; two at a time keep a 2-core box sane.
    args.test_threads.get_or_insert(2);
    let mut trials = Vec::new();
    for store in timer_stores::PLUGINS.iter() {
        for broker in timer_brokers::PLUGINS.iter() {
            trials.push(server_trial(
                &format!("matrix::{}_store_with_{}_broker", store.kind, broker.kind),
                store.unavailable().or_else(|| broker.unavailable()),
                move || run_pair(store, broker),
            ));
        }
    }
    libtest_mimic::run(&args, trials).exit();
}

/// The value of a step of this test's own setup; its failure ends the test with the error chain.
fn ok<T>(result: timer_core::Result<T>) -> T {
    result.unwrap_or_else(|e| panic!("{}", e.chain()))
}

/// The service's whole configuration: the plugins' sections, a short poll interval, and HTTP
/// targets allowed on `receiver` (a port of 127.0.0.1).
fn config_file(
    dir: &Path,
    store: serde_json::Value,
    broker: serde_json::Value,
    receiver: u16,
) -> String {
    let config = json!({
        "store": store,
        "broker": broker,
        "engine": {"poll_interval": "1s"},
        "targets": {"allow": ["{tenant}.*", format!("http://127.0.0.1:{receiver}/")]},
        "webhooks": {"allow_private_networks": true},
    });
    let text =
        toml::to_string(&toml::Value::try_from(config).expect("a TOML config")).expect("TOML text");
    let path = dir.join("matrix.toml");
    std::fs::write(&path, text).expect("write the config file");
    path.display().to_string()
}

async fn run_pair(store_plugin: &StorePlugin, broker_plugin: &BrokerPlugin) {
    const N: usize = 200;
    let (store, broker) = (store_plugin.kind, broker_plugin.kind);
    let store_resources = ok((store_plugin.isolated)("m"));
    let broker_resources = ok((broker_plugin.isolated)("m"));
    // Creates the broker's resources first, as a consumer of the events would (RabbitMQ returns
    // events no queue is bound to, and the service retries them).
    let client = ok(broker_resources.config.test_client().await);
    let dir = tempfile::tempdir().expect("tempdir");
    // The receiver of the HTTP targets: (path, webhook-id) of each call.
    let calls: Calls = Arc::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the receiver");
    let port = listener.local_addr().expect("addr").port();
    let app = axum::Router::new()
        .fallback(
            |axum::extract::State(calls): axum::extract::State<Calls>,
             uri: axum::http::Uri,
             headers: axum::http::HeaderMap| async move {
                let id = headers
                    .get("webhook-id")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                if let Ok(mut calls) = calls.lock() {
                    calls.push((uri.path().to_owned(), id));
                }
                axum::http::StatusCode::NO_CONTENT
            },
        )
        .with_state(calls.clone());
    let receiver = tokio::spawn(async move { axum::serve(listener, app).await });
    let config = config_file(
        dir.path(),
        ok(store_resources.config.to_value()),
        ok(broker_resources.config.to_value()),
        port,
    );
    let service = Service::start(Path::new(BIN), dir.path(), &[("TIMER_CONFIG", config)]).await;
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
            let mut body = json!({"tenantId": format!("m{}", i % 5), "serviceCallId": format!("c{i}"),
                              "dueTimeMs": now + 1_000 + (i as i64 * 1_500) / N as i64});
            if i % 10 == 0 {
                body["target"] = json!({"url": format!("http://127.0.0.1:{port}/c{i}")});
            }
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
    on_time(&format!("{store} + {broker}"), &fired);
    // The calls: each HTTP target once, with the id of its event (the event stream shows it).
    let called: HashMap<String, String> = calls
        .lock()
        .map(|c| c.iter().cloned().collect())
        .unwrap_or_default();
    let call_count = calls.lock().map(|c| c.len()).unwrap_or_default();
    assert_eq!(
        (called.len(), call_count),
        (N / 10, N / 10),
        "{store} + {broker}: each HTTP target called once: {called:?}"
    );
    let (by_call, by_broker): (Vec<Received>, Vec<Received>) = fired.into_iter().partition(|e| {
        let id = e.envelope["aggregateId"].as_str().unwrap_or_default();
        called.contains_key(&format!("/{id}"))
    });
    for e in &by_call {
        let path = format!(
            "/{}",
            e.envelope["aggregateId"].as_str().unwrap_or_default()
        );
        assert_eq!(
            called.get(&path).map(String::as_str),
            e.envelope["id"].as_str(),
            "{store} + {broker}: {path} called with its event id"
        );
    }
    receiver.abort();
    // The event stream announces what `publish` said it sent; the broker's own consumer shows
    // it was: every event, with its id, and nothing else (no call). (The memory broker lives in
    // the service's process: the event stream is its consumer.)
    if broker_plugin.test_server.is_some() {
        events_on_the_broker(&format!("{store} + {broker}"), client.as_ref(), &by_broker).await;
    }
    assert_eq!(service.terminate().await, Some(0), "a clean stop");
    drop(client);
    let _ = store_resources.config.clean_up().await;
    let _ = broker_resources.config.clean_up().await;
}

/// Every event `fired` (as the service's event stream showed them) is on the broker, read by
/// its own consumer with its id and the same envelope, and nothing else is.
async fn events_on_the_broker(pair: &str, client: &dyn TestClient, fired: &[Received]) {
    let n = fired.len();
    let on_broker = wait_for(Duration::from_secs(30), || async {
        client.events().await.ok().filter(|read| read.len() >= n)
    })
    .await;
    let Some(on_broker) = on_broker else {
        let read = client.events().await.map(|r| r.len());
        panic!("{pair}: the broker's consumer read {read:?} of {n} events");
    };
    let streamed: HashMap<String, &serde_json::Value> = fired
        .iter()
        .map(|e| {
            (
                e.envelope["id"].as_str().unwrap_or_default().to_owned(),
                &e.envelope,
            )
        })
        .collect();
    assert_eq!(
        on_broker.len(),
        n,
        "{pair}: as many events on the broker as fired"
    );
    for read in &on_broker {
        let envelope: serde_json::Value = serde_json::from_slice(&read.body)
            .unwrap_or_else(|e| panic!("{pair}: an event on the broker is not JSON: {e}"));
        assert_eq!(
            streamed.get(&read.id.to_string()).copied(),
            Some(&envelope),
            "{pair}: the event {} on the broker is the one streamed, under its id",
            read.id
        );
    }
}
