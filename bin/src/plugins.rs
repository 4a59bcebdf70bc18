//! Plugin assembly: the configured broker, the memory broker's hub the HTTP API uses, and the
//! caller of HTTP targets.

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

/// The engine with the caller of HTTP targets (`[webhooks]`), in a build that has it.
pub fn with_caller(
    engine: timer_core::Engine,
    config: &crate::config::Config,
) -> Result<timer_core::Engine> {
    #[cfg(feature = "webhook")]
    {
        let webhooks = timer_brokers::webhook::Webhooks::new(config.webhooks.clone())?;
        engine.with_caller(Arc::new(webhooks))
    }
    #[cfg(not(feature = "webhook"))]
    {
        let _ = config;
        Ok(engine)
    }
}

/// [`with_caller`], allowed to call private addresses such as 127.0.0.1 (the bench's receiver);
/// an error in a build without webhooks.
pub fn with_loopback_caller(
    engine: timer_core::Engine,
    config: &crate::config::Config,
) -> Result<timer_core::Engine> {
    #[cfg(feature = "webhook")]
    {
        let webhooks =
            timer_brokers::webhook::Webhooks::new(timer_brokers::webhook::WebhookConfig {
                allow_private_networks: true,
                ..config.webhooks.clone()
            })?;
        engine.with_caller(Arc::new(webhooks))
    }
    #[cfg(not(feature = "webhook"))]
    {
        let _ = (engine, config);
        Err(timer_core::Error::config(
            "this build has no HTTP targets (cargo feature webhook)",
        ))
    }
}
