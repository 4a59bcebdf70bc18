//! Plugin assembly: the one place that maps a config kind to a constructor.

use std::sync::Arc;

use timer_brokers::memory::MemoryHub;
use timer_core::{Broker, Result, Store};

use crate::config::{BrokerConfig, StoreConfig};

pub async fn store(config: &StoreConfig) -> Result<Arc<dyn Store>> {
    Ok(match config {
        StoreConfig::Memory(_) => Arc::new(timer_stores::memory::MemoryStore::new()),
        #[cfg(feature = "sqlite")]
        StoreConfig::Sqlite(c) => Arc::new(timer_stores::sqlite::SqliteStore::open(c).await?),
        #[cfg(feature = "postgres")]
        StoreConfig::Postgres(c) => Arc::new(timer_stores::postgres::PostgresStore::open(c).await?),
    })
}

/// The broker, plus the in-process hub when it is the memory broker (the HTTP API can feed
/// commands into it and show its dead letters).
pub async fn broker(config: &BrokerConfig) -> Result<(Arc<dyn Broker>, Option<MemoryHub>)> {
    Ok(match config {
        BrokerConfig::Memory(c) => {
            let hub = MemoryHub::new(c.clone());
            (Arc::new(hub.connect()), Some(hub))
        }
        #[cfg(feature = "nats")]
        BrokerConfig::Nats(c) => (
            Arc::new(timer_brokers::nats::NatsBroker::connect(c).await?),
            None,
        ),
        #[cfg(feature = "rabbitmq")]
        BrokerConfig::Rabbitmq(c) => (
            Arc::new(timer_brokers::rabbitmq::RabbitmqBroker::connect(c).await?),
            None,
        ),
        #[cfg(feature = "kafka")]
        BrokerConfig::Kafka(c) => (
            Arc::new(timer_brokers::kafka::KafkaBroker::connect(c).await?),
            None,
        ),
    })
}
