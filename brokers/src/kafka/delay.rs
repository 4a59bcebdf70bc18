//! Delayed messages: a record produced to `broker.delay_topic` with the header `timer-delay`
//! (milliseconds) or `timer-deliver-at` (RFC 3339, or epoch milliseconds) and the header
//! `timer-target-topic` is read here into the `ScheduleTimer` it stands for: at that time its
//! key, value and other headers go to the target topic (the same key, so the same partitioner
//! puts it on the same partition as a direct produce would). The engine then takes it like any
//! command (limits, `targets`, acknowledged after the commit).

use rdkafka::message::{BorrowedMessage, Headers, Message};
use serde_json::{json, Map, Value};
use uuid::Uuid;

use super::CONTENT_TYPE_HEADER;
use crate::shared::Delayed;

/// Milliseconds from when the service reads the record.
pub const DELAY_HEADER: &str = "timer-delay";
/// When to deliver: RFC 3339 with an offset, or epoch milliseconds.
pub const DELIVER_AT_HEADER: &str = "timer-deliver-at";
/// Where to deliver: a topic.
pub const TARGET_TOPIC_HEADER: &str = "timer-target-topic";
/// The record's id: the timer's `serviceCallId`.
pub const ID_HEADER: &str = "timer-id";
/// Whose timer it is (default `broker.delay_tenant`).
pub const TENANT_HEADER: &str = "timer-tenant";

/// The namespace of the ids derived for records without a `timer-id`.
const DERIVED_IDS: Uuid = Uuid::from_u128(0x6b1d_1e7a_3d2c_4f0e_9a51_7c0d_de1a_7002);

/// The `ScheduleTimer` (JSON) a record of the delay topic stands for. One that says no time
/// becomes a command without one, which the engine refuses (`missing_field`, a dead letter
/// naming `dueAt`); one without a target topic, or with a key that is not UTF-8, a command
/// whose target the broker refuses (`invalid_target`, a dead letter naming `target`).
pub fn command_of(message: &BorrowedMessage<'_>, default_tenant: &str) -> Vec<u8> {
    // Kafka headers may repeat a name and carry bytes: the first of a name counts, as text.
    let mut headers: Vec<(&str, String)> = Vec::new();
    if let Some(all) = message.headers() {
        for header in all.iter() {
            if headers.iter().all(|(name, _)| *name != header.key) {
                let value = String::from_utf8_lossy(header.value.unwrap_or_default());
                headers.push((header.key, value.into_owned()));
            }
        }
    }
    let header = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.clone())
    };
    let tenant = header(TENANT_HEADER).unwrap_or_else(|| default_tenant.to_owned());
    let reserved = [
        DELAY_HEADER,
        DELIVER_AT_HEADER,
        TARGET_TOPIC_HEADER,
        ID_HEADER,
        TENANT_HEADER,
        CONTENT_TYPE_HEADER,
    ];
    let kept: Map<String, Value> = headers
        .iter()
        .filter(|(name, _)| !reserved.contains(name))
        .map(|(name, value)| ((*name).to_owned(), Value::from(value.as_str())))
        .collect();
    let due = Delayed::due_of_text(header(DELAY_HEADER), header(DELIVER_AT_HEADER));
    let topic = header(TARGET_TOPIC_HEADER);
    let key = message.key().map(std::str::from_utf8);
    let mut target = json!({});
    if let Some(topic) = &topic {
        target["topic"] = Value::from(topic.as_str());
    }
    match key {
        None => {}
        Some(Ok(key)) => target["key"] = Value::from(key),
        // The broker's target check names it.
        Some(Err(_)) => target["key"] = json!({"notUtf8": true}),
    }
    Delayed {
        tenant,
        id: header(ID_HEADER),
        namespace: DERIVED_IDS,
        id_from: &[
            topic.as_deref().unwrap_or_default().as_bytes(),
            message.key().unwrap_or_default(),
        ],
        target,
        body: message.payload().unwrap_or_default(),
        content_type: header(CONTENT_TYPE_HEADER),
        headers: kept,
        due,
    }
    .command()
}
