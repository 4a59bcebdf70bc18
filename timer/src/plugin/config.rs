//! Plugin configs: the section type a plugin defines ([`Section`]), what every config tells of
//! itself ([`PluginConfig`]), the store and broker config traits, and reading a section as the
//! binary loaded it ([`ConfigSection`]).

use std::any::Any;
use std::fmt::Debug;
use std::sync::Arc;

use async_trait::async_trait;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::Serialize;

#[cfg(feature = "testing")]
use super::{Isolated, TestClient, TestServer};
use crate::broker::Broker;
use crate::config::EngineConfig;
use crate::error::{Error, Result};
use crate::store::Store;

/// What every plugin config tells of itself. Provided for every [`Section`] type; written by hand
/// only for a config that is more than its section (the memory broker's holds its hub).
pub trait PluginConfig: Debug + Send + Sync + 'static {
    /// `store.kind` / `broker.kind`.
    fn kind(&self) -> &'static str;
    /// The section as TOML would hold it, `kind` included (secrets too: redact before showing).
    fn to_value(&self) -> Result<serde_json::Value>;
    /// For a downcast to the plugin's own type (the memory broker's hub, a test's helpers).
    fn as_any(&self) -> &dyn Any;
}

/// A plugin's config section type. [`StorePlugin::of`](crate::plugin::StorePlugin::of) and
/// [`BrokerPlugin::of`](crate::plugin::BrokerPlugin::of) make the descriptor from it: `load`
/// parses the section and runs [`validate`](Section::validate);
/// `isolated` applies [`StoreConfig::isolated`] / [`BrokerConfig::isolated`] to
/// [`for_test_server`](Section::for_test_server). Its doc comments are the configuration
/// reference (`JsonSchema`): document every key there, for operators.
pub trait Section:
    Serialize + DeserializeOwned + JsonSchema + Default + Debug + Send + Sync + 'static
{
    /// `store.kind` / `broker.kind`, also the cargo feature and the folder name.
    const KIND: &'static str;
    /// The server its tests need; `None` when it runs in process or on a local file.
    #[cfg(feature = "testing")]
    const TEST_SERVER: Option<TestServer> = None;
    /// What can be checked without a server; `load` runs it.
    fn validate(&self) -> Result<()> {
        Ok(())
    }
    /// The config reaching the test server at `address` (before isolation); only called when
    /// there is a `TEST_SERVER`.
    #[cfg(feature = "testing")]
    fn for_test_server(_address: String) -> Self {
        Self::default()
    }
}

impl<C: Section> PluginConfig for C {
    fn kind(&self) -> &'static str {
        C::KIND
    }
    fn to_value(&self) -> Result<serde_json::Value> {
        let mut value = to_value(self)?;
        if let Some(section) = value.as_object_mut() {
            section.insert("kind".into(), C::KIND.into());
        }
        Ok(value)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A typed store config, as loaded by its plugin.
#[async_trait]
pub trait StoreConfig: PluginConfig {
    /// Rules that involve the engine settings; the default has none.
    fn check(&self, _engine: &EngineConfig) -> Result<()> {
        Ok(())
    }
    async fn open(&self) -> Result<Arc<dyn Store>>;
    /// A handle on the store that a running service has open, for tests and tools that read
    /// or write beside it (counting, playing another instance). Not for running an engine on:
    /// the default is [`open`](StoreConfig::open); a store that one service owns at a time
    /// (SQLite) opens it without taking it over.
    async fn attach(&self) -> Result<Arc<dyn Store>> {
        self.open().await
    }
    /// Whether the timers outlive the process: a store opened again from this config (after a
    /// restart, a crash) holds what the last one committed. `false` for a store in process
    /// memory. Every plugin says it (the conformance suite holds it to it).
    fn durable(&self) -> bool;
    /// Whether stores opened from this config share their timers, so several engines (as
    /// separate instances would) can run on one store; `false` for a store in process memory,
    /// and for one that a single service may open at a time (SQLite).
    fn shared(&self) -> bool {
        true
    }
    /// This config on fresh resources of the same server (a temp file, a new schema named
    /// `prefix`…); other settings kept. The bench runs on the configured server with it, and
    /// [`StorePlugin::isolated`](crate::plugin::StorePlugin::isolated) applies it to a config for
    /// the test server.
    #[cfg(feature = "testing")]
    fn isolated(&self, prefix: &str) -> Result<Isolated<dyn StoreConfig>>;
    /// Removes what an [`isolated`](crate::plugin::StorePlugin::isolated) run created (a bench
    /// schema); a no-op where nothing outlives the run.
    #[cfg(feature = "testing")]
    async fn clean_up(&self) -> Result<()> {
        Ok(())
    }
}

/// A typed broker config, as loaded by its plugin.
#[async_trait]
pub trait BrokerConfig: PluginConfig {
    /// Rules that involve the engine settings (a publish must end within half the lease).
    fn check(&self, _engine: &EngineConfig) -> Result<()> {
        Ok(())
    }
    async fn connect(&self) -> Result<Arc<dyn Broker>>;
    /// An independent client on the resources this config names: produces commands and reads
    /// events and dead letters as a real service would. Creates the resources first when they
    /// are missing, so commands can be sent before the service starts.
    #[cfg(feature = "testing")]
    async fn test_client(&self) -> Result<Arc<dyn TestClient>>;
    /// This config on fresh resources of the same server (streams, queues, topics, consumer
    /// group named after `prefix`); other settings kept. The bench runs on the configured
    /// server with it, and [`BrokerPlugin::isolated`](crate::plugin::BrokerPlugin::isolated)
    /// applies it to a config for the test server.
    #[cfg(feature = "testing")]
    fn isolated(&self, prefix: &str) -> Result<Isolated<dyn BrokerConfig>>;
    /// Removes what an [`isolated`](crate::plugin::BrokerPlugin::isolated) run created, where the
    /// server allows it safely; a no-op otherwise.
    #[cfg(feature = "testing")]
    async fn clean_up(&self) -> Result<()> {
        Ok(())
    }
}

/// A plugin's config section as the binary read it, with where each key came from.
pub struct ConfigSection<'a> {
    /// `store` or `broker`.
    pub name: &'a str,
    /// The section's keys and values (`kind` included); `Null` when the section is absent.
    pub value: serde_json::Value,
    /// Where a key (`store.url`) was set, as ` (in TOML file x.toml)`; empty when unknown.
    pub locate: &'a dyn Fn(&str) -> String,
}

impl ConfigSection<'_> {
    /// The section as `T`; keys left out take `T::default()`. An unknown key or a wrong value
    /// is a config error naming the key and where it was set.
    pub fn parse<T: DeserializeOwned + Default>(&self) -> Result<T> {
        if self.value.is_null() {
            return Ok(T::default());
        }
        serde_path_to_error::deserialize(&self.value).map_err(|e| {
            let inner = e.path().to_string();
            let key = if inner == "." {
                self.name.to_owned()
            } else {
                format!("{}.{inner}", self.name)
            };
            // The error may quote the value: a secret's is never printed.
            let problem = match key.rsplit('.').next() {
                Some(name) if crate::redact::is_secret_key(name) => {
                    crate::redact::NOT_SHOWN.to_owned()
                }
                _ => e.inner().to_string(),
            };
            Error::config(format!(
                "invalid configuration: {key}: {problem}{}",
                (self.locate)(&key)
            ))
        })
    }

    /// [`parse`](Self::parse) for the loader of plugin `kind`: a `kind` key in the section
    /// must name it.
    pub fn parse_as<T: DeserializeOwned + Default>(&self, kind: &str) -> Result<T> {
        match self.value.get("kind") {
            Some(given) if given.as_str() != Some(kind) => {
                let key = format!("{}.kind", self.name);
                Err(Error::config(format!(
                    "invalid configuration: {key} = {given}{}: the {kind} plugin cannot load it",
                    (self.locate)(&key)
                )))
            }
            _ => self.parse(),
        }
    }
}

/// A typed config as the value [`PluginConfig::to_value`] returns:
/// as TOML would hold it, so unset options (`None`, `null`) are left out.
pub fn to_value(config: &impl Serialize) -> Result<serde_json::Value> {
    let mut value = serde_json::to_value(config)
        .map_err(|e| Error::internal("cannot render a plugin config").with_source(e))?;
    drop_nulls(&mut value);
    Ok(value)
}

fn drop_nulls(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            map.retain(|_, v| !v.is_null());
            map.values_mut().for_each(drop_nulls);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(drop_nulls),
        _ => {}
    }
}
