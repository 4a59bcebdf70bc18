//! What a fire sends: a target's route (exchange and routing key), the AMQP properties and
//! headers of an event or a timer's own message, the trace context they carry, and the
//! routing key of a tenant's events.

use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use timer_core::broker::routing_token;
use timer_core::trace::{TRACEPARENT, TRACESTATE};
use timer_core::{KeyLimit, OutboundEvent, Target, TraceHeaders};

use super::{delay, RabbitmqConfig, MAX_SHORT_STRING};

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
/// content type and headers.
pub(super) fn properties_of(event: &OutboundEvent) -> BasicProperties {
    let properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(event.id.to_string().into());
    let mut headers = FieldTable::default();
    let own = event.message.iter().flat_map(|meta| &meta.headers);
    for (name, value) in own
        .map(|(name, value)| (name.as_str(), value.as_str()))
        .chain(event.trace_headers().map(|(name, value)| (name as &str, value)))
    {
        headers.insert(name.into(), AMQPValue::LongString(value.into()));
    }
    let properties = properties.with_headers(headers);
    let Some(meta) = &event.message else {
        return properties
            .with_content_type("application/json".into())
            .with_type("DueTimeReached".into());
    };
    match &meta.content_type {
        Some(content_type) => properties.with_content_type(content_type.as_str().into()),
        None => properties,
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
