//! Fair firing with the real binary: a herd of 100,000 timers of one tenant, due at one instant,
//! does not make the timers of other tenants due while it drains wait behind it. SQLite (one
//! instance) and PostgreSQL (three instances on one schema). The bound is generous (a fifth of
//! the herd's drain time, which is what every other tenant waited before claims were shared);
//! the figures are printed. PostgreSQL needs `TIMER_TEST_POSTGRES_URL` (bash scripts/test.sh
//! starts the server); without it that trial is ignored with the reason, or fails under
//! `TIMER_TEST_REQUIRE=1`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use libtest_mimic::Arguments;
use serde_json::{json, Value};
use timer_conformance::e2e::{due_ms, now_ms, percentiles, timer_of, EventLog, Service};
use timer_conformance::{server_trial, wait_for};
use timer_core::plugin::fresh_name;
use timer_stores::postgres::{PLUGIN, TEST_SERVER};

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");

/// The herd: this many timers of [`HERD_TENANT`], all due at one instant.
const HERD: usize = 100_000;
const HERD_TENANT: &str = "herd";
/// The others: each a timer every [`EVERY_MS`] for [`FOR_MS`] after the herd's due time.
const OTHERS: [&str; 3] = ["small-a", "small-b", "small-c"];
const EVERY_MS: i64 = 100;
const FOR_MS: i64 = 3_000;

fn main() {
    let args = Arguments::from_args();
    let trials = vec![
        server_trial(
            "fairness::sqlite::a_herd_does_not_make_other_tenants_late",
            None,
            on_sqlite,
        ),
        server_trial(
            "fairness::postgres::a_herd_does_not_make_other_tenants_late_on_three_instances",
            PLUGIN.unavailable(),
            on_postgres,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

async fn on_sqlite() {
    let dir = tempfile::tempdir().expect("tempdir");
    let env = vec![
        ("TIMER_STORE__KIND", "sqlite".to_string()),
        (
            "TIMER_STORE__URL",
            format!("sqlite://{}", dir.path().join("timers.db").display()),
        ),
        ("TIMER_BROKER__KIND", "memory".to_string()),
        // The status counts the backlog for each request (it is read while the herd drains).
        ("TIMER_HTTP__COUNTS_MAX_AGE", "0s".to_string()),
    ];
    let service = Service::start(Path::new(BIN), dir.path(), &env).await;
    a_herd_does_not_make_other_tenants_late(&[service]).await;
}

async fn on_postgres() {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = TEST_SERVER
        .address()
        .expect("TIMER_TEST_POSTGRES_URL is set");
    let env = vec![
        ("TIMER_STORE__KIND", "postgres".to_string()),
        ("TIMER_STORE__URL", url),
        ("TIMER_STORE__SCHEMA", fresh_name("fair_")),
        ("TIMER_BROKER__KIND", "memory".to_string()),
        // The status counts the backlog for each request (it is read while the herd drains).
        ("TIMER_HTTP__COUNTS_MAX_AGE", "0s".to_string()),
    ];
    let mut services = Vec::new();
    for _ in 0..3 {
        services.push(Service::start(Path::new(BIN), dir.path(), &env).await);
    }
    a_herd_does_not_make_other_tenants_late(&services).await;
}

async fn a_herd_does_not_make_other_tenants_late(services: &[Service]) {
    // Each instance publishes what it fires on its own stream: one per instance and tenant.
    let mut logs: Vec<EventLog> = Vec::new();
    for service in services {
        for tenant in OTHERS {
            logs.push(
                service
                    .events_at(&format!("/v1/events?tenant={tenant}"), None)
                    .await,
            );
        }
    }
    // Time to schedule everything first: the herd's due time is this far ahead.
    let lead_ms = 30_000;
    let due = now_ms() + lead_ms;
    let mut others = Vec::new();
    for tenant in OTHERS {
        for k in 0..=(FOR_MS / EVERY_MS) {
            others.push(json!({"tenantId": tenant, "serviceCallId": format!("o{k:03}"), "dueTimeMs": due + 20 + k * EVERY_MS}));
        }
    }
    services[0].schedule_batch(&others).await;
    let batches: Vec<Vec<Value>> = (0..HERD)
        .step_by(1_000)
        .map(|first| {
            (first..(first + 1_000).min(HERD))
                .map(|i| json!({"tenantId": HERD_TENANT, "serviceCallId": format!("h{i:06}"), "dueTimeMs": due}))
                .collect()
        })
        .collect();
    // Four batches in flight, spread over the instances.
    let mut pending = batches.into_iter().enumerate();
    loop {
        let round: Vec<_> = pending.by_ref().take(4).collect();
        if round.is_empty() {
            break;
        }
        let sends = round.into_iter().map(|(i, batch)| async move {
            services[i % services.len()].schedule_batch(&batch).await
        });
        futures::future::join_all(sends).await;
    }
    let took = now_ms() - (due - lead_ms);
    println!("scheduled {HERD} timers over HTTP in {took} ms");
    assert!(
        took < lead_ms - 1_000,
        "scheduling {HERD} timers took {took} ms, more than the lead of {lead_ms} ms"
    );
    // The herd has drained when its tenant has nothing Scheduled left. Meanwhile the status
    // shows who waits: the herd, longest.
    let herd_waiting: Mutex<Option<Value>> = Mutex::new(None);
    let drained_at = wait_for(
        Duration::from_secs(lead_ms as u64 / 1_000 + 300),
        || async {
            let (_, status) = services[0].get("/v1/status").await;
            let backlog = &status["backlog"];
            if backlog["byTenant"][0]["tenantId"] == HERD_TENANT
                && backlog["due"].as_u64() > Some(0)
            {
                herd_waiting
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert_with(|| backlog.clone());
            }
            let (status, summary) = services[0]
                .get(&format!("/v1/tenants/{HERD_TENANT}/summary"))
                .await;
            (status == 200 && summary["counts"]["scheduled"] == 0).then(now_ms)
        },
    )
    .await
    .unwrap_or_else(|| panic!("the herd did not drain: {}", services[0].log_text()));
    let drain = drained_at - due;
    let herd_waiting = herd_waiting.into_inner().unwrap_or_else(|p| p.into_inner());
    let Some(backlog) = herd_waiting else {
        panic!("no status showed the herd waiting while it drained for {drain} ms");
    };
    println!("the status while the herd drained: backlog {backlog}");
    assert_eq!(
        backlog["byTenant"][0]["dueSince"].as_str(),
        Some(
            timer_core::Timestamp::from_millis(due)
                .to_rfc3339()
                .as_str()
        ),
        "the herd waits since its due time: {backlog}"
    );
    let fired = wait_for(Duration::from_secs(60), || async {
        let all: Vec<_> = logs.iter().flat_map(|l| l.snapshot()).collect();
        (all.len() >= others.len()).then_some(all)
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "not every other tenant's timer fired: {}",
            services[0].log_text()
        )
    });
    let mut times: HashMap<String, Vec<i64>> = HashMap::new();
    for event in &fired {
        times
            .entry(timer_of(&event.envelope))
            .or_default()
            .push(event.at_ms - due_ms(&event.envelope));
    }
    let twice: Vec<_> = times.iter().filter(|(_, t)| t.len() > 1).take(5).collect();
    assert!(twice.is_empty(), "fired twice: {twice:?}");
    assert_eq!(
        times.len(),
        others.len(),
        "every other tenant's timer fired once"
    );
    // The ones due while the herd drained.
    let during: Vec<i64> = fired
        .iter()
        .filter(|e| due_ms(&e.envelope) < drained_at)
        .map(|e| e.at_ms - due_ms(&e.envelope))
        .collect();
    let measured = during.len();
    let (p50, p99, max) = percentiles(during);
    println!(
        "{} instance(s), a herd of {HERD}: drained {drain} ms after its due time; the other \
         tenants' {measured} timers due meanwhile fired late (at their reader) by p50 {p50} ms, \
         p99 {p99} ms, max {max} ms",
        services.len()
    );
    assert!(
        measured >= 10,
        "the herd drained in {drain} ms: too fast for the other tenants to be measured"
    );
    assert!(
        p99 < drain / 5,
        "the other tenants waited behind the herd: p99 {p99} ms of a {drain} ms drain"
    );
    // The instances' last minute names the herd, by tenant.
    let mut herd_fired = 0;
    for service in services {
        let (status, _) = service.get("/readyz").await;
        assert_eq!(status, 200);
        let (_, status) = service.get("/v1/status").await;
        let by_tenant = status["lastMinute"]["byTenant"].as_array().cloned();
        for tenant in by_tenant.unwrap_or_default() {
            if tenant["tenantId"] == HERD_TENANT {
                herd_fired += tenant["fired"].as_u64().unwrap_or(0);
            }
        }
    }
    assert!(
        herd_fired > 0,
        "no instance's status shows the herd's fires of the last minute"
    );
}
