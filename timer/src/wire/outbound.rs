//! A `ScheduleTimer`'s `target` and `message` checked into a [`Target`] and a [`Message`], and
//! a `TimerCompleted`'s `message` (text) read.

use std::collections::BTreeMap;

use base64::Engine as _;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use super::reasons::{Reason, Rejection};
use super::truncate;
use crate::config::Limits;
use crate::outbound::{Message, MessageMeta, Target};

/// Largest `target`, in bytes of JSON text (room for an HTTP target's URL and headers, such as
/// a bearer token).
pub const MAX_TARGET_BYTES: usize = 4096;
/// Most `message.headers` one message may carry.
pub const MAX_HEADERS: usize = 64;
/// Longest header name, in bytes.
pub const MAX_HEADER_NAME_BYTES: usize = 256;
/// Longest header value (and `message.contentType`), in bytes.
pub const MAX_HEADER_VALUE_BYTES: usize = 4096;

/// A `message` as a command gives it.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct WireMessage<'a> {
    #[serde(borrow, default)]
    body: Option<&'a RawValue>,
    #[serde(default)]
    body_base64: Option<String>,
    #[serde(default)]
    content_type: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
}

/// The `target` of a `ScheduleTimer`: a JSON object of at most [`MAX_TARGET_BYTES`], whose
/// fields the broker plugin checks ([`Broker::check_target`](crate::Broker::check_target)).
pub(super) fn target_of(
    raw: Option<&RawValue>,
    field: &dyn Fn(&str) -> String,
) -> Result<Option<Target>, Rejection> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    let invalid =
        |message: String| Rejection::new(Reason::InvalidTarget, Some(&field("target")), message);
    if raw.get().len() > MAX_TARGET_BYTES {
        return Err(invalid(format!(
            "is {} bytes of JSON, the limit is {MAX_TARGET_BYTES}",
            raw.get().len()
        )));
    }
    match serde_json::from_str::<Value>(raw.get()) {
        Ok(Value::Object(fields)) if !fields.is_empty() => Ok(Some(Target::new(fields))),
        Ok(_) => Err(invalid(
            "give an object of the broker's own terms, e.g. {\"subject\": \"orders.due\"} (NATS), \
             {\"exchange\": \"orders\", \"routingKey\": \"due\"} (RabbitMQ), {\"topic\": \"orders\"} \
             (Kafka), or an HTTP target {\"url\": \"https://hooks.example.com/due\"}"
                .to_owned(),
        )),
        Err(e) => Err(invalid(e.to_string())),
    }
}

/// The `message` of a `ScheduleTimer`: `body` (any JSON, its text delivered as given) or
/// `bodyBase64` (bytes), of at most `limits.max_message_bytes`; `contentType`; `headers`.
pub(super) fn message_of(
    raw: Option<&RawValue>,
    field: &dyn Fn(&str) -> String,
    limits: &Limits,
) -> Result<Option<Message>, Rejection> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    let invalid = |name: &str, message: String| {
        Rejection::new(Reason::InvalidJson, Some(&field(name)), message)
    };
    let mut de = serde_json::Deserializer::from_str(raw.get());
    let wire: WireMessage<'_> = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let name = if path == "." || path.contains('?') {
            "message".to_owned()
        } else {
            format!("message.{path}")
        };
        invalid(&name, e.into_inner().to_string())
    })?;
    let body = match (wire.body, wire.body_base64) {
        (Some(json), None) => json.get().as_bytes().to_vec(),
        (None, Some(text)) => base64::engine::general_purpose::STANDARD
            .decode(text.trim())
            .map_err(|e| invalid("message.bodyBase64", format!("is not base64 ({e})")))?,
        (Some(_), Some(_)) => {
            return Err(invalid(
                "message.body",
                "give either body (JSON) or bodyBase64 (bytes), not both".to_owned(),
            ))
        }
        (None, None) => {
            return Err(Rejection::new(
                Reason::MissingField,
                Some(&field("message.body")),
                "a message needs its body: body (any JSON) or bodyBase64 (bytes)",
            ))
        }
    };
    if body.len() > limits.max_message_bytes {
        return Err(Rejection::new(
            Reason::PayloadTooLarge,
            Some(&field("message")),
            format!(
                "message body is {} bytes, the limit is {} (limits.max_message_bytes)",
                body.len(),
                limits.max_message_bytes
            ),
        ));
    }
    if let Some(content_type) = &wire.content_type {
        header_value(content_type).map_err(|why| invalid("message.contentType", why))?;
    }
    if wire.headers.len() > MAX_HEADERS {
        return Err(invalid(
            "message.headers",
            format!("{} headers, at most {MAX_HEADERS}", wire.headers.len()),
        ));
    }
    for (name, value) in &wire.headers {
        let at = format!("message.headers.{}", truncate(name, 64));
        header_name(name).map_err(|why| invalid(&at, why))?;
        header_value(value).map_err(|why| invalid(&at, why))?;
    }
    Ok(Some(Message {
        body,
        meta: MessageMeta {
            content_type: wire.content_type,
            headers: wire.headers,
        },
    }))
}

/// A header name every broker carries: 1 to [`MAX_HEADER_NAME_BYTES`] visible ASCII
/// characters other than `:`.
fn header_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_HEADER_NAME_BYTES {
        return Err(format!(
            "a header name has 1 to {MAX_HEADER_NAME_BYTES} bytes"
        ));
    }
    match name.bytes().find(|b| !b.is_ascii_graphic() || *b == b':') {
        Some(b) => Err(format!(
            "a header name is visible ASCII without ':', not {:?}",
            char::from(b)
        )),
        None => Ok(()),
    }
}

/// A header value every broker carries: one line of at most [`MAX_HEADER_VALUE_BYTES`].
fn header_value(value: &str) -> Result<(), String> {
    if value.len() > MAX_HEADER_VALUE_BYTES {
        return Err(format!(
            "is {} bytes, the limit is {MAX_HEADER_VALUE_BYTES}",
            value.len()
        ));
    }
    if value.chars().any(char::is_control) {
        return Err("holds a control character (a value is one line)".to_owned());
    }
    Ok(())
}

/// A `TimerCompleted`'s `message`: text.
pub(super) fn completion_message(
    raw: Option<&RawValue>,
    field: &dyn Fn(&str) -> String,
) -> Result<Option<String>, Rejection> {
    raw.map(|raw| {
        serde_json::from_str::<String>(raw.get()).map_err(|_| {
            Rejection::new(
                Reason::InvalidJson,
                Some(&field("message")),
                "a TimerCompleted's message is text",
            )
        })
    })
    .transpose()
}
