use std::time::Duration;

use serde::{Deserialize, Serialize};
use timer_core::config::duration;

/// Config section of `broker.kind = "rabbitmq"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RabbitmqConfig {
    /// Always `rabbitmq`; checked by the binary.
    pub kind: String,
    /// `amqp://USER:PASSWORD@HOST:PORT/VHOST` or `amqps://...` (TLS, checked against the
    /// webpki root certificates and `tls_root_cert`). The default vhost `/` is written `%2f`.
    pub url: String,
    /// PEM file of the CA that signed the server certificate, for `amqps://` with a CA of your
    /// own (trusted besides the webpki roots).
    pub tls_root_cert: Option<std::path::PathBuf>,
    /// The durable queue commands arrive on; instances consume it as competing consumers.
    pub commands_queue: String,
    /// The durable topic exchange events are published to; the routing key is the tenant.
    pub events_exchange: String,
    /// The durable fanout exchange and queue rejected commands go to (reason in a header).
    pub dead_letter_exchange: String,
    pub dead_letter_queue: String,
    /// Most unacknowledged commands delivered to this instance at once (basic.qos).
    pub prefetch: u16,
    /// How long connecting may take.
    #[serde(with = "duration")]
    pub connect_timeout: Duration,
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
            prefetch: 1_000,
            connect_timeout: Duration::from_secs(5),
        }
    }
}
