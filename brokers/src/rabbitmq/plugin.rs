//! The `rabbitmq` plugin: its descriptor, isolated resources for a run, clean-up.

use std::sync::Arc;

use async_trait::async_trait;
use timer_core::plugin::{BrokerConfig, BrokerPlugin, Section};
#[cfg(feature = "testing")]
use timer_core::plugin::{fresh_name, Isolated, TestClient, TestServer};
use timer_core::{Broker, Result};

#[cfg(feature = "testing")]
use super::testing::RabbitmqTestClient;
use super::{RabbitmqBroker, RabbitmqConfig};

pub const PLUGIN: BrokerPlugin = BrokerPlugin::of::<RabbitmqConfig>();

/// The RabbitMQ server the tests use (`scripts/servers/rabbitmq.sh start` prints it).
#[cfg(feature = "testing")]
pub const TEST_SERVER: TestServer = TestServer::new(
    "TIMER_TEST_RABBITMQ_URL",
    "TIMER_TEST_RABBITMQ_DIR",
    "rabbitmq",
    "RABBITMQ_PORT",
)
// The script records the launcher's pid; the node is the Erlang VM under it.
.with_server_pid_in("rabbitmq-beam.pid");

impl Section for RabbitmqConfig {
    const KIND: &'static str = "rabbitmq";
    #[cfg(feature = "testing")]
    const TEST_SERVER: Option<TestServer> = Some(TEST_SERVER);
    #[cfg(feature = "testing")]
    fn for_test_server(url: String) -> Self {
        RabbitmqConfig {
            url,
            ..RabbitmqConfig::default()
        }
    }
}

#[async_trait]
impl BrokerConfig for RabbitmqConfig {
    async fn connect(&self) -> Result<Arc<dyn Broker>> {
        Ok(Arc::new(RabbitmqBroker::connect(self).await?))
    }
    /// Also binds a queue to the events exchange (RabbitMQ returns events no queue is bound
    /// to, and the service would retry them), as a consumer of the events would.
    #[cfg(feature = "testing")]
    async fn test_client(&self) -> Result<Arc<dyn TestClient>> {
        Ok(Arc::new(RabbitmqTestClient::new(self.clone()).await?))
    }
    /// Queues and exchanges of its own.
    #[cfg(feature = "testing")]
    fn isolated(&self, prefix: &str) -> Result<Isolated<dyn BrokerConfig>> {
        let name = fresh_name(prefix);
        Ok(Isolated::new(Box::new(RabbitmqConfig {
            commands_queue: format!("{name}.commands"),
            events_exchange: format!("{name}.events"),
            dead_letter_exchange: format!("{name}.dead"),
            dead_letter_queue: format!("{name}.dead"),
            delay_exchange: format!("{name}.delay"),
            ..self.clone()
        })))
    }
    #[cfg(feature = "testing")]
    async fn clean_up(&self) -> Result<()> {
        super::delete_topology(self).await
    }
}
