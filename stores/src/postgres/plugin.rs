//! The `postgres` plugin: its descriptor and checks, a schema of its own for an isolated run,
//! dropped by clean-up.

use std::sync::Arc;

use async_trait::async_trait;
#[cfg(feature = "testing")]
use sqlx::{Connection, PgConnection};
use timer_core::plugin::{Section, StoreConfig, StorePlugin};
#[cfg(feature = "testing")]
use timer_core::plugin::{fresh_name, Isolated, TestServer};
#[cfg(feature = "testing")]
use timer_core::Error;
use timer_core::{Result, Store};

use super::{PostgresConfig, PostgresStore};

pub const PLUGIN: StorePlugin = StorePlugin::of::<PostgresConfig>();

/// The PostgreSQL server the tests use (`scripts/servers/postgres.sh start` prints it).
#[cfg(feature = "testing")]
pub const TEST_SERVER: TestServer = TestServer::new(
    "TIMER_TEST_POSTGRES_URL",
    "TIMER_TEST_POSTGRES_DIR",
    "postgres",
    "PG_PORT",
);

impl Section for PostgresConfig {
    const KIND: &'static str = "postgres";
    #[cfg(feature = "testing")]
    const TEST_SERVER: Option<TestServer> = Some(TEST_SERVER);
    fn validate(&self) -> Result<()> {
        self.check()
    }
    #[cfg(feature = "testing")]
    fn for_test_server(url: String) -> Self {
        PostgresConfig {
            url,
            max_connections: 8,
            ..PostgresConfig::default()
        }
    }
}

#[async_trait]
impl StoreConfig for PostgresConfig {
    async fn open(&self) -> Result<Arc<dyn Store>> {
        Ok(Arc::new(PostgresStore::open(self).await?))
    }
    /// The server's tables (as durable as the server is configured to be).
    fn durable(&self) -> bool {
        true
    }
    /// A new schema `<prefix>_<random>` on the same server.
    #[cfg(feature = "testing")]
    fn isolated(&self, prefix: &str) -> Result<Isolated<dyn StoreConfig>> {
        Ok(Isolated::new(Box::new(PostgresConfig {
            schema: fresh_name(&format!("{prefix}_")),
            ..self.clone()
        })))
    }
    /// Drops the schema and everything in it.
    #[cfg(feature = "testing")]
    async fn clean_up(&self) -> Result<()> {
        let options = super::connect_options(self)?;
        let cannot = "postgres store: cannot connect to drop the schema";
        let mut conn =
            tokio::time::timeout(self.connect_timeout, PgConnection::connect_with(&options))
                .await
                .map_err(|_| Error::unavailable(format!("{cannot}: no answer in time")))?
                .map_err(|e| Error::unavailable(cannot).with_source(e))?;
        let dropped = sqlx::query(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema))
            .execute(&mut conn)
            .await
            .map(|_| ())
            .map_err(|e| {
                Error::unavailable(format!("postgres store: dropping schema {}", self.schema))
                    .with_source(e)
            });
        let _ = conn.close().await;
        dropped
    }
}
