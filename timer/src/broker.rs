//! The `Broker` contract. Every broker plugin implements it and passes the Broker
//! conformance suite in `timer-conformance`.

use std::time::Duration;

use async_trait::async_trait;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::model::TimerKey;
use crate::outbound::{MessageMeta, Target};
use crate::trace::{TraceContext, TraceHeaders, TRACEPARENT, TRACESTATE};

/// One inbound command. `tag` is the plugin's handle for acknowledging it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    pub tag: u64,
    pub body: Vec<u8>,
    /// The tenant the broker's own addressing gives the command, where the broker binds
    /// commands to tenants (`broker.bind_tenant`: the NATS subject's last token, the Kafka
    /// record key, the RabbitMQ `user-id` the server checked), so that a producer allowed to
    /// send for one tenant cannot act on another's timers: the engine refuses a command whose
    /// `tenantId` is not this one. `None`: not bound (any `tenantId` is taken).
    pub tenant: Option<String>,
    /// The trace context headers the command arrived with (`crate::trace`).
    pub trace: TraceHeaders,
}

/// One outbound event. `id` is the envelope id: it goes into the broker's de-duplication slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboundEvent {
    pub id: Uuid,
    pub key: TimerKey,
    /// The envelope (JSON), or the bytes of the timer's own message.
    pub body: Vec<u8>,
    /// Where it goes in place of the events destination ([`Broker::check_target`] took it).
    pub target: Option<Target>,
    /// Set when `body` is the timer's own message: its content type and headers, published
    /// with it as they are (the plugin's de-duplication header, carrying `id`, goes last).
    pub message: Option<MessageMeta>,
    /// The trace the fire belongs to: the plugin sends it as `traceparent` and `tracestate`
    /// headers ([`OutboundEvent::trace_headers`]).
    pub trace: Option<TraceContext>,
}

impl OutboundEvent {
    /// The `DueTimeReached` envelope `body`, with `id`, to the events destination.
    pub fn envelope(id: Uuid, key: TimerKey, body: Vec<u8>) -> Self {
        OutboundEvent {
            id,
            key,
            body,
            target: None,
            message: None,
            trace: None,
        }
    }

    /// The trace context headers to publish with it: none when the timer's own message has a
    /// `traceparent` or `tracestate` header already (the producer's headers go out unchanged,
    /// and the two belong together).
    pub fn trace_headers(&self) -> impl Iterator<Item = (&'static str, &str)> {
        let own = self.message.as_ref().is_some_and(|m| {
            m.headers
                .keys()
                .any(|h| h.eq_ignore_ascii_case(TRACEPARENT) || h.eq_ignore_ascii_case(TRACESTATE))
        });
        self.trace
            .iter()
            .filter(move |_| !own)
            .flat_map(TraceContext::headers)
    }
}

/// One event of a batch the broker refused for itself alone, while it confirmed the others: it
/// came back unroutable, or its key cannot be carried by the broker's protocol. `index` is its
/// place in the batch given to [`Broker::publish`]. The engine retries it on its own backoff
/// (and gives it up after `engine.max_attempts`), so one tenant's refused event never holds back
/// another tenant's; one the broker did not try ([`deferred`](Self::deferred)) it offers again
/// at once, without counting an attempt.
#[derive(Debug)]
pub struct Undelivered {
    pub index: usize,
    pub error: Error,
    /// Not sent, nor tried, in this publish: the broker left it for a later one (its
    /// destination not looked up yet, as it looks up only so many at once).
    pub deferred: bool,
}

impl Undelivered {
    /// An event refused alone: a failed attempt.
    pub fn new(index: usize, error: Error) -> Self {
        Undelivered {
            index,
            error,
            deferred: false,
        }
    }

    /// An event left for a later publish, not tried: `error` says why.
    pub fn deferred(index: usize, error: Error) -> Self {
        Undelivered {
            index,
            error,
            deferred: true,
        }
    }
}

/// A limit of a broker's protocol that an id breaks ([`Broker::check_key`]): the command field
/// (`tenantId`, `serviceCallId`) and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyLimit {
    pub field: &'static str,
    pub message: String,
}

/// A tenant id as one routing token (NATS subject token, AMQP topic word): letters, digits, `-`
/// and `_` stay; every other byte (`.`, `*`, `>`, `#`, spaces, non-ASCII) becomes `%XX`, so a
/// tenant is always exactly one token and distinct tenants stay distinct.
pub fn routing_token(tenant: &str) -> String {
    let mut out = String::with_capacity(tenant.len());
    for b in tenant.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The tenant id a [`routing_token`] stands for; `None` when the token is not one (a `%` not
/// followed by two hex digits, or bytes that are not UTF-8).
pub fn tenant_of_token(token: &str) -> Option<String> {
    let bytes = token.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = token.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[async_trait]
pub trait Broker: Send + Sync + 'static {
    /// The plugin's name: `memory`, `nats`, `kafka`, `rabbitmq`.
    fn name(&self) -> &'static str;

    /// Waits up to `wait` for commands and returns at most `max` (empty on timeout). A delivery
    /// not acknowledged is delivered again (after the plugin's ack wait, or to the next consumer
    /// once this one is gone). Several instances share the stream.
    async fn receive(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>>;

    /// Acknowledges deliveries after the store committed them.
    async fn ack(&self, tags: &[u64]) -> Result<()>;

    /// How long a delivery may stay unacknowledged before the broker delivers it again, where
    /// it does so by itself (NATS, memory); `None` where it does not while this consumer is
    /// connected (Kafka, RabbitMQ). The engine calls [`keep`](Self::keep) well within it for
    /// commands it holds back.
    fn ack_wait(&self) -> Option<Duration> {
        None
    }

    /// Restarts the ack wait of deliveries the engine is still working on (held back by their
    /// tenant's rate limit), so they are not delivered again meanwhile. Tags not (or no longer)
    /// known are skipped. Only called when [`ack_wait`](Self::ack_wait) is `Some`.
    async fn keep(&self, _tags: &[u64]) -> Result<()> {
        Ok(())
    }

    /// Hands back, as this instance stops receiving, the commands it received and did not
    /// acknowledge (held back for a rate limit, or still in the client's buffers), so another
    /// instance gets them at once instead of after the ack wait: a rolling upgrade then delays
    /// no command. Nothing to do where the server delivers them again as soon as this consumer
    /// goes (RabbitMQ, Kafka) or no other consumer can take them (memory).
    async fn give_back(&self) -> Result<()> {
        Ok(())
    }

    /// Whether this broker can carry the events of a timer with `key` (its routing key, subject
    /// or headers have limits of their own). The engine asks at admission, so a timer it could
    /// never publish is refused (reason `invalid_id`, naming the field) instead of stored.
    fn check_key(&self, _key: &TimerKey) -> std::result::Result<(), KeyLimit> {
        Ok(())
    }

    /// Whether this broker can publish to `target` (a `ScheduleTimer`'s own destination, in the
    /// broker's terms), and the destination's name as `targets.allow` patterns match it (the
    /// subject, `<exchange>/<routingKey>`, the topic): `Err` says what is wrong with it for this
    /// broker, and the engine refuses the timer (reason `invalid_target`). The default takes
    /// none.
    fn check_target(&self, _target: &Target) -> std::result::Result<String, String> {
        Err(format!(
            "the {} broker publishes every event to its events destination; it takes no target",
            self.name()
        ))
    }

    /// Whether this broker can carry a timer's own message (its content type and headers) to
    /// its destination: `Err` says what is wrong, and the engine refuses the timer (reason
    /// `invalid_target`, field `message`), as [`Caller::check_message`] does for an HTTP
    /// target. The wire's limits hold for every broker; this is for a broker's own (a field
    /// its protocol carries in fewer bytes, a header its server reads as an instruction).
    ///
    /// [`Caller::check_message`]: crate::call::Caller::check_message
    fn check_message(&self, _meta: &MessageMeta) -> std::result::Result<(), String> {
        Ok(())
    }

    /// Publishes a batch (pipelined, not one round trip each). `Ok` when the broker durably
    /// accepted every event but the ones it lists as [`Undelivered`] (refused one by one,
    /// e.g. returned as unroutable: the others are confirmed). On `Err` some events may have
    /// gone out: the caller treats the whole batch as unpublished and fires it again later (a
    /// duplicate, never a loss).
    async fn publish(&self, events: &[OutboundEvent]) -> Result<Vec<Undelivered>>;

    /// The name of the destination `key`'s events go to without a target (a subject, an
    /// exchange, a topic), for the `messaging.destination.name` of a publish span. `None`:
    /// the plugin does not say.
    fn events_destination(&self, _key: &TimerKey) -> Option<String> {
        None
    }

    /// Sends a command that cannot be processed to the dead-letter destination with the reason.
    async fn dead_letter(&self, body: &[u8], reason: &str) -> Result<()>;

    /// Ok when the broker is reachable.
    async fn health(&self) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_become_single_routing_tokens() {
        assert_eq!(routing_token("acme-1_x"), "acme-1_x");
        assert_eq!(routing_token("a.b *>#"), "a%2Eb%20%2A%3E%23");
        assert_eq!(routing_token("ü"), "%C3%BC");
        assert_ne!(routing_token("a.b"), routing_token("a%2Eb"));
    }

    #[test]
    fn tokens_read_back_as_their_tenants() {
        for tenant in ["acme-1_x", "a.b *>#", "ü🦀", "%", "a%2Eb"] {
            assert_eq!(
                tenant_of_token(&routing_token(tenant)).as_deref(),
                Some(tenant)
            );
        }
        assert_eq!(tenant_of_token("acme"), Some("acme".into()));
        assert_eq!(tenant_of_token("a%2"), None, "cut short");
        assert_eq!(tenant_of_token("a%zz"), None, "not hex");
        assert_eq!(tenant_of_token("%FF"), None, "not UTF-8");
    }
}
