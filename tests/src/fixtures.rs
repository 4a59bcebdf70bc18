//! Fixtures: a fresh, isolated resource per check for any plugin of the registries
//! (`timer_stores::PLUGINS`, `timer_brokers::PLUGINS`), and the rule for servers that are not
//! there (ignored with a reason locally; a failure when `TIMER_TEST_REQUIRE=1`, as CI sets).

use std::sync::Arc;

use timer_core::plugin::{
    BrokerConfig, BrokerPlugin, Isolated, StoreConfig, StorePlugin, TestClient,
};
use timer_core::{Result, Store};

/// Whether missing servers must fail the run instead of skipping (`TIMER_TEST_REQUIRE=1`).
pub fn require_servers() -> bool {
    std::env::var("TIMER_TEST_REQUIRE").is_ok_and(|v| v == "1")
}

/// A resource of a plugin under test (a store, a broker's test client) on fresh, isolated
/// resources (a temp file, a schema, streams or queues of its own), with the config naming them
/// and whatever keeps them alive. They stay behind on the throwaway test servers; names never
/// collide.
pub struct Fresh<R, C: ?Sized> {
    pub it: R,
    pub config: Box<C>,
    _guard: Box<dyn std::any::Any + Send + Sync>,
}

impl<R, C: ?Sized> Fresh<R, C> {
    fn of(it: R, isolated: Isolated<C>) -> Self {
        Fresh {
            it,
            config: isolated.config,
            _guard: isolated.guard,
        }
    }

    /// The resource, its config, and what keeps the resources alive (keep it until the end),
    /// for a check that drops the resource and opens it again, as a restart would.
    pub fn into_parts(self) -> (R, Box<C>, Keep) {
        (self.it, self.config, Keep(self._guard))
    }
}

/// Keeps fresh resources alive while held ([`Fresh::into_parts`]).
pub struct Keep(#[allow(dead_code)] Box<dyn std::any::Any + Send + Sync>);

/// A fresh, isolated store of `plugin`.
pub async fn fresh_store(plugin: &StorePlugin) -> Result<Fresh<Arc<dyn Store>, dyn StoreConfig>> {
    let isolated = (plugin.isolated)("t")?;
    let it = isolated.config.open().await?;
    Ok(Fresh::of(it, isolated))
}

/// Fresh resources of the broker `plugin`, and a test client on them.
pub async fn fresh_broker(
    plugin: &BrokerPlugin,
) -> Result<Fresh<Arc<dyn TestClient>, dyn BrokerConfig>> {
    let isolated = (plugin.isolated)("t")?;
    let it = isolated.config.test_client().await?;
    Ok(Fresh::of(it, isolated))
}

#[cfg(test)]
mod tests {
    #[test]
    fn registry_lines_name_their_plugins() {
        for known in timer_stores::PLUGINS.0 {
            assert!(known.plugin.is_none_or(|p| p.kind == known.kind));
        }
        for known in timer_brokers::PLUGINS.0 {
            assert!(known.plugin.is_none_or(|p| p.kind == known.kind));
        }
    }
}
