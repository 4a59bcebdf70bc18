//! The `nats` plugin descriptor: config loading, isolated resources for a run, clean-up.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use timer_core::plugin::{
    fresh_name, to_value, BrokerConfig, BrokerPlugin, ConfigSection, Isolated, TestClient,
    TestServer,
};
use timer_core::{Broker, Result};

use super::testing::NatsTestClient;
use super::{NatsBroker, NatsConfig};

pub const PLUGIN: BrokerPlugin = BrokerPlugin {
    kind: "nats",
    load,
    test_server: Some(TEST_SERVER),
    isolated,
};

/// The NATS server the tests use (`scripts/servers/nats.sh start` prints it).
pub const TEST_SERVER: TestServer = TestServer {
    address_env: "TIMER_TEST_NATS_URL",
    dir_env: "TIMER_TEST_NATS_DIR",
    script: "nats",
    port_env: "NATS_PORT",
};

fn load(section: &ConfigSection) -> Result<Box<dyn BrokerConfig>> {
    let config: NatsConfig = section.parse_as(PLUGIN.kind)?;
    config.check()?;
    Ok(Box::new(config))
}

fn isolated(prefix: &str) -> Result<Isolated<dyn BrokerConfig>> {
    NatsConfig {
        url: TEST_SERVER.address()?,
        // Redelivery within a check's patience.
        ack_wait: Duration::from_secs(2),
        ..NatsConfig::default()
    }
    .isolated(prefix)
}

#[async_trait]
impl BrokerConfig for NatsConfig {
    fn kind(&self) -> &'static str {
        PLUGIN.kind
    }
    fn to_value(&self) -> Result<serde_json::Value> {
        to_value(self)
    }
    async fn connect(&self) -> Result<Arc<dyn Broker>> {
        Ok(Arc::new(NatsBroker::connect(self).await?))
    }
    async fn test_client(&self) -> Result<Arc<dyn TestClient>> {
        Ok(Arc::new(NatsTestClient::new(self.clone()).await?))
    }
    /// Streams, subjects and a consumer of its own.
    fn isolated(&self, prefix: &str) -> Result<Isolated<dyn BrokerConfig>> {
        let name = fresh_name(prefix);
        Ok(Isolated::new(Box::new(NatsConfig {
            commands_stream: format!("C_{name}"),
            commands_subject: format!("{name}.commands.>"),
            consumer: name.clone(),
            events_stream: format!("E_{name}"),
            events_subject: format!("{name}.events"),
            dead_letter_stream: format!("D_{name}"),
            dead_letter_subject: format!("{name}.dead"),
            ..self.clone()
        })))
    }
    async fn clean_up(&self) -> Result<()> {
        super::delete_streams(self).await
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
