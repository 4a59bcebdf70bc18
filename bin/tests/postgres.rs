//! The `postgres` store with several `timer-service` processes on one database: every timer
//! fired once, a killed instance's timers fired by the others, an instance cut off from the
//! database for 10 s (alone, and beside one that is not), NOTIFY wake-ups across instances,
//! and clear errors for a wrong URL or password. Needs `TIMER_TEST_POSTGRES_URL`
//! (bash scripts/test.sh starts the server); without it the trials are ignored with the reason,
//! or fail under `TIMER_TEST_REQUIRE=1`.

use std::collections::HashMap;

use std::path::Path;
use std::time::Duration;

use libtest_mimic::Arguments;
use timer_conformance::e2e::{
    assert_reached, catch_holding_leases, count_by_key, drained, due_ms, free_addr,
    freeze_holding_leases, lateness_at_reader, lateness_ms, new_timers, now_ms, percentiles,
    recovered_after, refused_to_run, signal, store_timers, timer_of, EventLog, Service,
};
use timer_conformance::proxy::Proxy;
use timer_conformance::{server_trial, wait_for};
use timer_core::plugin::fresh_name;
use timer_core::{NewTimer, Store, TimerKey, Timestamp};
use timer_stores::postgres::{PostgresConfig, PostgresStore, PLUGIN, TEST_SERVER};
use tokio_util::sync::CancellationToken;

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");

fn main() {
    let args = Arguments::from_args();
    let missing = PLUGIN.unavailable();
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
            "postgres::cut_off_for_10s_keeps_what_it_acknowledged_and_catches_up",
            missing.clone(),
            cut_off_for_10s_keeps_what_it_acknowledged_and_catches_up,
        ),
        server_trial(
            "postgres::an_instance_cut_off_never_fires_what_another_fires",
            missing.clone(),
            an_instance_cut_off_never_fires_what_another_fires,
        ),
        server_trial(
            "postgres::a_statement_waiting_on_a_lock_is_cut_off_by_the_statement_timeout",
            missing.clone(),
            a_statement_waiting_on_a_lock_is_cut_off_by_the_statement_timeout,
        ),
        server_trial(
            "postgres::two_instances_take_from_one_rate_budget_with_limits_rate_shared",
            missing.clone(),
            two_instances_take_from_one_rate_budget_with_limits_rate_shared,
        ),
        server_trial(
            "postgres::notify_wakes_another_instance",
            missing.clone(),
            notify_wakes_another_instance,
        ),
        server_trial(
            "postgres::text_the_database_takes_no_nul_in_is_refused_as_bad_input",
            missing.clone(),
            text_the_database_takes_no_nul_in_is_refused_as_bad_input,
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
    PostgresConfig {
        url: TEST_SERVER
            .address()
            .expect("TIMER_TEST_POSTGRES_URL is set"),
        schema: fresh_name("e_"),
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

/// `n` timers of ten tenants, due evenly over `spread_ms` from `due_from`.
fn timers(prefix: &str, n: usize, due_from: i64, spread_ms: i64) -> Vec<NewTimer> {
    new_timers(prefix, n, 10, due_from, spread_ms)
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

/// `store.statement_timeout`: a statement of the store that waits on a lock another session
/// holds is cancelled by the server after the timeout, with an error saying so, instead of
/// holding its connection (and the task that called it) for as long as the lock is held.
async fn a_statement_waiting_on_a_lock_is_cut_off_by_the_statement_timeout() {
    let config = PostgresConfig {
        statement_timeout: Duration::from_millis(300),
        ..schema_config()
    };
    let store = PostgresStore::open(&config).await.expect("open");
    let now = Timestamp::from_millis(now_ms());
    store
        .schedule(&timers("lock", 1, now_ms() + 60_000, 0), now)
        .await
        .expect("schedule");
    let key = TimerKey::new("tenant-0", "lock00000");
    let other = sqlx::PgPool::connect(&config.url).await.expect("connect");
    let mut holder = other.begin().await.expect("begin");
    let locked = format!(
        "SELECT 1 FROM {}.timers WHERE tenant_id = $1 AND service_call_id = $2 FOR UPDATE",
        config.schema
    );
    let held: Option<i32> = sqlx::query_scalar(&locked)
        .bind(&key.tenant_id)
        .bind(&key.service_call_id)
        .fetch_optional(&mut *holder)
        .await
        .expect("lock the row");
    assert_eq!(held, Some(1), "the row exists");
    // Far longer than the timeout, so only a mechanism that is broken makes this fail.
    let cancelled = tokio::time::timeout(Duration::from_secs(20), store.cancel(&key, now))
        .await
        .expect("the statement timeout cuts the wait off");
    let error = cancelled.expect_err("cancelled by the server").chain();
    assert!(error.contains("statement timeout"), "{error}");
    holder.rollback().await.expect("rollback");
    store
        .cancel(&key, now)
        .await
        .expect("the lock gone, the cancel goes through");
    store.drop_schema().await.expect("drop schema");
}

async fn notify_reaches_another_store_handle() {
    let config = schema_config();
    let a = PostgresStore::open(&config).await.expect("open a");
    let b = PostgresStore::open(&config).await.expect("open b");
    let mut rx = b.wakeups().expect("postgres reports wake-ups");
    // LISTEN starts in the background: keep scheduling until b hears of one. What b hears may
    // lag a schedule behind (the "listening" wake-up comes first, when LISTEN answers after
    // the subscription), so any due time a sent is heard, not only the last.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut sent = std::collections::HashSet::new();
    let mut heard = false;
    while !heard && tokio::time::Instant::now() < deadline {
        let due = now_ms() + 60_000;
        a.schedule(&timers("n", 1, due, 0), Timestamp::from_millis(now_ms()))
            .await
            .expect("schedule");
        sent.insert(due);
        if let Ok(Ok(got)) = tokio::time::timeout(Duration::from_millis(200), rx.recv()).await {
            heard = sent.contains(&got.as_millis());
        }
    }
    assert!(heard, "a NOTIFY from one store handle reaches the other");
}

async fn three_instances_fire_20k_timers_once() {
    const N: usize = 20_000;
    // Polling a minute apart, a fire that waits for a poll instead of a wake-up (NOTIFY, or the
    // claim loop going on while a batch came back full) is tens of seconds late; one that waits
    // only for the two cores, which three debug-build instances and their readers share at
    // 4,000 fires a second, about a second (p99 2,003 ms once on CI).
    const WAITED_FOR_A_POLL_MS: i64 = 15_000;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = schema_config();
    let store = PostgresStore::open(&config).await.expect("open");
    let env = env_for(&config, &[("TIMER_ENGINE__POLL_INTERVAL", "60s")]);
    let services = start_instances(dir.path(), &env, 3).await;
    let mut logs = Vec::new();
    for s in &services {
        logs.push(s.events().await);
    }
    let due_from = now_ms() + 3_000;
    store_timers(&store, &timers("k", N, due_from, 5_000)).await;
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
    println!("3 instances, {N} timers over 5 s: per instance {per_instance:?}");
    // Bounded: when each fired, as its instance stamped it (`timestampMs` − `dueAt`), where a
    // lost wake-up would show (the latest, so that one fire of 20,000 waiting for a poll
    // fails it too). Only shown: when the tests' readers got it, later still.
    let fired = percentiles(events.iter().map(|e| lateness_ms(&e.envelope)).collect());
    let read = lateness_at_reader(&events);
    println!("3 instances, 20,000 timers over 5 s: late (p50, p99, max) when fired {fired:?} ms, at the readers {read:?} ms");
    assert!(
        fired.2 <= WAITED_FOR_A_POLL_MS,
        "fired up to {} ms late (p50 {}, p99 {}): a fire waited for a poll instead of its due \
         time?",
        fired.2,
        fired.0,
        fired.1
    );
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
    // A lease far longer than the bound below: waiting for the victim's leases to run out
    // cannot pass.
    let env = env_for(
        &config,
        &[
            ("TIMER_ENGINE__BATCH_SIZE", "200"),
            ("TIMER_ENGINE__LEASE", "60s"),
        ],
    );
    let mut services = start_instances(dir.path(), &env, 3).await;
    let victim_log = services[0].events().await;
    let due_from = now_ms() + 2_000;
    let all = timers("v", N, due_from, 5_000);
    store_timers(&store, &all).await;
    // Kill one instance while it holds leases: frozen (SIGSTOP) the moment it holds some, so
    // its connections stay open, then SIGKILL.
    victim_log
        .wait(500, Duration::from_secs(60))
        .await
        .expect("the victim fires");
    let victim = services.remove(0);
    let victim_pid = victim.pid();
    let owner = victim.get("/v1/status").await.1["instanceId"]
        .as_str()
        .map(str::to_owned)
        .expect("the status names the instance");
    let leases = Leases::connect(&config).await;
    let in_flight = freeze_holding_leases(victim_pid, Duration::from_secs(30), || {
        leases.held_by(&owner)
    })
    .await;
    let killed_ms = now_ms();
    victim.kill9().await;
    println!(
        "killed instance {owner} holding {} leases, after it fired {} events",
        in_flight.len(),
        victim_log.len()
    );
    let recovered = recovered_after(&store, &in_flight, killed_ms, Duration::from_secs(60)).await;
    println!("its timers in flight fired {recovered} ms after the kill, by the others");
    // Measured here: 817 to 942 ms (a take-over round every 250 ms, then the 750 ms in which
    // a live instance that lost its connection stops firing); the bound is ten times that,
    // and the others waited for the lease (60 s here) before.
    assert!(
        recovered < 10_000,
        "in-flight timers fired {recovered} ms after the kill"
    );
    assert!(
        drained(&store, Duration::from_secs(120)).await,
        "every timer fired after the kill ({} pending)",
        store.scheduled_count().await.unwrap_or(0)
    );
    assert_reached(&store, all.iter().map(|t| &t.key)).await;
    assert!(
        leases.held_by(&owner).await.is_empty(),
        "the dead instance's leases were taken over"
    );
    for s in services {
        assert_eq!(s.terminate().await, Some(0));
    }
}

/// `limits.rate.shared`: the allowance is kept in the schema, so what one instance took, the
/// other cannot take again; without it each instance has a budget of its own.
async fn two_instances_take_from_one_rate_budget_with_limits_rate_shared() {
    let dir = tempfile::tempdir().expect("tempdir");
    let later = now_ms() + 3_600_000;
    let batch = |tenant: &str, n: usize| {
        let commands: Vec<serde_json::Value> = (0..n)
            .map(|i| serde_json::json!({"tenantId": tenant, "serviceCallId": format!("r{i}"), "dueTimeMs": later}))
            .collect();
        serde_json::json!({ "commands": commands }).to_string()
    };
    for shared in [true, false] {
        let config = schema_config();
        let flag = shared.to_string();
        let env = env_for(
            &config,
            &[
                ("TIMER_LIMITS__RATE__SCHEDULES_PER_SECOND", "1"),
                ("TIMER_LIMITS__RATE__BURST", "5"),
                ("TIMER_LIMITS__RATE__SHARED", flag.as_str()),
            ],
        );
        let services = start_instances(dir.path(), &env, 2).await;
        // The whole burst through the first instance.
        let (status, v) = services[0].post("/v1/timers/batch", batch("acme", 5)).await;
        assert_eq!(status, 200, "{v}");
        // One more through the second, within the second the burst refills in.
        let (status, v) = services[1].post("/v1/timers/batch", batch("acme", 1)).await;
        if shared {
            assert_eq!(
                status, 429,
                "the second instance took from the same budget: {v}"
            );
            assert_eq!(v["error"]["reason"], "rate_limited", "{v}");
            // Another tenant's budget is untouched.
            let (status, v) = services[1]
                .post("/v1/timers/batch", batch("other", 5))
                .await;
            assert_eq!(status, 200, "{v}");
        } else {
            assert_eq!(status, 200, "each instance has its own budget: {v}");
        }
        for s in services {
            assert_eq!(s.terminate().await, Some(0));
        }
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
        .unwrap_or_else(|| b.fail("B did not fire it within 10 s (poll interval 60 s)"));
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

/// The timers one instance holds live leases on, read straight from the table with one
/// indexed query (`timers_leased`). A batch is leased only between its claim and its mark, tens of
/// milliseconds: the store's listing, tenant by tenant, is too slow to catch it on a busy
/// machine.
struct Leases {
    pool: sqlx::PgPool,
    query: String,
}

impl Leases {
    async fn connect(config: &PostgresConfig) -> Self {
        let pool = sqlx::PgPool::connect(&config.url)
            .await
            .expect("connect to the test database");
        let query = format!(
            "SELECT tenant_id, service_call_id FROM \"{}\".timers \
             WHERE state = 0 AND lease_owner = $1 AND lease_until IS NOT NULL ORDER BY 1, 2",
            config.schema
        );
        Self { pool, query }
    }

    /// What `owner` holds now, in key order (two looks compare equal when nothing changed).
    async fn held_by(&self, owner: &str) -> Vec<TimerKey> {
        sqlx::query_as::<_, (String, String)>(&self.query)
            .bind(owner)
            .fetch_all(&self.pool)
            .await
            .expect("read the leases")
            .into_iter()
            .map(|(tenant, id)| TimerKey::new(tenant, id))
            .collect()
    }
}

/// PostgreSQL takes no NUL in text: a query value or cursor with one (no id has a control
/// character) is refused as the request's fault, 400 naming it, never sent to the database to
/// come back as a 500.
async fn text_the_database_takes_no_nul_in_is_refused_as_bad_input() {
    use base64::Engine as _;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = schema_config();
    let service = Service::start(Path::new(BIN), dir.path(), &env_for(&config, &[])).await;
    let body = serde_json::json!({"tenantId": "acme", "serviceCallId": "a", "dueTimeMs": now_ms() + 60_000});
    let (status, v) = service.post("/v1/timers", body.to_string()).await;
    assert_eq!(status, 201, "{v}");
    let cursor = |json: serde_json::Value| {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json.to_string())
    };
    let list = cursor(
        serde_json::json!({"tenant": "acme", "states": [], "prefix": null,
        "due_after": null, "due_before": null, "recurring": null, "due_at": 0, "id": "a\0"}),
    );
    let summary = cursor(serde_json::json!({"after_tenant": "a\0"}));
    for (path, field) in [
        ("/v1/tenants/acme/timers?prefix=%00".to_owned(), "prefix"),
        (format!("/v1/tenants/acme/timers?cursor={list}"), "cursor"),
        (format!("/v1/summary?cursor={summary}"), "cursor"),
    ] {
        let (status, v) = service.get(&path).await;
        assert_eq!(status, 400, "{path}: {v}");
        assert_eq!(v["error"]["field"], field, "{path}: {v}");
    }
    let bulk = serde_json::json!({"action": "cancel", "filter": {"prefix": "a\0"}});
    let (status, v) = service
        .post("/v1/tenants/acme/timers/bulk", bulk.to_string())
        .await;
    assert_eq!(status, 400, "{v}");
    let (status, v) = service.get("/v1/tenants/acme/timers?prefix=a").await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["timers"].as_array().map(Vec::len), Some(1), "{v}");
    service.terminate().await;
}

/// SIGKILL, leaving the handle for the caller to drop.
async fn kill_now(a: &Service) {
    signal(a.pid(), "-KILL").await;
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
                free_addr().port()
            ),
            "refused",
        ),
    ];
    let mut outputs = HashMap::new();
    for (url, cause) in cases {
        let env = [
            ("TIMER_STORE__KIND", "postgres".to_owned()),
            ("TIMER_STORE__URL", url),
            ("TIMER_STORE__CONNECT_TIMEOUT", "3s".to_owned()),
        ];
        let exit = refused_to_run(Path::new(BIN), &["run"], dir.path(), &env).await;
        let err = &exit.stderr;
        let last = exit.last_line().to_owned();
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

/// How long the partition tests cut the network.
const CUT: Duration = Duration::from_secs(10);

/// The proxy in front of the test server, and `config` with its URL going through it.
async fn proxied(config: &PostgresConfig) -> (Proxy, PostgresConfig) {
    let proxy = Proxy::in_front_of(&config.url, 5432).await;
    let through = PostgresConfig {
        url: proxy.rewrite(&config.url),
        ..config.clone()
    };
    (proxy, through)
}

/// Schedules one timer due `ahead_ms` later every 100 ms through `service`'s API until
/// `stop`; returns the keys it acknowledged (201) and how many it sent.
fn schedule_steadily(
    service: &Service,
    prefix: &'static str,
    ahead_ms: i64,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<(Vec<TimerKey>, usize)> {
    let base = service.base.clone();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("an HTTP client");
    tokio::spawn(async move {
        let mut acknowledged = Vec::new();
        let mut sent = 0;
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        while !stop.is_cancelled() {
            tick.tick().await;
            let id = format!("{prefix}-{sent}");
            sent += 1;
            let body = serde_json::json!({"tenantId": "steady", "serviceCallId": id, "dueTimeMs": now_ms() + ahead_ms});
            let answer = http
                .post(format!("{base}/v1/timers"))
                .header("content-type", "application/json")
                .body(body.to_string())
                .send()
                .await;
            if answer.is_ok_and(|a| a.status().as_u16() == 201) {
                acknowledged.push(TimerKey::new("steady", &id));
            }
        }
        (acknowledged, sent)
    })
}

/// Events fired before they were due.
fn early(events: &[timer_conformance::e2e::Received]) -> Vec<String> {
    events
        .iter()
        .filter(|e| lateness_ms(&e.envelope) < 0)
        .map(|e| timer_of(&e.envelope))
        .collect()
}

async fn cut_off_for_10s_keeps_what_it_acknowledged_and_catches_up() {
    const N: usize = 3_000;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = schema_config();
    let store = PostgresStore::open(&config).await.expect("open");
    let (proxy, through) = proxied(&config).await;
    let env = env_for(
        &through,
        &[
            ("TIMER_STORE__CONNECT_TIMEOUT", "2s"),
            ("TIMER_ENGINE__POLL_INTERVAL", "1s"),
        ],
    );
    let service = Service::start(Path::new(BIN), dir.path(), &env).await;
    let events = service.events().await;
    let due_from = now_ms() + 1_000;
    let all = timers("c", N, due_from, 25_000);
    store_timers(&store, &all).await;
    let stop = CancellationToken::new();
    let steady = schedule_steadily(&service, "s", 2_000, stop.clone());
    events
        .wait(200, Duration::from_secs(60))
        .await
        .unwrap_or_else(|| service.fail("firing started"));

    let cut = service.cut_off(&proxy).await;
    let cut_ms = cut.at_ms;
    println!(
        "cut off from PostgreSQL: not ready {} ms later: {}",
        cut.not_ready_ms, cut.readyz
    );
    // The partition lasts its time (not a wait for something to happen).
    tokio::time::sleep_until(cut.at + CUT).await;
    let fired_in_cut = events
        .snapshot()
        .iter()
        .filter(|e| e.at_ms > cut_ms + 2_000)
        .count();
    assert_eq!(
        fired_in_cut, 0,
        "nothing fires while the store is cut off (after its first 2 s)"
    );
    let (healed_ms, ready) = service.heal(&proxy).await;
    // A few more schedules after the cut, then stop.
    let more = events.len() + 20;
    events.wait(more, Duration::from_secs(60)).await;
    stop.cancel();
    let (acknowledged, sent) = steady.await.expect("the scheduler");
    assert!(
        drained(&store, Duration::from_secs(120)).await,
        "every timer fired after the cut ({} pending); log:\n{}",
        store.scheduled_count().await.unwrap_or(0),
        service.log_text()
    );
    assert_reached(&store, all.iter().map(|t| &t.key).chain(&acknowledged)).await;
    let got = events.snapshot();
    let counts = count_by_key(&got);
    let missing: Vec<_> = all
        .iter()
        .map(|t| t.key.to_string())
        .chain(acknowledged.iter().map(|k| k.to_string()))
        .filter(|k| !counts.contains_key(k))
        .take(5)
        .collect();
    assert!(
        missing.is_empty(),
        "every stored and acknowledged timer's event arrived: {missing:?}"
    );
    let early = early(&got);
    assert!(early.is_empty(), "nothing fired early: {early:?}");
    // Caught up: the last timer due before the heal fired this long after it.
    let caught_up = got
        .iter()
        .filter(|e| due_ms(&e.envelope) < healed_ms)
        .map(|e| e.at_ms - healed_ms)
        .max()
        .unwrap_or(0);
    let twice = counts.values().filter(|n| **n > 1).count();
    println!(
        "cut {} s: {fired_in_cut} fired during the cut (after its first 2 s), ready {ready} ms \
         after the heal, everything due before the heal fired {caught_up} ms after it; \
         {} of {sent} schedules acknowledged (all fired), {twice} fired twice",
        CUT.as_secs(),
        acknowledged.len()
    );
    assert_eq!(service.terminate().await, Some(0));
}

async fn an_instance_cut_off_never_fires_what_another_fires() {
    const N: usize = 6_000;
    const BURSTS: usize = 10;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = schema_config();
    let store = PostgresStore::open(&config).await.expect("open");
    let lost_within = store
        .lease_owners()
        .expect("postgres keeps lease owners")
        .lost_within();
    let (proxy, through) = proxied(&config).await;
    // A lease shorter than the cut: B claims what A held while A is still running, cut off.
    let extra = [
        ("TIMER_STORE__CONNECT_TIMEOUT", "2s"),
        ("TIMER_ENGINE__BATCH_SIZE", "200"),
        ("TIMER_ENGINE__LEASE", "3s"),
    ];
    let a = Service::start(Path::new(BIN), dir.path(), &env_for(&through, &extra)).await;
    let b = Service::start(Path::new(BIN), dir.path(), &env_for(&config, &extra)).await;
    let (a_log, b_log) = (a.events().await, b.events().await);
    // Bursts of timers due at once, so that claims are large and their settles take a while.
    let due_from = now_ms() + 1_000;
    let all: Vec<NewTimer> = (0..BURSTS)
        .flat_map(|i| timers(&format!("p{i}"), N / BURSTS, due_from + i as i64 * 3_000, 0))
        .collect();
    store_timers(&store, &all).await;
    let a_owner = a.get("/v1/status").await.1["instanceId"]
        .as_str()
        .map(str::to_owned)
        .expect("the status names the instance");
    // Cut A off while the database shows it holding leases: a batch of its own in flight,
    // which only B can fire while the cut lasts.
    let leases = Leases::connect(&config).await;
    let mut cut = (0, tokio::time::Instant::now());
    let held = catch_holding_leases(
        "A",
        Duration::from_secs(60),
        || leases.held_by(&a_owner),
        async || {
            proxy.cut();
            cut = (now_ms(), tokio::time::Instant::now());
        },
        async || {
            a.heal(&proxy).await;
        },
    )
    .await;
    let (cut_ms, cut_at) = cut;
    a.readyz_turns(503, Duration::from_secs(10))
        .await
        .unwrap_or_else(|| a.fail("A reports not ready while cut off"));
    assert!(b.ready_again(Duration::from_secs(1)).await, "B stays ready");
    // The partition lasts its time (not a wait for something to happen).
    tokio::time::sleep_until(cut_at + CUT).await;
    let (healed_ms, _) = a.heal(&proxy).await;
    assert!(
        drained(&store, Duration::from_secs(120)).await,
        "every timer fired ({} pending)",
        store.scheduled_count().await.unwrap_or(0)
    );
    assert_reached(&store, all.iter().map(|t| &t.key)).await;

    let (a_events, b_events) = (a_log.snapshot(), b_log.snapshot());
    // Each timer's first and last fire (`timestampMs`) on one instance.
    let spans = |events: &[timer_conformance::e2e::Received]| {
        let mut spans: HashMap<String, (i64, i64)> = HashMap::new();
        for e in events {
            let at = e.envelope["timestampMs"].as_i64().unwrap_or(0);
            let span = spans.entry(timer_of(&e.envelope)).or_insert((at, at));
            *span = (span.0.min(at), span.1.max(at));
        }
        spans
    };
    let (a_spans, b_spans) = (spans(&a_events), spans(&b_events));
    // What A's broker confirmed after the cut (its event stream, which shows a fire once the
    // broker confirmed it): nothing once its fence was up, until the heal. The slack is for
    // the stream's own delay on a busy machine.
    let a_in_cut: Vec<i64> = a_events
        .iter()
        .map(|e| e.at_ms - cut_ms)
        .filter(|after| (0..(healed_ms - cut_ms)).contains(after))
        .collect();
    let a_last_in_cut = a_in_cut.iter().max().copied().unwrap_or(0);
    let bound = lost_within.as_millis() as i64 + 1_000;
    assert!(
        a_last_in_cut < bound,
        "A fired {a_last_in_cut} ms after it was cut off, later than {lost_within:?} (+1 s); \
         log:\n{}",
        a.log_text()
    );
    // Fired by both: A's fire came first (its publish before it lost the lease), then B's.
    let mut both = 0;
    for (timer, (b_at, b_last)) in &b_spans {
        if let Some((a_at, a_last)) = a_spans.get(timer) {
            both += 1;
            assert!(
                a_last < b_at || b_last < a_at,
                "{timer} fired by A at {a_at}..{a_last} and by B at {b_at}..{b_last}: at once"
            );
        }
    }
    // B fired what A held, while A was still cut off (once A's 3 s leases ran out).
    let held_by_b: Vec<i64> = held
        .iter()
        .filter_map(|k| b_spans.get(&k.to_string()).map(|(at, _)| at - cut_ms))
        .collect();
    assert_eq!(held_by_b.len(), held.len(), "B fired every timer A held");
    assert!(
        held_by_b.iter().all(|after| *after < healed_ms - cut_ms),
        "B fired them during the cut: {held_by_b:?} ms after it"
    );
    let all_events: Vec<_> = a_events.iter().chain(&b_events).cloned().collect();
    let early = early(&all_events);
    assert!(early.is_empty(), "nothing fired early: {early:?}");
    println!(
        "A cut off holding {} leases: A fired {} events in the cut, the last {a_last_in_cut} ms \
         after it; B fired those {} timers {:?}..{:?} ms after the cut; {both} timers fired by \
         both (one after the other); A {} / B {} events",
        held.len(),
        a_in_cut.len(),
        held_by_b.len(),
        held_by_b.iter().min(),
        held_by_b.iter().max(),
        a_events.len(),
        b_events.len()
    );
    for s in [a, b] {
        assert_eq!(s.terminate().await, Some(0));
    }
}
