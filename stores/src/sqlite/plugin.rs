//! The `sqlite` plugin descriptor: config loading, a temp file for an isolated run.

use std::any::Any;
use std::sync::Arc;

use async_trait::async_trait;
use timer_core::plugin::{to_value, ConfigSection, Isolated, StoreConfig, StorePlugin};
use timer_core::{Error, Result, Store};

use super::{SqliteConfig, SqliteStore};

pub const PLUGIN: StorePlugin = StorePlugin {
    kind: "sqlite",
    load,
    test_server: None,
    isolated,
};

fn load(section: &ConfigSection) -> Result<Box<dyn StoreConfig>> {
    let config: SqliteConfig = section.parse_as(PLUGIN.kind)?;
    Ok(Box::new(config))
}

fn isolated(prefix: &str) -> Result<Isolated<dyn StoreConfig>> {
    SqliteConfig::default().isolated(prefix)
}

#[async_trait]
impl StoreConfig for SqliteConfig {
    fn kind(&self) -> &'static str {
        PLUGIN.kind
    }
    fn to_value(&self) -> Result<serde_json::Value> {
        to_value(self)
    }
    async fn open(&self) -> Result<Arc<dyn Store>> {
        Ok(Arc::new(SqliteStore::open(self).await?))
    }
    /// Never the configured file: `<prefix>.db` in a new temp dir, removed when the guard drops.
    fn isolated(&self, prefix: &str) -> Result<Isolated<dyn StoreConfig>> {
        let dir = tempfile::tempdir()
            .map_err(|e| Error::internal("cannot create a temp dir").with_source(e))?;
        let config = SqliteConfig {
            url: format!(
                "sqlite://{}",
                dir.path().join(format!("{prefix}.db")).display()
            ),
            ..self.clone()
        };
        Ok(Isolated {
            config: Box::new(config),
            guard: Box::new(dir),
        })
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
