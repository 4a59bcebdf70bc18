//! What a fire sends: a target's route (topic, key, partition), the record headers of an
//! event or a timer's own message, the trace context a record carries, and a failed delivery
//! report as an error.

use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use timer_core::{Error, OutboundEvent, Target, TraceHeaders};

use super::{unavailable, KafkaConfig, EVENT_ID_HEADER};

/// Where a target `{"topic": "orders", "key": "o-42", "partition": 3}` sends a record: a topic
/// (a Kafka topic name, none of the service's own), an optional key (else no key: the
/// partitioner spreads them) and an optional partition (else the partitioner's choice).
pub(super) struct Route<'t> {
    pub topic: &'t str,
    pub key: Option<&'t str>,
    pub partition: Option<i32>,
}

pub(super) fn target_route<'t>(target: &'t Target, config: &KafkaConfig) -> std::result::Result<Route<'t>, String> {
    let shape = || {
        format!(
            "the kafka broker takes a target {{\"topic\": \"orders\", \"key\": \"o-42\", \
             \"partition\": 0}} (key and partition optional), not {}",
            target.to_json()
        )
    };
    let fields = target.fields();
    if fields.keys().any(|k| !matches!(k.as_str(), "topic" | "key" | "partition")) {
        return Err(shape());
    }
    let topic = target.text("topic").ok_or_else(shape)?;
    let key = match fields.get("key") {
        None => None,
        Some(key) => Some(key.as_str().ok_or_else(|| {
            format!("the key must be text (a record key in UTF-8), not {key}")
        })?),
    };
    let partition = match fields.get("partition") {
        None => None,
        Some(p) => Some(
            p.as_i64()
                .and_then(|p| i32::try_from(p).ok())
                .filter(|p| *p >= 0)
                .ok_or_else(|| format!("partition {p} is not a partition number (0 or more)"))?,
        ),
    };
    let legal = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if topic.is_empty() || topic.len() > 249 || topic == "." || topic == ".." || !topic.chars().all(legal) {
        return Err(format!(
            "{topic:?} is not a Kafka topic name (1 to 249 of a-z, A-Z, 0-9, '.', '_', '-')"
        ));
    }
    // Kafka's own (`__consumer_offsets`, `__transaction_state`): the cluster's bookkeeping.
    if topic.starts_with("__") {
        return Err(format!(
            "topic {topic} is one of Kafka's internal topics (starting with __); a timer cannot \
             send there"
        ));
    }
    if config.own_topics().contains(&topic) {
        return Err(format!(
            "topic {topic} is one of the service's own (commands, events, dead letters, delayed \
             records); a timer cannot send there"
        ));
    }
    Ok(Route {
        topic,
        key,
        partition,
    })
}

/// The trace context headers of a record (`traceparent`, `tracestate`); values not UTF-8 are
/// skipped.
pub(super) fn trace_of(message: &BorrowedMessage<'_>) -> TraceHeaders {
    let Some(headers) = message.headers() else {
        return TraceHeaders::default();
    };
    TraceHeaders::from_pairs(headers.iter().filter_map(|header| {
        Some((header.key, std::str::from_utf8(header.value?).ok()?))
    }))
}

/// The headers of an event: a timer's own message's headers and content type (as
/// `content-type`), its trace context, then `timer-event-id` (the event id; a header of that
/// name the message gave is left out).
pub(super) fn headers_of<'e>(event: &'e OutboundEvent, id: &'e str) -> OwnedHeaders {
    let mut headers = OwnedHeaders::new();
    if let Some(meta) = &event.message {
        for (name, value) in &meta.headers {
            if name != EVENT_ID_HEADER {
                headers = headers.insert(Header {
                    key: name.as_str(),
                    value: Some(value.as_bytes()),
                });
            }
        }
        if let Some(content_type) = &meta.content_type {
            headers = headers.insert(Header {
                key: CONTENT_TYPE_HEADER,
                value: Some(content_type.as_bytes()),
            });
        }
    }
    for (name, value) in event.trace_headers() {
        headers = headers.insert(Header {
            key: name,
            value: Some(value.as_bytes()),
        });
    }
    headers.insert(Header {
        key: EVENT_ID_HEADER,
        value: Some(id.as_bytes()),
    })
}

/// The header carrying a timer's own message's content type (Kafka records have no such
/// property).
pub const CONTENT_TYPE_HEADER: &str = "content-type";

/// A failed delivery report: the code's name (`MessageTimedOut`) joins the context, the error
/// stays the source.
pub(super) fn delivery_failed(what: String, e: KafkaError) -> Error {
    let what = match e.rdkafka_error_code() {
        Some(code) => format!("{what} ({code:?})"),
        None => what,
    };
    unavailable(&what, e)
}

#[cfg(test)]
mod tests {
    use timer_core::Target;

    use super::{target_route, KafkaConfig};

    /// Kafka's internal topics and the service's own are never targets, whatever
    /// `targets.allow` says.
    #[test]
    fn internal_and_own_topics_are_no_targets() {
        let config = KafkaConfig::default();
        let topic = |name: &str| {
            let target = Target::from_json(&serde_json::json!({ "topic": name }).to_string())
                .expect("a target");
            target_route(&target, &config).map(|route| route.topic.to_owned())
        };
        assert_eq!(topic("acme.orders"), Ok("acme.orders".to_owned()));
        for name in [
            "__consumer_offsets",
            "__transaction_state",
            config.commands_topic.as_str(),
        ] {
            assert!(topic(name).is_err(), "{name}");
        }
    }
}
