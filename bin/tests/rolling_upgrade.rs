//! The rolling upgrade (#42): three instances of the previous release (built from git history
//! by `scripts/previous.sh`, `TIMER_TEST_PREVIOUS_BIN`) run on one PostgreSQL schema with NATS
//! under steady load (HTTP schedules round-robin over the live instances, as a load balancer
//! sends them, and NATS commands; timers due every few ms). They are replaced one by one by
//! this build: start a new instance (the first applies this release's migrations, an index
//! built CONCURRENTLY among them, while the old ones fire), take the old one out of the
//! rotation, SIGTERM it. A checker then reads every event and the final store: none lost, none
//! early, none fired twice; the longest wait of any schedule and the lateness are printed.
//! Then the previous release starts again on the migrated schema (a rollback works). Also: a
//! SQLite file of the previous release upgraded in place (stop, start this build: a copy is
//! written, every timer fires once, as its history says, and the previous release starts on it
//! again), and this build refusing a schema a newer release needs.
//!
//! Needs `TIMER_TEST_POSTGRES_URL`, `TIMER_TEST_NATS_URL` and `TIMER_TEST_PREVIOUS_BIN`
//! (bash scripts/test.sh sets them all).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use libtest_mimic::Arguments;
use serde_json::{json, Value};
use timer_conformance::e2e::{
    not_reached_within, now_ms, percentiles, run_to_end, schedule, timer_of, write_config, Service,
};
use timer_conformance::scenarios::envelope;
use timer_conformance::{server_trial, wait_for};
use timer_core::plugin::{fresh_name, BrokerConfig, Isolated, TestClient};
use timer_core::TimerKey;
use timer_stores::postgres::{PostgresConfig, PostgresStore, TEST_SERVER};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");
const INSTANCES: usize = 3;
/// HTTP schedules and NATS commands sent per second.
const HTTP_RATE: u64 = 50;
const NATS_RATE: u64 = 25;
/// Timers are due this far after they are sent (uniformly): one due every 13 ms or so.
const DUE_IN_MS: (i64, i64) = (50, 1_500);
/// Steady load before the first replacement, between replacements and after the last.
const STEADY: Duration = Duration::from_secs(4);
/// Generous bounds: they fail only when a mechanism breaks (a schedule that waits for the
/// migration, a fire that waits for an instance's leases to run out).
const LONGEST_WAIT_BOUND_MS: i64 = 5_000;
const LATENESS_P99_BOUND_MS: i64 = 3_000;

/// The previous release's binary, or why there is none.
fn previous() -> Result<PathBuf, String> {
    let path = std::env::var("TIMER_TEST_PREVIOUS_BIN").map_err(|_| {
        "TIMER_TEST_PREVIOUS_BIN is not set (bash scripts/previous.sh build, then \
         eval \"$(bash scripts/previous.sh env)\"; bash scripts/test.sh does both)"
            .to_owned()
    })?;
    let path = PathBuf::from(path);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "TIMER_TEST_PREVIOUS_BIN {path:?} is not a file (bash scripts/previous.sh build)"
        ))
    }
}

fn main() {
    let args = Arguments::from_args();
    let servers = TEST_SERVER
        .unavailable()
        .or_else(|| timer_brokers::nats::PLUGIN.unavailable());
    let missing = servers.clone().or_else(|| previous().err());
    let trials = vec![
        server_trial(
            "rolling_upgrade::three_instances_of_the_previous_release_replaced_under_load",
            missing,
            || async {
                let previous = previous().expect("the previous release");
                roll(&previous).await;
            },
        ),
        server_trial(
            "rolling_upgrade::a_sqlite_file_of_the_previous_release_upgraded_in_place",
            previous().err(),
            || async {
                let previous = previous().expect("the previous release");
                upgrade_in_place(&previous).await;
            },
        ),
        server_trial(
            "rolling_upgrade::this_build_refuses_a_schema_a_newer_release_needs",
            TEST_SERVER.unavailable(),
            refuse_a_newer_schema,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

/// A schedule the load sent: the timer, its due time, and whether it was taken (HTTP 201 or
/// the broker's acknowledgement), with how long that took (HTTP, retries on another instance
/// included).
struct Sent {
    key: TimerKey,
    due: i64,
    taken: bool,
    waited_ms: Option<i64>,
}

/// The base URLs of the instances in the rotation (a load balancer's list).
type Rotation = Arc<Mutex<Vec<String>>>;

fn instance_config(
    dir: &Path,
    pg: &PostgresConfig,
    broker: &Value,
    id: &str,
) -> Vec<(&'static str, String)> {
    let config = json!({
        "store": { "kind": "postgres", "url": pg.url, "schema": pg.schema },
        "broker": broker,
        "engine": { "instance_id": id },
    });
    let path = write_config(dir, &config);
    vec![("TIMER_CONFIG", path.display().to_string())]
}

struct Instance {
    id: String,
    _dir: tempfile::TempDir,
    service: Service,
}

async fn start(bin: &Path, pg: &PostgresConfig, broker: &Value, id: &str) -> Instance {
    let dir = tempfile::tempdir().expect("tempdir");
    let env = instance_config(dir.path(), pg, broker, id);
    let service = Service::start(bin, dir.path(), &env).await;
    Instance {
        id: id.to_owned(),
        _dir: dir,
        service,
    }
}

async fn roll(previous: &Path) {
    let pg = PostgresConfig {
        url: TEST_SERVER.address().expect("TIMER_TEST_POSTGRES_URL"),
        schema: fresh_name("upgrade_"),
        ..PostgresConfig::default()
    };
    let Isolated {
        config: broker,
        guard: _guard,
    } = (timer_brokers::nats::PLUGIN.isolated)("upgrade").expect("isolated resources");
    let broker: Arc<dyn BrokerConfig> = Arc::from(broker);
    let section = broker.to_value().expect("the broker section");
    let client = broker.test_client().await.expect("a broker client");

    // The previous release makes the schema: nothing of this build has touched it.
    let mut old = Vec::new();
    for i in 0..INSTANCES {
        old.push(start(previous, &pg, &section, &format!("old-{i}")).await);
    }
    let version = run_to_end(
        previous,
        Path::new("."),
        &["--version"],
        &[] as &[(&str, &str)],
        Duration::from_secs(30),
    )
    .await;
    println!("previous release: {}", version.stdout.trim());

    let rotation: Rotation = Arc::new(Mutex::new(
        old.iter().map(|i| i.service.base.clone()).collect(),
    ));
    let sent: Arc<Mutex<Vec<Sent>>> = Arc::default();
    let stop = CancellationToken::new();
    let http_load = tokio::spawn(schedule_over_http(
        rotation.clone(),
        sent.clone(),
        stop.clone(),
    ));
    let nats_load = tokio::spawn(send_commands(client, sent.clone(), stop.clone()));
    tokio::time::sleep(STEADY).await;

    // One by one: start the new one, put it in the rotation, take the old one out, stop it.
    let mut new = Vec::new();
    let mut migration_ms = 0;
    let mut steps: Vec<(String, i64)> = Vec::new();
    for (i, old_one) in old.into_iter().enumerate() {
        let started = Instant::now();
        let instance = start(Path::new(BIN), &pg, &section, &format!("new-{i}")).await;
        let ready_ms = started.elapsed().as_millis() as i64;
        if i == 0 {
            migration_ms = ready_ms;
            // Both releases live on one schema: the list shows which runs which.
            let (status, v) = instance.service.get("/v1/status").await;
            assert_eq!(status, 200, "{v}");
            let listed: Vec<(String, Value)> = v["instances"]
                .as_array()
                .expect("instances")
                .iter()
                .map(|i| {
                    (
                        i["id"].as_str().unwrap_or("?").to_owned(),
                        i["version"].clone(),
                    )
                })
                .collect();
            println!("instances while both releases run: {}", v["instances"]);
            assert_eq!(
                listed,
                [
                    ("new-0".to_owned(), json!(env!("CARGO_PKG_VERSION"))),
                    ("old-0".to_owned(), Value::Null),
                    ("old-1".to_owned(), Value::Null),
                    ("old-2".to_owned(), Value::Null),
                ],
                "{v}"
            );
        }
        println!("new-{i} ready {ready_ms} ms after its start");
        steps.push((format!("new-{i} ready"), now_ms()));
        rotation
            .lock()
            .expect("rotation")
            .push(instance.service.base.clone());
        rotation
            .lock()
            .expect("rotation")
            .retain(|base| *base != old_one.service.base);
        steps.push((format!("{} stopping", old_one.id), now_ms()));
        let code = old_one.service.terminate().await;
        assert_eq!(code, Some(0), "{} stopped cleanly", old_one.id);
        steps.push((format!("{} stopped", old_one.id), now_ms()));
        new.push(instance);
        tokio::time::sleep(STEADY).await;
    }
    stop.cancel();
    http_load.await.expect("the HTTP load");
    nats_load.await.expect("the NATS load");

    // The checker: every schedule taken fires once, not early; the store says Reached.
    let (taken, refused): (Vec<Sent>, Vec<Sent>) = std::mem::take(&mut *sent.lock().expect("sent"))
        .into_iter()
        .partition(|s| s.taken);
    assert!(
        refused.is_empty(),
        "{} schedules were not taken",
        refused.len()
    );
    let due: HashMap<String, i64> = taken.iter().map(|s| (s.key.to_string(), s.due)).collect();
    let reader = broker.test_client().await.expect("a broker client");
    let events = wait_for(Duration::from_secs(120), || async {
        let events = reader.events().await.ok()?;
        let fired: HashSet<String> = events.iter().map(|e| timer_of(&envelope(e))).collect();
        due.keys().all(|k| fired.contains(k)).then_some(events)
    })
    .await;
    let events = match events {
        Some(events) => events,
        None => reader.events().await.expect("read the events"),
    };
    let mut fires: HashMap<String, Vec<i64>> = HashMap::new();
    for e in &events {
        let v = envelope(e);
        fires
            .entry(timer_of(&v))
            .or_default()
            .push(v["timestampMs"].as_i64().unwrap_or(0));
    }
    let lost: Vec<&String> = due.keys().filter(|k| !fires.contains_key(*k)).collect();
    let early: Vec<String> = fires
        .iter()
        .filter_map(|(k, at)| {
            let due = due.get(k)?;
            at.iter()
                .any(|at| at < due)
                .then(|| format!("{k} due {due}"))
        })
        .collect();
    let twice: Vec<&String> = fires
        .iter()
        .filter(|(_, at)| at.len() > 1)
        .map(|(k, _)| k)
        .collect();
    let mut late: Vec<(i64, &String, i64)> = due
        .iter()
        .filter_map(|(k, due)| Some((fires.get(k)?.iter().min()? - due, k, *due)))
        .collect();
    late.sort_unstable_by(|a, b| b.cmp(a));
    for (lateness, key, due) in late.iter().take(3) {
        // The last step of the upgrade before its due time: what it waited for.
        let before = steps
            .iter()
            .rfind(|(_, at)| at <= due)
            .map_or("before the first step".to_owned(), |(step, at)| {
                format!("{} ms after {step}", due - at)
            });
        println!("most late: {key} {lateness} ms, due {before}");
    }
    let lateness: Vec<i64> = late.iter().map(|(l, _, _)| *l).collect();
    let (l50, l99, lmax) = percentiles(lateness);
    let waits: Vec<i64> = taken.iter().filter_map(|s| s.waited_ms).collect();
    let http_count = waits.len();
    let (w50, w99, wmax) = percentiles(waits);

    let store = PostgresStore::open(&pg).await.expect("open the schema");
    let keys: Vec<TimerKey> = taken.iter().map(|s| s.key.clone()).collect();
    let not_reached = not_reached_within(&store, &keys, Duration::from_secs(60)).await;
    println!(
        "rolling upgrade: {} timers ({http_count} over HTTP, {} over NATS), {} events; lost {}, \
         early {}, fired twice {}, not Reached in the store {}",
        taken.len(),
        taken.len() - http_count,
        events.len(),
        lost.len(),
        early.len(),
        twice.len(),
        not_reached.len()
    );
    println!(
        "schedule wait over HTTP (ms): p50 {w50}, p99 {w99}, longest {wmax}; lateness (ms): p50 \
         {l50}, p99 {l99}, max {lmax}; the first new instance was ready (migrated) {migration_ms} \
         ms after its start"
    );
    assert!(lost.is_empty(), "lost: {lost:?}");
    assert!(early.is_empty(), "early: {early:?}");
    assert!(twice.is_empty(), "fired twice: {twice:?}");
    assert!(not_reached.is_empty(), "not Reached: {not_reached:?}");
    assert!(wmax < LONGEST_WAIT_BOUND_MS, "a schedule waited {wmax} ms");
    assert!(l99 < LATENESS_P99_BOUND_MS, "lateness p99 {l99} ms");

    // This release's migrations are recorded, the index built CONCURRENTLY is valid.
    let migrations = sql_rows(
        &pg,
        "SELECT version::text || ' ' || applied_by FROM timer_migrations ORDER BY version",
    )
    .await;
    let release = env!("CARGO_PKG_VERSION");
    assert_eq!(
        migrations,
        [
            format!("15 {release}"),
            format!("16 {release}"),
            format!("17 {release}"),
        ],
        "recorded by this release"
    );
    let valid = sql_rows(
        &pg,
        "SELECT i.indisvalid::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
         WHERE c.relname = 'timers_failed' AND c.relnamespace = current_schema()::regnamespace",
    )
    .await;
    assert_eq!(valid, ["true"], "timers_failed is valid");

    // A rollback works: the previous release starts on the migrated schema.
    let back = start(previous, &pg, &section, "old-again").await;
    let (status, v) = new[0].service.get("/v1/status").await;
    assert_eq!(status, 200, "{v}");
    assert!(
        v["instances"].as_array().is_some_and(|l| l
            .iter()
            .any(|i| i["id"] == "old-again" && i["version"].is_null())),
        "the previous release runs beside this one again: {v}"
    );
    assert_eq!(back.service.terminate().await, Some(0));
    for instance in new {
        assert_eq!(instance.service.terminate().await, Some(0));
    }
    store.drop_schema().await.expect("drop the schema");
}

/// Reads the first column of `sql` on the schema, as text.
async fn sql_rows(pg: &PostgresConfig, sql: &str) -> Vec<String> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&pg.url).await.expect("connect");
    sqlx::query(&format!("SET search_path TO {}", pg.schema))
        .execute(&mut conn)
        .await
        .expect("search_path");
    sqlx::query_scalar(sql)
        .fetch_all(&mut conn)
        .await
        .expect(sql)
}

/// HTTP schedules at [`HTTP_RATE`], each to the next instance of the rotation; one that fails
/// (an instance on its way out) goes to the next.
async fn schedule_over_http(
    rotation: Rotation,
    sent: Arc<Mutex<Vec<Sent>>>,
    stop: CancellationToken,
) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("a client");
    let mut tick = tokio::time::interval(Duration::from_millis(1_000 / HTTP_RATE));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut rng = fastrand::Rng::new();
    let mut n = 0usize;
    while !stop.is_cancelled() {
        tick.tick().await;
        let (tenant, id) = (format!("tenant-{}", n % 5), format!("h{n:07}"));
        let due = now_ms() + rng.i64(DUE_IN_MS.0..DUE_IN_MS.1);
        let body = schedule(&tenant, &id, due);
        let started = Instant::now();
        let mut taken = false;
        for attempt in 0..10 {
            let base = {
                let rotation = rotation.lock().expect("rotation");
                rotation[(n + attempt) % rotation.len()].clone()
            };
            let answer = http
                .post(format!("{base}/v1/timers"))
                .header("content-type", "application/json")
                .body(body.clone())
                .send()
                .await;
            if answer.is_ok_and(|r| r.status().as_u16() == 201) {
                taken = true;
                break;
            }
        }
        n += 1;
        sent.lock().expect("sent").push(Sent {
            key: TimerKey::new(&tenant, &id),
            due,
            taken,
            waited_ms: taken.then(|| started.elapsed().as_millis() as i64),
        });
    }
}

/// NATS `ScheduleTimer` commands at [`NATS_RATE`].
async fn send_commands(
    client: Arc<dyn TestClient>,
    sent: Arc<Mutex<Vec<Sent>>>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(1_000 / NATS_RATE));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut rng = fastrand::Rng::new();
    let mut n = 0usize;
    while !stop.is_cancelled() {
        tick.tick().await;
        let (tenant, id) = (format!("tenant-{}", n % 5), format!("n{n:07}"));
        n += 1;
        let due = now_ms() + rng.i64(DUE_IN_MS.0..DUE_IN_MS.1);
        let body = schedule(&tenant, &id, due);
        let send = client.send_command(body.as_bytes());
        let taken = matches!(
            tokio::time::timeout(Duration::from_secs(5), send).await,
            Ok(Ok(()))
        );
        sent.lock().expect("sent").push(Sent {
            key: TimerKey::new(&tenant, &id),
            due,
            taken,
            waited_ms: None,
        });
    }
}

/// SQLite: the previous release schedules, stops; this build starts on the same file and writes
/// the copy; every timer fires once (by either: what fell due before the stop fired on the
/// previous release), none early, as each timer's history says; the previous release starts on
/// the file again.
async fn upgrade_in_place(previous: &Path) {
    const N: usize = 200;
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("timers.db");
    let env = |instance: &str| {
        vec![
            ("TIMER_STORE__KIND", "sqlite".to_owned()),
            ("TIMER_STORE__URL", format!("sqlite://{}", file.display())),
            ("TIMER_BROKER__KIND", "memory".to_owned()),
            ("TIMER_ENGINE__INSTANCE_ID", instance.to_owned()),
        ]
    };
    let old = Service::start(previous, dir.path(), &env("old")).await;
    // Due after the restart, as a rule; one due now fires on the previous release.
    let due = now_ms() + 10_000;
    let ids: Vec<String> = (0..N).map(|i| format!("u{i:04}")).collect();
    let commands: Vec<Value> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| json!({"tenantId": "t", "serviceCallId": id, "dueTimeMs": due + i as i64 * 5}))
        .chain([json!({"tenantId": "t", "serviceCallId": "now", "dueTimeMs": now_ms()})])
        .collect();
    old.schedule_batch(&commands).await;
    let fired_before = old.events().await;
    assert!(
        fired_before
            .wait(1, Duration::from_secs(30))
            .await
            .is_some(),
        "the one due now fires"
    );
    assert_eq!(old.terminate().await, Some(0));

    let new = Service::start(Path::new(BIN), dir.path(), &env("new")).await;
    let copy = dir
        .path()
        .join(format!("timers.db.before-{}", env!("CARGO_PKG_VERSION")));
    assert!(copy.is_file(), "the copy before migrating, at {copy:?}");
    // Every timer Reached, then each one's fires from its history (which instance, how late).
    let reached = wait_for(Duration::from_secs(60), || async {
        for id in &ids {
            let (_, v) = new.get(&format!("/v1/tenants/t/timers/{id}")).await;
            if v["state"] != "Reached" {
                return None;
            }
        }
        Some(())
    })
    .await;
    assert!(reached.is_some(), "every timer Reached after the upgrade");
    let mut by_instance: HashMap<String, usize> = HashMap::new();
    let mut lateness = Vec::new();
    for id in &ids {
        let (status, v) = new.get(&format!("/v1/tenants/t/timers/{id}/history")).await;
        assert_eq!(status, 200, "{v}");
        let fires: Vec<&Value> = v["history"]
            .as_array()
            .expect("history")
            .iter()
            .filter(|e| e["type"] == "fired")
            .collect();
        assert_eq!(fires.len(), 1, "{id} fired once: {v}");
        let late = fires[0]["latenessMs"].as_i64().expect("latenessMs");
        assert!(late >= 0, "{id} fired early: {v}");
        lateness.push(late);
        let instance = fires[0]["instance"].as_str().unwrap_or("?").to_owned();
        *by_instance.entry(instance).or_default() += 1;
    }
    let (p50, p99, max) = percentiles(lateness);
    println!(
        "upgrade in place: {N} timers fired once each, by instance {by_instance:?}; lateness \
         p50 {p50} p99 {p99} max {max} ms"
    );
    assert!(
        by_instance.get("new").is_some_and(|n| *n > 0),
        "this build fired the timers due after the restart: {by_instance:?}"
    );
    assert_eq!(new.terminate().await, Some(0));
    // Going back: the previous release starts on the migrated file.
    let back = Service::start(previous, dir.path(), &env("old")).await;
    let (status, v) = back.get("/v1/status").await;
    assert_eq!(
        (status, v["store"]["healthy"].clone()),
        (200, json!(true)),
        "{v}"
    );
    assert_eq!(back.terminate().await, Some(0));
}

/// This build refuses, before it changes anything, a schema whose record says a newer release
/// is needed, naming both releases.
async fn refuse_a_newer_schema() {
    let pg = PostgresConfig {
        url: TEST_SERVER.address().expect("TIMER_TEST_POSTGRES_URL"),
        schema: fresh_name("newer_"),
        ..PostgresConfig::default()
    };
    let store = PostgresStore::open(&pg).await.expect("migrate the schema");
    // As release 9.1.0 would record a migration that 9.0.0 and older cannot run with.
    sql_rows(
        &pg,
        "INSERT INTO timer_migrations (version, description, checksum, oldest_release, applied_by, \
         took_ms) VALUES (900, 'a newer release', '\\x00', '9.0.0', '9.1.0', 0) RETURNING 'ok'",
    )
    .await;
    let dir = tempfile::tempdir().expect("tempdir");
    let env = instance_config(dir.path(), &pg, &json!({ "kind": "memory" }), "refused");
    let exit = run_to_end(
        Path::new(BIN),
        dir.path(),
        &["run"],
        &env,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(exit.code, Some(1), "{}", exit.stderr);
    let release = env!("CARGO_PKG_VERSION");
    for part in [
        "was migrated by timer-service 9.1.0",
        "works with timer-service 9.0.0 or newer only (migration 900)",
        &format!("this binary is timer-service {release}"),
        &pg.schema,
    ] {
        assert!(
            exit.stderr.contains(part),
            "names {part:?}: {}",
            exit.stderr
        );
    }
    store.drop_schema().await.expect("drop the schema");
}
