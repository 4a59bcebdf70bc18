//! The `memory` plugin descriptor. Its loaded config owns the [`MemoryHub`]: every connect,
//! test client and the binary's HTTP API (which feeds commands in and shows dead letters) share
//! that one in-process broker.

use std::any::Any;
use std::sync::Arc;

use async_trait::async_trait;
use timer_core::plugin::{BrokerConfig, BrokerPlugin, ConfigSection, PluginConfig, Section};
#[cfg(feature = "testing")]
use timer_core::plugin::{Isolated, ReadDeadLetter, ReadEvent, ReadMessage, TestClient};
use timer_core::{Broker, Result};
#[cfg(feature = "testing")]
use std::collections::BTreeMap;
#[cfg(feature = "testing")]
use timer_core::{Target, TraceHeaders};

use super::{MemoryConfig, MemoryHub};

/// Written out, not [`BrokerPlugin::of`]: the loaded config is a [`HubConfig`], more than its
/// section.
pub const PLUGIN: BrokerPlugin = BrokerPlugin {
    kind: MemoryConfig::KIND,
    load,
    #[cfg(feature = "testing")]
    test_server: None,
    #[cfg(feature = "testing")]
    isolated,
    schema: || schemars::schema_for!(MemoryConfig),
};

fn load(section: &ConfigSection) -> Result<Box<dyn BrokerConfig>> {
    let config: MemoryConfig = section.parse_as(PLUGIN.kind)?;
    Ok(Box::new(HubConfig::new(config)))
}

impl Section for MemoryConfig {
    const KIND: &'static str = "memory";
}

#[cfg(feature = "testing")]
fn isolated(_prefix: &str) -> Result<Isolated<dyn BrokerConfig>> {
    // Redelivery within a check's patience, as the NATS test config has it.
    let config = MemoryConfig {
        ack_wait: std::time::Duration::from_secs(2),
        ..MemoryConfig::default()
    };
    Ok(Isolated::new(Box::new(HubConfig::new(config))))
}

/// The loaded `memory` config: the settings, and the hub made from them.
#[derive(Clone)]
pub struct HubConfig {
    pub config: MemoryConfig,
    pub hub: MemoryHub,
}

impl HubConfig {
    pub fn new(config: MemoryConfig) -> Self {
        HubConfig {
            hub: MemoryHub::new(config.clone()),
            config,
        }
    }
}

impl std::fmt::Debug for HubConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.config.fmt(f)
    }
}

impl PluginConfig for HubConfig {
    fn kind(&self) -> &'static str {
        PLUGIN.kind
    }
    fn to_value(&self) -> Result<serde_json::Value> {
        self.config.to_value()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[async_trait]
impl BrokerConfig for HubConfig {
    async fn connect(&self) -> Result<Arc<dyn Broker>> {
        Ok(Arc::new(self.hub.connect()))
    }
    #[cfg(feature = "testing")]
    async fn test_client(&self) -> Result<Arc<dyn TestClient>> {
        Ok(Arc::new(MemoryTestClient {
            hub: self.hub.clone(),
        }))
    }
    /// A hub of its own.
    #[cfg(feature = "testing")]
    fn isolated(&self, _prefix: &str) -> Result<Isolated<dyn BrokerConfig>> {
        Ok(Isolated::new(Box::new(HubConfig::new(self.config.clone()))))
    }
}

/// A producer and reader on a hub, as the tests use it.
#[cfg(feature = "testing")]
pub struct MemoryTestClient {
    pub hub: MemoryHub,
}

#[cfg(feature = "testing")]
#[async_trait]
impl TestClient for MemoryTestClient {
    async fn connect(&self) -> Result<Box<dyn Broker>> {
        Ok(Box::new(self.hub.connect()))
    }
    async fn send_command(&self, body: &[u8]) -> Result<()> {
        self.hub.send_command(body)
    }
    async fn send_command_with_headers(
        &self,
        body: &[u8],
        headers: &BTreeMap<String, String>,
    ) -> Result<()> {
        let trace =
            TraceHeaders::from_pairs(headers.iter().map(|(n, v)| (n.as_str(), v.as_str())));
        self.hub.send_traced(body, trace)
    }
    async fn events(&self) -> Result<Vec<ReadEvent>> {
        let read = |e: super::PublishedEvent| ReadEvent {
            id: e.id,
            body: e.body,
            headers: e.headers,
        };
        let events = self.hub.events()?.into_iter();
        Ok(events.filter(|e| e.queue.is_none()).map(read).collect())
    }
    async fn make_target(&self, name: &str) -> Result<Option<Target>> {
        let mut fields = serde_json::Map::new();
        fields.insert("queue".into(), name.into());
        Ok(Some(Target::new(fields)))
    }
    async fn read_target(&self, target: &Target) -> Result<Vec<ReadMessage>> {
        let queue = target.text("queue");
        let read = |e: super::PublishedEvent| {
            let meta = e.message.unwrap_or_default();
            let mut headers = meta.headers;
            headers.extend(e.headers);
            ReadMessage {
                id: Some(e.id),
                body: e.body,
                content_type: meta.content_type,
                headers,
                key: None,
                arrived_ms: None,
            }
        };
        let events = self.hub.events()?.into_iter();
        Ok(events.filter(|e| e.queue.as_deref() == queue).map(read).collect())
    }
    async fn dead_letters(&self) -> Result<Vec<ReadDeadLetter>> {
        let read = |d: super::DeadLetter| ReadDeadLetter {
            body: d.body.into_bytes(),
            reason: d.reason,
        };
        Ok(self.hub.dead_letters()?.into_iter().map(read).collect())
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
