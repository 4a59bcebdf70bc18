//! What a fire sends: a target's route (exchange and routing key) and whether its exchange is
//! declared, the AMQP properties and headers of an event or a timer's own message, the trace
//! context they carry, and the routing key of a tenant's events.

use lapin::options::ExchangeDeclareOptions;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, ExchangeKind};
use timer_core::broker::routing_token;
use timer_core::trace::{TRACEPARENT, TRACESTATE};
use timer_core::{KeyLimit, MessageMeta, OutboundEvent, Result, Target, TraceHeaders};

use super::{delay, open_channel, s, unavailable, RabbitmqConfig, Session, MAX_SHORT_STRING};

/// Where a target `{"exchange": "orders", "routingKey": "due.eu"}` sends a message: the
/// exchange (`""`, the default exchange, routes to the queue the routing key names) and the
/// routing key, each at most 255 bytes; never to the service's own exchanges and queues.
pub(super) fn target_route<'t>(
    target: &'t Target,
    config: &RabbitmqConfig,
) -> std::result::Result<(&'t str, &'t str), String> {
    let shape = || {
        format!(
            "the rabbitmq broker takes a target {{\"exchange\": \"orders\", \"routingKey\": \
             \"due.eu\"}} (both text; the exchange \"\" is the default exchange), not {}",
            target.to_json()
        )
    };
    let fields = target.fields();
    if fields.keys().any(|k| k != "exchange" && k != "routingKey") {
        return Err(shape());
    }
    let field = |name: &str| match fields.get(name) {
        None => Ok(""),
        Some(value) => value.as_str().ok_or_else(shape),
    };
    let (exchange, key) = (field("exchange")?, field("routingKey")?);
    if !fields.contains_key("exchange") {
        return Err(shape());
    }
    for (name, value) in [("exchange", exchange), ("routingKey", key)] {
        if value.len() > MAX_SHORT_STRING {
            return Err(format!(
                "{name} is {} bytes; AMQP allows at most {MAX_SHORT_STRING}",
                value.len()
            ));
        }
    }
    let own_exchange = exchange == config.events_exchange
        || exchange == config.dead_letter_exchange
        || exchange == config.delay_exchange;
    let own_queue =
        exchange.is_empty() && (key == config.commands_queue || key == config.dead_letter_queue);
    if own_exchange || own_queue {
        return Err(format!(
            "exchange {exchange:?} with routing key {key:?} reaches the service's own commands, \
             events or dead letters; a timer cannot send there"
        ));
    }
    Ok((exchange, key))
}

/// The trace context headers of a delivery (`traceparent`, `tracestate`), as text.
pub(super) fn trace_of(properties: &BasicProperties) -> TraceHeaders {
    let Some(headers) = properties.headers() else {
        return TraceHeaders::default();
    };
    let found: Vec<(&str, String)> = headers
        .inner()
        .iter()
        .map(|(name, value)| (name.as_str(), value))
        .filter(|(name, _)| {
            name.eq_ignore_ascii_case(TRACEPARENT) || name.eq_ignore_ascii_case(TRACESTATE)
        })
        .filter_map(|(name, value)| Some((name, delay::text_of(value)?)))
        .collect();
    TraceHeaders::from_pairs(found.iter().map(|(name, value)| (*name, value.as_str())))
}

/// The properties of an event: persistent, `message_id` = the event id, the trace context in
/// the headers; an envelope is JSON of type `DueTimeReached`, a timer's own message has its
/// content type and headers. `Err` when AMQP cannot carry them: a header name or the content
/// type over [`MAX_SHORT_STRING`] bytes, or properties over `frame_max` bytes (AMQP sends them
/// in one frame, and the server closes a connection that sends a larger one).
pub(super) fn properties_of(
    event: &OutboundEvent,
    frame_max: usize,
) -> std::result::Result<BasicProperties, String> {
    let properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(event.id.to_string().into());
    let own = event.message.iter().flat_map(|meta| &meta.headers);
    let pairs: Vec<(&str, &str)> = own
        .map(|(name, value)| (name.as_str(), value.as_str()))
        .chain(event.trace_headers().map(|(name, value)| (name as &str, value)))
        .collect();
    let mut headers = FieldTable::default();
    for (name, value) in &pairs {
        let name = short(&format!("the header name {:?}", truncated(name)), name)?;
        headers.insert(name, AMQPValue::LongString((*value).into()));
    }
    let size = properties_size(
        event.message.as_ref().and_then(|m| m.content_type.as_deref()),
        pairs.iter().map(|(name, value)| (name.len(), value.len())),
    );
    if size > frame_max {
        return Err(format!(
            "its headers and content type take {size} bytes in AMQP's content header frame; \
             the connection allows at most {frame_max} (frame_max)"
        ));
    }
    let properties = properties.with_headers(headers);
    let Some(meta) = &event.message else {
        return Ok(properties
            .with_content_type("application/json".into())
            .with_type("DueTimeReached".into()));
    };
    Ok(match &meta.content_type {
        Some(content_type) => {
            properties.with_content_type(short("the content type", content_type)?)
        }
        None => properties,
    })
}

/// Whether AMQP can carry a timer's own message: its content type and header names are short
/// strings (at most [`MAX_SHORT_STRING`] bytes), and its properties, with room for a trace
/// context, fit in one frame of RabbitMQ's default `frame_max` ([`DEFAULT_FRAME_MAX`]).
pub(super) fn check_message(meta: &MessageMeta) -> std::result::Result<(), String> {
    if let Some(content_type) = &meta.content_type {
        short("message.contentType", content_type)?;
    }
    for name in meta.headers.keys() {
        short(&format!("the name of message.headers.{}", truncated(name)), name)?;
    }
    let size = properties_size(
        meta.content_type.as_deref(),
        meta.headers
            .iter()
            .map(|(name, value)| (name.len(), value.len()))
            .chain(TRACE_ROOM),
    );
    if size > DEFAULT_FRAME_MAX {
        return Err(format!(
            "message.headers and message.contentType take {size} bytes as AMQP properties \
             (with room for a trace context); AMQP sends them in one frame, which RabbitMQ \
             allows {DEFAULT_FRAME_MAX} bytes by default (frame_max)"
        ));
    }
    Ok(())
}

/// RabbitMQ's default `frame_max`: the largest frame a connection takes.
pub(super) const DEFAULT_FRAME_MAX: usize = 131_072;

/// Room for the trace context headers a fire adds (`traceparent`, 55 bytes; `tracestate`, at
/// most 512), as (name, value) lengths.
const TRACE_ROOM: [(usize, usize); 2] = [(TRACEPARENT.len(), 55), (TRACESTATE.len(), 512)];

/// An upper bound of the bytes of a content header frame carrying these properties: the frame's
/// own fields, the message id, content type and type, and a header table of (name, value)
/// lengths, each header a short string name, a type byte and a long string value.
fn properties_size(
    content_type: Option<&str>,
    headers: impl Iterator<Item = (usize, usize)>,
) -> usize {
    // Frame header and end (8), class, weight, body size, flags (14), delivery mode (1),
    // message id (1 + 36), type (1 + 14), the header table's length (4).
    const FIXED: usize = 8 + 14 + 1 + 37 + 15 + 4;
    let content_type = 1 + content_type.map_or("application/json".len(), str::len);
    FIXED
        + content_type
        + headers
            .map(|(name, value)| 1 + name + 1 + 4 + value)
            .sum::<usize>()
}

/// A short string, or what is wrong with it.
fn short(what: &str, text: &str) -> std::result::Result<ShortString, String> {
    ShortString::try_new(text).map_err(|_| {
        format!(
            "{what} is {} bytes; AMQP allows at most {MAX_SHORT_STRING}",
            text.len()
        )
    })
}

/// The start of a name too long to show whole.
fn truncated(name: &str) -> &str {
    match name.char_indices().nth(32) {
        Some((at, _)) => &name[..at],
        None => name,
    }
}

/// The routing key of a tenant's events, when it fits AMQP's limit.
pub(super) fn routing_key(tenant: &str) -> std::result::Result<String, KeyLimit> {
    let key = routing_token(tenant);
    if key.len() > MAX_SHORT_STRING {
        return Err(KeyLimit {
            field: "tenantId",
            message: format!(
                "becomes the routing key {}..., {} bytes; AMQP allows at most {MAX_SHORT_STRING} \
                 (every byte but letters, digits, - and _ takes 3)",
                &key[..16],
                key.len()
            ),
        });
    }
    Ok(key)
}

/// Whether `exchange` is declared: a passive declare on a channel of its own. `Some(why)` when
/// it is not (the server closes that channel; the connection goes on).
pub(super) async fn check_exchange(session: &Session, exchange: &str) -> Result<Option<String>> {
    let channel = open_channel(&session.connection).await?;
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let declared = channel
        .exchange_declare(
            s("the exchange name", exchange)?,
            ExchangeKind::Direct,
            passive,
            FieldTable::default(),
        )
        .await;
    match declared {
        Ok(()) => {
            let _ = channel.close(200, "checked".into()).await;
            Ok(None)
        }
        Err(e) if session.connection.status().connected() => Ok(Some(e.to_string())),
        Err(e) => Err(unavailable(&format!("checking exchange {exchange}"), e)),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use timer_core::TraceContext;
    use uuid::Uuid;

    use super::*;

    fn message(content_type: Option<String>, headers: BTreeMap<String, String>) -> MessageMeta {
        MessageMeta {
            content_type,
            headers,
        }
    }

    fn event(meta: MessageMeta) -> OutboundEvent {
        let key = timer_core::TimerKey::new("acme", "call-1");
        let mut event = OutboundEvent::envelope(Uuid::nil(), key, b"{}".to_vec());
        event.message = Some(meta);
        // The longest trace state a trace context keeps (512 bytes).
        let state: Vec<String> = (0..32).map(|i| format!("vendor{i:02}=v{i:07}")).collect();
        let trace = TraceContext::parse(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            Some(&state.join(",")),
        );
        event.trace = Some(trace.unwrap());
        event
    }

    /// `count` headers of names of `name` bytes and values of `value` bytes.
    fn headers(count: usize, name: usize, value: usize) -> BTreeMap<String, String> {
        (0..count)
            .map(|i| (format!("{i:0>name$}"), "v".repeat(value)))
            .collect()
    }

    #[test]
    fn a_content_type_or_header_name_over_255_bytes_is_refused_not_a_panic() {
        let long = "a".repeat(256);
        let refused = [
            message(Some(format!("text/{long}")), BTreeMap::new()),
            message(None, BTreeMap::from([(long.clone(), "v".into())])),
        ];
        for meta in refused {
            let why = check_message(&meta).unwrap_err();
            assert!(why.contains("AMQP allows at most 255"), "{why}");
            let why = properties_of(&event(meta), DEFAULT_FRAME_MAX).unwrap_err();
            assert!(why.contains("AMQP allows at most 255"), "{why}");
        }
        let at_the_limit = message(
            Some("a".repeat(255)),
            BTreeMap::from([("b".repeat(255), "v".into())]),
        );
        check_message(&at_the_limit).unwrap();
        let properties = properties_of(&event(at_the_limit), DEFAULT_FRAME_MAX).unwrap();
        assert_eq!(properties.content_type().as_ref().unwrap().as_str().len(), 255);
    }

    #[test]
    fn properties_over_one_frame_are_refused_and_the_bound_holds_with_a_trace() {
        // 64 headers of 4 KiB: what the wire allows, twice a default frame (names of the
        // longest AMQP takes).
        let refused = message(None, headers(64, 255, 4096));
        let why = check_message(&refused).unwrap_err();
        assert!(why.contains("frame_max"), "{why}");
        let why = properties_of(&event(refused), DEFAULT_FRAME_MAX).unwrap_err();
        assert!(why.contains("at most 131072 (frame_max)"), "{why}");
        // The largest message check_message takes fits in a frame with the largest trace.
        let mut values = 1;
        while check_message(&message(None, headers(30, 255, values + 1))).is_ok() {
            values += 1;
        }
        let largest = event(message(None, headers(30, 255, values)));
        properties_of(&largest, DEFAULT_FRAME_MAX).unwrap();
        // A server with a smaller frame refuses it at fire, one event alone.
        let why = properties_of(&largest, 65_536).unwrap_err();
        assert!(why.contains("at most 65536 (frame_max)"), "{why}");
    }
}
