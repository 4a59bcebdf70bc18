//! Scenarios of failures: an unreachable server, the service killed during ingest, a service
//! restart and a server outage while 10,000 timers fire.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use super::setup::{commands, envelope, stored, timers, Setup};
use super::BrokerCase;
use timer_core::Store;

use crate::e2e::{
    free_addr, metric, now_ms, percentiles, refused_to_run, write_config, ScriptedServer, Service,
};
use crate::wait_for;

/// `run` against a server nobody listens on exits 1 with one line naming the address, never
/// its password.
pub async fn an_unreachable_server_is_a_one_line_error(case: Arc<BrokerCase>) {
    let kind = case.plugin.kind;
    let (broker, expected) = case.traits.unreachable.as_ref().unwrap_or_else(|| {
        panic!("no unreachable-server settings for the {kind} broker in its BrokerTraits")
    });
    let port = free_addr().port().to_string();
    let broker: Value = serde_json::from_str(&broker.to_string().replace("{port}", &port))
        .expect("the section with the port");
    let expected = expected.replace("{port}", &port);
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write_config(
        dir.path(),
        &json!({ "store": { "kind": "memory" }, "broker": broker }),
    );
    let exit = refused_to_run(
        &case.bin,
        &["run"],
        dir.path(),
        &[("TIMER_CONFIG", config.display().to_string())],
    )
    .await;
    let err = &exit.stderr;
    assert!(exit.last_line().starts_with(&expected), "{err}");
    assert!(!err.contains("secret"), "no password in the output: {err}");
}

/// kill -9 of the service while it ingests: commands it had not acknowledged come back from
/// the broker after the restart; every acknowledged one was committed first.
pub async fn service_killed_during_ingest_loses_no_command(case: Arc<BrokerCase>) {
    const N: usize = 10_000;
    let setup = Setup::new(&case);
    let store = setup.store().await;
    let client = setup.client().await;
    let service = setup.start().await;
    let bodies = commands("i", N, 1, now_ms() + 20_000, 2_000);
    // Sent while the kill is prepared: ingest keeps pace with sending on some brokers.
    let sending = {
        let client = client.clone();
        tokio::spawn(async move { client.send_commands(&bodies).await })
    };
    let mid = stored(store.as_ref(), 1)
        .await
        .unwrap_or_else(|| service.fail("ingest started"));
    service.kill9().await;
    let stored_at_kill = store.scheduled_count().await.expect("pending");
    println!(
        "killed the service ({} store) during ingest: {mid} stored when seen, {stored_at_kill} \
         after the kill",
        case.store.kind
    );
    assert!(
        stored_at_kill < N as u64,
        "the kill came before ingest finished"
    );
    sending.await.expect("send task").expect("send");
    let service = setup.start().await;
    if stored(store.as_ref(), N).await.is_none() {
        service.fail("every command stored after the restart");
    }
    let fired = wait_for(Duration::from_secs(90), || async {
        client.events().await.ok().filter(|e| timers(e).len() >= N)
    })
    .await;
    assert!(fired.is_some(), "every timer fired");
    service.terminate().await;
    setup.clean_up().await;
}

/// A command is acknowledged only once the store committed it, seen on the broker: while the
/// store refuses writes, the service has the command and the broker keeps it (Kafka: the group
/// committed nothing); the service goes down (SIGKILL; SIGTERM where the test server keeps a
/// killed consumer's commands), the store comes back, and the next service gets the command
/// again and stores it. A service that acknowledged on receipt would have lost it.
#[cfg(feature = "sqlite")]
pub async fn a_command_stays_unacknowledged_while_the_store_refuses_writes(case: Arc<BrokerCase>) {
    use super::WAIT;
    use crate::e2e::schedule;

    let setup = Setup::new(&case);
    let store = setup.store().await;
    let client = setup.client().await;
    let service = setup.start().await;
    let lock = setup.refuse_writes().await;
    let due = now_ms() + 600_000;
    client
        .send_command(schedule("t", "held", due).as_bytes())
        .await
        .expect("send");
    let received = wait_for(WAIT, || async {
        let text = service.text("/metrics").await;
        (metric(&text, "timer_commands_received") >= 1.0).then_some(())
    })
    .await;
    if received.is_none() {
        service.fail("the service received the command");
    }
    if let Some(acknowledged) = case.traits.acknowledged {
        assert_eq!(
            acknowledged(setup.broker.config.as_ref()).await,
            0,
            "the consumer committed a command the store has not"
        );
    }
    match case.traits.no_takeover {
        None => service.kill9().await,
        Some(_) => {
            service.terminate().await;
        }
    }
    drop(lock);
    assert_eq!(
        store.scheduled_count().await.expect("pending"),
        0,
        "the store committed nothing while it refused writes"
    );
    let service = setup.start().await;
    if stored(store.as_ref(), 1).await.is_none() {
        service.fail("the command came back to the next service and was stored");
    }
    service.terminate().await;
    setup.clean_up().await;
}

/// 10,000 timers: the service is stopped (SIGTERM) while it stores the first half and started
/// again after the second half was sent, so it resumes from what it acknowledged; then the
/// server crashes and comes back while they fire (unless its test server cannot take that:
/// [`ScriptedServer::crash_left_out`]). Every timer fires; an event that arrives twice carries the same id.
pub async fn ten_thousand_timers_survive_a_service_restart_and_a_server_outage(
    case: Arc<BrokerCase>,
) {
    const N: usize = 10_000;
    let setup = Setup::new(&case);
    let store = setup.store().await;
    let client = setup.client().await;
    // Far enough out that two service starts and all sends come first on a slow box.
    let all = commands("n", N, 7, now_ms() + 30_000, 6_000);
    let service = setup.start().await;
    client.send_commands(&all[..N / 2]).await.expect("send");
    if stored(store.as_ref(), 1).await.is_none() {
        service.fail("ingest started");
    }
    assert_eq!(service.terminate().await, Some(0), "a clean stop");
    let stored_at_stop = store.scheduled_count().await.expect("pending");
    let acknowledged = match case.traits.acknowledged {
        Some(acknowledged) => {
            let n = acknowledged(setup.broker.config.as_ref()).await;
            assert!(
                n > 0 && n <= stored_at_stop,
                "acknowledged commands ({n}) are stored ones only ({stored_at_stop} stored)"
            );
            n.to_string()
        }
        None => "not told".to_owned(),
    };
    // The second half while it is down; it resumes from what it acknowledged.
    client.send_commands(&all[N / 2..]).await.expect("send");
    let service = setup.start().await;
    if stored(store.as_ref(), N).await.is_none() {
        service.fail(format!(
            "every command stored after the restart ({} of {N}, {stored_at_stop} at the stop)",
            match store.scheduled_count().await {
                Ok(n) => n.to_string(),
                Err(e) => e.to_string(),
            }
        ));
    }
    println!(
        "service stopped with {stored_at_stop} of {N} stored ({acknowledged} acknowledged); \
         after the restart all {N}"
    );

    let server = ScriptedServer::of_plugin(case.plugin);
    match server.crash_left_out() {
        Some(why) => println!(
            "the {} server's outage is left out ({why}); the restart of the service is tested",
            case.plugin.kind
        ),
        None => server_outage_while_timers_fire(&case, &server, &service, store.as_ref(), N).await,
    }

    // The events wait on the broker; read them with a client of its own after the outage
    // (RabbitMQ's connection closes with the server).
    let client = setup.client().await;
    let read = wait_for(Duration::from_secs(180), || async {
        client.events().await.ok().filter(|e| timers(e).len() >= N)
    })
    .await
    .unwrap_or_else(|| service.fail("not every timer fired"));
    let mut ids_by_timer: HashMap<String, Vec<String>> = HashMap::new();
    let mut late = Vec::new();
    for e in &read {
        let v = envelope(e);
        let id = v["id"].as_str().unwrap_or_default().to_owned();
        assert_eq!(id, e.id.to_string(), "the broker carries the envelope id");
        ids_by_timer
            .entry(crate::e2e::timer_of(&v))
            .or_default()
            .push(id);
        late.push(crate::e2e::lateness_ms(&v));
    }
    assert_eq!(ids_by_timer.len(), N, "every timer fired");
    for (timer, ids) in &ids_by_timer {
        assert!(
            ids.iter().all(|id| *id == ids[0]),
            "{timer}: repeats only with the same id: {ids:?}"
        );
    }
    let repeated = ids_by_timer.values().filter(|ids| ids.len() > 1).count();
    let (p50, p99, max) = percentiles(late);
    println!(
        "{N} timers through {} with a service restart{}: {} events read, {repeated} timers \
         delivered more than once (same id); lateness ms p50 {p50} p99 {p99} max {max}",
        case.plugin.kind,
        match server.crash_left_out() {
            Some(_) => "",
            None => " and a server outage",
        },
        read.len()
    );
    if let Some(bound) = case.traits.max_repeated {
        assert!(
            repeated <= bound,
            "{repeated} timers delivered twice, at most {bound} for {}",
            case.plugin.kind
        );
    }
    assert!(
        service.ready_again(Duration::from_secs(30)).await,
        "the service is ready again"
    );
    assert_eq!(service.terminate().await, Some(0));
    setup.clean_up().await;
}

/// The outage of `ten_thousand_timers_survive_a_service_restart_and_a_server_outage`: the
/// server crashes once 3,000 of `n` timers fired, the service says so on `/readyz`, and the
/// server comes back on the same files.
async fn server_outage_while_timers_fire(
    case: &BrokerCase,
    server: &ScriptedServer,
    service: &Service,
    store: &dyn Store,
    n: usize,
) {
    // The server goes down once firing is well under way (3,000 fired), and comes back on the
    // same files.
    let unfired = wait_for(Duration::from_secs(90), || async {
        let pending = store.scheduled_count().await.ok()?;
        (pending <= (n - 3_000) as u64).then_some(pending)
    })
    .await
    .unwrap_or_else(|| service.fail("firing started"));
    let guard = server.restart_guard();
    let failures_before = metric(&service.text("/metrics").await, "timer_publish_failures");
    let down_at = std::time::Instant::now();
    server.crash().await;
    // While the server is gone the service says so: a plugin whose health answered Ok
    // regardless fails here (one whose publish did would lose events, which the count of
    // events on the broker below finds). Not longer: the outage is to stay short.
    let noticed = wait_for(Duration::from_secs(30), || async {
        let (ready, body) = service.get("/readyz").await;
        (ready == 503 && body["broker"]["status"] == "unavailable").then_some(())
    })
    .await;
    let (_, status) = service.get("/v1/status").await;
    if noticed.is_none() {
        service.fail(format!(
            "with the {} server down, /readyz still answered the broker ok; status: {status}",
            case.plugin.kind
        ));
    }
    assert_eq!(status["broker"]["healthy"], false, "{status}");
    let failed =
        metric(&service.text("/metrics").await, "timer_publish_failures") - failures_before;
    println!(
        "{} down: /readyz 503 (broker unavailable) within {} ms, {failed} publishes failed by \
         then; the status says: {}",
        case.plugin.kind,
        down_at.elapsed().as_millis(),
        status["broker"]["error"]
    );
    server.run("start").await;
    drop(guard);
    println!(
        "crash of the {} server with {} of {n} timers fired; started again",
        case.plugin.kind,
        n as u64 - unfired
    );
    assert!(
        unfired > 0,
        "the outage came while timers were still firing"
    );
}
