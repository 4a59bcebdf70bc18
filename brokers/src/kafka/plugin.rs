//! The `kafka` plugin: its descriptor and checks, isolated resources for a run.

use std::sync::Arc;

use async_trait::async_trait;
use timer_core::plugin::{BrokerConfig, BrokerPlugin, Section};
#[cfg(feature = "testing")]
use timer_core::plugin::{fresh_name, Isolated, TestClient, TestServer};
use timer_core::{Broker, EngineConfig, Error, Result};

#[cfg(feature = "testing")]
use super::testing::KafkaTestClient;
use super::{KafkaBroker, KafkaConfig};

pub const PLUGIN: BrokerPlugin = BrokerPlugin::of::<KafkaConfig>();

/// The Kafka-protocol server the tests use (`scripts/servers/kafka.sh start` prints it).
#[cfg(feature = "testing")]
pub const TEST_SERVER: TestServer = TestServer::new(
    "TIMER_TEST_KAFKA_BROKERS",
    "TIMER_TEST_KAFKA_DIR",
    "kafka",
    "KAFKA_PORT",
)
.bypassing_proxies("a Kafka client goes on to the addresses the cluster advertises")
// Restarted while an idempotent producer (the service's) had batches in flight, tansu panics in
// its storage task (tansu-storage 0.6.0 lite.rs:503, "more or less than one row", in its
// idempotent-sequence check; after SIGTERM as after SIGKILL) and answers every request with an
// error from then on. Kafka itself keeps producer state across restarts; there is no other
// Kafka-protocol server here to test that against.
.not_restartable("tansu 0.6.0 panics when restarted under an idempotent producer (lite.rs:503)");

impl Section for KafkaConfig {
    const KIND: &'static str = "kafka";
    #[cfg(feature = "testing")]
    const TEST_SERVER: Option<TestServer> = Some(TEST_SERVER);
    fn validate(&self) -> Result<()> {
        self.check()
    }
    #[cfg(feature = "testing")]
    fn for_test_server(brokers: String) -> Self {
        KafkaConfig {
            brokers,
            ..KafkaConfig::default()
        }
    }
}

#[async_trait]
impl BrokerConfig for KafkaConfig {
    fn check(&self, engine: &EngineConfig) -> Result<()> {
        // The engine stops waiting for a publish after engine.publish_timeout and releases its
        // timers; librdkafka would still deliver a queued event later, after a cancel may have
        // succeeded.
        if self.publish_timeout >= engine.publish_timeout {
            return Err(Error::config(format!(
                "broker.publish_timeout ({}) must be below engine.publish_timeout ({})",
                humantime::format_duration(self.publish_timeout),
                humantime::format_duration(engine.publish_timeout)
            )));
        }
        Ok(())
    }
    async fn connect(&self) -> Result<Arc<dyn Broker>> {
        Ok(Arc::new(KafkaBroker::connect(self).await?))
    }
    #[cfg(feature = "testing")]
    async fn test_client(&self) -> Result<Arc<dyn TestClient>> {
        Ok(Arc::new(KafkaTestClient::new(self.clone()).await?))
    }
    /// Topics and a consumer group of their own.
    #[cfg(feature = "testing")]
    fn isolated(&self, prefix: &str) -> Result<Isolated<dyn BrokerConfig>> {
        let name = fresh_name(prefix);
        Ok(Isolated::new(Box::new(KafkaConfig {
            group_id: name.clone(),
            commands_topic: format!("{name}.commands"),
            events_topic: format!("{name}.events"),
            dead_letter_topic: format!("{name}.dead"),
            delay_topic: format!("{name}.delay"),
            ..self.clone()
        })))
    }
    /// Leaves the topics: tansu 0.6.0 (the Kafka test server) panics in its storage and sends
    /// metadata that crashes librdkafka once a topic is deleted. Says so, naming them.
    #[cfg(feature = "testing")]
    async fn clean_up(&self) -> Result<()> {
        eprintln!(
            "note: the kafka topics {} stay on {}; delete them with your cluster's tools",
            self.own_topics().join(", "),
            self.brokers
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn publish_timeout_must_stay_below_the_engines() {
        let engine = EngineConfig {
            publish_timeout: Duration::from_secs(15),
            ..EngineConfig::default()
        };
        let slow = KafkaConfig {
            publish_timeout: Duration::from_secs(20),
            ..KafkaConfig::default()
        };
        let e = BrokerConfig::check(&slow, &engine).unwrap_err().to_string();
        assert!(
            e.contains("broker.publish_timeout (20s) must be below engine.publish_timeout (15s)"),
            "{e}"
        );
        assert!(BrokerConfig::check(&KafkaConfig::default(), &engine).is_ok());
    }
}
