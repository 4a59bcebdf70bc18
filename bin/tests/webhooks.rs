//! HTTP targets end to end: the built binary (SQLite, the in-process broker) calls a real HTTP
//! receiver on 127.0.0.1, which checks every signature with an independent Standard Webhooks
//! implementation (the `standardwebhooks` crate).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde_json::{json, Value};
use timer_conformance::e2e::{now_ms, percentiles, run_ok, write_config, Service};
use timer_conformance::wait_for;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");

/// The tests run one at a time, so that those measuring lateness do not measure the others (a
/// service starting is load too).
static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn secret(byte: u8) -> String {
    format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode([byte; 32])
    )
}

/// One call the receiver got.
#[derive(Debug, Clone)]
struct Hook {
    at_ms: i64,
    path: String,
    method: Method,
    headers: HeaderMap,
    body: Bytes,
}

impl Hook {
    fn id(&self) -> String {
        header(&self.headers, "webhook-id")
    }

    /// Whether `secret` verifies its signature: with the receiver's own library (the
    /// `standardwebhooks` crate), which takes UTF-8 bodies only; a binary body by the spec's
    /// recipe with the HMAC that library uses (`hmac-sha256`).
    fn verifies(&self, secret: &str) -> bool {
        if std::str::from_utf8(&self.body).is_ok() {
            let Ok(hook) = standardwebhooks::Webhook::new(secret) else {
                return false;
            };
            return hook.verify(&self.body, &self.headers).is_ok();
        }
        let Ok(key) =
            base64::engine::general_purpose::STANDARD.decode(secret.trim_start_matches("whsec_"))
        else {
            return false;
        };
        let timestamp = header(&self.headers, "webhook-timestamp");
        let mut signed = format!("{}.{timestamp}.", self.id()).into_bytes();
        signed.extend_from_slice(&self.body);
        let expected = format!(
            "v1,{}",
            base64::engine::general_purpose::STANDARD.encode(hmac_sha256::HMAC::mac(&signed, &key))
        );
        header(&self.headers, "webhook-signature")
            .split(' ')
            .any(|s| s == expected)
    }
}

fn header(headers: &HeaderMap, name: &str) -> String {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// An HTTP receiver: records every call; answers by the path's first segment: `ok` 200,
/// `flaky` 503 three times per webhook id then 200, `missing` 404, `slow` 200 after 5 s.
#[derive(Clone, Default)]
struct Receiver {
    calls: Arc<Mutex<Vec<Hook>>>,
}

impl Receiver {
    fn calls(&self) -> Vec<Hook> {
        self.calls.lock().map(|c| c.clone()).unwrap_or_default()
    }

    /// The calls whose path starts with `prefix`, by webhook id.
    fn by_id(&self, prefix: &str) -> HashMap<String, Vec<Hook>> {
        let mut out: HashMap<String, Vec<Hook>> = HashMap::new();
        for call in self.calls() {
            if call.path.starts_with(prefix) {
                out.entry(call.id()).or_default().push(call);
            }
        }
        out
    }

    /// Serves on `listener` until the task is aborted.
    fn serve(&self, listener: TcpListener) -> JoinHandle<()> {
        let app = axum::Router::new()
            .fallback(receive)
            .with_state(self.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        })
    }
}

async fn receive(
    State(receiver): State<Receiver>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let hook = Hook {
        at_ms: now_ms(),
        path: uri.path().to_owned(),
        method,
        headers,
        body,
    };
    let id = hook.id();
    let kind = hook.path.split('/').nth(2).unwrap_or_default().to_owned();
    let seen = {
        let Ok(mut calls) = receiver.calls.lock() else {
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        };
        calls.push(hook);
        calls.iter().filter(|c| c.id() == id).count()
    };
    match kind.as_str() {
        "flaky" if seen <= 3 => {
            (StatusCode::SERVICE_UNAVAILABLE, "busy, come back").into_response()
        }
        "missing" => (StatusCode::NOT_FOUND, "no such hook here").into_response(),
        "slow" => {
            // The receiver is slow: this is what it simulates, not a wait for anything.
            tokio::time::sleep(Duration::from_secs(5)).await;
            (StatusCode::OK, "ok").into_response()
        }
        _ => (StatusCode::OK, "ok").into_response(),
    }
}

/// A receiver on a port of its own.
async fn receiver() -> (Receiver, u16, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let receiver = Receiver::default();
    let task = receiver.serve(listener);
    (receiver, port, task)
}

/// A service (SQLite, memory broker) whose tenants may call `http://127.0.0.1:<port>/<tenant>/`
/// of each port, signing with secret 1 for every tenant and secrets 2 and 3 for `acme`.
async fn service(dir: &Path, ports: &[u16], engine: Value) -> Service {
    service_with(dir, ports, engine, json!({})).await
}

/// [`service`], with these keys in its `webhooks` section besides.
async fn service_with(dir: &Path, ports: &[u16], engine: Value, webhooks: Value) -> Service {
    let allow: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}/{{tenant}}/"))
        .collect();
    let mut hooks = json!({
        "allow_private_networks": true,
        "secret": secret(1),
        "tenants": {"acme": {"secrets": [secret(2), secret(3)]}},
    });
    if let (Some(hooks), Value::Object(more)) = (hooks.as_object_mut(), webhooks) {
        hooks.extend(more);
    }
    let file = write_config(
        dir,
        &json!({
            "store": {"kind": "sqlite", "url": format!("sqlite://{}", dir.join("timers.db").display())},
            "broker": {"kind": "memory"},
            "engine": engine,
            "targets": {"allow": allow},
            "webhooks": hooks,
        }),
    );
    Service::start(
        Path::new(BIN),
        dir,
        &[("TIMER_CONFIG", file.display().to_string())],
    )
    .await
}

fn hook_timer(tenant: &str, id: &str, due: i64, url: String) -> Value {
    json!({"tenantId": tenant, "serviceCallId": id, "dueTimeMs": due, "target": {"url": url}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_arrive_on_time_signed_with_the_exact_body_and_headers() {
    let _alone = ALONE.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (receiver, port, _task) = receiver().await;
    let service = service(dir.path(), &[port], json!({})).await;
    let start = now_ms() + 1_500;
    let mut due = HashMap::new();
    let mut commands = Vec::new();
    for i in 0..200i64 {
        let tenant = if i % 2 == 0 { "acme" } else { "globex" };
        let id = format!("hook-{i:03}");
        let at = start + i * 10;
        due.insert(id.clone(), at);
        let mut command = hook_timer(
            tenant,
            &id,
            at,
            format!("http://127.0.0.1:{port}/{tenant}/ok/{id}"),
        );
        command["target"]["headers"] = json!({"authorization": format!("Bearer t-{i}")});
        if i % 4 < 2 {
            // The producer's own bytes, content type and headers.
            command["message"] = json!({"bodyBase64": base64::engine::general_purpose::STANDARD
                .encode([0u8, 1, 2, 255, i as u8]),
                "contentType": "application/x-thing", "headers": {"x-order": i.to_string()}});
        }
        commands.push(command);
    }
    for chunk in commands.chunks(50) {
        service.schedule_batch(chunk).await;
    }
    let arrived = wait_for(Duration::from_secs(60), || async {
        let by_id = receiver.by_id("/");
        (by_id.len() >= 200).then_some(by_id)
    })
    .await
    .unwrap_or_else(|| {
        service.fail(format!(
            "{} of 200 webhooks arrived",
            receiver.by_id("/").len()
        ))
    });
    let mut late = Vec::new();
    for (i, command) in commands.iter().enumerate() {
        let id = command["serviceCallId"].as_str().unwrap_or_default();
        let tenant = command["tenantId"].as_str().unwrap_or_default();
        let Some(calls) = arrived
            .values()
            .find(|c| c[0].path.ends_with(&format!("/{id}")))
        else {
            service.fail(format!("{id} never arrived"));
        };
        assert_eq!(calls.len(), 1, "{id} arrived once");
        let hook = &calls[0];
        assert_eq!(hook.method, Method::POST);
        assert_eq!(
            header(&hook.headers, "authorization"),
            format!("Bearer t-{i}"),
            "the target's headers"
        );
        let at = due[id];
        assert!(
            hook.at_ms >= at,
            "{id} arrived {} ms early",
            at - hook.at_ms
        );
        late.push(hook.at_ms - at);
        // Signed as the spec says, with the tenant's secrets: each verifies on its own.
        if tenant == "acme" {
            assert!(
                hook.verifies(&secret(2)) && hook.verifies(&secret(3)),
                "{id}"
            );
            assert!(
                !hook.verifies(&secret(1)),
                "{id}: acme has secrets of its own"
            );
        } else {
            assert!(hook.verifies(&secret(1)), "{id}");
            assert!(!hook.verifies(&secret(2)), "{id}");
        }
        if command.get("message").is_some() {
            assert_eq!(
                &hook.body[..],
                &[0u8, 1, 2, 255, i as u8],
                "{id}: byte-exact"
            );
            assert_eq!(header(&hook.headers, "content-type"), "application/x-thing");
            assert_eq!(header(&hook.headers, "x-order"), i.to_string());
        } else {
            let envelope: Value = serde_json::from_slice(&hook.body).expect("the envelope");
            assert_eq!(envelope["type"], "DueTimeReached", "{envelope}");
            assert_eq!(envelope["payload"]["serviceCallId"], id, "{envelope}");
            assert_eq!(envelope["id"], hook.id(), "webhook-id is the event id");
            assert_eq!(header(&hook.headers, "content-type"), "application/json");
        }
    }
    let (p50, p99, max) = percentiles(late);
    println!("webhook lateness at the receiver: p50 {p50} ms, p99 {p99} ms, max {max} ms");
    // Generous: only a broken mechanism (polling, a lost wake-up) is this late.
    assert!(p99 < 1_000, "p99 {p99} ms");
    // The receiver sees the fire before the store records it: wait for the record.
    let v = wait_for(Duration::from_secs(30), || async {
        let (_, v) = service.get("/v1/tenants/acme/timers/hook-000").await;
        (v["state"] == "Reached").then_some(v)
    })
    .await
    .expect("the fire is recorded");
    assert_eq!(
        v["target"]["url"],
        format!("http://127.0.0.1:{port}/acme/ok/hook-000"),
        "{v}"
    );

    // The history keeps how the receiver answered.
    let (_, history) = service
        .get("/v1/tenants/acme/timers/hook-000/history")
        .await;
    let answer = history["history"]
        .as_array()
        .and_then(|e| e.iter().find(|e| e["type"] == "fired"))
        .map(|e| e["answer"].as_str().unwrap_or_default().to_owned())
        .unwrap_or_default();
    assert!(
        answer.starts_with(&format!("127.0.0.1:{port} answered 200 OK in ")),
        "{history}"
    );

    // Secrets are nowhere: not in the log, the answers, nor check-config.
    let config = dir.path().join("timer-service.toml");
    let out = run_ok(
        tokio::process::Command::new(BIN)
            .arg("check-config")
            .env("TIMER_CONFIG", &config)
            .current_dir(dir.path()),
        "check-config",
    )
    .await;
    let shown = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        shown.contains("[webhooks"),
        "check-config shows the section: {shown}"
    );
    let answers = format!("{v}{}", service.text("/v1/status").await);
    for s in [secret(1), secret(2), secret(3)] {
        let key = s.trim_start_matches("whsec_");
        for (what, text) in [
            ("check-config", &shown),
            ("log", &service.log_text()),
            ("answers", &answers),
        ] {
            assert!(!text.contains(key), "a secret in the {what}: {text}");
        }
    }
    service.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_receivers_are_retried_refused_or_waited_for_and_nothing_is_lost() {
    let _alone = ALONE.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (receiver, port, _task) = receiver().await;
    // A receiver that is down, on a port of its own: nothing listens there yet.
    let down = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let down_port = down.local_addr().expect("addr").port();
    drop(down);
    let engine = json!({"retry_base": "200ms", "retry_max": "2s", "retry_jitter_percent": 0,
        "max_attempts": 40});
    let service = service(dir.path(), &[port, down_port], engine).await;
    let soon = now_ms() + 500;
    let mut commands = Vec::new();
    for i in 0..5 {
        let id = format!("flaky-{i}");
        commands.push(hook_timer(
            "acme",
            &id,
            soon,
            format!("http://127.0.0.1:{port}/acme/flaky/{id}"),
        ));
    }
    commands.push(hook_timer(
        "acme",
        "gone",
        soon,
        format!("http://127.0.0.1:{port}/acme/missing/gone"),
    ));
    for i in 0..20 {
        let id = format!("down-{i:02}");
        commands.push(hook_timer(
            "globex",
            &id,
            soon,
            format!("http://127.0.0.1:{down_port}/globex/ok/{id}"),
        ));
    }
    service.schedule_batch(&commands).await;

    // 503 three times, then 200: four calls each, spaced by the backoff (200, 400, 800 ms).
    let flaky = wait_for(Duration::from_secs(30), || async {
        let by_id = receiver.by_id("/acme/flaky/");
        (by_id.len() == 5 && by_id.values().all(|c| c.len() >= 4)).then_some(by_id)
    })
    .await
    .unwrap_or_else(|| service.fail(format!("flaky: {:?}", receiver.by_id("/acme/flaky/"))));
    for calls in flaky.values() {
        let gaps: Vec<i64> = calls.windows(2).map(|w| w[1].at_ms - w[0].at_ms).collect();
        for (k, gap) in gaps.iter().enumerate() {
            let backoff = 200 << k;
            assert!(
                *gap >= backoff - 5,
                "gap {k} of {}: {gaps:?}",
                calls[0].path
            );
        }
    }
    for i in 0..5 {
        let v = wait_for(Duration::from_secs(10), || async {
            let (_, v) = service
                .get(&format!("/v1/tenants/acme/timers/flaky-{i}"))
                .await;
            (v["state"] == "Reached").then_some(v)
        })
        .await;
        assert!(v.is_some(), "flaky-{i} Reached");
    }

    // 404: failed at once, with a dead letter naming the status.
    let failed = wait_for(Duration::from_secs(10), || async {
        let (_, v) = service.get("/v1/tenants/acme/timers/gone").await;
        (v["state"] == "Failed").then_some(v)
    })
    .await
    .unwrap_or_else(|| service.fail("the 404 timer did not fail"));
    let last = failed["lastError"].as_str().unwrap_or_default();
    assert!(
        last.contains("404 Not Found") && last.contains("no such hook here"),
        "{failed}"
    );
    assert_eq!(receiver.by_id("/acme/missing/").len(), 1);
    assert_eq!(
        receiver
            .by_id("/acme/missing/")
            .values()
            .next()
            .map(Vec::len),
        Some(1),
        "called once"
    );
    let (_, letters) = service.get("/v1/dead-letters").await;
    let letter = letters["deadLetters"]
        .as_array()
        .and_then(|l| {
            l.iter().find(|d| {
                d["reason"]
                    .as_str()
                    .is_some_and(|r| r.starts_with("target_refused") && r.contains("404"))
            })
        })
        .cloned();
    assert!(
        letter.is_some(),
        "a dead letter naming the status: {letters}"
    );

    // The receiver that was down for 10 s gets every call once it is back; meanwhile the calls
    // are tried and fail (counted for its host).
    let started = now_ms();
    let down_host = format!("host=\"127.0.0.1:{down_port}\"");
    let tried = wait_for(Duration::from_secs(30), || async {
        let text = service.text("/metrics").await;
        text.lines()
            .any(|l| {
                l.starts_with("timer_webhook_calls")
                    && l.contains(&down_host)
                    && l.contains("outcome=\"retry\"")
            })
            .then_some(())
    })
    .await;
    assert!(
        tried.is_some(),
        "calls to the receiver that is down were tried"
    );
    // Down for 10 s from the due time: that is the outage, not a wait for a condition.
    let back_at = soon + 10_000;
    tokio::time::sleep(Duration::from_millis((back_at - started).max(0) as u64)).await;
    let down_receiver = Receiver::default();
    let listener = TcpListener::bind(("127.0.0.1", down_port))
        .await
        .expect("bind the down receiver's port again");
    let _down_task = down_receiver.serve(listener);
    let all = wait_for(Duration::from_secs(30), || async {
        let by_id = down_receiver.by_id("/globex/ok/");
        (by_id.len() == 20).then_some(by_id)
    })
    .await
    .unwrap_or_else(|| {
        service.fail(format!(
            "{} of 20 arrived after the outage",
            down_receiver.by_id("/globex/ok/").len()
        ))
    });
    assert_eq!(all.len(), 20);
    // Each was tried while the receiver was down: its history says how that failed.
    let (_, history) = service
        .get("/v1/tenants/globex/timers/down-00/history")
        .await;
    let failed = history["history"]
        .as_array()
        .map(|h| h.iter().filter(|e| e["type"] == "publish_failed").count())
        .unwrap_or_default();
    assert!(failed >= 2, "tried during the outage: {history}");
    assert!(
        history
            .to_string()
            .contains(&format!("calling 127.0.0.1:{down_port}")),
        "{history}"
    );
    let v = wait_for(Duration::from_secs(10), || async {
        let (_, v) = service
            .get("/v1/tenants/globex/timers?state=reached&limit=100")
            .await;
        (v["timers"].as_array().map(Vec::len) == Some(20)).then_some(v)
    })
    .await;
    assert!(v.is_some(), "all 20 Reached");
    service.terminate().await;
}

/// `POST …/trigger` of a timer with an HTTP target calls the target, as its due fire would:
/// signed, with `"trigger": "manual"` and the id the answer names; a receiver that refuses the
/// call makes the trigger answer 503 with its answer, and records nothing. The schedules stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manual_trigger_calls_the_http_target() {
    // Starting a service is load the lateness measurements would see.
    let _alone = ALONE.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (receiver, port, _task) = receiver().await;
    let service = service(dir.path(), &[port], json!({})).await;
    let later = now_ms() + 3_600_000;
    for (id, kind) in [("taken", "ok"), ("refused", "missing")] {
        let url = format!("http://127.0.0.1:{port}/acme/{kind}/{id}");
        let (status, v) = service
            .post("/v1/timers", hook_timer("acme", id, later, url).to_string())
            .await;
        assert_eq!(status, 201, "{v}");
    }

    let (status, v) = service
        .post("/v1/tenants/acme/timers/taken/trigger", "")
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["outcome"], "triggered", "{v}");
    let calls = receiver.calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    let call = &calls[0];
    assert_eq!(call.path, "/acme/ok/taken");
    assert_eq!(call.id(), v["eventId"].as_str().unwrap_or_default());
    assert!(call.verifies(&secret(2)), "signed with the tenant's secret");
    let body: Value = serde_json::from_slice(&call.body).expect("the envelope");
    assert_eq!(body["payload"]["trigger"], "manual", "{body}");

    let (status, v) = service
        .post("/v1/tenants/acme/timers/refused/trigger", "")
        .await;
    assert_eq!(status, 503, "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("did not take the manually triggered event") && message.contains("404"),
        "{v}"
    );
    let (_, history) = service.get("/v1/tenants/acme/timers/refused/history").await;
    let entries = history["history"].as_array().cloned().unwrap_or_default();
    assert!(!entries.is_empty(), "{history}");
    assert!(
        entries.iter().all(|e| e["type"] != "triggered"),
        "{history}"
    );
    for id in ["taken", "refused"] {
        let (_, t) = service.get(&format!("/v1/tenants/acme/timers/{id}")).await;
        assert_eq!(t["state"], "Scheduled", "{t}");
        assert_eq!(t["dueTimeMs"], later, "{t}");
    }
    service.terminate().await;
}

/// A `CancelTimer` (through `POST /v1/commands`: the in-process broker) for a timer whose call is
/// in flight waits for that call, holding back only its own tenant's commands: another tenant's
/// schedule sent after it is stored while the receiver still takes its 5 s, not after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_that_meets_a_slow_call_holds_back_no_other_tenant() {
    let _alone = ALONE.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (slow, port, _task) = receiver().await;
    let service = service(dir.path(), &[port], json!({})).await;
    let url = format!("http://127.0.0.1:{port}/sloth/slow/call");
    let (status, v) = service
        .post(
            "/v1/timers",
            hook_timer("sloth", "call", now_ms(), url).to_string(),
        )
        .await;
    assert_eq!(status, 201, "{v}");
    let started = wait_for(Duration::from_secs(10), || async {
        slow.calls().first().map(|call| call.at_ms)
    })
    .await
    .unwrap_or_else(|| service.fail("the receiver was never called"));
    let later = now_ms() + 3_600_000;
    for command in [
        json!({"type": "CancelTimer", "tenantId": "sloth", "serviceCallId": "call"}),
        json!({"tenantId": "other", "serviceCallId": "next", "dueTimeMs": later}),
    ] {
        let (status, v) = service.post("/v1/commands", command.to_string()).await;
        assert_eq!(status, 202, "{v}");
    }
    let stored = wait_for(Duration::from_secs(10), || async {
        let (status, _) = service.get("/v1/tenants/other/timers/next").await;
        (status == 200).then(now_ms)
    })
    .await
    .unwrap_or_else(|| service.fail("the other tenant's schedule was never stored"));
    // The receiver answers 5 s after the call began: a schedule stored later waited for it.
    assert!(
        stored < started + 5_000,
        "stored {} ms after the call began, behind another tenant's cancel",
        stored - started
    );
    let fired = wait_for(Duration::from_secs(30), || async {
        let (_, t) = service.get("/v1/tenants/sloth/timers/call").await;
        (t["state"] == "Reached").then_some(t)
    })
    .await;
    assert!(fired.is_some(), "the call in flight ended the timer");
    service.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_receiver_does_not_make_another_tenants_webhooks_late() {
    let _alone = ALONE.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (slow, slow_port, _slow_task) = receiver().await;
    let (fast, fast_port, _fast_task) = receiver().await;
    let service = service(dir.path(), &[slow_port, fast_port], json!({})).await;
    let start = now_ms() + 1_500;
    // 100 calls of `sloth` that each take 5 s, due first; then `acme`'s 300, over 3 s.
    let mut commands: Vec<Value> = (0..100)
        .map(|i| {
            let id = format!("slow-{i:03}");
            hook_timer(
                "sloth",
                &id,
                start,
                format!("http://127.0.0.1:{slow_port}/sloth/slow/{id}"),
            )
        })
        .collect();
    let mut due = HashMap::new();
    for i in 0..300i64 {
        let id = format!("fast-{i:03}");
        let at = start + 100 + i * 10;
        due.insert(format!("/acme/ok/{id}"), at);
        commands.push(hook_timer(
            "acme",
            &id,
            at,
            format!("http://127.0.0.1:{fast_port}/acme/ok/{id}"),
        ));
    }
    for chunk in commands.chunks(100) {
        service.schedule_batch(chunk).await;
    }
    let arrived = wait_for(Duration::from_secs(60), || async {
        let by_id = fast.by_id("/acme/");
        (by_id.len() >= 300).then_some(by_id)
    })
    .await
    .unwrap_or_else(|| service.fail(format!("{} of 300 arrived", fast.by_id("/acme/").len())));
    let late: Vec<i64> = arrived
        .values()
        .map(|c| c[0].at_ms - due[&c[0].path])
        .collect();
    assert!(late.iter().all(|l| *l >= 0), "none early");
    let (p50, p99, max) = percentiles(late);
    let slow_started = slow.calls().len();
    println!(
        "beside a receiver taking 5 s a call ({slow_started} of its calls started), the other \
         tenant's lateness: p50 {p50} ms, p99 {p99} ms, max {max} ms"
    );
    assert!(slow_started >= 1, "the slow receiver was called");
    assert!(p99 <= 50, "p99 {p99} ms beside a slow receiver");
    service.terminate().await;
}

/// Tenants calling one host take its turns in turn: `sloth`'s backlog there (20 calls of 5 s;
/// 2 run at once, 6 more may wait, the rest are handed back) neither keeps `acme`'s calls to the
/// same host out nor makes them wait behind all of it: acme's first call gets the second turn
/// that ends (about 5 s), where behind sloth's line it would wait three rounds (15 s) more. The
/// fires sloth has beyond its line are handed back for as long as its line takes to move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_calling_one_host_take_its_turns_in_turn() {
    let _alone = ALONE.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (receiver, port, _task) = receiver().await;
    let limits = json!({"per_host_concurrency": 2, "per_host_waiting": 6});
    let service = service_with(dir.path(), &[port], json!({}), limits).await;
    let now = now_ms();
    // `count` timers of `tenant` due at `due`, calling `/<tenant>/<kind>/<kind>-<i>` of the port.
    let hooks = |tenant: &str, kind: &str, count: usize, due: i64| -> Vec<Value> {
        (0..count)
            .map(|i| {
                let id = format!("{kind}-{i:02}");
                let url = format!("http://127.0.0.1:{port}/{tenant}/{kind}/{id}");
                hook_timer(tenant, &id, due, url)
            })
            .collect()
    };
    service
        .schedule_batch(&hooks("sloth", "slow", 20, now))
        .await;
    let running = wait_for(Duration::from_secs(10), || async {
        (receiver.by_id("/sloth/").len() >= 2).then_some(())
    })
    .await;
    assert!(running.is_some(), "sloth's first calls started");
    let due = now_ms();
    service.schedule_batch(&hooks("acme", "ok", 2, due)).await;
    let first = wait_for(Duration::from_secs(40), || async {
        receiver
            .by_id("/acme/")
            .values()
            .map(|calls| calls[0].at_ms)
            .min()
    })
    .await
    .unwrap_or_else(|| service.fail("acme's calls never came through"));
    println!(
        "beside a backlog of another tenant at the same host, the first call came {} ms after \
         its due time",
        first - due
    );
    assert!(
        first - due < 12_000,
        "acme's first call came {} ms after its due time: behind sloth's line",
        first - due
    );
    let both = wait_for(Duration::from_secs(30), || async {
        (receiver.by_id("/acme/").len() == 2).then_some(())
    })
    .await;
    assert!(both.is_some(), "acme's second call came through too");
    // sloth's 12 fires beyond its line were handed back until its line may have moved (4 s at
    // first, then rounds of 5 s calls), not claimed and handed back every second (about 120
    // times by now).
    let took = now_ms() - now;
    let text = service.text("/metrics").await;
    let busy: f64 = text
        .lines()
        .filter(|l| l.starts_with("timer_webhook_calls") && l.contains("outcome=\"busy\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    println!("{busy} fires handed back in {took} ms");
    assert!(
        busy <= 60.0,
        "{busy} fires handed back in {took} ms: a backlog claimed again every second"
    );
    service.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_and_metadata_urls_are_refused_at_schedule_time() {
    // Starting a service is load the lateness measurements would see.
    let _alone = ALONE.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let file = write_config(
        dir.path(),
        &json!({
            "store": {"kind": "sqlite", "url": format!("sqlite://{}", dir.path().join("timers.db").display())},
            "broker": {"kind": "memory"},
            "targets": {"allow": ["http://169.254.169.254", "http://10.0.0.1", "http://127.0.0.1",
                                  "http://localhost", "https://hooks.example.com/acme/"]},
        }),
    );
    let service = Service::start(
        Path::new(BIN),
        dir.path(),
        &[("TIMER_CONFIG", file.display().to_string())],
    )
    .await;
    let far = now_ms() + 3_600_000;
    for (url, says) in [
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("http://10.0.0.1/hook", "private"),
        ("http://127.0.0.1:9/hook", "loopback"),
        ("http://localhost:9/hook", "loopback name"),
        ("https://hooks.example.com/globex/x", "targets.allow"),
        ("ftp://hooks.example.com/acme/x", "not http or https"),
        // The same addresses written otherwise.
        ("http://2130706433/hook", "loopback"),
        ("http://0x7f.1/hook", "loopback"),
        ("http://[::127.0.0.1]/hook", "loopback"),
        ("http://[::ffff:169.254.169.254]/", "link-local"),
        ("http://[64:ff9b::a00:1]/", "NAT64"),
    ] {
        let command = hook_timer("acme", "t", far, url.to_owned());
        let (status, v) = service.post("/v1/timers", command.to_string()).await;
        assert_eq!(status, 400, "{url}: {v}");
        assert_eq!(v["error"]["reason"], "invalid_target", "{url}: {v}");
        assert_eq!(v["error"]["field"], "target", "{url}: {v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{url}: {message}");
    }
    let ok = hook_timer(
        "acme",
        "ok",
        far,
        "https://hooks.example.com/acme/due".into(),
    );
    let (status, v) = service.post("/v1/timers", ok.to_string()).await;
    assert_eq!(status, 201, "a public URL the tenant may call: {v}");
    // A message header HTTP cannot carry, or one the service sets itself.
    let mut bad = hook_timer(
        "acme",
        "bad-header",
        far,
        "https://hooks.example.com/acme/due".into(),
    );
    bad["message"] = json!({"body": {}, "headers": {"webhook-signature": "v1,forged"}});
    let (status, v) = service.post("/v1/timers", bad.to_string()).await;
    assert_eq!(
        (status, &v["error"]["field"]),
        (400, &json!("message")),
        "{v}"
    );
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("message.headers.webhook-signature: set by the service itself"),
        "{message}"
    );
    service.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_killed_mid_run_loses_no_call() {
    // Its load would be in the others' measurements.
    let _alone = ALONE.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (receiver, port, _task) = receiver().await;
    // A short lease: the killed instance's claims come back soon after the restart.
    let engine = json!({"lease": "2s"});
    let service = service(dir.path(), &[port], engine.clone()).await;
    let start = now_ms() + 1_000;
    let n = 2_000i64;
    let commands: Vec<Value> = (0..n)
        .map(|i| {
            let id = format!("k-{i:04}");
            hook_timer(
                "acme",
                &id,
                start + i * 2,
                format!("http://127.0.0.1:{port}/acme/ok/{id}"),
            )
        })
        .collect();
    for chunk in commands.chunks(500) {
        service.schedule_batch(chunk).await;
    }
    let half = wait_for(Duration::from_secs(60), || async {
        (receiver.by_id("/acme/ok/").len() >= n as usize / 2).then_some(())
    })
    .await;
    if half.is_none() {
        service.fail("half the calls never arrived");
    }
    service.kill9().await;
    let at_kill = receiver.by_id("/acme/ok/").len();
    let service = self::service(dir.path(), &[port], engine).await;
    let all = wait_for(Duration::from_secs(60), || async {
        let by_path: std::collections::HashSet<String> =
            receiver.calls().into_iter().map(|c| c.path).collect();
        (by_path.len() == n as usize).then_some(by_path)
    })
    .await;
    let Some(all) = all else {
        service.fail(format!(
            "{} of {n} calls arrived after the kill",
            receiver.by_id("/acme/ok/").len()
        ));
    };
    let calls = receiver.calls();
    println!(
        "killed after {at_kill} of {n} calls; all {} arrived, {} calls in all (repeats of a \
         fire the killed instance made but did not settle)",
        all.len(),
        calls.len()
    );
    assert!(at_kill < n as usize, "killed mid-run");
    // A repeat is the same fire: the same webhook-id for one path.
    let mut ids: HashMap<String, String> = HashMap::new();
    for call in &calls {
        let id = ids.entry(call.path.clone()).or_insert_with(|| call.id());
        assert_eq!(*id, call.id(), "{}: one fire, one webhook-id", call.path);
    }
    let v = wait_for(Duration::from_secs(30), || async {
        let text = service.text("/v1/status").await;
        let v: Value = serde_json::from_str(&text).unwrap_or_default();
        (v["timers"]["pending"] == 0 && v["timers"]["failed"] == 0).then_some(v)
    })
    .await;
    assert!(v.is_some(), "every timer settled");
    service.terminate().await;
}
