//! Delayed messages: a message published on `<broker.delay_prefix>.<subject>` with the header
//! `Timer-Delay` (milliseconds) or `Timer-Deliver-At` (RFC 3339, or epoch milliseconds) is read
//! here into the `ScheduleTimer` it stands for: at that time its body and headers go to
//! `<subject>`. The engine then takes it like any command (limits, `targets`, acknowledged
//! after the commit).

use async_nats::jetstream;
use serde_json::{json, Map, Value};
use uuid::Uuid;

use super::{is_jetstream_header, CONTENT_TYPE};
use crate::shared::Delayed;

/// Milliseconds from when the service reads the message.
pub const DELAY_HEADER: &str = "Timer-Delay";
/// When to deliver: RFC 3339 with an offset, or epoch milliseconds.
pub const DELIVER_AT_HEADER: &str = "Timer-Deliver-At";
/// Whose timer it is (default `broker.delay_tenant`).
pub const TENANT_HEADER: &str = "Timer-Tenant";
/// The message's id: the timer's `serviceCallId`.
const MESSAGE_ID: &str = "Nats-Msg-Id";

/// The namespace of the ids derived for messages without a `Nats-Msg-Id`.
const DERIVED_IDS: Uuid = Uuid::from_u128(0x6b1d_1e7a_3d2c_4f0e_9a51_7c0d_de1a_7001);

/// The `ScheduleTimer` (JSON) a delayed message for `target` (its subject without the prefix)
/// stands for. One that says no time becomes a command without one, which the engine refuses
/// (`missing_field`, a dead letter naming `dueAt`).
pub fn command_of(message: &jetstream::Message, target: &str, default_tenant: &str) -> Vec<u8> {
    let header = |name: &str| {
        let value = message.headers.as_ref()?.get(name)?;
        Some(value.as_str().to_owned())
    };
    let tenant = header(TENANT_HEADER).unwrap_or_else(|| default_tenant.to_owned());
    // The service's headers, and JetStream's (`Nats-Msg-Id`, `Nats-Expected-Stream`, ...:
    // instructions to the delay stream, not part of the message).
    let reserved = [DELAY_HEADER, DELIVER_AT_HEADER, TENANT_HEADER, CONTENT_TYPE];
    let kept: Map<String, Value> = message
        .headers
        .iter()
        .flat_map(|h| h.iter())
        .map(|(name, values)| (name.to_string(), values))
        .filter(|(name, _)| !reserved.contains(&name.as_str()) && !is_jetstream_header(name))
        .filter_map(|(name, values)| Some((name, Value::from(values.first()?.as_str()))))
        .collect();
    let due = Delayed::due_of_text(header(DELAY_HEADER), header(DELIVER_AT_HEADER));
    Delayed {
        tenant,
        id: header(MESSAGE_ID),
        namespace: DERIVED_IDS,
        id_from: &[target.as_bytes()],
        target: json!({"subject": target}),
        body: &message.payload,
        content_type: header(CONTENT_TYPE),
        headers: kept,
        due,
    }
    .command()
}
