//! The `nats` broker end to end: 10,000 `ScheduleTimer` published with a NATS client, 10,000
//! `DueTimeReached` read back from the events stream, each once (a repeat only with the same
//! envelope id), with nats-server killed (SIGKILL) and restarted in the middle; and a malformed
//! command dead-lettered with its reason while the stream keeps flowing. Needs
//! `TIMER_TEST_NATS_URL` and `TIMER_TEST_NATS_DIR` (bash scripts/test.sh starts nats-server).

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use libtest_mimic::Arguments;
use serde_json::{json, Value};
use timer_brokers::nats::{NatsConfig, REASON_HEADER};
use timer_conformance::e2e::{percentiles, ScriptedServer, Service};
use timer_conformance::fixtures::NATS_URL_VAR;
use timer_conformance::{server_trial, wait_for};

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");
const DIR_VAR: &str = "TIMER_TEST_NATS_DIR";

fn main() {
    let mut args = Arguments::from_args();
    // One trial at a time: one of them stops the shared server, which the others need.
    args.test_threads.get_or_insert(1);
    let missing = [NATS_URL_VAR, DIR_VAR]
        .iter()
        .find(|v| std::env::var(v).is_err())
        .map(|v| format!("{v} is not set (bash scripts/test.sh starts nats-server)"));
    let trials = vec![
        server_trial(
            "nats::malformed_command_is_dead_lettered_and_the_stream_keeps_flowing",
            missing.clone(),
            malformed_command_is_dead_lettered,
        ),
        server_trial(
            "nats::service_killed_during_ingest_loses_no_command",
            missing.clone(),
            || service_killed_during_ingest_loses_no_command(Backend::Sqlite),
        ),
        #[cfg(feature = "postgres")]
        server_trial(
            "nats::service_on_postgres_killed_during_ingest_loses_no_command",
            missing.clone().or_else(|| {
                std::env::var(timer_conformance::fixtures::POSTGRES_URL_VAR)
                    .is_err()
                    .then(|| "TIMER_TEST_POSTGRES_URL is not set".to_owned())
            }),
            || service_killed_during_ingest_loses_no_command(Backend::Postgres),
        ),
        server_trial(
            "nats::ten_thousand_timers_through_nats_survive_a_server_kill",
            missing.clone(),
            ten_thousand_timers_survive_a_server_kill,
        ),
        server_trial(
            "nats::a_stream_with_other_subjects_is_an_error_not_an_overwrite",
            missing.clone(),
            a_stream_with_other_subjects_is_an_error,
        ),
        server_trial(
            "nats::cron_every_second_in_berlin_fires_one_catch_up_after_a_stop",
            missing.clone(),
            cron_every_second_survives_a_stop,
        ),
        server_trial(
            "nats::an_unreachable_server_is_a_one_line_error",
            missing,
            an_unreachable_server_is_a_one_line_error,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

/// Streams and subjects of this test's own on the test server.
fn config() -> NatsConfig {
    let id = &uuid::Uuid::new_v4().simple().to_string()[..12];
    NatsConfig {
        url: std::env::var(NATS_URL_VAR).expect("TIMER_TEST_NATS_URL"),
        commands_stream: format!("EC_{id}"),
        commands_subject: format!("e{id}.commands.>"),
        consumer: format!("e{id}"),
        events_stream: format!("EE_{id}"),
        events_subject: format!("e{id}.events"),
        dead_letter_stream: format!("ED_{id}"),
        dead_letter_subject: format!("e{id}.dead"),
        ..NatsConfig::default()
    }
}

fn env(dir: &Path, c: &NatsConfig) -> Vec<(&'static str, String)> {
    vec![
        ("TIMER_STORE__KIND", "sqlite".into()),
        (
            "TIMER_STORE__URL",
            format!("sqlite://{}", dir.join("timers.db").display()),
        ),
        ("TIMER_BROKER__KIND", "nats".into()),
        ("TIMER_BROKER__URL", c.url.clone()),
        ("TIMER_BROKER__COMMANDS_STREAM", c.commands_stream.clone()),
        ("TIMER_BROKER__COMMANDS_SUBJECT", c.commands_subject.clone()),
        ("TIMER_BROKER__CONSUMER", c.consumer.clone()),
        ("TIMER_BROKER__EVENTS_STREAM", c.events_stream.clone()),
        ("TIMER_BROKER__EVENTS_SUBJECT", c.events_subject.clone()),
        (
            "TIMER_BROKER__DEAD_LETTER_STREAM",
            c.dead_letter_stream.clone(),
        ),
        (
            "TIMER_BROKER__DEAD_LETTER_SUBJECT",
            c.dead_letter_subject.clone(),
        ),
        ("TIMER_BROKER__ACK_WAIT", "5s".into()),
        ("TIMER_ENGINE__RETRY_MAX", "2s".into()),
        ("TIMER_ENGINE__POLL_INTERVAL", "1s".into()),
    ]
}

async fn client(url: &str) -> jetstream::Context {
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(url)
        .await
        .expect("connect to nats");
    jetstream::new(client)
}

/// Every message of `stream` from the start (a throwaway consumer per call).
async fn read_all(js: &jetstream::Context, stream: &str) -> Option<Vec<jetstream::Message>> {
    let stream = js.get_stream(stream).await.ok()?;
    let reader = stream
        .create_consumer(consumer::pull::Config {
            ack_policy: consumer::AckPolicy::None,
            deliver_policy: consumer::DeliverPolicy::All,
            inactive_threshold: Duration::from_secs(30),
            ..Default::default()
        })
        .await
        .ok()?;
    let mut out = Vec::new();
    loop {
        let mut batch = reader.fetch().max_messages(5_000).messages().await.ok()?;
        let before = out.len();
        while let Some(message) = batch.next().await {
            out.push(message.ok()?);
        }
        if out.len() == before {
            return Some(out);
        }
    }
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

async fn publish_commands(js: &jetstream::Context, c: &NatsConfig, bodies: Vec<String>) {
    let subject = c.commands_subject.replace('>', "test");
    let mut acks = Vec::new();
    for body in bodies {
        acks.push(
            js.publish(subject.clone(), body.into())
                .await
                .expect("publish"),
        );
        if acks.len() == 1_000 {
            for ack in acks.drain(..) {
                ack.await.expect("PubAck");
            }
        }
    }
    for ack in acks {
        ack.await.expect("PubAck");
    }
}

async fn malformed_command_is_dead_lettered() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = config();
    let service = Service::start(Path::new(BIN), dir.path(), &env(dir.path(), &c)).await;
    let js = client(&c.url).await;
    let good = json!({"tenantId": "t", "serviceCallId": "after-bad", "dueTimeMs": now_ms()});
    publish_commands(&js, &c, vec!["{not json".into(), good.to_string()]).await;
    let letters = wait_for(Duration::from_secs(30), || async {
        read_all(&js, &c.dead_letter_stream)
            .await
            .filter(|l| !l.is_empty())
    })
    .await
    .expect("a dead letter");
    assert_eq!(letters[0].payload.as_ref(), b"{not json");
    let reason = letters[0]
        .headers
        .as_ref()
        .and_then(|h| h.get(REASON_HEADER))
        .map(|v| v.as_str().to_owned())
        .unwrap_or_default();
    assert!(
        reason.starts_with("invalid_json"),
        "reason header: {reason:?}"
    );
    let events = wait_for(Duration::from_secs(30), || async {
        read_all(&js, &c.events_stream)
            .await
            .filter(|e| !e.is_empty())
    })
    .await
    .expect("the good command fired");
    let v: Value = serde_json::from_slice(&events[0].payload).expect("json");
    assert_eq!(v["aggregateId"], "after-bad");
    assert_eq!(
        events[0].subject.as_str(),
        format!("{}.t", c.events_subject)
    );
    service.terminate().await;
    let _ = timer_brokers::nats::delete_streams(&c).await;
}

async fn ten_thousand_timers_survive_a_server_kill() {
    const N: usize = 10_000;
    let dir = tempfile::tempdir().expect("tempdir");
    let c = config();
    let port = url::Url::parse(&c.url)
        .ok()
        .and_then(|u| u.port())
        .unwrap_or(4222);
    let service = Service::start(Path::new(BIN), dir.path(), &env(dir.path(), &c)).await;
    let js = client(&c.url).await;
    let due_from = now_ms() + 4_000;
    let bodies: Vec<String> = (0..N)
        .map(|i| {
            json!({"tenantId": format!("tenant-{}", i % 7), "serviceCallId": format!("n{i:05}"),
                   "dueTimeMs": due_from + (i as i64 * 6_000) / N as i64})
            .to_string()
        })
        .collect();
    publish_commands(&js, &c, bodies).await;

    // Kill the server once firing is well under way, then start it again on the same files.
    let before = wait_for(Duration::from_secs(60), || async {
        read_all(&js, &c.events_stream)
            .await
            .filter(|e| e.len() >= 3_000)
    })
    .await
    .expect("firing started");
    let dir_var = std::env::var(DIR_VAR).expect("dir");
    let pid = std::fs::read_to_string(Path::new(&dir_var).join("nats.pid")).expect("pid file");
    let server = ScriptedServer::new("nats", dir_var.clone(), "NATS_PORT", port);
    let guard = server.restart_guard();
    let status = tokio::process::Command::new("kill")
        .args(["-KILL", pid.trim()])
        .status()
        .await
        .expect("kill");
    assert!(status.success());
    server.run("start").await;
    drop(guard);
    println!(
        "killed nats-server after {} events were stored; restarted it",
        before.len()
    );
    assert!(
        before.len() < N,
        "the kill came while timers were still firing"
    );

    let events = wait_for(Duration::from_secs(180), || async {
        let all = read_all(&js, &c.events_stream).await?;
        let keys: std::collections::HashSet<Vec<u8>> = all
            .iter()
            .filter_map(|m| serde_json::from_slice::<Value>(&m.payload).ok())
            .map(|v| format!("{}/{}", v["tenantId"], v["aggregateId"]).into_bytes())
            .collect();
        (keys.len() >= N).then_some(all)
    })
    .await
    .unwrap_or_else(|| panic!("not every timer fired; log:\n{}", service.log_text()));
    let mut ids_by_key: HashMap<String, Vec<String>> = HashMap::new();
    let mut late = Vec::new();
    for m in &events {
        let v: Value = serde_json::from_slice(&m.payload).expect("json");
        let key = format!("{}/{}", v["tenantId"], v["aggregateId"]);
        ids_by_key
            .entry(key)
            .or_default()
            .push(v["id"].as_str().unwrap_or_default().to_owned());
        let due = chrono::DateTime::parse_from_rfc3339(
            v["payload"]["dueAt"].as_str().unwrap_or_default(),
        )
        .map(|d| d.timestamp_millis())
        .unwrap_or(0);
        late.push(v["timestampMs"].as_i64().unwrap_or(0) - due);
    }
    assert_eq!(ids_by_key.len(), N, "every timer fired");
    let repeated = ids_by_key.values().filter(|ids| ids.len() > 1).count();
    for (key, ids) in &ids_by_key {
        assert!(
            ids.iter().all(|id| *id == ids[0]),
            "{key}: repeats only with the same id: {ids:?}"
        );
    }
    let (p50, p99, max) = percentiles(late);
    println!(
        "{N} timers through NATS with a server kill: {} events stored, {repeated} timers \
         stored twice (same id); lateness ms p50 {p50} p99 {p99} max {max}",
        events.len()
    );
    let ready = wait_for(Duration::from_secs(30), || async {
        (service.get("/readyz").await.0 == 200).then_some(())
    })
    .await;
    assert!(ready.is_some(), "the service is ready again");
    assert_eq!(service.terminate().await, Some(0));
    let _ = timer_brokers::nats::delete_streams(&c).await;
}

async fn a_stream_with_other_subjects_is_an_error() {
    let c = config();
    let js = client(&c.url).await;
    js.create_stream(jetstream::stream::Config {
        name: c.events_stream.clone(),
        subjects: vec!["somebody.else.>".into()],
        ..Default::default()
    })
    .await
    .expect("create a foreign stream");
    let err = match timer_brokers::nats::NatsBroker::connect(&c).await {
        Ok(_) => panic!("connecting over a mismatching stream must fail"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains(&c.events_stream) && err.contains("somebody.else.>"),
        "{err}"
    );
    assert!(
        err.contains("broker.events_subject"),
        "names the key: {err}"
    );
    let info = js
        .get_stream(&c.events_stream)
        .await
        .expect("still there")
        .cached_info()
        .clone();
    assert_eq!(
        info.config.subjects,
        vec!["somebody.else.>".to_string()],
        "left unchanged"
    );
    let _ = timer_brokers::nats::delete_streams(&c).await;
}

async fn an_unreachable_server_is_a_one_line_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = timer_conformance::e2e::free_addr().port();
    let out = tokio::process::Command::new(BIN)
        .arg("run")
        .current_dir(dir.path())
        .env("TIMER_STORE__KIND", "memory")
        .env("TIMER_BROKER__KIND", "nats")
        .env(
            "TIMER_BROKER__URL",
            format!("nats://user:secret@127.0.0.1:{port}"),
        )
        .env("TIMER_BROKER__CONNECT_TIMEOUT", "2s")
        .env("TIMER_HTTP__ADDR", "127.0.0.1:0")
        .output()
        .await
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.starts_with(&format!(
            "error: nats broker: cannot connect to nats://***@127.0.0.1:{port}"
        )),
        "{err}"
    );
    assert!(!err.contains("secret"), "no password in the output: {err}");
}

/// Where the service under test keeps its timers.
#[derive(Clone, Copy)]
enum Backend {
    Sqlite,
    #[cfg(feature = "postgres")]
    Postgres,
}

/// The store settings for `backend`, and a handle on the same store for the test to count with.
async fn backend(
    kind: Backend,
    dir: &Path,
) -> (
    Vec<(&'static str, String)>,
    std::sync::Arc<dyn timer_core::Store>,
) {
    match kind {
        Backend::Sqlite => {
            let db = dir.join("timers.db");
            let store = timer_stores::sqlite::SqliteStore::open(
                &timer_stores::sqlite::SqliteConfig::for_path(&db),
            )
            .await
            .expect("open the file");
            (
                vec![
                    ("TIMER_STORE__KIND", "sqlite".to_owned()),
                    ("TIMER_STORE__URL", format!("sqlite://{}", db.display())),
                ],
                std::sync::Arc::new(store),
            )
        }
        #[cfg(feature = "postgres")]
        Backend::Postgres => {
            let url = std::env::var(timer_conformance::fixtures::POSTGRES_URL_VAR).expect("url");
            let schema = format!(
                "ingest_{}",
                &uuid::Uuid::new_v4().simple().to_string()[..12]
            );
            let store = timer_stores::postgres::PostgresStore::open(
                &timer_stores::postgres::PostgresConfig {
                    url: url.clone(),
                    schema: schema.clone(),
                    ..Default::default()
                },
            )
            .await
            .expect("open the schema");
            (
                vec![
                    ("TIMER_STORE__KIND", "postgres".to_owned()),
                    ("TIMER_STORE__URL", url),
                    ("TIMER_STORE__SCHEMA", schema),
                ],
                std::sync::Arc::new(store),
            )
        }
    }
}

/// kill -9 of the service while it ingests: commands it had not acknowledged come back from
/// the durable consumer after the restart; every acknowledged one was committed first.
async fn service_killed_during_ingest_loses_no_command(kind: Backend) {
    const N: usize = 10_000;
    let dir = tempfile::tempdir().expect("tempdir");
    let c = config();
    let (store_env, store) = backend(kind, dir.path()).await;
    let mut environment = env(dir.path(), &c);
    environment.retain(|(k, _)| !k.starts_with("TIMER_STORE__"));
    environment.extend(store_env);
    let service = Service::start(Path::new(BIN), dir.path(), &environment).await;
    let js = client(&c.url).await;
    let due_from = now_ms() + 20_000;
    let bodies: Vec<String> = (0..N)
        .map(|i| {
            json!({"tenantId": "t", "serviceCallId": format!("i{i:05}"),
                   "dueTimeMs": due_from + (i as i64 * 2_000) / N as i64})
            .to_string()
        })
        .collect();
    publish_commands(&js, &c, bodies).await;
    let mid = wait_for(Duration::from_secs(60), || async {
        let n = store.scheduled_count().await.ok()?;
        (n > 0).then_some(n)
    })
    .await
    .expect("ingest started");
    service.kill9().await;
    let stored_at_kill = store.scheduled_count().await.expect("pending");
    println!(
        "killed the service ({}) during ingest: {mid} stored when seen, {stored_at_kill} after the kill",
        store.name()
    );
    assert!(
        stored_at_kill < N as u64,
        "the kill came before ingest finished"
    );
    let service = Service::start(Path::new(BIN), dir.path(), &environment).await;
    let all = wait_for(Duration::from_secs(60), || async {
        (store.scheduled_count().await.ok()? >= N as u64).then_some(())
    })
    .await;
    assert!(
        all.is_some(),
        "every command stored after the restart; log:\n{}",
        service.log_text()
    );
    let events = wait_for(Duration::from_secs(90), || async {
        read_all(&js, &c.events_stream).await.filter(|e| {
            let timers: std::collections::HashSet<String> = e
                .iter()
                .filter_map(|m| serde_json::from_slice::<Value>(&m.payload).ok())
                .map(|v| v["aggregateId"].to_string())
                .collect();
            timers.len() >= N
        })
    })
    .await;
    assert!(events.is_some(), "every timer fired");
    service.terminate().await;
    let _ = timer_brokers::nats::delete_streams(&c).await;
}

/// One occurrence as read from the events stream.
struct Occurrence {
    n: i64,
    id: String,
    due: i64,
    fired: i64,
}

async fn occurrences(js: &jetstream::Context, stream: &str) -> Vec<Occurrence> {
    let mut seen = std::collections::HashSet::new();
    let mut out: Vec<Occurrence> = read_all(js, stream)
        .await
        .unwrap_or_default()
        .iter()
        .filter_map(|m| serde_json::from_slice::<Value>(&m.payload).ok())
        .map(|v| Occurrence {
            n: v["payload"]["occurrence"].as_i64().unwrap_or(0),
            id: v["id"].as_str().unwrap_or_default().to_owned(),
            due: chrono::DateTime::parse_from_rfc3339(
                v["payload"]["dueAt"].as_str().unwrap_or_default(),
            )
            .map(|d| d.timestamp_millis())
            .unwrap_or(0),
            fired: v["timestampMs"].as_i64().unwrap_or(0),
        })
        // A repeat of one fire carries the same id; count each fire once.
        .filter(|o| seen.insert(o.id.clone()))
        .collect();
    out.sort_by_key(|o| o.due);
    out
}

/// Issue #11: `*/1 * * * * *` in Europe/Berlin fires every second for 10 s; the service is
/// stopped for 5 s and started again: exactly one catch-up fire, then the rhythm continues.
async fn cron_every_second_survives_a_stop() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = config();
    let environment = env(dir.path(), &c);
    let service = Service::start(Path::new(BIN), dir.path(), &environment).await;
    let js = client(&c.url).await;
    let command = json!({"tenantId": "t", "serviceCallId": "tick", "cron": "*/1 * * * * *",
                         "timeZone": "Europe/Berlin"});
    publish_commands(&js, &c, vec![command.to_string()]).await;
    let before = wait_for(Duration::from_secs(40), || async {
        let o = occurrences(&js, &c.events_stream).await;
        (o.len() >= 10).then_some(o)
    })
    .await
    .unwrap_or_else(|| panic!("10 occurrences; log:\n{}", service.log_text()));
    assert_eq!(service.terminate().await, Some(0));
    let stopped_at = now_ms();
    let fired_before = occurrences(&js, &c.events_stream).await.len();
    // The scenario's downtime (what is tested is what happens after it, not a wait for a
    // condition).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let restarted_at = now_ms();
    let service = Service::start(Path::new(BIN), dir.path(), &environment).await;
    let all = wait_for(Duration::from_secs(40), || async {
        let o = occurrences(&js, &c.events_stream).await;
        (o.len() >= fired_before + 4).then_some(o)
    })
    .await
    .unwrap_or_else(|| panic!("firing resumed; log:\n{}", service.log_text()));
    assert_eq!(service.terminate().await, Some(0));

    // Every second for the first ten, numbered in order (a fire more than a second late, on a
    // loaded box, moves the next one to the following second).
    for pair in before.windows(2).take(9) {
        let gap = pair[1].due - pair[0].due;
        assert!(gap >= 1_000 && gap % 1_000 == 0, "one per second: {gap} ms");
        assert_eq!(pair[1].n, pair[0].n + 1, "numbered in order");
    }
    let catch_ups: Vec<&Occurrence> = all
        .iter()
        .filter(|o| o.due < restarted_at && o.fired >= restarted_at)
        .collect();
    assert_eq!(
        catch_ups.len(),
        1,
        "exactly one catch-up fire for the occurrences missed while stopped"
    );
    let catch_up = catch_ups[0];
    assert!(
        catch_up.due >= stopped_at - 1_000,
        "it is the first missed one"
    );
    let after: Vec<&Occurrence> = all.iter().filter(|o| o.due > catch_up.due).collect();
    assert!(after.len() >= 3, "the rhythm continues");
    assert!(
        after[0].due >= restarted_at,
        "no backlog: the next occurrence lies after the restart"
    );
    for pair in after.windows(2) {
        let gap = pair[1].due - pair[0].due;
        assert!(
            gap >= 1_000 && gap % 1_000 == 0,
            "one per second again: {gap} ms"
        );
    }
    let late: Vec<i64> = before.iter().map(|o| o.fired - o.due).collect();
    let (p50, p99, max) = percentiles(late);
    println!(
        "cron every second: {} fires before the stop (lateness ms p50 {p50} p99 {p99} max \
         {max}), stopped {} ms, one catch-up {} ms late, {} on time after it",
        before.len(),
        restarted_at - stopped_at,
        catch_up.fired - catch_up.due,
        after.len()
    );
    let _ = timer_brokers::nats::delete_streams(&c).await;
}
