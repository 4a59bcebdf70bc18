//! The `kafka` broker end to end against a real Kafka-protocol server (tansu): 10,000
//! `ScheduleTimer` produced by an ordinary Kafka client and 10,000 `DueTimeReached` consumed back,
//! each once (a repeat only with the same envelope id), with the service stopped and restarted
//! during ingest (it resumes from its committed offsets) and tansu killed (SIGKILL) and restarted
//! while timers fire; two instances in one consumer group splitting the partitions; a malformed
//! command dead-lettered with its reason; clear errors for a missing topic and an unreachable
//! server. Needs `TIMER_TEST_KAFKA_BROKERS` and `TIMER_TEST_KAFKA_DIR` (bash scripts/test.sh
//! starts tansu).

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use libtest_mimic::Arguments;
use serde_json::{json, Value};
use timer_brokers::kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use timer_brokers::kafka::rdkafka::message::{Headers, Message};
use timer_brokers::kafka::rdkafka::{Offset, TopicPartitionList};
use timer_brokers::kafka::{client_config, KafkaConfig, EVENT_ID_HEADER, REASON_HEADER};
use timer_conformance::e2e::{percentiles, ScriptedServer, Service};
use timer_conformance::fixtures::kafka::{KafkaBrokers, KafkaFixture};
use timer_conformance::fixtures::KAFKA_BROKERS_VAR;
use timer_conformance::{server_trial, wait_for};
use timer_core::Store;

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");
const DIR_VAR: &str = "TIMER_TEST_KAFKA_DIR";

fn main() {
    let mut args = Arguments::from_args();
    // One trial at a time: one of them stops the shared server, which the others need.
    args.test_threads.get_or_insert(1);
    let missing = [KAFKA_BROKERS_VAR, DIR_VAR]
        .iter()
        .find(|v| std::env::var(v).is_err())
        .map(|v| format!("{v} is not set (bash scripts/test.sh starts tansu)"));
    let trials = vec![
        server_trial(
            "kafka::malformed_command_is_dead_lettered_and_the_topic_keeps_flowing",
            missing.clone(),
            malformed_command_is_dead_lettered,
        ),
        server_trial(
            "kafka::ten_thousand_timers_survive_a_service_restart_and_a_server_kill",
            missing.clone(),
            ten_thousand_timers_survive_restarts,
        ),
        server_trial(
            "kafka::two_instances_in_one_group_split_the_partitions",
            missing.clone(),
            two_instances_split_the_partitions,
        ),
        server_trial(
            "kafka::a_missing_topic_it_may_not_create_is_named",
            missing.clone(),
            a_missing_topic_is_named,
        ),
        server_trial(
            "kafka::an_unreachable_server_is_a_one_line_error",
            missing,
            an_unreachable_server_is_a_one_line_error,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

/// Topics of their own per test, never deleted: the test server is thrown away after the run,
/// and tansu 0.6.0's storage task panics ("more or less than one row") when a topic is deleted
/// while a consumer still fetches from it, which leaves the server unable to answer.
fn config() -> KafkaConfig {
    KafkaBrokers::config().expect("TIMER_TEST_KAFKA_BROKERS")
}

fn env(dir: &Path, c: &KafkaConfig) -> Vec<(&'static str, String)> {
    vec![
        ("TIMER_STORE__KIND", "sqlite".into()),
        (
            "TIMER_STORE__URL",
            format!("sqlite://{}", dir.join("timers.db").display()),
        ),
        ("TIMER_BROKER__KIND", "kafka".into()),
        ("TIMER_BROKER__BROKERS", c.brokers.clone()),
        ("TIMER_BROKER__GROUP_ID", c.group_id.clone()),
        ("TIMER_BROKER__COMMANDS_TOPIC", c.commands_topic.clone()),
        ("TIMER_BROKER__EVENTS_TOPIC", c.events_topic.clone()),
        (
            "TIMER_BROKER__DEAD_LETTER_TOPIC",
            c.dead_letter_topic.clone(),
        ),
        ("TIMER_ENGINE__RETRY_MAX", "2s".into()),
        ("TIMER_ENGINE__POLL_INTERVAL", "1s".into()),
    ]
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// One message as the reader saw it.
#[derive(Clone)]
struct Read {
    body: Vec<u8>,
    headers: HashMap<String, String>,
}

/// Reads a topic from the beginning in a thread of its own, as an ordinary consumer (no group
/// commits), until dropped; librdkafka reconnects by itself after a server restart.
struct TopicReader {
    got: Arc<Mutex<Vec<Read>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TopicReader {
    fn start(c: &KafkaConfig, topic: &str) -> TopicReader {
        let consumer: BaseConsumer = client_config(c)
            .set("group.id", format!("reader-{}", uuid::Uuid::new_v4()))
            .set("enable.auto.commit", "false")
            .set("fetch.wait.max.ms", "10")
            .create()
            .expect("reader consumer");
        let metadata = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .expect("metadata");
        let mut list = TopicPartitionList::new();
        for t in metadata.topics().iter().filter(|t| t.name() == topic) {
            for p in t.partitions() {
                list.add_partition_offset(topic, p.id(), Offset::Beginning)
                    .expect("partition");
            }
        }
        assert!(list.count() > 0, "topic {topic} has partitions");
        consumer.assign(&list).expect("assign");
        let got = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (got, stop) = (got.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
                        let headers = m
                            .headers()
                            .map(|h| {
                                h.iter()
                                    .filter_map(|h| {
                                        Some((
                                            h.key.to_owned(),
                                            String::from_utf8_lossy(h.value?).into_owned(),
                                        ))
                                    })
                                    .collect()
                            })
                            .unwrap_or_default();
                        let read = Read {
                            body: m.payload().unwrap_or_default().to_vec(),
                            headers,
                        };
                        got.lock().expect("reader lock").push(read);
                    }
                }
            })
        };
        TopicReader {
            got,
            stop,
            thread: Some(thread),
        }
    }

    fn snapshot(&self) -> Vec<Read> {
        self.got.lock().expect("reader lock").clone()
    }

    /// Waits until `done` holds for what was read so far.
    async fn wait(&self, deadline: Duration, done: impl Fn(&[Read]) -> bool) -> Option<Vec<Read>> {
        wait_for(deadline, || async {
            let now = self.snapshot();
            done(&now).then_some(now)
        })
        .await
    }
}

impl Drop for TopicReader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Distinct timers among the events read.
fn timers(events: &[Read]) -> HashSet<String> {
    events
        .iter()
        .filter_map(|e| serde_json::from_slice::<Value>(&e.body).ok())
        .map(|v| format!("{}/{}", v["tenantId"], v["aggregateId"]))
        .collect()
}

fn commands(prefix: &str, n: usize, due_from: i64, spread_ms: i64) -> Vec<(String, String)> {
    (0..n)
        .map(|i| {
            let tenant = format!("tenant-{}", i % 7);
            let body = json!({"tenantId": tenant, "serviceCallId": format!("{prefix}{i:05}"),
                              "dueTimeMs": due_from + (i as i64 * spread_ms) / n as i64});
            (tenant, body.to_string())
        })
        .collect()
}

async fn malformed_command_is_dead_lettered() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = config();
    let fixture = KafkaFixture::new(c.clone()).await.expect("topics");
    let service = Service::start(Path::new(BIN), dir.path(), &env(dir.path(), &c)).await;
    let good = json!({"tenantId": "t", "serviceCallId": "after-bad", "dueTimeMs": now_ms()});
    fixture
        .produce_many(&[
            ("t".into(), "{not json".into()),
            ("t".into(), good.to_string()),
        ])
        .await
        .expect("produce");
    let dead = TopicReader::start(&c, &c.dead_letter_topic);
    let letters = dead
        .wait(Duration::from_secs(60), |l| !l.is_empty())
        .await
        .unwrap_or_else(|| panic!("a dead letter; log:\n{}", service.log_text()));
    assert_eq!(letters[0].body, b"{not json");
    let reason = letters[0]
        .headers
        .get(REASON_HEADER)
        .cloned()
        .unwrap_or_default();
    assert!(
        reason.starts_with("invalid_json"),
        "reason header: {reason:?}"
    );
    let events = TopicReader::start(&c, &c.events_topic);
    let fired = events
        .wait(Duration::from_secs(60), |e| !e.is_empty())
        .await
        .expect("the good command fired");
    let v: Value = serde_json::from_slice(&fired[0].body).expect("json");
    assert_eq!(v["aggregateId"], "after-bad");
    assert_eq!(
        fired[0].headers.get(EVENT_ID_HEADER),
        v["id"].as_str().map(str::to_owned).as_ref(),
        "the envelope id is in the header"
    );
    service.terminate().await;
}

async fn ten_thousand_timers_survive_restarts() {
    const N: usize = 10_000;
    let dir = tempfile::tempdir().expect("tempdir");
    let c = config();
    let port = c
        .brokers
        .rsplit(':')
        .next()
        .and_then(|p| p.parse::<u16>().ok())
        .expect("a port in TIMER_TEST_KAFKA_BROKERS");
    let fixture = KafkaFixture::new(c.clone()).await.expect("topics");
    let environment = env(dir.path(), &c);
    let store = timer_stores::sqlite::SqliteStore::open(
        &timer_stores::sqlite::SqliteConfig::for_path(dir.path().join("timers.db")),
    )
    .await
    .expect("open the store file");

    // The first half while the service runs; it is stopped once it has stored some of them.
    // Far enough out that two service starts and all produces come first on a slow box.
    let due_from = now_ms() + 30_000;
    let all = commands("n", N, due_from, 6_000);
    let service = Service::start(Path::new(BIN), dir.path(), &environment).await;
    fixture.produce_many(&all[..N / 2]).await.expect("produce");
    wait_for(Duration::from_secs(60), || async {
        (store.scheduled_count().await.ok()? > 0).then_some(())
    })
    .await
    .expect("ingest started");
    assert_eq!(service.terminate().await, Some(0), "a clean stop");
    let stored_at_stop = store.scheduled_count().await.expect("pending");
    // What the group committed: only commands the store had committed, and some of them.
    let committed = committed_commands(&c).await;
    assert!(
        committed > 0 && committed <= stored_at_stop,
        "committed offsets ({committed}) cover stored commands only ({stored_at_stop} stored)"
    );
    // The second half while it is down; it resumes from the offsets it committed.
    fixture.produce_many(&all[N / 2..]).await.expect("produce");
    let service = Service::start(Path::new(BIN), dir.path(), &environment).await;
    let stored = wait_for(Duration::from_secs(60), || async {
        let n = store.scheduled_count().await.ok()?;
        (n >= N as u64).then_some(n)
    })
    .await;
    assert!(
        stored.is_some(),
        "every command stored after the restart ({} of {N}, {stored_at_stop} at the stop); log:\n{}",
        store.scheduled_count().await.unwrap_or(0),
        service.log_text()
    );
    println!(
        "service stopped with {stored_at_stop} of {N} stored ({committed} committed); after the \
         restart all {N}"
    );

    // Kill tansu once firing is well under way, then start it again on the same files.
    let events = TopicReader::start(&c, &c.events_topic);
    let before = events
        .wait(Duration::from_secs(90), |e| e.len() >= 3_000)
        .await
        .unwrap_or_else(|| panic!("firing started; log:\n{}", service.log_text()));
    let dir_var = std::env::var(DIR_VAR).expect("dir");
    let pid = std::fs::read_to_string(Path::new(&dir_var).join("kafka.pid")).expect("pid file");
    let server = ScriptedServer::new("kafka", dir_var.clone(), "KAFKA_PORT", port);
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
        "killed tansu after {} events were read; restarted it",
        before.len()
    );
    assert!(
        before.len() < N,
        "the kill came while timers were still firing"
    );

    let read = events
        .wait(Duration::from_secs(180), |e| timers(e).len() >= N)
        .await
        .unwrap_or_else(|| {
            panic!(
                "not every timer fired ({} read); log:\n{}",
                timers(&events.snapshot()).len(),
                service.log_text()
            )
        });
    let mut ids_by_key: HashMap<String, Vec<String>> = HashMap::new();
    let mut late = Vec::new();
    for e in &read {
        let v: Value = serde_json::from_slice(&e.body).expect("json");
        let key = format!("{}/{}", v["tenantId"], v["aggregateId"]);
        let id = v["id"].as_str().unwrap_or_default().to_owned();
        assert_eq!(e.headers.get(EVENT_ID_HEADER), Some(&id), "id header");
        ids_by_key.entry(key).or_default().push(id);
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
        "{N} timers through Kafka: {} events read, {repeated} timers delivered twice (same id); \
         lateness ms p50 {p50} p99 {p99} max {max}",
        read.len()
    );
    let ready = wait_for(Duration::from_secs(30), || async {
        (service.get("/readyz").await.0 == 200).then_some(())
    })
    .await;
    assert!(ready.is_some(), "the service is ready again");
    assert_eq!(service.terminate().await, Some(0));
}

/// How many commands the consumer group committed: the sum of its committed offsets over the
/// command topic's partitions.
async fn committed_commands(c: &KafkaConfig) -> u64 {
    let c = c.clone();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = client_config(&c)
            .set("group.id", &c.group_id)
            .set("enable.auto.commit", "false")
            .create()
            .expect("a consumer in the service's group");
        let metadata = consumer
            .fetch_metadata(Some(&c.commands_topic), Duration::from_secs(10))
            .expect("metadata");
        let mut list = TopicPartitionList::new();
        for t in metadata
            .topics()
            .iter()
            .filter(|t| t.name() == c.commands_topic)
        {
            for p in t.partitions() {
                list.add_partition(&c.commands_topic, p.id());
            }
        }
        let committed = consumer
            .committed_offsets(list, Duration::from_secs(10))
            .expect("committed offsets");
        committed
            .elements()
            .iter()
            .filter_map(|e| match e.offset() {
                Offset::Offset(n) if n > 0 => Some(n as u64),
                _ => None,
            })
            .sum()
    })
    .await
    .expect("committed offsets task")
}

/// Two instances, each with a store of its own, in one consumer group: each command reaches one
/// of them (a rebalance may hand a command to both: then its repeats share the event id), so
/// every timer fires and both take part.
async fn two_instances_split_the_partitions() {
    const N: usize = 2_000;
    let c = config();
    let fixture = KafkaFixture::new(c.clone()).await.expect("topics");
    let dirs = [
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    ];
    let a = Service::start(Path::new(BIN), dirs[0].path(), &env(dirs[0].path(), &c)).await;
    let b = Service::start(Path::new(BIN), dirs[1].path(), &env(dirs[1].path(), &c)).await;
    // Produce once the group settled: B has its partitions (A's were revoked and re-assigned
    // in the same rebalance).
    wait_for(Duration::from_secs(60), || async {
        (a.log_text().contains("partitions assigned")
            && b.log_text().contains("partitions assigned"))
        .then_some(())
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "both joined the group; logs:\n{}\n---\n{}",
            a.log_text(),
            b.log_text()
        )
    });
    fixture
        .produce_many(&commands("g", N, now_ms() + 3_000, 2_000))
        .await
        .expect("produce");
    let events = TopicReader::start(&c, &c.events_topic);
    let read = events
        .wait(Duration::from_secs(90), |e| timers(e).len() >= N)
        .await
        .unwrap_or_else(|| {
            panic!(
                "every timer fired; logs:\n{}\n---\n{}",
                a.log_text(),
                b.log_text()
            )
        });
    let mut per_instance = Vec::new();
    for dir in &dirs {
        let store = timer_stores::sqlite::SqliteStore::open(
            &timer_stores::sqlite::SqliteConfig::for_path(dir.path().join("timers.db")),
        )
        .await
        .expect("open the store file");
        let mut stored = 0;
        for (tenant, body) in commands("g", N, 0, 1) {
            let v: Value = serde_json::from_str(&body).expect("json");
            let id = v["serviceCallId"].as_str().unwrap_or_default();
            if store
                .get(&timer_core::TimerKey::new(tenant, id))
                .await
                .expect("get")
                .is_some()
            {
                stored += 1;
            }
        }
        per_instance.push(stored);
    }
    println!(
        "two instances in one group: timers stored per instance {per_instance:?}; {} events",
        read.len()
    );
    assert_eq!(timers(&read).len(), N, "every timer fired");
    let mut ids: HashMap<String, HashSet<String>> = HashMap::new();
    for e in &read {
        let v: Value = serde_json::from_slice(&e.body).expect("json");
        ids.entry(format!("{}/{}", v["tenantId"], v["aggregateId"]))
            .or_default()
            .insert(v["id"].as_str().unwrap_or_default().to_owned());
    }
    assert!(
        ids.values().all(|i| i.len() == 1),
        "a timer delivered twice carries the same id"
    );
    assert!(
        per_instance.iter().all(|n| *n > 0),
        "both instances took part: {per_instance:?}"
    );
    assert!(per_instance.iter().sum::<usize>() >= N, "{per_instance:?}");
    a.terminate().await;
    b.terminate().await;
}

async fn a_missing_topic_is_named() {
    let c = KafkaConfig {
        create_topics: false,
        ..config()
    };
    let err = match timer_brokers::kafka::KafkaBroker::connect(&c).await {
        Ok(_) => panic!("a missing topic with create_topics off must fail"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains(&c.commands_topic) && err.contains("broker.create_topics is off"),
        "{err}"
    );
}

async fn an_unreachable_server_is_a_one_line_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = timer_conformance::e2e::free_addr().port();
    let out = tokio::process::Command::new(BIN)
        .arg("run")
        .current_dir(dir.path())
        .env("TIMER_STORE__KIND", "memory")
        .env("TIMER_BROKER__KIND", "kafka")
        .env("TIMER_BROKER__BROKERS", format!("127.0.0.1:{port}"))
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
            "error: kafka broker: cannot reach 127.0.0.1:{port}"
        )),
        "{err}"
    );
}
