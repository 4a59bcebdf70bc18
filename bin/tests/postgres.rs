//! The `postgres` store with several `timer-service` processes on one database: every timer
//! fired once, a killed instance's timers fired by the others, NOTIFY wake-ups across
//! instances, and clear errors for a wrong URL or password. Needs `TIMER_TEST_POSTGRES_URL`
//! (bash scripts/test.sh starts the server); without it the trials are ignored with the reason,
//! or fail under `TIMER_TEST_REQUIRE=1`.

use std::collections::HashMap;

use std::path::Path;
use std::time::Duration;

use libtest_mimic::Arguments;
use timer_conformance::e2e::{count_by_key, percentiles, EventLog, Service};
use timer_conformance::fixtures::POSTGRES_URL_VAR;
use timer_conformance::{server_trial, wait_for};
use timer_core::{NewTimer, Store, TimerKey, TimerState, Timestamp};
use timer_stores::postgres::{PostgresConfig, PostgresStore};

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");

fn main() {
    let args = Arguments::from_args();
    let missing = std::env::var(POSTGRES_URL_VAR)
        .is_err()
        .then(|| format!("{POSTGRES_URL_VAR} is not set (bash scripts/test.sh starts PostgreSQL)"));
    let trials = vec![
        server_trial(
            "postgres::notify_reaches_another_store_handle",
            missing.clone(),
            notify_reaches_another_store_handle,
        ),
        server_trial(
            "postgres::three_instances_fire_20k_timers_once",
            missing.clone(),
            three_instances_fire_20k_timers_once,
        ),
        server_trial(
            "postgres::killed_instance_timers_fired_by_the_others",
            missing.clone(),
            killed_instance_timers_fired_by_the_others,
        ),
        server_trial(
            "postgres::notify_wakes_another_instance",
            missing.clone(),
            notify_wakes_another_instance,
        ),
        server_trial(
            "postgres::wrong_password_or_port_is_a_one_line_error",
            missing,
            wrong_password_or_port_is_a_one_line_error,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

/// The test server with a schema of this test's own.
fn schema_config() -> PostgresConfig {
    let id = uuid::Uuid::new_v4().simple().to_string();
    PostgresConfig {
        url: std::env::var(POSTGRES_URL_VAR).expect("TIMER_TEST_POSTGRES_URL is set"),
        schema: format!("e_{}", &id[..16]),
        ..PostgresConfig::default()
    }
}

fn env_for(config: &PostgresConfig, extra: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("TIMER_STORE__KIND", "postgres".to_string()),
        ("TIMER_STORE__URL", config.url.clone()),
        ("TIMER_STORE__SCHEMA", config.schema.clone()),
        ("TIMER_BROKER__KIND", "memory".to_string()),
    ];
    env.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
    env
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

fn timers(prefix: &str, n: usize, due_from: i64, spread_ms: i64) -> Vec<NewTimer> {
    (0..n)
        .map(|i| NewTimer {
            key: TimerKey::new(format!("tenant-{}", i % 10), format!("{prefix}{i:05}")),
            due_at: Timestamp::from_millis(due_from + (i as i64 * spread_ms) / n as i64),
            correlation_id: None,
            payload: None,
            recurrence: None,
        })
        .collect()
}

/// Events of several streams together.
fn all_events(logs: &[&EventLog]) -> Vec<timer_conformance::e2e::Received> {
    logs.iter().flat_map(|l| l.snapshot()).collect()
}

async fn start_instances(dir: &Path, env: &[(&'static str, String)], n: usize) -> Vec<Service> {
    let mut services = Vec::new();
    for _ in 0..n {
        services.push(Service::start(Path::new(BIN), dir, env).await);
    }
    services
}

async fn notify_reaches_another_store_handle() {
    let config = schema_config();
    let a = PostgresStore::open(&config).await.expect("open a");
    let b = PostgresStore::open(&config).await.expect("open b");
    let mut rx = b.wakeups().expect("postgres reports wake-ups");
    // LISTEN starts in the background: keep scheduling until b hears of one.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut heard = false;
    while !heard && tokio::time::Instant::now() < deadline {
        let due = now_ms() + 60_000;
        a.schedule(&timers("n", 1, due, 0), Timestamp::from_millis(now_ms()))
            .await
            .expect("schedule");
        if let Ok(Ok(got)) = tokio::time::timeout(Duration::from_millis(200), rx.recv()).await {
            heard = got.as_millis() == due;
        }
    }
    assert!(heard, "a NOTIFY from one store handle reaches the other");
}

async fn three_instances_fire_20k_timers_once() {
    const N: usize = 20_000;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = schema_config();
    let store = PostgresStore::open(&config).await.expect("open");
    let services = start_instances(dir.path(), &env_for(&config, &[]), 3).await;
    let mut logs = Vec::new();
    for s in &services {
        logs.push(s.events().await);
    }
    let due_from = now_ms() + 3_000;
    store
        .schedule(
            &timers("k", N, due_from, 5_000),
            Timestamp::from_millis(now_ms()),
        )
        .await
        .expect("schedule 20k");
    let refs: Vec<&EventLog> = logs.iter().collect();
    let done = wait_for(Duration::from_secs(120), || async {
        let events = all_events(&refs);
        (count_by_key(&events).len() >= N).then_some(events)
    })
    .await;
    let events = done.unwrap_or_else(|| {
        panic!(
            "not all fired: {} distinct",
            count_by_key(&all_events(&refs)).len()
        )
    });
    let counts = count_by_key(&events);
    let twice: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).take(5).collect();
    assert!(twice.is_empty(), "no timer fired twice, got {twice:?}");
    assert_eq!(counts.len(), N);
    let per_instance: Vec<usize> = logs.iter().map(|l| l.len()).collect();
    let late: Vec<i64> = events
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
    println!("3 instances, {N} timers over 5 s: per instance {per_instance:?}; lateness ms p50 {p50} p99 {p99} max {max}");
    assert_eq!(store.scheduled_count().await.expect("pending"), 0);
    for s in services {
        assert_eq!(s.terminate().await, Some(0));
    }
}

async fn killed_instance_timers_fired_by_the_others() {
    const N: usize = 20_000;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = schema_config();
    let store = PostgresStore::open(&config).await.expect("open");
    let env = env_for(
        &config,
        &[
            ("TIMER_ENGINE__LEASE", "5s"),
            ("TIMER_ENGINE__BATCH_SIZE", "200"),
        ],
    );
    let mut services = start_instances(dir.path(), &env, 3).await;
    let victim_log = services[0].events().await;
    let due_from = now_ms() + 2_000;
    store
        .schedule(
            &timers("v", N, due_from, 5_000),
            Timestamp::from_millis(now_ms()),
        )
        .await
        .expect("schedule");
    // Kill one instance while it holds leases: freeze it (SIGSTOP) the moment it holds some,
    // check it still does (a mark may have landed meanwhile), then SIGKILL it.
    victim_log
        .wait(500, Duration::from_secs(60))
        .await
        .expect("the victim fires");
    let victim = services.remove(0);
    let victim_pid = victim.pid();
    let db = sqlx::PgPool::connect(&config.url).await.expect("connect");
    let leased = |pid: u32| {
        let db = db.clone();
        let sql = format!(
            "SELECT COUNT(*) FROM {}.timers WHERE state = 0 AND lease_owner LIKE $1",
            config.schema
        );
        async move {
            sqlx::query_scalar::<_, i64>(&sql)
                .bind(format!("{pid}-%"))
                .fetch_one(&db)
                .await
                .expect("count leases")
        }
    };
    let mut leased_by_victim = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while leased_by_victim == 0 && tokio::time::Instant::now() < deadline {
        if leased(victim_pid).await == 0 {
            continue;
        }
        signal(victim_pid, "-STOP").await;
        leased_by_victim = leased(victim_pid).await;
        if leased_by_victim == 0 {
            signal(victim_pid, "-CONT").await;
        }
    }
    assert!(leased_by_victim > 0, "caught the victim holding leases");
    victim.kill9().await;
    println!(
        "killed instance pid {victim_pid} holding {leased_by_victim} leases, after it fired {} events",
        victim_log.len()
    );
    let done = wait_for(Duration::from_secs(120), || async {
        (store.scheduled_count().await.ok()? == 0).then_some(())
    })
    .await;
    assert!(
        done.is_some(),
        "every timer fired after the kill ({} pending)",
        store.scheduled_count().await.unwrap_or(0)
    );
    for t in &timers("v", N, due_from, 5_000) {
        let row = store.get(&t.key).await.expect("get").expect("row");
        assert_eq!(row.state, TimerState::Reached, "{}", t.key);
    }
    assert_eq!(
        leased(victim_pid).await,
        0,
        "the dead instance's leases were taken over"
    );
    for s in services {
        assert_eq!(s.terminate().await, Some(0));
    }
}

async fn notify_wakes_another_instance() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = schema_config();
    let env = env_for(&config, &[("TIMER_ENGINE__POLL_INTERVAL", "60s")]);
    let a = Service::start(Path::new(BIN), dir.path(), &env).await;
    let b = Service::start(Path::new(BIN), dir.path(), &env).await;
    let events = b.events().await;
    let due = now_ms() + 200;
    let body = serde_json::json!({"tenantId": "t", "serviceCallId": "w", "dueTimeMs": due});
    let (status, v) = a.post("/v1/timers", body.to_string()).await;
    assert_eq!(status, 201, "{v}");
    // A is gone right after the insert: only B can fire it, and only NOTIFY tells B in time.
    kill_now(&a).await;
    let got = events
        .wait(1, Duration::from_secs(10))
        .await
        .unwrap_or_else(|| {
            panic!(
                "B did not fire it within 10 s (poll interval 60 s); log:\n{}",
                b.log_text()
            )
        });
    assert_eq!(got[0].envelope["aggregateId"], "w");
    let late = got[0].envelope["timestampMs"].as_i64().unwrap_or(0) - due;
    println!("fired by the other instance {late} ms after due");
    assert!(
        late < 2_000,
        "well before the 60 s poll interval: {late} ms"
    );
    drop(a);
    b.terminate().await;
}

/// SIGKILL, leaving the handle for the caller to drop.
async fn kill_now(a: &Service) {
    signal(a.pid(), "-KILL").await;
}

/// Sends a signal to the process we started, by its pid.
async fn signal(pid: u32, signal: &str) {
    let status = tokio::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .await
        .expect("kill");
    assert!(status.success(), "kill {signal} {pid}");
}

async fn wrong_password_or_port_is_a_one_line_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = schema_config();
    let mut url = url::Url::parse(&config.url).expect("url");
    let _ = url.set_password(Some("wrong-password"));
    let cases = [
        (url.to_string(), "password authentication failed"),
        (
            format!(
                "postgres://postgres:x@127.0.0.1:{}/test",
                timer_conformance::e2e::free_addr().port()
            ),
            "refused",
        ),
    ];
    let mut outputs = HashMap::new();
    for (url, cause) in cases {
        let out = tokio::process::Command::new(BIN)
            .arg("run")
            .current_dir(dir.path())
            .env("TIMER_STORE__KIND", "postgres")
            .env("TIMER_STORE__URL", &url)
            .env("TIMER_STORE__CONNECT_TIMEOUT", "3s")
            .env("TIMER_HTTP__ADDR", "127.0.0.1:0")
            .output()
            .await
            .expect("run");
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(1), "{err}");
        let last = err.lines().last().unwrap_or_default().to_string();
        assert!(
            last.starts_with("error: postgres store: cannot connect to 127.0.0.1:"),
            "{err}"
        );
        assert!(
            last.to_lowercase().contains(cause),
            "names the cause {cause:?}: {err}"
        );
        assert!(
            !err.contains("wrong-password"),
            "the password never appears: {err}"
        );
        outputs.insert(cause, last);
    }
    for (cause, line) in outputs {
        println!("{cause}: {line}");
    }
}
