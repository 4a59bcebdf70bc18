//! PostgreSQL restarted under load: the service reports not ready, reconnects by itself, and
//! loses nothing. A test binary of its own, because it stops the shared test server (cargo runs
//! test binaries one after another). Needs `TIMER_TEST_POSTGRES_URL` and
//! `TIMER_TEST_POSTGRES_DIR` (bash scripts/test.sh sets both).

use std::path::Path;
use std::time::Duration;

use libtest_mimic::Arguments;
use timer_conformance::e2e::{
    assert_reached, count_by_key, drained, due_ms, new_timers, now_ms, on_time, store_timers,
    Received, ScriptedServer, Service,
};
use timer_conformance::{server_trial, wait_for};
use timer_core::plugin::fresh_name;
use timer_stores::postgres::{PostgresConfig, PostgresStore, TEST_SERVER};

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");

fn main() {
    let args = Arguments::from_args();
    let missing = ScriptedServer::of(&TEST_SERVER).err();
    let trials = vec![server_trial(
        "postgres::restart_under_load_loses_nothing",
        missing,
        restart_under_load_loses_nothing,
    )];
    libtest_mimic::run(&args, trials).exit();
}

async fn readyz(service: &Service) -> u16 {
    service.get("/readyz").await.0
}

async fn restart_under_load_loses_nothing() {
    const N: usize = 3_000;
    let url = TEST_SERVER.address().expect("url");
    let config = PostgresConfig {
        url: url.clone(),
        schema: fresh_name("r_"),
        ..PostgresConfig::default()
    };
    let store = PostgresStore::open(&config).await.expect("open");
    let dir = tempfile::tempdir().expect("tempdir");
    let env = vec![
        ("TIMER_STORE__KIND", "postgres".to_string()),
        ("TIMER_STORE__URL", url),
        ("TIMER_STORE__SCHEMA", config.schema.clone()),
        ("TIMER_STORE__CONNECT_TIMEOUT", "2s".to_string()),
        ("TIMER_BROKER__KIND", "memory".to_string()),
        ("TIMER_ENGINE__LEASE", "3s".to_string()),
        ("TIMER_ENGINE__POLL_INTERVAL", "1s".to_string()),
    ];
    let service = Service::start(Path::new(BIN), dir.path(), &env).await;
    let events = service.events().await;
    let timers = new_timers("r", N, 1, now_ms() + 1_000, 8_000);
    store_timers(&store, &timers).await;
    events
        .wait(100, Duration::from_secs(30))
        .await
        .expect("firing started");

    let server = ScriptedServer::of(&TEST_SERVER).expect("the PostgreSQL test server");
    let stopped_at = now_ms();
    server.run("stop").await;
    // Whatever happens next, the server is running again for the test binaries after this one.
    let _restart = server.restart_guard();
    let not_ready = wait_for(Duration::from_secs(30), || async {
        (readyz(&service).await == 503).then_some(())
    })
    .await;
    assert!(
        not_ready.is_some(),
        "/readyz reports 503 while PostgreSQL is down"
    );
    let fired_while_down = events.len();
    server.run("start").await;
    let ready = wait_for(Duration::from_secs(60), || async {
        (readyz(&service).await == 200).then_some(())
    })
    .await;
    assert!(
        ready.is_some(),
        "/readyz recovers; log:\n{}",
        service.log_text()
    );
    let ready_at = now_ms();

    assert!(
        drained(&store, Duration::from_secs(120)).await,
        "every timer fired after the restart; log:\n{}",
        service.log_text()
    );
    assert_reached(&store, timers.iter().map(|t| &t.key)).await;
    let counts = count_by_key(&events.snapshot());
    let seen = counts.len();
    let repeated = counts.values().filter(|n| **n > 1).count();
    println!(
        "restart under load: {fired_while_down} fired before the outage was seen, {seen} of {N} \
         seen on the stream, {repeated} fired twice"
    );
    assert_eq!(seen, N, "every timer's event reached the stream");
    // Away from the outage the timers fire on time: those due well before the server stopped,
    // and those due a while after the service was ready again (its pool reconnected).
    let (before, after): (Vec<Received>, Vec<Received>) = events
        .snapshot()
        .into_iter()
        .filter(|r| {
            let due = due_ms(&r.envelope);
            due < stopped_at - 200 || due > ready_at + 1_000
        })
        .partition(|r| due_ms(&r.envelope) < stopped_at);
    assert!(!before.is_empty(), "timers fired before the outage");
    on_time("before the PostgreSQL restart", &before);
    if !after.is_empty() {
        on_time("after the PostgreSQL restart", &after);
    }
    assert_eq!(service.terminate().await, Some(0));
}
