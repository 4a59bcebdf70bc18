//! Broker plugins of timer-service, one folder per broker behind its cargo feature. Each knows its
//! SDK and `timer-core`, nothing of other plugins or of HTTP; each exports a
//! [`BrokerPlugin`](timer_core::BrokerPlugin) that `PLUGINS` lists. A new broker is its folder,
//! its feature in Cargo.toml and one line here.

#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
mod shared;

/// HTTP targets: signed webhooks at the due time, with or without a broker.
#[cfg(feature = "webhook")]
pub mod webhook;

timer_core::plugins! { BrokerPlugin:
    memory = "memory",
    nats = "nats",
    kafka = "kafka",
    rabbitmq = "rabbitmq",
}
