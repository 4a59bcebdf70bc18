//! The `nats` plugin: its descriptor, isolated resources for a run, clean-up.

use std::sync::Arc;

use async_trait::async_trait;
use timer_core::plugin::{BrokerConfig, BrokerPlugin, Section};
#[cfg(feature = "testing")]
use timer_core::plugin::{fresh_name, Isolated, TestClient, TestServer};
use timer_core::{Broker, Result};

#[cfg(feature = "testing")]
use super::testing::NatsTestClient;
use super::{NatsBroker, NatsConfig};

pub const PLUGIN: BrokerPlugin = BrokerPlugin::of::<NatsConfig>();

/// The NATS server the tests use (`scripts/servers/nats.sh start` prints it).
#[cfg(feature = "testing")]
pub const TEST_SERVER: TestServer = TestServer::new(
    "TIMER_TEST_NATS_URL",
    "TIMER_TEST_NATS_DIR",
    "nats",
    "NATS_PORT",
);

impl Section for NatsConfig {
    const KIND: &'static str = "nats";
    #[cfg(feature = "testing")]
    const TEST_SERVER: Option<TestServer> = Some(TEST_SERVER);
    fn validate(&self) -> Result<()> {
        self.check()
    }
    #[cfg(feature = "testing")]
    fn for_test_server(url: String) -> Self {
        // Redelivery within a check's patience.
        let ack_wait = std::time::Duration::from_secs(2);
        NatsConfig {
            url,
            ack_wait,
            ..NatsConfig::default()
        }
    }
}

#[async_trait]
impl BrokerConfig for NatsConfig {
    async fn connect(&self) -> Result<Arc<dyn Broker>> {
        Ok(Arc::new(NatsBroker::connect(self).await?))
    }
    #[cfg(feature = "testing")]
    async fn test_client(&self) -> Result<Arc<dyn TestClient>> {
        Ok(Arc::new(NatsTestClient::new(self.clone()).await?))
    }
    /// Streams, subjects and a consumer of its own.
    #[cfg(feature = "testing")]
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
            delay_prefix: format!("{name}.delay"),
            delay_stream: format!("L_{name}"),
            ..self.clone()
        })))
    }
    #[cfg(feature = "testing")]
    async fn clean_up(&self) -> Result<()> {
        super::delete_streams(self).await
    }
}
