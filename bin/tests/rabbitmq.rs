//! The `rabbitmq` broker end to end: 10,000 commands published with an AMQP client, 10,000
//! events consumed back, each once (a repeat only with the same message id), with RabbitMQ
//! restarted in the middle; a malformed command in the dead-letter queue with its reason; a
//! one-line error for an unreachable server. Needs `TIMER_TEST_RABBITMQ_URL` and
//! `TIMER_TEST_RABBITMQ_DIR` (bash scripts/test.sh starts RabbitMQ).

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions,
    ConfirmSelectOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use libtest_mimic::Arguments;
use serde_json::{json, Value};
use timer_brokers::rabbitmq::{RabbitmqConfig, REASON_HEADER};
use timer_conformance::e2e::{percentiles, ScriptedServer, Service};
use timer_conformance::fixtures::RABBITMQ_URL_VAR;
use timer_conformance::{server_trial, wait_for};

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");
const DIR_VAR: &str = "TIMER_TEST_RABBITMQ_DIR";

fn main() {
    let mut args = Arguments::from_args();
    // One trial at a time: one of them stops the shared server, which the others need.
    args.test_threads.get_or_insert(1);
    let missing = [RABBITMQ_URL_VAR, DIR_VAR]
        .iter()
        .find(|v| std::env::var(v).is_err())
        .map(|v| format!("{v} is not set (bash scripts/test.sh starts RabbitMQ)"));
    let trials = vec![
        server_trial(
            "rabbitmq::malformed_command_lands_in_the_dead_letter_queue",
            missing.clone(),
            malformed_command_lands_in_the_dead_letter_queue,
        ),
        server_trial(
            "rabbitmq::an_unroutable_event_is_retried_not_lost",
            missing.clone(),
            an_unroutable_event_is_retried_not_lost,
        ),
        server_trial(
            "rabbitmq::an_unreachable_server_is_a_one_line_error",
            missing.clone(),
            an_unreachable_server_is_a_one_line_error,
        ),
        server_trial(
            "rabbitmq::ten_thousand_timers_survive_a_broker_restart",
            missing,
            ten_thousand_timers_survive_a_broker_restart,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

fn config() -> RabbitmqConfig {
    let id = &uuid::Uuid::new_v4().simple().to_string()[..12];
    RabbitmqConfig {
        url: std::env::var(RABBITMQ_URL_VAR).expect("TIMER_TEST_RABBITMQ_URL"),
        commands_queue: format!("e{id}.commands"),
        events_exchange: format!("e{id}.events"),
        dead_letter_exchange: format!("e{id}.dead"),
        dead_letter_queue: format!("e{id}.dead"),
        ..RabbitmqConfig::default()
    }
}

fn env(dir: &Path, c: &RabbitmqConfig) -> Vec<(&'static str, String)> {
    vec![
        ("TIMER_STORE__KIND", "sqlite".into()),
        (
            "TIMER_STORE__URL",
            format!("sqlite://{}", dir.join("timers.db").display()),
        ),
        ("TIMER_BROKER__KIND", "rabbitmq".into()),
        ("TIMER_BROKER__URL", c.url.clone()),
        ("TIMER_BROKER__COMMANDS_QUEUE", c.commands_queue.clone()),
        ("TIMER_BROKER__EVENTS_EXCHANGE", c.events_exchange.clone()),
        (
            "TIMER_BROKER__DEAD_LETTER_EXCHANGE",
            c.dead_letter_exchange.clone(),
        ),
        (
            "TIMER_BROKER__DEAD_LETTER_QUEUE",
            c.dead_letter_queue.clone(),
        ),
        ("TIMER_ENGINE__RETRY_MAX", "2s".into()),
        ("TIMER_ENGINE__POLL_INTERVAL", "1s".into()),
    ]
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

async fn channel(url: &str) -> (Connection, Channel) {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("connect to rabbitmq");
    let channel = connection.create_channel().await.expect("channel");
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    (connection, channel)
}

/// A durable queue bound to the events exchange (`#`): it keeps every event, also across a
/// broker restart.
async fn bind_reader(ch: &Channel, c: &RabbitmqConfig) -> String {
    let queue = format!("{}.reader", c.events_exchange);
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(queue.as_str().into(), durable, FieldTable::default())
        .await
        .expect("reader queue");
    ch.queue_bind(
        queue.as_str().into(),
        c.events_exchange.as_str().into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("bind reader");
    queue
}

async fn publish_commands(ch: &Channel, c: &RabbitmqConfig, bodies: Vec<String>) {
    let mut confirms = Vec::new();
    for body in bodies {
        confirms.push(
            ch.basic_publish(
                "".into(),
                c.commands_queue.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .expect("publish"),
        );
        if confirms.len() == 1_000 {
            for confirm in confirms.drain(..) {
                let confirmation = confirm.await.expect("confirm");
                assert!(
                    matches!(confirmation, lapin::Confirmation::Ack(None)),
                    "{confirmation:?}"
                );
            }
        }
    }
    for confirm in confirms {
        let confirmation = confirm.await.expect("confirm");
        assert!(
            matches!(confirmation, lapin::Confirmation::Ack(None)),
            "{confirmation:?}"
        );
    }
}

async fn malformed_command_lands_in_the_dead_letter_queue() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = config();
    let service = Service::start(Path::new(BIN), dir.path(), &env(dir.path(), &c)).await;
    let (_conn, ch) = channel(&c.url).await;
    let reader = bind_reader(&ch, &c).await;
    let good = json!({"tenantId": "t", "serviceCallId": "after-bad", "dueTimeMs": now_ms()});
    publish_commands(&ch, &c, vec!["{not json".into(), good.to_string()]).await;
    let letter = wait_for(Duration::from_secs(30), || async {
        ch.basic_get(
            c.dead_letter_queue.as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await
        .ok()
        .flatten()
    })
    .await
    .expect("a dead letter");
    assert_eq!(letter.delivery.data, b"{not json");
    let reason = letter
        .delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(REASON_HEADER).cloned());
    assert!(
        matches!(&reason, Some(AMQPValue::LongString(r)) if r.to_string().starts_with("invalid_json")),
        "reason header: {reason:?}"
    );
    let event = wait_for(Duration::from_secs(30), || async {
        ch.basic_get(reader.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .ok()
            .flatten()
    })
    .await
    .expect("the good command fired");
    let v: Value = serde_json::from_slice(&event.delivery.data).expect("json");
    assert_eq!(v["aggregateId"], "after-bad");
    assert_eq!(
        event.delivery.routing_key.as_str(),
        "t",
        "routing key = tenant"
    );
    assert_eq!(
        event.delivery.properties.delivery_mode(),
        &Some(2),
        "persistent"
    );
    service.terminate().await;
    let _ = timer_brokers::rabbitmq::delete_topology(&c).await;
}

async fn an_unreachable_server_is_a_one_line_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = timer_conformance::e2e::free_addr().port();
    let out = tokio::process::Command::new(BIN)
        .arg("run")
        .current_dir(dir.path())
        .env("TIMER_STORE__KIND", "memory")
        .env("TIMER_BROKER__KIND", "rabbitmq")
        .env(
            "TIMER_BROKER__URL",
            format!("amqp://guest:secret@127.0.0.1:{port}/%2f"),
        )
        .env("TIMER_HTTP__ADDR", "127.0.0.1:0")
        .output()
        .await
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{err}");
    let last = err.lines().last().unwrap_or_default();
    let expected =
        format!("error: rabbitmq broker: cannot connect to amqp://***@127.0.0.1:{port}/%2f");
    assert!(last.starts_with(&expected), "{err}");
    assert!(!err.contains("secret"), "no password in the output: {err}");
}

/// Consumes the reader queue (acking), adding events to `seen`, until `until` says stop or the
/// connection drops.
async fn consume(url: &str, queue: &str, seen: &mut Vec<Value>, until: impl Fn(&[Value]) -> bool) {
    let Ok(connection) = Connection::connect(url, ConnectionProperties::default()).await else {
        return;
    };
    let Ok(ch) = connection.create_channel().await else {
        return;
    };
    let Ok(mut consumer) = ch
        .basic_consume(
            queue.into(),
            "test-reader".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
    else {
        return;
    };
    while !until(seen) {
        match tokio::time::timeout(Duration::from_secs(30), consumer.next()).await {
            Ok(Some(Ok(delivery))) => {
                let mut v: Value = serde_json::from_slice(&delivery.data).unwrap_or(Value::Null);
                v["_messageId"] = json!(delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|m| m.to_string()));
                seen.push(v);
                let _ = delivery.acker.ack(BasicAckOptions::default()).await;
            }
            _ => return,
        }
    }
    let _ = connection.close(200, "done".into()).await;
}

fn distinct_keys(events: &[Value]) -> usize {
    events
        .iter()
        .map(|v| format!("{}/{}", v["tenantId"], v["aggregateId"]))
        .collect::<std::collections::HashSet<_>>()
        .len()
}

async fn ten_thousand_timers_survive_a_broker_restart() {
    const N: usize = 10_000;
    let dir = tempfile::tempdir().expect("tempdir");
    let c = config();
    let port = url::Url::parse(&c.url)
        .ok()
        .and_then(|u| u.port())
        .unwrap_or(5672);
    let service = Service::start(Path::new(BIN), dir.path(), &env(dir.path(), &c)).await;
    let (conn, ch) = channel(&c.url).await;
    let reader = bind_reader(&ch, &c).await;
    let due_from = now_ms() + 4_000;
    let bodies: Vec<String> = (0..N)
        .map(|i| {
            json!({"tenantId": format!("tenant-{}", i % 7), "serviceCallId": format!("r{i:05}"),
                   "dueTimeMs": due_from + (i as i64 * 8_000) / N as i64})
            .to_string()
        })
        .collect();
    publish_commands(&ch, &c, bodies).await;
    let _ = conn.close(200, "done".into()).await;

    let mut events = Vec::new();
    consume(&c.url, &reader, &mut events, |seen| seen.len() >= 3_000).await;
    assert!(
        distinct_keys(&events) < N,
        "the restart comes while timers are still firing"
    );
    let dir_var = std::env::var(DIR_VAR).expect("TIMER_TEST_RABBITMQ_DIR");
    let server = ScriptedServer::new("rabbitmq", dir_var, "RABBITMQ_PORT", port);
    let guard = server.restart_guard();
    server.run("stop").await;
    server.run("start").await;
    drop(guard);
    println!(
        "restarted RabbitMQ after {} events were consumed",
        events.len()
    );

    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    while distinct_keys(&events) < N && tokio::time::Instant::now() < deadline {
        consume(&c.url, &reader, &mut events, |seen| {
            distinct_keys(seen) >= N
        })
        .await;
    }
    assert_eq!(
        distinct_keys(&events),
        N,
        "every timer fired; log:\n{}",
        service.log_text()
    );
    let mut ids: HashMap<String, Vec<String>> = HashMap::new();
    let mut late = Vec::new();
    for v in &events {
        let key = format!("{}/{}", v["tenantId"], v["aggregateId"]);
        ids.entry(key)
            .or_default()
            .push(v["_messageId"].as_str().unwrap_or_default().to_owned());
        let due = chrono::DateTime::parse_from_rfc3339(
            v["payload"]["dueAt"].as_str().unwrap_or_default(),
        )
        .map(|d| d.timestamp_millis())
        .unwrap_or(0);
        late.push(v["timestampMs"].as_i64().unwrap_or(0) - due);
    }
    for (key, list) in &ids {
        assert!(
            list.iter().all(|id| *id == list[0] && !id.is_empty()),
            "{key}: {list:?}"
        );
    }
    let repeated = ids.values().filter(|l| l.len() > 1).count();
    let (p50, p99, max) = percentiles(late);
    println!(
        "{N} timers through RabbitMQ with a restart: {} events consumed, {repeated} delivered \
         twice (same message id); lateness ms p50 {p50} p99 {p99} max {max}",
        events.len()
    );
    let ready = wait_for(Duration::from_secs(30), || async {
        (service.get("/readyz").await.0 == 200).then_some(())
    })
    .await;
    assert!(ready.is_some(), "the service is ready again");
    assert_eq!(service.terminate().await, Some(0));
    let _ = timer_brokers::rabbitmq::delete_topology(&c).await;
}

async fn an_unroutable_event_is_retried_not_lost() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = config();
    let mut environment = env(dir.path(), &c);
    environment.push(("TIMER_ENGINE__RETRY_BASE", "100ms".into()));
    environment.push(("TIMER_ENGINE__RETRY_MAX", "200ms".into()));
    let service = Service::start(Path::new(BIN), dir.path(), &environment).await;
    let (status, v) = service
        .post(
            "/v1/timers",
            json!({"tenantId": "t", "serviceCallId": "nobody-listens", "dueTimeMs": now_ms()})
                .to_string(),
        )
        .await;
    assert_eq!(status, 201, "{v}");
    // No queue is bound to the events exchange: RabbitMQ returns the event, the timer stays.
    let failing = wait_for(Duration::from_secs(30), || async {
        let (_, t) = service.get("/v1/tenants/t/timers/nobody-listens").await;
        (t["attempts"].as_u64()? >= 1).then_some(t)
    })
    .await
    .expect("publish attempts recorded");
    assert_eq!(failing["state"], "Scheduled", "{failing}");
    assert!(
        failing["lastError"]
            .as_str()
            .unwrap_or("")
            .contains("no queue is bound"),
        "{failing}"
    );
    // Once a queue is bound, the retry delivers it.
    let (_conn, ch) = channel(&c.url).await;
    let reader = bind_reader(&ch, &c).await;
    let event = wait_for(Duration::from_secs(30), || async {
        ch.basic_get(reader.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .ok()
            .flatten()
    })
    .await
    .expect("delivered after the binding");
    let v: Value = serde_json::from_slice(&event.delivery.data).expect("json");
    assert_eq!(v["aggregateId"], "nobody-listens");
    service.terminate().await;
    let _ = timer_brokers::rabbitmq::delete_topology(&c).await;
}
