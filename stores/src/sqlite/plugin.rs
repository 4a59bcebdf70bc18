//! The `sqlite` plugin: its descriptor, a temp file for an isolated run.

use std::sync::Arc;

use async_trait::async_trait;
#[cfg(feature = "testing")]
use timer_core::plugin::Isolated;
use timer_core::plugin::{Section, StoreConfig, StorePlugin};
#[cfg(feature = "testing")]
use timer_core::Error;
use timer_core::{Result, Store};

use super::{SqliteConfig, SqliteStore};

pub const PLUGIN: StorePlugin = StorePlugin::of::<SqliteConfig>();

impl Section for SqliteConfig {
    const KIND: &'static str = "sqlite";
}

#[async_trait]
impl StoreConfig for SqliteConfig {
    async fn open(&self) -> Result<Arc<dyn Store>> {
        Ok(Arc::new(SqliteStore::open(self).await?))
    }
    async fn attach(&self) -> Result<Arc<dyn Store>> {
        Ok(Arc::new(SqliteStore::attach(self).await?))
    }
    /// A file; a transaction is committed once in its write-ahead log.
    fn durable(&self) -> bool {
        true
    }
    /// One service at a time has the file open (its lock file keeps others off).
    fn shared(&self) -> bool {
        false
    }
    /// Never the configured file: `<prefix>.db` in a new temp dir, removed when the guard drops.
    #[cfg(feature = "testing")]
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
}
