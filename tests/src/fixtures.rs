//! Fixtures: a fresh, isolated resource per check for every compiled-in plugin, and the rule for
//! servers that are not there (ignored with a reason locally; a failure when
//! `TIMER_TEST_REQUIRE=1`, as CI sets).

use std::sync::Arc;

use async_trait::async_trait;
use timer_core::plugin::{BrokerConfig, BrokerPlugin, TestClient};
use timer_core::{Result, Store};
use timer_stores::memory::MemoryStore;

/// Whether missing servers must fail the run instead of skipping (`TIMER_TEST_REQUIRE=1`).
pub fn require_servers() -> bool {
    std::env::var("TIMER_TEST_REQUIRE").is_ok_and(|v| v == "1")
}

/// A store under test with whatever keeps its resource alive (a temp dir, a schema).
pub struct FreshStore {
    pub store: Arc<dyn Store>,
    _guard: Box<dyn Send + Sync>,
}

/// Makes fresh stores of one plugin.
#[async_trait]
pub trait StoreFactory: Send + Sync + 'static {
    fn name(&self) -> &'static str;
    /// Why this plugin's server is unavailable, if it is.
    fn unavailable(&self) -> Option<String> {
        None
    }
    async fn fresh(&self) -> Result<FreshStore>;
}

pub struct MemoryStores;

#[async_trait]
impl StoreFactory for MemoryStores {
    fn name(&self) -> &'static str {
        "memory"
    }
    async fn fresh(&self) -> Result<FreshStore> {
        Ok(FreshStore {
            store: Arc::new(MemoryStore::new()),
            _guard: Box::new(()),
        })
    }
}

#[cfg(feature = "sqlite")]
pub struct SqliteStores;

#[cfg(feature = "sqlite")]
#[async_trait]
impl StoreFactory for SqliteStores {
    fn name(&self) -> &'static str {
        "sqlite"
    }
    async fn fresh(&self) -> Result<FreshStore> {
        use timer_stores::sqlite::{SqliteConfig, SqliteStore};
        let dir = tempfile::tempdir()
            .map_err(|e| timer_core::Error::internal("cannot create a temp dir").with_source(e))?;
        let store =
            SqliteStore::open(&SqliteConfig::for_path(dir.path().join("timers.db"))).await?;
        Ok(FreshStore {
            store: Arc::new(store),
            _guard: Box::new(dir),
        })
    }
}

/// Each check gets a schema of its own (`t_<random>`) in the test database.
#[cfg(feature = "postgres")]
pub struct PostgresStores;

#[cfg(feature = "postgres")]
impl PostgresStores {
    /// A config for a new random schema on the test server, if one is configured.
    pub fn config() -> Option<timer_stores::postgres::PostgresConfig> {
        let url = std::env::var(POSTGRES_URL_VAR).ok()?;
        let id = uuid::Uuid::new_v4().simple().to_string();
        Some(timer_stores::postgres::PostgresConfig {
            url,
            schema: format!("t_{}", &id[..16]),
            max_connections: 8,
            ..Default::default()
        })
    }
}

#[cfg(feature = "postgres")]
#[async_trait]
impl StoreFactory for PostgresStores {
    fn name(&self) -> &'static str {
        "postgres"
    }
    fn unavailable(&self) -> Option<String> {
        std::env::var(POSTGRES_URL_VAR).is_err().then(|| {
            format!(
                "{POSTGRES_URL_VAR} is not set (bash scripts/test.sh starts a PostgreSQL server)"
            )
        })
    }
    async fn fresh(&self) -> Result<FreshStore> {
        let config = Self::config()
            .ok_or_else(|| timer_core::Error::config(format!("{POSTGRES_URL_VAR} is not set")))?;
        let store = timer_stores::postgres::PostgresStore::open(&config).await?;
        // Schemas stay behind in the throwaway test database; names never collide.
        Ok(FreshStore {
            store: Arc::new(store),
            _guard: Box::new(()),
        })
    }
}

/// Every store plugin compiled into this build.
pub fn store_factories() -> Vec<Box<dyn StoreFactory>> {
    #[allow(unused_mut)]
    let mut all: Vec<Box<dyn StoreFactory>> = vec![Box::new(MemoryStores)];
    #[cfg(feature = "sqlite")]
    all.push(Box::new(SqliteStores));
    #[cfg(feature = "postgres")]
    all.push(Box::new(PostgresStores));
    all
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
