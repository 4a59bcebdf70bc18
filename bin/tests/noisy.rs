//! One tenant must not be able to stop or starve the others. While tenant `noisy` abuses the
//! embedded service in turn (floods `POST /v1/commands` far over its rate, stalls an event stream
//! its events pour into, holds connections open with headers that never end), tenant `steady`
//! schedules a timer every 50 ms, alternately over `POST /v1/timers` and through
//! `POST /v1/commands` (the broker path), and reads its own event stream. Every one of its timers
//! fires, and on time (measured as the event reached its reader), and each abuse meets the limit
//! meant for it.
//!
//! The timers are kept in the memory store, so that what is measured is the service keeping
//! tenants apart, not the disk. Abuses with brokers of their own (ids too long for a routing key,
//! an unbound RabbitMQ queue) are in the broker tests; a bulk resume of long-paused series in
//! `timer-core` (`resume_stops_counting_a_long_pause_of_a_fast_series`).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};
use timer_conformance::e2e::{lateness_at_reader, now_ms, schedule, timer_of, Service};
use timer_conformance::wait_for;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");

/// How long after its due time a steady timer may reach its reader. Generous: on time is a few
/// ms; a tenant stuck behind the noisy one's flood waited seconds.
const ON_TIME_MS: i64 = 500;

/// The noisy tenant's rate, and its share of what the broker path may hold back.
const RATE: usize = 100;
const HELD_SHARE: usize = 300;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_noisy_tenant_neither_stops_nor_starves_the_others() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = timer_conformance::e2e::write_config(
        dir.path(),
        &json!({
            "store": { "kind": "memory" },
            "broker": { "kind": "memory", "max_queued_per_tenant": 2_000 },
            "limits": { "rate": {
                "tenants": { "noisy": { "schedules_per_second": RATE, "burst": RATE } },
                "max_held": 2_000,
                "max_held_per_tenant": HELD_SHARE,
            } },
            "http": {
                "header_read_timeout": "1s",
                "request_timeout": "2s",
                "max_connections": 128,
                "max_event_streams": 16,
                "event_stream_buffer": 65_536,
            },
        }),
    );
    let env = [("TIMER_CONFIG", config.display().to_string())];
    let service = Arc::new(Service::start(Path::new(BIN), dir.path(), &env).await);
    let steady_events = service.events_at("/v1/events?tenant=steady", None).await;

    let stop = CancellationToken::new();
    let steady = tokio::spawn(steadily(service.clone(), stop.clone()));

    flood_the_commands(&service).await;
    stall_an_event_stream(&service).await;
    hold_connections_with_slow_headers(&service).await;
    hold_connections_with_slow_bodies(&service).await;

    stop.cancel();
    let sent = steady.await.expect("the steady tenant's task");
    assert!(
        sent.len() >= 20,
        "the steady tenant kept sending: {}",
        sent.len()
    );
    let received = wait_for(Duration::from_secs(30), || async {
        let got = steady_events.snapshot();
        (got.len() >= sent.len()).then_some(got)
    })
    .await
    .unwrap_or_else(|| {
        service.fail(format_args!(
            "every steady timer fired: {} of {}",
            steady_events.len(),
            sent.len()
        ))
    });
    let fired: std::collections::HashSet<String> =
        received.iter().map(|r| timer_of(&r.envelope)).collect();
    let lost: Vec<&String> = sent.iter().filter(|id| !fired.contains(*id)).collect();
    assert!(lost.is_empty(), "steady timers that never fired: {lost:?}");
    let (p50, p99, max) = lateness_at_reader(&received);
    eprintln!(
        "steady tenant: {} timers, lateness at its reader p50 {p50} ms, p99 {p99} ms, max {max} ms",
        sent.len()
    );
    assert!(
        p99 <= ON_TIME_MS,
        "the steady tenant's timers fire on time: p99 {p99} ms"
    );
    if let Ok(service) = Arc::try_unwrap(service) {
        service.terminate().await;
    }
}

/// Tenant `steady`: one timer every 50 ms, due 300 ms later, alternately over HTTP and the
/// broker path, until `stop`. The timers it got accepted (`steady/<id>`).
async fn steadily(service: Arc<Service>, stop: CancellationToken) -> Vec<String> {
    let mut sent = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let mut i = 0;
    while !stop.is_cancelled() {
        tick.tick().await;
        let id = format!("s{i:04}");
        let body = schedule("steady", &id, now_ms() + 300);
        let path = if i % 2 == 0 {
            "/v1/timers"
        } else {
            "/v1/commands"
        };
        let (status, v) = service.post(path, body).await;
        assert!(
            status == 201 || status == 202,
            "the steady tenant is never refused: {path} answered {status} {v}"
        );
        sent.push(format!("steady/{id}"));
        i += 1;
    }
    sent
}

/// 3,000 commands through `POST /v1/commands` at once, 30 times the noisy tenant's rate: they
/// are held back only up to its share (`limits.rate.max_held_per_tenant`), the rest refused as
/// dead letters, so the broker path goes on reading the other tenants' commands.
async fn flood_the_commands(service: &Service) {
    let commands: Vec<String> = (0..3_000)
        .map(|i| schedule("noisy", &format!("f{i:04}"), now_ms() + 3_600_000))
        .collect();
    let statuses: Vec<u16> = futures::stream::iter(commands)
        .map(|c| async move { service.post("/v1/commands", c).await.0 })
        .buffer_unordered(16)
        .collect()
        .await;
    assert!(
        statuses.iter().all(|s| *s == 202 || *s == 503),
        "queued, or refused while the queue is full: {statuses:?}"
    );
    let refused = wait_for(Duration::from_secs(30), || async {
        let (_, letters) = service.get("/v1/dead-letters").await;
        let refused = letters["deadLetters"]
            .as_array()?
            .iter()
            .filter(|l| {
                l["reason"]
                    .as_str()
                    .is_some_and(|r| r.contains("limits.rate.max_held_per_tenant"))
            })
            .count();
        (refused > 0).then_some(refused)
    })
    .await
    .unwrap_or_else(|| service.fail("the flood beyond the tenant's share is dead-lettered"));
    eprintln!("flood: {refused} commands beyond the noisy tenant's share dead-lettered");
}

/// An event stream that is never read, of a tenant whose 400 timers with 60 KB payloads fire
/// (24 MB, more than the sockets' buffers hold): the service keeps at most
/// `http.event_stream_buffer` bytes for it, then sends `lagged` and ends the stream, instead of
/// keeping every event for it.
async fn stall_an_event_stream(service: &Service) {
    const N: usize = 400;
    let mut stalled = TcpStream::connect(service.addr).await.expect("connect");
    let request =
        "GET /v1/events?tenant=hoarder HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    stalled.write_all(request.as_bytes()).await.expect("send");
    let payload = json!({ "blob": "x".repeat(60 * 1024) });
    let due = now_ms() + 1_000;
    let commands: Vec<Value> = (0..N)
        .map(|i| {
            json!({"tenantId": "hoarder", "serviceCallId": format!("big{i:03}"),
                   "dueTimeMs": due, "payload": payload})
        })
        .collect();
    for chunk in commands.chunks(25) {
        let body = json!({ "commands": chunk }).to_string();
        let (status, v) = service.post("/v1/timers/batch", body).await;
        assert_eq!(status, 200, "{v}");
    }
    // Read now: what was queued, then `lagged`, then the end of the stream.
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(60), stalled.read_to_end(&mut answer))
        .await
        .expect("the stalled stream ends within a minute");
    read.expect("read the stream");
    let text = String::from_utf8_lossy(&answer);
    assert!(text.contains("event: lagged"), "ends with lagged");
    let delivered = text.matches("event: DueTimeReached").count();
    assert!(
        delivered < N,
        "dropped before all {N}: {delivered} delivered"
    );
    eprintln!("stalled stream: {delivered} of {N} events, then lagged and closed");
}

/// 40 bulk actions (the route without a request timeout) whose bodies never arrive whole: each
/// is answered 408 after `http.request_timeout`, so they cannot hold the service's connections.
async fn hold_connections_with_slow_bodies(service: &Service) {
    let mut slow = Vec::new();
    for _ in 0..40 {
        let mut stream = TcpStream::connect(service.addr).await.expect("connect");
        stream
            .write_all(
                b"POST /v1/tenants/noisy/timers/bulk HTTP/1.1\r\nHost: 127.0.0.1\r\n\
                  Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"action\"",
            )
            .await
            .expect("send");
        slow.push(stream);
    }
    let started = tokio::time::Instant::now();
    for mut stream in slow {
        let mut answer = vec![0u8; 12];
        let read = tokio::time::timeout(Duration::from_secs(15), stream.read_exact(&mut answer));
        assert!(
            matches!(read.await, Ok(Ok(_))),
            "a bulk action whose body never arrives is answered"
        );
        assert_eq!(
            &answer,
            b"HTTP/1.1 408",
            "{}",
            String::from_utf8_lossy(&answer)
        );
    }
    eprintln!(
        "slow bodies: 40 bulk actions answered 408 within {} ms",
        started.elapsed().as_millis()
    );
}

/// 40 connections that send the start of a request and never the end of its headers: each is
/// closed after `http.header_read_timeout`, so they cannot hold the service's connections.
async fn hold_connections_with_slow_headers(service: &Service) {
    let mut slow = Vec::new();
    for _ in 0..40 {
        let mut stream = TcpStream::connect(service.addr).await.expect("connect");
        stream
            .write_all(b"GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            .await
            .expect("send");
        slow.push(stream);
    }
    let started = tokio::time::Instant::now();
    for mut stream in slow {
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut rest));
        assert!(
            closed.await.is_ok(),
            "a connection whose headers never end is closed"
        );
    }
    eprintln!(
        "slow headers: 40 connections closed within {} ms",
        started.elapsed().as_millis()
    );
}
