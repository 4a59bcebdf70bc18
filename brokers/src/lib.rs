//! Broker plugins of timer-service, one folder per broker behind its cargo feature. Each knows its
//! SDK and `timer-core`, nothing of other plugins or of HTTP; each exports a
//! [`BrokerPlugin`](timer_core::BrokerPlugin) that [`PLUGINS`] lists.

use timer_core::known;
use timer_core::plugin::{BrokerPlugin, Registry};

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "memory")]
pub mod memory;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;

/// Every broker kind, with its descriptor when its cargo feature is compiled in. A new broker is
/// its folder, its feature in Cargo.toml and one line here.
pub const PLUGINS: Registry<BrokerPlugin> = Registry(&[
    known!("memory", memory),
    known!("nats", nats),
    known!("kafka", kafka),
    known!("rabbitmq", rabbitmq),
]);

#[cfg(test)]
mod tests {
    #[test]
    fn registry_lines_name_their_plugins() {
        for known in super::PLUGINS.0 {
            if let Some(plugin) = known.plugin {
                assert_eq!(plugin.kind, known.kind);
            }
        }
    }
}
