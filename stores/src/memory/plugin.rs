//! The `memory` plugin.

use std::sync::Arc;

use async_trait::async_trait;
#[cfg(feature = "testing")]
use timer_core::plugin::Isolated;
use timer_core::plugin::{Section, StoreConfig, StorePlugin};
use timer_core::{Result, Store};

use super::{MemoryConfig, MemoryStore};

pub const PLUGIN: StorePlugin = StorePlugin::of::<MemoryConfig>();

impl Section for MemoryConfig {
    const KIND: &'static str = "memory";
}

#[async_trait]
impl StoreConfig for MemoryConfig {
    /// A new, empty store every time.
    async fn open(&self) -> Result<Arc<dyn Store>> {
        Ok(Arc::new(MemoryStore::new()))
    }
    /// Process memory: a restart starts empty.
    fn durable(&self) -> bool {
        false
    }
    fn shared(&self) -> bool {
        false
    }
    #[cfg(feature = "testing")]
    fn isolated(&self, _prefix: &str) -> Result<Isolated<dyn StoreConfig>> {
        Ok(Isolated::new(Box::new(self.clone())))
    }
}
