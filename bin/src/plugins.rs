//! Plugin assembly: the configured broker, and the memory broker's hub the HTTP API uses.

use std::sync::Arc;

use timer_brokers::memory::{HubConfig, MemoryHub};
use timer_core::plugin::BrokerConfig;
use timer_core::{Broker, Result};

/// The broker, plus the in-process hub when it is the memory broker (the HTTP API can feed
/// commands into it and show its dead letters).
pub async fn broker(config: &dyn BrokerConfig) -> Result<(Arc<dyn Broker>, Option<MemoryHub>)> {
    Ok((config.connect().await?, memory_hub(config)))
}

/// The hub of the memory broker; `None` for any other broker.
pub fn memory_hub(config: &dyn BrokerConfig) -> Option<MemoryHub> {
    config
        .as_any()
        .downcast_ref::<HubConfig>()
        .map(|c| c.hub.clone())
}
