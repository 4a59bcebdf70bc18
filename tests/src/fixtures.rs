//! Fixtures: a fresh, isolated resource per check for any plugin of the registries
//! (`timer_stores::PLUGINS`, `timer_brokers::PLUGINS`), and the rule for servers that are not
//! there (ignored with a reason locally; a failure when `TIMER_TEST_REQUIRE=1`, as CI sets).

use std::sync::Arc;

use timer_core::plugin::{BrokerConfig, BrokerPlugin, StoreConfig, StorePlugin, TestClient};
use timer_core::{Result, Store};

/// Whether missing servers must fail the run instead of skipping (`TIMER_TEST_REQUIRE=1`).
pub fn require_servers() -> bool {
    std::env::var("TIMER_TEST_REQUIRE").is_ok_and(|v| v == "1")
}

/// A fresh store of a store plugin (a temp file, a schema of its own on the test server), with
/// the config naming it and whatever keeps it alive.
pub struct FreshStore {
    pub store: Arc<dyn Store>,
    pub config: Box<dyn StoreConfig>,
    _guard: Box<dyn std::any::Any + Send + Sync>,
}

/// A fresh, isolated store of `plugin`. Schemas stay behind in the throwaway test database;
/// names never collide.
pub async fn fresh_store(plugin: &StorePlugin) -> Result<FreshStore> {
    let isolated = (plugin.isolated)("t")?;
    let store = isolated.config.open().await?;
    Ok(FreshStore {
        store,
        config: isolated.config,
        _guard: isolated.guard,
    })
}

/// A test client on fresh resources of a broker plugin's test server (streams, queues, topics
/// of its own), with the config naming them and whatever keeps them alive.
pub struct FreshBroker {
    pub client: Arc<dyn TestClient>,
    pub config: Box<dyn BrokerConfig>,
    _guard: Box<dyn std::any::Any + Send + Sync>,
}

/// Fresh resources of `plugin` and a test client on them. Resources stay behind on the
/// throwaway test servers; names never collide.
pub async fn fresh_broker(plugin: &BrokerPlugin) -> Result<FreshBroker> {
    let isolated = (plugin.isolated)("t")?;
    let client = isolated.config.test_client().await?;
    Ok(FreshBroker {
        client,
        config: isolated.config,
        _guard: isolated.guard,
    })
}

// The test servers' variables, for the end-to-end files that name them; each plugin's
// `TEST_SERVER` is where they are defined.

/// `timer_stores::postgres::TEST_SERVER.address_env`.
pub const POSTGRES_URL_VAR: &str = "TIMER_TEST_POSTGRES_URL";
/// `timer_brokers::nats::TEST_SERVER.address_env`.
pub const NATS_URL_VAR: &str = "TIMER_TEST_NATS_URL";
/// `timer_brokers::rabbitmq::TEST_SERVER.address_env`.
pub const RABBITMQ_URL_VAR: &str = "TIMER_TEST_RABBITMQ_URL";
/// `timer_brokers::kafka::TEST_SERVER.address_env`.
pub const KAFKA_BROKERS_VAR: &str = "TIMER_TEST_KAFKA_BROKERS";

/// The Kafka test client under its former name, for the Kafka end-to-end file until it uses the
/// plugin descriptor.
#[cfg(feature = "kafka")]
pub mod kafka {
    use timer_brokers::kafka::KafkaConfig;
    pub use timer_brokers::kafka::KafkaTestClient as KafkaFixture;

    pub struct KafkaBrokers;

    impl KafkaBrokers {
        /// A config with fresh names on the test server, if one is configured.
        pub fn config() -> Option<KafkaConfig> {
            let isolated = (timer_brokers::kafka::PLUGIN.isolated)("t").ok()?;
            isolated
                .config
                .as_any()
                .downcast_ref::<KafkaConfig>()
                .cloned()
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn registry_lines_name_their_plugins() {
        for known in timer_stores::PLUGINS.0 {
            assert!(known.plugin.is_none_or(|p| p.kind == known.kind));
        }
        for known in timer_brokers::PLUGINS.0 {
            assert!(known.plugin.is_none_or(|p| p.kind == known.kind));
        }
    }
}
