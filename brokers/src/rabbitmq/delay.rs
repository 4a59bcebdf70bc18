//! The delay exchange (`broker.delay_exchange`): a drop-in for RabbitMQ's archived
//! delayed-message exchange plugin. A producer publishes any message there with the header
//! `x-delay` (milliseconds) or `x-deliver-at` (RFC 3339, or epoch milliseconds); the service
//! stores it as a timer and, at that time, publishes it to the exchange in `x-target-exchange`
//! (default: the default exchange `""`) with its own routing key, body, content type and
//! headers. Each such message is read here into the `ScheduleTimer` it stands for, which the
//! engine then takes like any command (limits, `targets`, acknowledged after the commit).

use std::collections::BTreeMap;

use lapin::message::Delivery;
use lapin::types::AMQPValue;
use serde_json::{json, Map, Value};
use uuid::Uuid;

use crate::shared::Delayed;

/// Milliseconds from when the service reads the message.
pub const DELAY_HEADER: &str = "x-delay";
/// When to deliver: RFC 3339 with an offset, or epoch milliseconds.
pub const DELIVER_AT_HEADER: &str = "x-deliver-at";
/// Where to deliver: an exchange (default `""`, the default exchange).
pub const TARGET_EXCHANGE_HEADER: &str = "x-target-exchange";
/// Whose timer it is (default `broker.delay_tenant`).
pub const TENANT_HEADER: &str = "timer-tenant";

/// The namespace of the ids derived for messages without a `message_id`.
const DERIVED_IDS: Uuid = Uuid::from_u128(0x6b1d_1e7a_3d2c_4f0e_9a51_7c0d_de1a_7000);

/// The `ScheduleTimer` (JSON) a message of the delay exchange stands for. One that says no
/// time becomes a command without one, which the engine refuses (`missing_field`, a dead
/// letter naming the headers).
pub fn command_of(delivery: &Delivery, default_tenant: &str) -> Vec<u8> {
    let properties = &delivery.properties;
    let headers: BTreeMap<String, AMQPValue> = properties
        .headers()
        .as_ref()
        .map(|h| {
            h.inner()
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect()
        })
        .unwrap_or_default();
    let text = |name: &str| headers.get(name).and_then(text_of);
    let exchange = text(TARGET_EXCHANGE_HEADER).unwrap_or_default();
    let routing_key = delivery.routing_key.as_str();
    let tenant = text(TENANT_HEADER).unwrap_or_else(|| default_tenant.to_owned());
    let headers_kept: Map<String, Value> = headers
        .iter()
        .filter(|(name, _)| {
            ![DELAY_HEADER, DELIVER_AT_HEADER, TARGET_EXCHANGE_HEADER, TENANT_HEADER]
                .contains(&name.as_str())
        })
        .filter_map(|(name, value)| Some((name.clone(), Value::from(text_of(value)?))))
        .collect();
    let due = due_of(&headers);
    Delayed {
        tenant,
        id: properties.message_id().as_ref().map(|id| id.to_string()),
        namespace: DERIVED_IDS,
        id_from: &[exchange.as_bytes(), routing_key.as_bytes()],
        target: json!({"exchange": exchange, "routingKey": routing_key}),
        body: &delivery.data,
        content_type: properties.content_type().as_ref().map(|c| c.to_string()),
        headers: headers_kept,
        due,
    }
    .command()
}

/// The due time the headers say: `x-delay` (milliseconds from now) before `x-deliver-at`. A
/// delay that is no whole number of milliseconds is passed on as it was given, so that the
/// refusal names it (not a missing due time).
fn due_of(headers: &BTreeMap<String, AMQPValue>) -> Option<(&'static str, Value)> {
    if let Some(delay) = headers.get(DELAY_HEADER) {
        return Some(match integer_of(delay) {
            // As the plugin did: a negative delay is none.
            Some(ms) => ("dueInMs", Value::from(ms.max(0))),
            None => (
                "dueInMs",
                Value::from(text_of(delay).unwrap_or_else(|| format!("{delay:?}"))),
            ),
        });
    }
    headers
        .get(DELIVER_AT_HEADER)
        .and_then(|at| match (integer_of(at), text_of(at)) {
            (Some(ms), _) => Some(("dueTimeMs", Value::from(ms))),
            (None, Some(text)) => Some(("dueAt", Value::from(text))),
            (None, None) => None,
        })
}

/// A header value as text: strings as they are, numbers and booleans printed.
pub(super) fn text_of(value: &AMQPValue) -> Option<String> {
    Some(match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.to_string(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::Float(f) => f.to_string(),
        AMQPValue::Double(d) => d.to_string(),
        other => integer_of(other)?.to_string(),
    })
}

/// A header value as an integer: integer types, a float or double of a whole number (a client
/// that sends `seconds * 1000` from a language without integers), an AMQP timestamp (seconds, as
/// milliseconds), or text of digits.
fn integer_of(value: &AMQPValue) -> Option<i64> {
    let whole = |f: f64| {
        // 2^63, exact as an f64: the first value past i64.
        const PAST: f64 = 9_223_372_036_854_775_808.0;
        // Not NaN nor infinite either: their fraction is NaN.
        (f.fract() == 0.0 && (-PAST..PAST).contains(&f)).then_some(f as i64)
    };
    match value {
        AMQPValue::Float(f) => whole(f64::from(*f)),
        AMQPValue::Double(d) => whole(*d),
        AMQPValue::ShortShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::Timestamp(secs) => i64::try_from(*secs).ok()?.checked_mul(1000),
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok()?.trim().parse().ok(),
        AMQPValue::ShortString(s) => s.as_str().trim().parse().ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use lapin::types::{AMQPValue, LongString};
    use serde_json::Value;

    use super::{due_of, DELAY_HEADER, DELIVER_AT_HEADER};

    fn due(name: &str, value: AMQPValue) -> Option<(&'static str, Value)> {
        due_of(&BTreeMap::from([(name.to_owned(), value)]))
    }

    /// `x-delay` as any number type a client library sends, whole numbers as floats too; what
    /// is no whole number goes on as given, for the refusal to name it.
    #[test]
    fn a_delay_of_any_number_type_is_read() {
        let ms = |n: i64| Some(("dueInMs", Value::from(n)));
        assert_eq!(due(DELAY_HEADER, AMQPValue::LongInt(1_500)), ms(1_500));
        assert_eq!(due(DELAY_HEADER, AMQPValue::Double(1_500.0)), ms(1_500));
        assert_eq!(due(DELAY_HEADER, AMQPValue::Float(250.0)), ms(250));
        assert_eq!(due(DELAY_HEADER, AMQPValue::LongLongInt(-5)), ms(0));
        let text = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()));
        assert_eq!(due(DELAY_HEADER, text("2000")), ms(2_000));
        assert_eq!(
            due(DELAY_HEADER, AMQPValue::Double(1.5)),
            Some(("dueInMs", Value::from("1.5")))
        );
        assert_eq!(
            due(DELAY_HEADER, text("5s")),
            Some(("dueInMs", Value::from("5s")))
        );
        assert_eq!(
            due(DELAY_HEADER, AMQPValue::Double(f64::INFINITY)),
            Some(("dueInMs", Value::from("inf")))
        );
        assert_eq!(
            due(DELIVER_AT_HEADER, AMQPValue::LongLongInt(1_800_000_000_000)),
            Some(("dueTimeMs", Value::from(1_800_000_000_000_i64)))
        );
        assert_eq!(due("other", AMQPValue::LongInt(1)), None);
    }
}
