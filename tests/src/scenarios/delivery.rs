//! Delayed delivery through the service: a `ScheduleTimer` from the broker with its own
//! `target` and `message` delivers the message there, byte-exact, at its due time; a cancelled
//! one never arrives.

use std::sync::Arc;

use base64::Engine as _;
use serde_json::json;

use timer_core::plugin::TestClient;

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
