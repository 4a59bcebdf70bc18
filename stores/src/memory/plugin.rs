//! The `memory` plugin descriptor.

use std::any::Any;
use std::sync::Arc;

use async_trait::async_trait;
use timer_core::plugin::{to_value, ConfigSection, Isolated, StoreConfig, StorePlugin};
use timer_core::{Result, Store};

use super::{MemoryConfig, MemoryStore};

pub const PLUGIN: StorePlugin = StorePlugin {
    kind: "memory",
    load,
    test_server: None,
    isolated,
};

fn load(section: &ConfigSection) -> Result<Box<dyn StoreConfig>> {
    let config: MemoryConfig = section.parse_as(PLUGIN.kind)?;
    Ok(Box::new(config))
}

fn isolated(prefix: &str) -> Result<Isolated<dyn StoreConfig>> {
    MemoryConfig::default().isolated(prefix)
}

#[async_trait]
impl StoreConfig for MemoryConfig {
    fn kind(&self) -> &'static str {
        PLUGIN.kind
    }
    fn to_value(&self) -> Result<serde_json::Value> {
        to_value(&MemoryConfig {
            kind: PLUGIN.kind.into(),
        })
    }
    /// A new, empty store every time.
    async fn open(&self) -> Result<Arc<dyn Store>> {
        Ok(Arc::new(MemoryStore::new()))
    }
    fn shared(&self) -> bool {
        false
    }
    fn isolated(&self, _prefix: &str) -> Result<Isolated<dyn StoreConfig>> {
        Ok(Isolated::new(Box::new(self.clone())))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
