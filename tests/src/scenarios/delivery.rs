//! Delayed delivery through the service: a `ScheduleTimer` from the broker with its own
//! `target` and `message` delivers the message there, byte-exact, at its due time; a cancelled
//! one never arrives. Through the broker's own delay ingress, 10,000 of them survive a kill, and
//! the delay bench sees every one of its messages arrive.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use serde_json::{json, Value};

use timer_core::plugin::{DelayedMessage, DelayedUntil, ReadMessage, TestClient};

use super::{BrokerCase, Setup};
use crate::e2e::{now_ms, Service};
use crate::wait_for;

/// Two messages for one target of the broker's own (made by its test client), due together; the
/// second is cancelled by id right after it was sent. The first arrives at the target with its
/// body byte for byte, its content type and headers, and the event id in the de-duplication
/// slot; the second never does (it would have fired in the same batch), and is Cancelled.
pub async fn a_timers_own_message_arrives_at_its_target_and_a_cancelled_one_does_not(
    case: Arc<BrokerCase>,
) {
    // Any destination here; who may send where has tests of its own.
    let setup = Setup::with_sections(&case, json!({ "targets": { "allow": ["*"] } }));
    let client = setup.client().await;
    let target = client
        .make_target("delayed")
        .await
        .expect("make a target")
        .unwrap_or_else(|| panic!("{} takes no targets", case.plugin.kind));
    let service = setup.start().await;
    let body: Vec<u8> = (0..4096).map(|i| (i * 7 % 256) as u8).collect();
    let encoded = base64::engine::general_purpose::STANDARD.encode(&body);
    let due = now_ms() + 2_000;
    let command = |id: &str| {
        json!({"tenantId": "t", "serviceCallId": id, "dueTimeMs": due,
            "target": target.fields(),
            "message": {"bodyBase64": encoded, "contentType": "application/octet-stream",
                        "headers": {"x-call": id}}})
        .to_string()
    };
    client
        .send_command(command("kept").as_bytes())
        .await
        .expect("send");
    client
        .send_command(command("dropped").as_bytes())
        .await
        .expect("send");
    let cancel = json!({"type": "CancelTimer", "tenantId": "t", "serviceCallId": "dropped"});
    client
        .send_command(cancel.to_string().as_bytes())
        .await
        .expect("send");
    let arrived = wait_for(std::time::Duration::from_secs(30), || async {
        let got = client.read_target(&target).await.ok()?;
        (!got.is_empty()).then_some(got)
    })
    .await
    .unwrap_or_else(|| service.fail("the message arrived at its target"));
    let kept: Vec<_> = arrived
        .iter()
        .filter(|m| m.headers.get("x-call").map(String::as_str) == Some("kept"))
        .collect();
    assert_eq!(
        kept.len(),
        1,
        "one message (its header names it): {:?}",
        arrived.len()
    );
    assert!(
        kept[0].body == body,
        "byte for byte ({} bytes)",
        kept[0].body.len()
    );
    assert_eq!(
        kept[0].content_type.as_deref(),
        Some("application/octet-stream")
    );
    assert!(
        kept[0].id.is_some(),
        "the event id in the de-duplication slot"
    );
    assert!(
        now_ms() >= due,
        "not before its due time: arrived {} ms early",
        due - now_ms()
    );
    assert!(
        arrived
            .iter()
            .all(|m| m.headers.get("x-call").map(String::as_str) != Some("dropped")),
        "the cancelled message never arrived"
    );
    let (_, dropped) = service.get("/v1/tenants/t/timers/dropped").await;
    assert_eq!(dropped["state"], "Cancelled", "{dropped}");
    let (_, kept) = service.get("/v1/tenants/t/timers/kept").await;
    assert_eq!(kept["state"], "Reached", "{kept}");
    service.terminate().await;
    setup.clean_up().await;
}

/// The end of a broker-native delay test: of three delayed messages of the tenant `default`,
/// the first and the last were delivered (Reached), the middle one cancelled by its id; and a
/// message that said no time was dead-lettered (`missing_field`, naming `dueAt`).
pub async fn delivered_cancelled_and_dead_lettered(
    service: &Service,
    client: &dyn TestClient,
    (first, cancelled, last): (&str, &str, &str),
) {
    for (id, state) in [
        (first, "Reached"),
        (cancelled, "Cancelled"),
        (last, "Reached"),
    ] {
        let (_, timer) = service
            .get(&format!("/v1/tenants/default/timers/{id}"))
            .await;
        assert_eq!(timer["state"], state, "{timer}");
    }
    let dead = wait_for(std::time::Duration::from_secs(30), || async {
        let letters = client.dead_letters().await.ok()?;
        letters.into_iter().find(|d| d.reason.contains("dueAt"))
    })
    .await
    .expect("the message without a time is a dead letter");
    assert!(dead.reason.contains("missing_field"), "{}", dead.reason);
}

/// How many delayed messages the broker-native ingress scenario sends, over ten seconds.
const DELAYED: usize = 10_000;

/// The body of delayed message `i`: its number and bytes of every value, of a length that varies.
fn delayed_body(i: usize) -> Vec<u8> {
    let mut body = (i as u64).to_be_bytes().to_vec();
    body.extend((0..(64 + i % 200)).map(|k| (k * 31 + i) as u8));
    body
}

/// `timer-service bench --workload delay` on the broker's server, small (500 messages over a
/// second): it measures what it says, every message arriving and none early.
pub async fn the_delay_bench_sees_every_message_arrive(case: Arc<BrokerCase>) {
    let setup = Setup::new(&case);
    let args = [
        "bench",
        "--workload",
        "delay",
        "--timers",
        "500",
        "--over",
        "1s",
        "--pending",
        "0",
        "--runs",
        "1",
        "--json",
    ];
    let exit = setup.run_to_end(&args, Duration::from_secs(300)).await;
    assert_eq!(exit.code, Some(0), "bench: {}", exit.stderr);
    let figures: Vec<serde_json::Value> = serde_json::from_str(&exit.stdout)
        .unwrap_or_else(|e| panic!("bench --json prints JSON ({e}): {}", exit.stdout));
    let metric = |name: &str| {
        figures
            .iter()
            .find(|f| f["workload"] == "delay" && f["metric"] == name)
            .and_then(|f| f["median"].as_f64())
    };
    assert_eq!(metric("missing"), Some(0.0), "{}", exit.stdout);
    assert_eq!(metric("early"), Some(0.0), "{}", exit.stdout);
    assert!(metric("p99").is_some_and(|ms| ms >= 0.0), "{}", exit.stdout);
    setup.clean_up().await;
}

/// 10,000 delayed messages through the broker's own delay ingress (RabbitMQ's delay exchange,
/// NATS's delay subjects, Kafka's delay topic), a thousand a second for ten seconds, to three
/// destinations, due one to four seconds after they were sent; the service is killed (-9) and
/// started again in the middle of it (on a test server that keeps a killed consumer's
/// deliveries, `no_takeover`, once they are all stored, while they fire). Every message arrives
/// byte for byte with its headers, none before its time, and its repeats carry one id; one
/// cancelled by its id never arrives; one over `limits.max_message_bytes` and one for a target
/// its tenant may not send to are dead-lettered naming `message` and `target`.
pub async fn ten_thousand_delayed_messages_through_the_native_ingress_survive_a_kill(
    case: Arc<BrokerCase>,
) {
    let setup = Setup::with_sections(
        &case,
        json!({
            // Tenant `default` (the ingress's default tenant) may send anywhere, no one else.
            "targets": { "allow": [], "tenants": { "default": { "allow": ["*"] } } },
            "limits": { "max_message_bytes": 1024 },
        }),
    );
    let client = setup.client().await;
    let mut targets = Vec::new();
    for name in ["d0", "d1", "d2"] {
        let target = client.make_target(name).await.expect("make a target");
        targets.push(target.unwrap_or_else(|| panic!("{} takes no targets", case.plugin.kind)));
    }
    let service = setup.start().await;
    let message = |id: &str, target: usize, when: DelayedUntil, body: Vec<u8>| DelayedMessage {
        target: targets[target].clone(),
        id: Some(id.to_owned()),
        tenant: None,
        when,
        body,
        headers: BTreeMap::from([("x-seq".to_owned(), id.to_owned())]),
    };

    // The three that do not arrive: one cancelled, two refused.
    let cancelled = message(
        "cancel-me",
        0,
        DelayedUntil::AtMs(now_ms() + 15_000),
        vec![1],
    );
    let too_big = message("too-big", 1, DelayedUntil::DelayMs(0), vec![7; 2_000]);
    let intruder = DelayedMessage {
        tenant: Some("intruder".into()),
        ..message("intruder", 2, DelayedUntil::DelayMs(0), vec![8])
    };
    let has_ingress = client
        .send_delayed(&[cancelled, too_big, intruder])
        .await
        .expect("send delayed messages");
    assert!(has_ingress, "{} has a delay ingress", case.plugin.kind);
    let stored = wait_for(Duration::from_secs(30), || async {
        let (status, _) = service.get("/v1/tenants/default/timers/cancel-me").await;
        (status == 200).then_some(())
    })
    .await;
    if stored.is_none() {
        service.fail("the message to cancel was stored");
    }
    let cancel =
        json!({"type": "CancelTimer", "tenantId": "default", "serviceCallId": "cancel-me"});
    client
        .send_command(cancel.to_string().as_bytes())
        .await
        .expect("send the cancel");

    // A hundred every 100 ms; the due time of each, or (for a delay) the least it can be.
    let start = now_ms();
    let sending = {
        let client = client.clone();
        let targets = targets.clone();
        tokio::spawn(async move {
            let mut due = vec![0i64; DELAYED];
            for batch in 0..DELAYED / 100 {
                let at = start + batch as i64 * 100;
                let wait = u64::try_from(at - now_ms()).unwrap_or(0);
                // Pacing the load, not waiting for anything.
                tokio::time::sleep(Duration::from_millis(wait)).await;
                let sent = now_ms();
                let messages: Vec<DelayedMessage> = (batch * 100..batch * 100 + 100)
                    .map(|i| {
                        let after = 1_000 + (i as i64 * 7_919) % 3_000;
                        due[i] = sent + after;
                        DelayedMessage {
                            target: targets[i % 3].clone(),
                            id: Some(format!("m-{i}")),
                            tenant: None,
                            when: if i % 10 == 0 {
                                DelayedUntil::DelayMs(after)
                            } else {
                                DelayedUntil::AtMs(sent + after)
                            },
                            body: delayed_body(i),
                            headers: BTreeMap::from([("x-seq".to_owned(), i.to_string())]),
                        }
                    })
                    .collect();
                client.send_delayed(&messages).await?;
            }
            Ok::<_, timer_core::Error>(due)
        })
    };

    // The kill: half-way through the sending; where the test server keeps a killed consumer's
    // deliveries from its successor, once the last message of each destination is stored (and
    // with it the rest of its partition), while they fire.
    match case.traits.no_takeover {
        None => {
            let half = start + 5_000;
            wait_for(Duration::from_secs(30), || async {
                (now_ms() >= half).then_some(())
            })
            .await;
        }
        Some(why) => {
            println!("killed once every message is stored: {why}");
            let all = wait_for(Duration::from_secs(90), || async {
                for i in DELAYED - 3..DELAYED {
                    let path = format!("/v1/tenants/default/timers/m-{i}");
                    if service.get(&path).await.0 != 200 {
                        return None;
                    }
                }
                Some(())
            })
            .await;
            if all.is_none() {
                service.fail("the last message of each destination was stored");
            }
        }
    }
    service.kill9().await;
    let killed_at = now_ms() - start;
    let service = setup.start().await;
    let due = sending
        .await
        .expect("the sending task")
        .expect("send delayed messages");

    // Read the targets once nothing is Scheduled any more (reading whole topics again and
    // again would load a test server that is slow already); then until every message is there
    // (some may still wait on the broker for the restarted service).
    let store = setup.store().await;
    let settled = wait_for(Duration::from_secs(120), || async {
        (store.scheduled_count().await.ok()? == 0).then_some(())
    })
    .await;
    if settled.is_none() {
        service.fail("every delayed message fired");
    }
    let read_all = || async {
        let mut all = Vec::new();
        for target in &targets {
            all.extend(client.read_target(target).await?);
        }
        Ok::<Vec<ReadMessage>, timer_core::Error>(all)
    };
    let complete = wait_for(Duration::from_secs(60), || async {
        let all = read_all().await.ok()?;
        let seqs: HashSet<&str> = all
            .iter()
            .filter_map(|m| m.headers.get("x-seq").map(String::as_str))
            .collect();
        let done = (0..DELAYED).all(|i| seqs.contains(i.to_string().as_str()));
        drop(seqs);
        done.then_some(all)
    })
    .await;
    let arrived = match complete {
        Some(arrived) => arrived,
        None => {
            let all = read_all()
                .await
                .unwrap_or_else(|e| service.fail(format!("reading the targets: {e}")));
            let seqs: HashSet<String> = all
                .iter()
                .filter_map(|m| m.headers.get("x-seq").cloned())
                .collect();
            let missing = (0..DELAYED)
                .filter(|i| !seqs.contains(&i.to_string()))
                .count();
            service.fail(format!(
                "every message arrived ({missing} of {DELAYED} missing)"
            ));
        }
    };
    let mut by_seq: HashMap<String, Vec<&ReadMessage>> = HashMap::new();
    for m in &arrived {
        let seq = m.headers.get("x-seq").cloned().unwrap_or_default();
        by_seq.entry(seq).or_default().push(m);
    }
    assert!(
        !by_seq.contains_key("cancel-me"),
        "the message cancelled by its id never arrived"
    );
    let (_, timer) = service.get("/v1/tenants/default/timers/cancel-me").await;
    assert_eq!(timer["state"], "Cancelled", "{timer}");
    assert!(
        arrived.iter().all(|m| m.arrived_ms.is_some()),
        "the test client stamps every arrival (else nothing shows a message was not early)"
    );
    let mut late = Vec::new();
    let mut repeated = 0;
    for (i, due) in due.iter().enumerate() {
        let copies = &by_seq[&i.to_string()];
        repeated += copies.len() - 1;
        let id = copies[0].id;
        assert!(
            id.is_some(),
            "m-{i}: the event id in the de-duplication slot"
        );
        for m in copies {
            assert_eq!(m.id, id, "m-{i}: repeats carry one id");
            assert!(m.body == delayed_body(i), "m-{i}: byte for byte");
            if let Some(arrived) = m.arrived_ms {
                assert!(
                    arrived >= *due,
                    "m-{i} arrived {} ms before its time",
                    due - arrived
                );
                late.push(arrived - due);
            }
        }
    }
    for (reason, names) in [
        ("payload_too_large", "message"),
        ("invalid_target", "target"),
    ] {
        let dead = wait_for(Duration::from_secs(30), || async {
            let letters = client.dead_letters().await.ok()?;
            letters.into_iter().find(|d| d.reason.contains(reason))
        })
        .await
        .unwrap_or_else(|| service.fail(format!("a dead letter {reason}")));
        assert!(dead.reason.contains(names), "{}", dead.reason);
    }
    let (p50, p99, max) = crate::e2e::percentiles(late);
    println!(
        "{DELAYED} delayed messages, the service killed at {:.1} s: all arrived, {repeated} \
         repeated (one id each), lateness p50 {p50} ms, p99 {p99} ms, max {max} ms (through the \
         kill)",
        killed_at as f64 / 1_000.0
    );
    service.terminate().await;
    setup.clean_up().await;
}

/// The setup of [`an_event_its_destination_refuses_is_retried_alone`]: any target allowed,
/// retries 200 to 400 ms apart.
pub fn refusing_destination_setup(case: &BrokerCase) -> Setup {
    Setup::with_sections(
        case,
        json!({ "targets": { "allow": ["*"] },
                "engine": { "retry_base": "200ms", "retry_max": "400ms" } }),
    )
}

/// `target`, a destination of the broker's own that takes one message and refuses the next
/// ones (a NATS stream full with discard new, a RabbitMQ queue full with reject-publish), made
/// by the caller on `setup`'s server. Two timers due together go there, an envelope beside
/// them in the same batch: one of the two is stored, the other refused alone, retried with
/// `says` in its `lastError`; the others are Reached once, no attempt counted, and the envelope
/// read once. Cleaning up is the caller's.
pub async fn an_event_its_destination_refuses_is_retried_alone(
    setup: &Setup,
    target: Value,
    says: &str,
) {
    let client = setup.client().await;
    let service = setup.start().await;
    let due = now_ms() + 300;
    let mut timers = Vec::new();
    for id in ["one", "two"] {
        timers.push(
            json!({"tenantId": "t", "serviceCallId": id, "dueTimeMs": due,
            "target": target, "message": {"body": {"id": id}}}),
        );
    }
    timers.push(json!({"tenantId": "t", "serviceCallId": "beside", "dueTimeMs": due}));
    let batch = json!({ "commands": timers });
    let (status, v) = service.post("/v1/timers/batch", batch.to_string()).await;
    assert_eq!(status, 200, "{v}");
    let states = wait_for(Duration::from_secs(30), || async {
        let mut got = Vec::new();
        for id in ["one", "two", "beside"] {
            let (_, t) = service.get(&format!("/v1/tenants/t/timers/{id}")).await;
            got.push(t);
        }
        let reached = |t: &Value| t["state"] == "Reached";
        let retried = |t: &Value| t["state"] == "Scheduled" && t["attempts"].as_u64() >= Some(2);
        let one_each =
            (reached(&got[0]) && retried(&got[1])) || (retried(&got[0]) && reached(&got[1]));
        (one_each && reached(&got[2])).then_some(got)
    })
    .await
    .unwrap_or_else(|| service.fail("one of the two stored, the other retried alone"));
    let refused = states
        .iter()
        .find(|t| t["state"] == "Scheduled")
        .unwrap_or_else(|| service.fail("the refused one"));
    let error = refused["lastError"].as_str().unwrap_or_default();
    assert!(error.contains(says), "{refused}");
    for t in states.iter().filter(|t| t["state"] == "Reached") {
        assert_eq!(
            t["attempts"], 0,
            "published beside the refused one, once: {t}"
        );
    }
    let events = client.events().await.expect("events");
    assert_eq!(
        events.len(),
        1,
        "the envelope beside them, once: {events:?}"
    );
    service.terminate().await;
}
