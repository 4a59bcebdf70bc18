use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use timer_core::config::duration;

/// The RabbitMQ broker (AMQP 0-9-1): commands from a durable queue that every instance
/// consumes, events to a topic exchange with the tenant as routing key, dead letters to a
/// fanout exchange and its queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RabbitmqConfig {
    /// Always `rabbitmq`; checked by the binary.
    pub kind: String,
    /// `amqp://USER:PASSWORD@HOST:PORT/VHOST`, or `amqps://...` for TLS, where the server
    /// certificate is checked against the webpki root certificates (the Mozilla set compiled
    /// into the binary) and `broker.tls_root_cert`. The vhost `/` is written `%2f`.
    /// `check-config` shows the password as `***`.
    pub url: String,
    /// PEM file of the CA that signed the server certificate, for `amqps://` with a CA of your
    /// own (trusted besides the webpki roots). Without it such a certificate fails with
    /// `invalid peer certificate: UnknownIssuer`.
    pub tls_root_cert: Option<std::path::PathBuf>,
    /// The durable queue commands arrive on. Every instance consumes it (competing consumers);
    /// a command is acknowledged after the store committed it.
    pub commands_queue: String,
    /// The durable topic exchange events are published to, with the tenant as routing key. An
    /// event that no bound queue matches comes back and is retried.
    pub events_exchange: String,
    /// The durable fanout exchange rejected commands and `TimerFailed` envelopes are published
    /// to.
    pub dead_letter_exchange: String,
    /// The durable queue bound to the dead-letter exchange; the reason is in the header
    /// `x-timer-dead-letter-reason`.
    pub dead_letter_queue: String,
    /// Most commands delivered to this instance and not yet acknowledged (`basic.qos`), 0 to
    /// 65535; 0 means no limit.
    pub prefetch: u16,
    /// How long opening a connection may take, at start-up and on every reconnect. When the
    /// first connection fails, `run` exits 1.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub connect_timeout: Duration,
    /// Bind each command to the tenant of the user that published it: the message's `user-id`
    /// property, which RabbitMQ checks against the user of the connection (a message claiming
    /// another user is refused by the server), is the tenant, and a command naming another
    /// `tenantId` (or without `user-id`) is refused (`invalid_id`, a dead letter). Give each
    /// tenant's producers a RabbitMQ user named as the tenant. `false`: the tenant is the
    /// command's `tenantId`, whoever sent it.
    pub bind_tenant: bool,
    /// The durable fanout exchange of delayed messages, bound to `broker.commands_queue`: a
    /// message published there with the header `x-delay` (milliseconds) or `x-deliver-at`
    /// (RFC 3339, or epoch milliseconds) is stored as a timer and published at that time to the
    /// exchange in its header `x-target-exchange` (default: the default exchange) with its own
    /// routing key, body, content type and headers. Its `message_id` is the timer's
    /// `serviceCallId` (without one, an id derived from its target, routing key and body), its
    /// header `timer-tenant` the tenant (else `broker.delay_tenant`). The place of RabbitMQ's
    /// delayed-message exchange plugin.
    pub delay_exchange: String,
    /// The tenant of a delayed message without a `timer-tenant` header.
    pub delay_tenant: String,
}

impl Default for RabbitmqConfig {
    fn default() -> Self {
        RabbitmqConfig {
            kind: "rabbitmq".into(),
            url: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
            tls_root_cert: None,
            commands_queue: "timer.commands".into(),
            events_exchange: "timer.events".into(),
            dead_letter_exchange: "timer.dead-letters".into(),
            dead_letter_queue: "timer.dead-letters".into(),
            prefetch: 20_000,
            connect_timeout: Duration::from_secs(5),
            bind_tenant: false,
            delay_exchange: "timer.delay".into(),
            delay_tenant: "default".into(),
        }
    }
}
