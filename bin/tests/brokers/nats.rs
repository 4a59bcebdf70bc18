//! What is NATS's own: JetStream drops a publish with an id it already stored (so an outage
//! repeats no event), a stream of another's is never overwritten, and events go to the tenant's
//! subject (checked on a cron timer that fires every second through a stop of the service); a
//! series with `catchUp: all` fires its latest missed occurrences after a stop; a service cut
//! off from the server for 10 s (a proxy between them) reports not ready, loses nothing and
//! catches up.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use serde_json::{json, Value};
use timer_brokers::nats::{NatsBroker, NatsConfig, NatsTestClient};
use timer_conformance::e2e::{
    due_ms, lateness_ms, now_ms, percentiles, timer_of, ScriptedServer, Service,
};
use timer_conformance::proxy::Proxy;
use timer_conformance::scenarios::{
    an_event_its_destination_refuses_is_retried_alone, commands,
    delivered_cancelled_and_dead_lettered, envelope, fires, refusing_destination_setup, timers,
    BrokerCase, BrokerTraits, Setup,
};
use timer_conformance::{check, checks, wait_for, Check};
use timer_core::plugin::TestClient;

pub fn traits() -> BrokerTraits {
    BrokerTraits {
        // As a service would run it (the isolated config redelivers after 2 s, for the
        // conformance checks' patience).
        settings: json!({ "ack_wait": "5s" }),
        // A publish again with the same envelope id (Nats-Msg-Id) within the duplicate window
        // is dropped by the stream.
        max_repeated: Some(0),
        unreachable: Some((
            json!({"kind": "nats", "url": "nats://user:secret@127.0.0.1:{port}",
                   "connect_timeout": "2s"}),
            "error: nats broker: cannot connect to nats://***@127.0.0.1:{port}",
        )),
        acknowledged: None,
        no_takeover: None,
        bound_tenant: "test",
    }
}

pub fn checks() -> Vec<Check<Arc<BrokerCase>>> {
    let mut checks = checks![
        a_stream_with_other_subjects_is_an_error_not_an_overwrite,
        cron_every_second_in_berlin_fires_one_catch_up_after_a_stop,
        a_ten_second_cut_from_the_server_loses_nothing_and_catches_up,
        a_delayed_message_arrives_on_its_subject_at_its_time,
        a_target_no_stream_captures_gets_one_plain_publish,
        an_event_its_stream_refuses_is_retried_alone,
        commands_a_stopping_instance_did_not_acknowledge_go_to_another_at_once,
        streams_the_server_lost_are_made_again,
        a_server_back_without_its_store_gets_the_streams_made_again,
        a_refused_command_the_server_could_not_take_back_is_dead_lettered_cut,
        a_dead_letter_over_the_servers_max_payload_is_cut_to_fit,
        an_event_larger_than_the_server_takes_fails_alone,
    ];
    // Its series goes on from when an occurrence fired: one fired over a second late (a busy
    // machine) would leave a gap it takes for a missed one.
    checks.push(check!(catch_up_all_fires_the_three_latest_missed_after_ten_seconds_down).alone());
    checks
}

fn nats_config(setup: &Setup) -> &NatsConfig {
    setup
        .broker
        .config
        .as_any()
        .downcast_ref()
        .expect("a nats config")
}

/// An instance that stops hands back the commands it received and did not acknowledge: another
/// gets them at once, not after the ack wait (30 s here), so a rolling upgrade delays none.
async fn commands_a_stopping_instance_did_not_acknowledge_go_to_another_at_once(
    case: Arc<BrokerCase>,
) {
    use timer_core::Broker;
    const N: usize = 5;
    let setup = Setup::new(&case);
    let config = NatsConfig {
        ack_wait: Duration::from_secs(30),
        ..nats_config(&setup).clone()
    };
    let stopping = NatsBroker::connect(&config).await.expect("connect");
    let other = NatsBroker::connect(&config).await.expect("connect");
    let client = setup.broker.config.test_client().await.expect("a client");
    for i in 0..N {
        let command = json!({"tenantId": "t", "serviceCallId": format!("g{i}"), "dueTimeMs": now_ms() + 60_000});
        client
            .send_command(command.to_string().as_bytes())
            .await
            .expect("send");
    }
    let mut received = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while received < N && tokio::time::Instant::now() < deadline {
        received += stopping
            .receive(N, Duration::from_millis(500))
            .await
            .expect("receive")
            .len();
    }
    assert_eq!(received, N, "the stopping instance received them all");
    stopping.give_back().await.expect("give back");
    let started = tokio::time::Instant::now();
    let mut again = 0;
    // Well within the ack wait: without the hand-back none comes for 30 s.
    while again < N && started.elapsed() < Duration::from_secs(10) {
        let batch = other
            .receive(N, Duration::from_millis(500))
            .await
            .expect("receive");
        let tags: Vec<u64> = batch.iter().map(|d| d.tag).collect();
        other.ack(&tags).await.expect("ack");
        again += batch.len();
    }
    assert_eq!(
        again, N,
        "another instance got every command back within 10 s"
    );
    println!(
        "{N} commands handed back, received by another instance in {} ms",
        started.elapsed().as_millis()
    );
}

async fn a_stream_with_other_subjects_is_an_error_not_an_overwrite(case: Arc<BrokerCase>) {
    let setup = Setup::new(&case);
    let c = nats_config(&setup);
    let js = jetstream_of(c).await;
    js.create_stream(jetstream::stream::Config {
        name: c.events_stream.clone(),
        subjects: vec!["somebody.else.>".into()],
        ..Default::default()
    })
    .await
    .expect("create a foreign stream");
    let err = match NatsBroker::connect(c).await {
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
    setup.clean_up().await;
}

/// One occurrence as read from the events stream.
struct Occurrence {
    n: i64,
    id: String,
    due: i64,
    fired: i64,
}

/// Each fire once (a repeat of one fire carries the same id), in due order.
async fn occurrences(client: &dyn TestClient) -> Vec<Occurrence> {
    let mut seen = HashSet::new();
    let mut out: Vec<Occurrence> = client
        .events()
        .await
        .unwrap_or_default()
        .iter()
        .filter_map(|e| serde_json::from_slice::<Value>(&e.body).ok())
        .map(|v| Occurrence {
            n: v["payload"]["occurrence"].as_i64().unwrap_or(0),
            id: v["id"].as_str().unwrap_or_default().to_owned(),
            due: due_ms(&v),
            fired: v["timestampMs"].as_i64().unwrap_or(0),
        })
        .filter(|o| seen.insert(o.id.clone()))
        .collect();
    out.sort_by_key(|o| o.due);
    out
}

/// `*/1 * * * * *` in Europe/Berlin fires every second for 10 s; the service is stopped for
/// 5 s and started again: exactly one catch-up fire, then the rhythm continues. Every event is
/// on the subject `<events_subject>.<tenant>`.
async fn cron_every_second_in_berlin_fires_one_catch_up_after_a_stop(case: Arc<BrokerCase>) {
    let setup = Setup::new(&case);
    let service = setup.start().await;
    let client = setup.client().await;
    let command = json!({"tenantId": "t", "serviceCallId": "tick", "cron": "*/1 * * * * *",
                         "timeZone": "Europe/Berlin"});
    client
        .send_command(command.to_string().as_bytes())
        .await
        .expect("send");
    let before = wait_for(Duration::from_secs(40), || async {
        let o = occurrences(client.as_ref()).await;
        (o.len() >= 10).then_some(o)
    })
    .await
    .unwrap_or_else(|| panic!("10 occurrences; log:\n{}", service.log_text()));
    assert_eq!(service.terminate().await, Some(0));
    let stopped_at = now_ms();
    let fired_before = occurrences(client.as_ref()).await.len();
    // The scenario's downtime (what is tested is what happens after it, not a wait for a
    // condition).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let restarted_at = now_ms();
    let service = setup.start().await;
    let all = wait_for(Duration::from_secs(40), || async {
        let o = occurrences(client.as_ref()).await;
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
    let c = nats_config(&setup);
    let raw = client
        .as_any()
        .downcast_ref::<NatsTestClient>()
        .expect("the nats test client")
        .read_all(&c.events_stream)
        .await
        .expect("read the events stream");
    let subject = format!("{}.t", c.events_subject);
    assert!(
        raw.iter().all(|m| m.subject.as_str() == subject),
        "events go to {subject}"
    );
    setup.clean_up().await;
}

/// `*/1 * * * * *` with `catchUp: all, catchUpLimit: 3`; the service is stopped for 10 s: once
/// it is back, the 3 latest missed occurrences fire late, one after the other, the older missed
/// ones are skipped (history reason `catch_up`), and the series goes on every second.
async fn catch_up_all_fires_the_three_latest_missed_after_ten_seconds_down(case: Arc<BrokerCase>) {
    const LIMIT: usize = 3;
    let setup = Setup::new(&case);
    let service = setup.start().await;
    let client = setup.client().await;
    let command = json!({"tenantId": "t", "serviceCallId": "catch-up", "cron": "*/1 * * * * *",
                         "catchUp": "all", "catchUpLimit": LIMIT});
    client
        .send_command(command.to_string().as_bytes())
        .await
        .expect("send");
    wait_for(Duration::from_secs(40), || async {
        (occurrences(client.as_ref()).await.len() >= 3).then_some(())
    })
    .await
    .unwrap_or_else(|| panic!("3 occurrences; log:\n{}", service.log_text()));
    assert_eq!(service.terminate().await, Some(0));
    let before = occurrences(client.as_ref()).await;
    // The scenario's downtime (what is tested is what happens after it, not a wait for a
    // condition).
    tokio::time::sleep(Duration::from_secs(10)).await;
    let restarted_at = now_ms();
    let service = setup.start().await;
    let all = wait_for(Duration::from_secs(40), || async {
        let o = occurrences(client.as_ref()).await;
        (o.len() >= before.len() + LIMIT + 3).then_some(o)
    })
    .await
    .unwrap_or_else(|| panic!("firing resumed; log:\n{}", service.log_text()));
    let (_, timer) = service.get("/v1/tenants/t/timers/catch-up").await;
    let (_, history) = service
        .get("/v1/tenants/t/timers/catch-up/history?limit=1000")
        .await;
    assert_eq!(service.terminate().await, Some(0));

    let after: Vec<&Occurrence> = all.iter().filter(|o| o.fired >= restarted_at).collect();
    let back_at = after.iter().map(|o| o.fired).min().unwrap_or(restarted_at);
    // Due before the service fired again: missed while it was down (or starting).
    let late: Vec<&&Occurrence> = after.iter().filter(|o| o.due < back_at).collect();
    assert_eq!(
        late.len(),
        LIMIT,
        "catchUpLimit missed occurrences fire late: {:?}",
        late.iter().map(|o| o.due).collect::<Vec<_>>()
    );
    let last_before = before.last().expect("fires before the stop");
    let first_late = late[0];
    let missed = (first_late.due - last_before.due) / 1_000 - 1;
    assert!(
        missed + LIMIT as i64 >= 10,
        "a stop of 10 s misses 10 occurrences or more: {missed} skipped, {LIMIT} fired"
    );
    let on_time: Vec<&&Occurrence> = after.iter().filter(|o| o.due >= back_at).collect();
    assert!(on_time.len() >= 3, "the series goes on");
    // The late ones are the latest missed: consecutive seconds, and the first one due after
    // them follows on.
    let resumed: Vec<&Occurrence> = late.iter().chain(on_time.iter()).map(|o| **o).collect();
    for pair in resumed.windows(2) {
        assert_eq!(pair[1].due - pair[0].due, 1_000, "one per second, no gap");
        assert_eq!(pair[1].n, pair[0].n + 1, "numbered in order");
    }
    let entries = history["history"].as_array().cloned().unwrap_or_default();
    let skipped: i64 = entries
        .iter()
        .filter(|e| e["type"] == "skipped")
        .map(|e| {
            assert_eq!(e["reason"], "catch_up", "{e}");
            e["count"].as_i64().unwrap_or(0)
        })
        .sum();
    assert_eq!(
        skipped, missed,
        "the older missed ones are skipped: {entries:?}"
    );
    let caught_up = entries
        .iter()
        .filter(|e| e["type"] == "fired" && e["caughtUp"] == true)
        .count();
    assert!(
        caught_up >= LIMIT - 1,
        "the fires before the last missed one are marked caught up: {entries:?}"
    );
    assert_eq!(timer["work"]["counts"]["skippedCatchUp"], missed, "{timer}");
    println!(
        "catch-up all, limit {LIMIT}: {missed} missed occurrences skipped, {LIMIT} fired {:?} ms \
         late, then {} on time",
        late.iter().map(|o| o.fired - o.due).collect::<Vec<_>>(),
        on_time.len()
    );
    setup.clean_up().await;
}

async fn a_ten_second_cut_from_the_server_loses_nothing_and_catches_up(case: Arc<BrokerCase>) {
    const N: usize = 2_000;
    const CUT: Duration = Duration::from_secs(10);
    let setup = Setup::new(&case);
    let url = nats_config(&setup).url.clone();
    let proxy = Proxy::in_front_of(&url, 4222).await;
    let setup = setup.with_broker_key("url", json!(proxy.rewrite(&url)));
    let client = setup.client().await;
    let store = setup.store().await;
    let service = setup.start().await;
    // Half the commands before the cut, half while it lasts (the server takes them; the
    // service reads them after); due from 3 s to 23 s from now.
    let all = commands("cut", N, 5, now_ms() + 3_000, 20_000);
    client.send_commands(&all[..N / 2]).await.expect("send");
    wait_for(Duration::from_secs(60), || async {
        client.events().await.ok().filter(|e| e.len() >= 100)
    })
    .await
    .unwrap_or_else(|| service.fail("firing started"));

    let cut = service.cut_off(&proxy).await;
    client.send_commands(&all[N / 2..]).await.expect("send");
    // The partition lasts its time (not a wait for something to happen).
    tokio::time::sleep_until(cut.at + CUT).await;
    let (healed_ms, ready) = service.heal(&proxy).await;
    // Caught up: every timer due before the heal is on the stream (an upper bound: the stream
    // is read again and again until it is).
    let due_before_heal: HashSet<String> = all
        .iter()
        .filter_map(|c| serde_json::from_slice::<Value>(c).ok())
        .filter(|c| c["dueTimeMs"].as_i64().unwrap_or(0) < healed_ms)
        .map(|c| {
            format!(
                "{}/{}",
                c["tenantId"].as_str().unwrap_or("?"),
                c["serviceCallId"].as_str().unwrap_or("?")
            )
        })
        .collect();
    wait_for(Duration::from_secs(120), || async {
        let fired = timers(&client.events().await.ok()?);
        due_before_heal.is_subset(&fired).then_some(())
    })
    .await
    .unwrap_or_else(|| service.fail("every timer due during the cut fired after it"));
    let caught_up = now_ms() - healed_ms;
    let read = wait_for(Duration::from_secs(120), || async {
        client.events().await.ok().filter(|e| timers(e).len() >= N)
    })
    .await
    .unwrap_or_else(|| service.fail("every timer fired after the cut"));
    let mut ids: HashMap<String, HashSet<String>> = HashMap::new();
    let mut early = Vec::new();
    for e in &read {
        let v = envelope(e);
        ids.entry(timer_of(&v))
            .or_default()
            .insert(v["id"].as_str().unwrap_or_default().to_owned());
        if lateness_ms(&v) < 0 {
            early.push(timer_of(&v));
        }
    }
    assert_eq!(ids.len(), N, "every timer fired");
    assert!(early.is_empty(), "nothing fired early: {early:?}");
    assert!(
        ids.values().all(|ids| ids.len() == 1),
        "a timer delivered twice has one id"
    );
    let repeated = read.len() - N;
    println!(
        "cut off from NATS for {} s: not ready {} ms later ({}), ready {ready} ms \
         after the heal; the {} timers due before the heal on the stream {caught_up} ms after \
         it; {} events for {N} timers ({repeated} repeated)",
        CUT.as_secs(),
        cut.not_ready_ms,
        cut.readyz,
        due_before_heal.len(),
        read.len()
    );
    // JetStream drops a publish with an event id it already stored.
    assert_eq!(repeated, 0, "no event delivered twice");
    assert!(
        wait_for(Duration::from_secs(30), || async {
            (store.scheduled_count().await.ok()? == 0).then_some(())
        })
        .await
        .is_some(),
        "every timer is Reached in the store"
    );
    assert_eq!(service.terminate().await, Some(0));
    setup.clean_up().await;
}

/// Delayed messages: published on `<delay_prefix>.<subject>` with `Timer-Delay` or
/// `Timer-Deliver-At`, they arrive at their time (never before) on `<subject>`, byte for byte
/// with their headers but JetStream's, the event id as `Nats-Msg-Id`; one cancelled by its
/// `Nats-Msg-Id` never arrives (a later one does); one that says no time is dead-lettered naming
/// what is missing. A timer's own message with a JetStream header is refused at admission.
async fn a_delayed_message_arrives_on_its_subject_at_its_time(case: Arc<BrokerCase>) {
    use async_nats::HeaderMap;
    let setup = Setup::with_sections(&case, json!({ "targets": { "allow": ["*"] } }));
    let service = setup.start().await;
    let client = setup.client().await;
    let target = client
        .make_target("delayed")
        .await
        .expect("make a target")
        .expect("nats takes targets");
    let subject = target.text("subject").expect("a subject").to_owned();
    let config = nats_config(&setup).clone();
    let js = &client
        .as_any()
        .downcast_ref::<NatsTestClient>()
        .expect("the nats test client")
        .js;
    let body = b"hello \x00\xff delayed".to_vec();
    let publish = |id: &'static str, time: Option<(&'static str, String)>| {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", id);
        // An instruction to the delay stream, not part of the message: it stays behind (the
        // target's stream would refuse the event it named another stream for).
        headers.insert("Nats-Expected-Stream", config.delay_stream.as_str());
        headers.insert("x-order", "42");
        headers.insert("Content-Type", "text/plain");
        if let Some((name, value)) = time {
            headers.insert(name, value.as_str());
        }
        let on = format!("{}.{subject}", config.delay_prefix);
        let body = body.clone();
        async move {
            js.publish_with_headers(on, headers, body.into())
                .await
                .expect("publish")
                .await
                .expect("PubAck");
            now_ms()
        }
    };
    let at = chrono::DateTime::from_timestamp_millis(now_ms() + 1_500)
        .expect("a time")
        .to_rfc3339();
    let sent = publish("n-1", Some(("Timer-Delay", "1500".into()))).await;
    publish("n-2", Some(("Timer-Deliver-At", at))).await;
    publish("n-3", Some(("Timer-Delay", "2000".into()))).await;
    publish("n-none", None).await;
    // Delayed messages and commands travel on different streams: the cancel is sent once the
    // timer is stored (sent at once, it could be applied first, to no timer).
    let stored = wait_for(Duration::from_secs(10), || async {
        let (status, _) = service.get("/v1/tenants/default/timers/n-3").await;
        (status == 200).then_some(())
    })
    .await;
    assert!(stored.is_some(), "n-3 is stored");
    let cancel = json!({"type": "CancelTimer", "tenantId": "default", "serviceCallId": "n-3"});
    client
        .send_command(cancel.to_string().as_bytes())
        .await
        .expect("send the cancel");
    publish("n-4", Some(("Timer-Delay", "2500".into()))).await;

    let got = wait_for(Duration::from_secs(30), || async {
        let got = client.read_target(&target).await.ok()?;
        (got.len() >= 3).then_some((now_ms(), got))
    })
    .await;
    let (arrived, got) = got.unwrap_or_else(|| service.fail("n-1, n-2 and n-4 arrived"));
    for m in &got {
        assert_eq!(m.body, body, "byte for byte");
        assert_eq!(m.content_type.as_deref(), Some("text/plain"));
        assert_eq!(
            m.headers.get("x-order").map(String::as_str),
            Some("42"),
            "{m:?}"
        );
        assert!(m.id.is_some(), "the event id as Nats-Msg-Id: {m:?}");
        assert!(
            !m.headers.contains_key("Timer-Delay"),
            "the time headers stay behind"
        );
        assert!(!m.headers.contains_key("Nats-Expected-Stream"), "{m:?}");
    }
    assert!(
        arrived >= sent + 1_500,
        "not early: {} ms after",
        arrived - sent
    );
    assert_eq!(
        got.len(),
        3,
        "the cancelled n-3 never arrived (n-4, due after it, did)"
    );
    delivered_cancelled_and_dead_lettered(&service, client.as_ref(), ("n-1", "n-3", "n-4")).await;

    // A timer's own message may not carry JetStream's headers.
    let timer = json!({"tenantId": "t", "serviceCallId": "rollup", "dueTimeMs": now_ms(),
        "target": target.fields(), "message": {"body": 1, "headers": {"nats-rollup": "all"}}});
    let (status, v) = service.post("/v1/timers", timer.to_string()).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["field"], "message", "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("nats-rollup: a header starting with Nats-"),
        "{v}"
    );
    service.terminate().await;
    setup.clean_up().await;
}

/// A target stream that answers no to a message (full, with discard new) refuses that event
/// alone ([`an_event_its_destination_refuses_is_retried_alone`]).
async fn an_event_its_stream_refuses_is_retried_alone(case: Arc<BrokerCase>) {
    use async_nats::jetstream::stream::{Config, DiscardPolicy};
    let setup = refusing_destination_setup(&case);
    let config = nats_config(&setup).clone();
    let subject = format!("{}_full.due", config.events_subject);
    let js = async_nats::jetstream::new(async_nats::connect(&config.url).await.expect("connect"));
    let stream = format!("{}_FULL", config.events_stream);
    js.create_stream(Config {
        name: stream.clone(),
        subjects: vec![subject.clone()],
        max_messages: 1,
        discard: DiscardPolicy::New,
        ..Config::default()
    })
    .await
    .expect("a stream that takes one message");
    let target = json!({ "subject": subject });
    an_event_its_destination_refuses_is_retried_alone(&setup, target, "maximum messages").await;
    let _ = js.delete_stream(&stream).await;
    setup.clean_up().await;
}

/// A target subject no stream captures gets one plain publish, to whoever subscribes then, and
/// the timer is Reached at once: not a JetStream publish, which would reach the subscriber and
/// then wait for a PubAck that never comes (a failed attempt, and the message again on retry).
async fn a_target_no_stream_captures_gets_one_plain_publish(case: Arc<BrokerCase>) {
    let setup = Setup::with_sections(&case, json!({ "targets": { "allow": ["*"] } }));
    let service = setup.start().await;
    let config = nats_config(&setup).clone();
    let subject = format!("{}_plain.due", config.events_subject);
    let nats = async_nats::connect(&config.url).await.expect("connect");
    let mut subscriber = nats.subscribe(subject.clone()).await.expect("subscribe");
    nats.flush().await.expect("flush");
    let due = now_ms();
    let timer = json!({"tenantId": "t", "serviceCallId": "plain", "dueTimeMs": due,
        "target": {"subject": subject}, "message": {"body": {"n": 1}}});
    let (status, v) = service.post("/v1/timers", timer.to_string()).await;
    assert_eq!(status, 201, "{v}");
    let got = tokio::time::timeout(
        Duration::from_secs(10),
        futures::StreamExt::next(&mut subscriber),
    )
    .await
    .expect("the message within 10 s")
    .expect("a message");
    assert_eq!(got.payload.as_ref(), br#"{"n":1}"#);
    let reached = wait_for(Duration::from_secs(3), || async {
        let (_, t) = service.get("/v1/tenants/t/timers/plain").await;
        (t["state"] == "Reached").then_some(t)
    })
    .await
    .unwrap_or_else(|| service.fail("Reached within 3 s of its due time"));
    assert_eq!(reached["attempts"], 0, "no failed attempt: {reached}");
    service.terminate().await;
    setup.clean_up().await;
}

/// A refused command as large as the server takes (its `max_payload`) is dead-lettered cut to
/// what a command may be: whole, with the reason's header, it would be over `max_payload`,
/// refused every time, and every tenant's commands after it would wait behind it for ever.
async fn a_refused_command_the_server_could_not_take_back_is_dead_lettered_cut(
    case: Arc<BrokerCase>,
) {
    let setup = Setup::new(&case);
    let service = setup.start().await;
    let client = setup.client().await;
    let max = max_payload(&setup).await;
    let mut huge = json!({"tenantId": "t", "serviceCallId": "huge", "dueTimeMs": now_ms(),
                          "payload": ""})
    .to_string();
    // Just under max_payload (the test client's publish adds no header), so that with the
    // dead letter's reason header it is over.
    huge.insert_str(huge.len() - 2, &"x".repeat(max - 16 - huge.len()));
    let letter = dead_lettered_and_passed(&service, client.as_ref(), &huge, "too_large").await;
    let limit = timer_core::Limits::default().command_bytes();
    assert_eq!(letter.body.len(), limit, "{}", letter.reason);
    assert!(
        letter
            .reason
            .contains(&format!("holds its first {limit} of {} bytes", huge.len())),
        "{}",
        letter.reason
    );
    service.terminate().await;
    setup.clean_up().await;
}

/// Sends `command` (which the server takes), checks that a command sent after it is applied,
/// and returns its dead letter, found by a word of its reason (`says`); its body is the start
/// of the command.
async fn dead_lettered_and_passed(
    service: &Service,
    client: &dyn TestClient,
    command: &str,
    says: &str,
) -> timer_core::plugin::ReadDeadLetter {
    client
        .send_command(command.as_bytes())
        .await
        .expect("the server takes the command");
    fires(client, service, "after", "after the refused command").await;
    let letter = wait_for(Duration::from_secs(30), || async {
        let letters = client.dead_letters().await.ok()?;
        letters.into_iter().find(|d| d.reason.contains(says))
    })
    .await
    .unwrap_or_else(|| service.fail(format!("no dead letter saying {says}")));
    assert!(command.as_bytes().starts_with(&letter.body));
    letter
}

/// With `limits.max_message_bytes` raised past the server's `max_payload`, a command refused
/// for another reason (no `serviceCallId`) just under it is dead-lettered cut to fit, by the
/// broker: whole, with the reason's header, the server would refuse it every time.
async fn a_dead_letter_over_the_servers_max_payload_is_cut_to_fit(case: Arc<BrokerCase>) {
    let setup = Setup::with_sections(
        &case,
        json!({ "limits": { "max_message_bytes": 4_194_304 } }),
    );
    let service = setup.start().await;
    let client = setup.client().await;
    let max = max_payload(&setup).await;
    let head = format!(
        r#"{{"tenantId":"t","dueTimeMs":{},"message":{{"body":""#,
        now_ms()
    );
    let filler = "x".repeat(max - 16 - head.len() - 3);
    let nameless = format!(r#"{head}{filler}"}}}}"#);
    assert_eq!(nameless.len(), max - 16);
    let letter =
        dead_lettered_and_passed(&service, client.as_ref(), &nameless, "serviceCallId").await;
    assert!(letter.body.len() < nameless.len(), "{}", letter.reason);
    assert!(letter.reason.contains("max_payload"), "{}", letter.reason);
    service.terminate().await;
    setup.clean_up().await;
}

/// An event larger than the server takes (`limits.max_message_bytes` raised past its
/// `max_payload`) fails alone: the timers fired with it in one batch are published and Reached,
/// it is retried, naming why.
async fn an_event_larger_than_the_server_takes_fails_alone(case: Arc<BrokerCase>) {
    let setup = Setup::with_sections(
        &case,
        json!({ "limits": { "max_message_bytes": 4_194_304 } }),
    );
    let service = setup.start().await;
    let max = max_payload(&setup).await;
    let due = now_ms() + 1_000;
    let huge = json!({"tenantId": "t", "serviceCallId": "huge", "dueTimeMs": due,
                      "message": {"body": "x".repeat(max)}});
    let small = json!({"tenantId": "t", "serviceCallId": "small", "dueTimeMs": due});
    service.schedule_batch(&[huge, small]).await;
    let reached = wait_for(Duration::from_secs(30), || async {
        let (_, t) = service.get("/v1/tenants/t/timers/small").await;
        (t["state"] == "Reached").then_some(t)
    })
    .await
    .unwrap_or_else(|| service.fail("the small timer was not Reached"));
    assert_eq!(reached["attempts"], 0, "published at once: {reached}");
    let failed = wait_for(Duration::from_secs(30), || async {
        let (_, t) = service.get("/v1/tenants/t/timers/huge").await;
        (t["attempts"].as_u64() >= Some(1)).then_some(t)
    })
    .await
    .unwrap_or_else(|| service.fail("the large event's failure was not recorded"));
    assert_eq!(failed["state"], "Scheduled", "{failed}");
    assert!(
        failed["lastError"]
            .as_str()
            .is_some_and(|e| e.contains("max_payload")),
        "{failed}"
    );
    service.terminate().await;
    setup.clean_up().await;
}

/// The largest message the server takes (its `max_payload`, headers included).
async fn max_payload(setup: &Setup) -> usize {
    let url = &nats_config(setup).url;
    let client = async_nats::connect(url).await.expect("connect");
    client.server_info().max_payload
}

/// The server loses the service's streams while it runs (its JetStream store wiped, a stream
/// deleted): the service makes them again and goes on. The events stream alone: the publish
/// that found no stream is retried, and the stream made again before the next, so the timer's
/// event arrives. Every stream: the reader, told its consumer is gone, makes the streams and
/// consumers again, and a command sent to the new commands stream is applied and fires.
async fn streams_the_server_lost_are_made_again(case: Arc<BrokerCase>) {
    let setup = Setup::new(&case);
    let service = setup.start().await;
    let c = nats_config(&setup);
    let js = jetstream_of(c).await;
    let client = setup.broker.config.test_client().await.expect("a client");
    js.delete_stream(&c.events_stream)
        .await
        .expect("delete the events stream");
    fires(
        client.as_ref(),
        &service,
        "events-lost",
        "after the events stream was lost",
    )
    .await;

    for stream in own_streams(c) {
        js.delete_stream(stream).await.expect("delete a stream");
    }
    made_again(&js, c, &service, Duration::from_secs(30), "of their loss").await;
    fires(
        client.as_ref(),
        &service,
        "all-lost",
        "after every stream was lost",
    )
    .await;
    service.terminate().await;
    setup.clean_up().await;
}

/// The server restarted without its JetStream store (its files removed while it was down): the
/// service, reconnected, finds its consumer gone, makes the streams and consumers again, and a
/// command sent then fires.
async fn a_server_back_without_its_store_gets_the_streams_made_again(case: Arc<BrokerCase>) {
    let setup = Setup::new(&case);
    let service = setup.start().await;
    let c = nats_config(&setup);
    let client = setup.broker.config.test_client().await.expect("a client");
    fires(client.as_ref(), &service, "before", "before the restart").await;
    let server = ScriptedServer::of_plugin(case.plugin);
    let guard = server.restart_guard();
    server.run("stop").await;
    let dir = std::env::var("TIMER_TEST_NATS_DIR").expect("TIMER_TEST_NATS_DIR");
    let store = std::path::Path::new(&dir).join("jetstream");
    std::fs::remove_dir_all(&store).expect("remove the JetStream store");
    std::fs::create_dir_all(&store).expect("an empty JetStream store");
    server.run("start").await;
    drop(guard);
    let js = jetstream_of(c).await;
    made_again(
        &js,
        c,
        &service,
        Duration::from_secs(90),
        "of the server's return",
    )
    .await;
    let client = setup.broker.config.test_client().await.expect("a client");
    fires(
        client.as_ref(),
        &service,
        "after",
        "after the server came back without its store",
    )
    .await;
    service.terminate().await;
    setup.clean_up().await;
}

/// A JetStream context of its own on the server of `config`.
async fn jetstream_of(config: &NatsConfig) -> jetstream::Context {
    jetstream::new(
        timer_brokers::nats::connect_client(config)
            .await
            .expect("connect to nats"),
    )
}

/// The service's four streams.
fn own_streams(c: &NatsConfig) -> [&String; 4] {
    [
        &c.commands_stream,
        &c.events_stream,
        &c.dead_letter_stream,
        &c.delay_stream,
    ]
}

/// Fails `service` unless all of its streams exist again within `within` (`since` says of
/// what, for the failure).
async fn made_again(
    js: &jetstream::Context,
    c: &NatsConfig,
    service: &Service,
    within: Duration,
    since: &str,
) {
    let made = wait_for(within, || async {
        for stream in own_streams(c) {
            js.get_stream(stream).await.ok()?;
        }
        Some(())
    })
    .await;
    if made.is_none() {
        service.fail(format!("every stream made again within {within:?} {since}"));
    }
}
