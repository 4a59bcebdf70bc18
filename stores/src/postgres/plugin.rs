//! The `postgres` plugin descriptor: config loading and checks, a schema of its own for an
//! isolated run, dropped by clean-up.

use std::any::Any;
use std::sync::Arc;

use async_trait::async_trait;
use sqlx::{Connection, PgConnection};
use timer_core::plugin::{
    fresh_name, to_value, ConfigSection, Isolated, StoreConfig, StorePlugin, TestServer,
};
use timer_core::{Error, Result, Store};

use super::{PostgresConfig, PostgresStore};

pub const PLUGIN: StorePlugin = StorePlugin {
    kind: "postgres",
    load,
    test_server: Some(TEST_SERVER),
    isolated,
};

/// The PostgreSQL server the tests use (`scripts/servers/postgres.sh start` prints it).
pub const TEST_SERVER: TestServer = TestServer {
    address_env: "TIMER_TEST_POSTGRES_URL",
    dir_env: "TIMER_TEST_POSTGRES_DIR",
    script: "postgres",
    port_env: "PG_PORT",
};

fn load(section: &ConfigSection) -> Result<Box<dyn StoreConfig>> {
    let config: PostgresConfig = section.parse_as(PLUGIN.kind)?;
    config.check()?;
    Ok(Box::new(config))
}

fn isolated(prefix: &str) -> Result<Isolated<dyn StoreConfig>> {
    PostgresConfig {
        url: TEST_SERVER.address()?,
        max_connections: 8,
        ..PostgresConfig::default()
    }
    .isolated(prefix)
}

#[async_trait]
impl StoreConfig for PostgresConfig {
    fn kind(&self) -> &'static str {
        PLUGIN.kind
    }
    fn to_value(&self) -> Result<serde_json::Value> {
        to_value(self)
    }
    async fn open(&self) -> Result<Arc<dyn Store>> {
        Ok(Arc::new(PostgresStore::open(self).await?))
    }
    /// A new schema `<prefix>_<random>` on the same server.
    fn isolated(&self, prefix: &str) -> Result<Isolated<dyn StoreConfig>> {
        Ok(Isolated::new(Box::new(PostgresConfig {
            schema: fresh_name(&format!("{prefix}_")),
            ..self.clone()
        })))
    }
    /// Drops the schema and everything in it.
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
    fn as_any(&self) -> &dyn Any {
        self
    }
}
