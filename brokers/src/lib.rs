//! Broker plugins of timer-service, one module per broker behind its cargo feature. Each knows its
//! SDK and `timer-core`, nothing of other plugins or of HTTP.

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "memory")]
pub mod memory;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
mod shared;
