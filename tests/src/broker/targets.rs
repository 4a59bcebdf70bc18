//! Delayed delivery through a broker: a timer's own message, published to its own target
//! byte-exact with the event id in the broker's de-duplication slot.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::json;
use timer_core::plugin::{ReadMessage, TestClient};
use timer_core::{MessageMeta, OutboundEvent, Target, TimerKey};
use uuid::Uuid;

use super::{read_events, WAIT};
use crate::wait_for;

/// A target of these fields.
fn target(fields: serde_json::Value) -> Target {
    match fields {
        serde_json::Value::Object(fields) => Target::new(fields),
        other => panic!("a target is an object, not {other}"),
    }
}

/// Every byte value, then more, up to `n` bytes: NUL, invalid UTF-8 and all.
fn binary(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 31 % 256) as u8).collect()
}

/// Waits for `n` messages at `target`.
async fn read_target(fx: &dyn TestClient, target: &Target, n: usize) -> Vec<ReadMessage> {
    wait_for(WAIT, || async {
        fx.read_target(target).await.ok().filter(|m| m.len() >= n)
    })
    .await
    .unwrap_or_else(|| panic!("{n} message(s) at {}", target.to_json()))
}

/// A timer's message goes to its target as it was given: the body byte for byte, the content
/// type and every header, the event id in the de-duplication slot; nothing of it goes to the
/// events destination, and an envelope in the same batch still goes there. A message without
/// a target goes to the events destination, byte-exact too. A plugin that takes no targets
/// refuses every one at admission ([`Broker::check_target`](timer_core::Broker::check_target)).
pub async fn a_message_goes_to_its_target_byte_exact(fx: Arc<dyn TestClient>) {
    let broker = fx.connect().await.expect("connect");
    let Some(target) = fx.make_target("delayed").await.expect("make a target") else {
        for any in [
            json!({"subject": "x"}),
            json!({"exchange": "x"}),
            json!({"topic": "x"}),
        ] {
            assert!(
                broker.check_target(&self::target(any)).is_err(),
                "{} takes no targets, so it refuses every one",
                broker.name()
            );
        }
        println!("{} takes no targets (yet)", broker.name());
        return;
    };
    broker
        .check_target(&target)
        .expect("the target the test client made");
    assert!(
        broker
            .check_target(&self::target(json!({"nonsense": 1})))
            .is_err(),
        "a target of no field the broker knows is refused"
    );
    let meta = MessageMeta {
        content_type: Some("application/octet-stream".into()),
        headers: BTreeMap::from([
            ("x-order".to_owned(), "42".to_owned()),
            ("X-Mixed-Case".to_owned(), "ü and spaces".to_owned()),
        ]),
    };
    let body = binary(64 * 1024);
    let message = OutboundEvent {
        id: Uuid::now_v7(),
        key: TimerKey::new("acme", "delayed-1"),
        body: body.clone(),
        target: Some(target.clone()),
        message: Some(meta.clone()),
        trace: None,
    };
    let envelope = OutboundEvent::envelope(
        Uuid::now_v7(),
        TimerKey::new("acme", "plain"),
        br#"{"n":1}"#.to_vec(),
    );
    let untargeted = OutboundEvent {
        id: Uuid::now_v7(),
        key: TimerKey::new("acme", "delayed-2"),
        body: binary(300),
        target: None,
        message: Some(meta.clone()),
        trace: None,
    };
    let batch = [message.clone(), envelope.clone(), untargeted.clone()];
    let undelivered = broker.publish(&batch).await.expect("publish");
    assert!(undelivered.is_empty(), "all confirmed: {undelivered:?}");

    let got = read_target(fx.as_ref(), &target, 1).await;
    assert_eq!(got.len(), 1, "one message at the target");
    let got = &got[0];
    assert!(
        got.body == body,
        "the body, byte for byte ({} bytes)",
        got.body.len()
    );
    assert_eq!(
        got.id,
        Some(message.id),
        "the event id in the de-duplication slot"
    );
    assert_eq!(got.content_type, meta.content_type, "the content type");
    if let Some(key) = &got.key {
        assert_eq!(
            key.as_slice(),
            b"delayed",
            "the target's key (routing key, record key)"
        );
    }
    for (name, value) in &meta.headers {
        assert_eq!(
            got.headers.get(name),
            Some(value),
            "header {name} arrived as given: {:?}",
            got.headers
        );
    }
    let events = read_events(fx.as_ref(), 2).await;
    let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
    assert!(
        ids.contains(&envelope.id),
        "the envelope went to the events destination"
    );
    assert!(!ids.contains(&message.id), "the targeted message did not");
    let plain = events
        .iter()
        .find(|e| e.id == untargeted.id)
        .expect("a message without a target goes to the events destination");
    assert!(plain.body == untargeted.body, "byte for byte there too");
}
