//! The `rabbitmq` plugin descriptor: config loading, isolated resources for a run, clean-up.

use std::any::Any;
use std::sync::Arc;

use async_trait::async_trait;
use timer_core::plugin::{
    fresh_name, to_value, BrokerConfig, BrokerPlugin, ConfigSection, Isolated, TestClient,
    TestServer,
};
use timer_core::{Broker, Result};

use super::testing::RabbitmqTestClient;
use super::{RabbitmqBroker, RabbitmqConfig};

pub const PLUGIN: BrokerPlugin = BrokerPlugin {
    kind: "rabbitmq",
    load,
    test_server: Some(TEST_SERVER),
    isolated,
};

/// The RabbitMQ server the tests use (`scripts/servers/rabbitmq.sh start` prints it).
pub const TEST_SERVER: TestServer = TestServer {
    address_env: "TIMER_TEST_RABBITMQ_URL",
    dir_env: "TIMER_TEST_RABBITMQ_DIR",
    script: "rabbitmq",
    port_env: "RABBITMQ_PORT",
};

fn load(section: &ConfigSection) -> Result<Box<dyn BrokerConfig>> {
    let config: RabbitmqConfig = section.parse_as(PLUGIN.kind)?;
    Ok(Box::new(config))
}

fn isolated(prefix: &str) -> Result<Isolated<dyn BrokerConfig>> {
    RabbitmqConfig {
        url: TEST_SERVER.address()?,
        ..RabbitmqConfig::default()
    }
    .isolated(prefix)
}

#[async_trait]
impl BrokerConfig for RabbitmqConfig {
    fn kind(&self) -> &'static str {
        PLUGIN.kind
    }
    fn to_value(&self) -> Result<serde_json::Value> {
        to_value(self)
    }
    async fn connect(&self) -> Result<Arc<dyn Broker>> {
        Ok(Arc::new(RabbitmqBroker::connect(self).await?))
    }
    /// Also binds a queue to the events exchange (RabbitMQ returns events no queue is bound
    /// to, and the service would retry them), as a consumer of the events would.
    async fn test_client(&self) -> Result<Arc<dyn TestClient>> {
        Ok(Arc::new(RabbitmqTestClient::new(self.clone()).await?))
    }
    /// Queues and exchanges of its own.
    fn isolated(&self, prefix: &str) -> Result<Isolated<dyn BrokerConfig>> {
        let name = fresh_name(prefix);
        Ok(Isolated::new(Box::new(RabbitmqConfig {
            commands_queue: format!("{name}.commands"),
            events_exchange: format!("{name}.events"),
            dead_letter_exchange: format!("{name}.dead"),
            dead_letter_queue: format!("{name}.dead"),
            ..self.clone()
        })))
    }
    async fn clean_up(&self) -> Result<()> {
        super::delete_topology(self).await
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
