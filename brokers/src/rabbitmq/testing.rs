//! An independent RabbitMQ client on one config's topology, for tests: publishes commands with
//! confirms as a producing service would, and drains the events sink and the dead-letter queue.

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::Mutex;

use async_trait::async_trait;
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};
use timer_core::plugin::{ReadDeadLetter, ReadEvent, ReadMessage, TestClient};
use timer_core::{Broker, Error, Result, Target};

use super::{
    bind_queue, connection, declare_queue, declare_sink, testing_targets, RabbitmqBroker,
    RabbitmqConfig, REASON_HEADER,
};

/// A channel with confirms, and the sink queue ([`declare_sink`]) that collects every event.
/// Drained messages are kept, so `events()` and `dead_letters()` return everything so far.
pub struct RabbitmqTestClient {
    pub config: RabbitmqConfig,
    _connection: Connection,
    channel: Channel,
    /// The user of `config.url`: commands carry it as their `user-id` (RabbitMQ checks it),
    /// which `broker.bind_tenant` reads as their tenant.
    user: String,
    events_queue: String,
    events: Mutex<Vec<ReadEvent>>,
    dead: Mutex<Vec<ReadDeadLetter>>,
    /// What arrived at the targets so far ([`TestClient::make_target`]), with its routing key.
    targeted: Mutex<Vec<(String, ReadMessage)>>,
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> Error {
    Error::unavailable(format!("rabbitmq test client: {what}: {e}"))
}

impl RabbitmqTestClient {
    /// Declares the topology and the events sink, so commands can be sent (and events are
    /// routable) before a connect.
    pub async fn new(config: RabbitmqConfig) -> Result<Self> {
        let events_queue = declare_sink(&config).await?;
        let connection = connection(&config).await?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| unavailable("channel", e))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| unavailable("confirms", e))?;
        let user = config
            .url
            .parse::<lapin::uri::AMQPUri>()
            .map(|uri| uri.authority.userinfo.username)
            .map_err(|e| unavailable("the URL", e))?;
        Ok(RabbitmqTestClient {
            config,
            _connection: connection,
            channel,
            user,
            events_queue,
            events: Mutex::new(Vec::new()),
            dead: Mutex::new(Vec::new()),
            targeted: Mutex::new(Vec::new()),
        })
    }

    /// Takes every message waiting in `queue`.
    pub async fn drain(&self, queue: &str) -> Result<Vec<lapin::message::BasicGetMessage>> {
        let mut out = Vec::new();
        while let Some(message) = self
            .channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .map_err(|e| unavailable("basic.get", e))?
        {
            out.push(message);
        }
        Ok(out)
    }
}

#[async_trait]
impl TestClient for RabbitmqTestClient {
    async fn connect(&self) -> Result<Box<dyn Broker>> {
        Ok(Box::new(RabbitmqBroker::connect(&self.config).await?))
    }
    async fn send_command(&self, body: &[u8]) -> Result<()> {
        self.send_commands(&[body.to_vec()]).await
    }
    async fn send_commands(&self, bodies: &[Vec<u8>]) -> Result<()> {
        for chunk in bodies.chunks(1_000) {
            let mut confirms = Vec::with_capacity(chunk.len());
            for body in chunk {
                confirms.push(
                    self.channel
                        .basic_publish(
                            "".into(),
                            self.config.commands_queue.as_str().into(),
                            BasicPublishOptions::default(),
                            body,
                            BasicProperties::default()
                                .with_delivery_mode(2)
                                .with_user_id(self.user.as_str().into()),
                        )
                        .await
                        .map_err(|e| unavailable("publish", e))?,
                );
            }
            for confirm in futures::future::join_all(confirms).await {
                match confirm.map_err(|e| unavailable("confirm", e))? {
                    lapin::Confirmation::Ack(None) => {}
                    other => {
                        return Err(unavailable("publish", format!("not confirmed: {other:?}")))
                    }
                }
            }
        }
        Ok(())
    }
    async fn events(&self) -> Result<Vec<ReadEvent>> {
        let new = self.drain(&self.events_queue).await?;
        let mut events = self
            .events
            .lock()
            .map_err(|_| Error::internal("poisoned"))?;
        for m in new {
            let id = m
                .delivery
                .properties
                .message_id()
                .as_ref()
                .and_then(|id| uuid::Uuid::parse_str(id.as_str()).ok())
                .ok_or_else(|| Error::internal("event without a message_id"))?;
            events.push(ReadEvent {
                id,
                body: m.delivery.data,
            });
        }
        Ok(events.clone())
    }
    async fn dead_letters(&self) -> Result<Vec<ReadDeadLetter>> {
        let new = self.drain(&self.config.dead_letter_queue).await?;
        let mut dead = self.dead.lock().map_err(|_| Error::internal("poisoned"))?;
        for m in new {
            let reason = m
                .delivery
                .properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get(REASON_HEADER).cloned())
                .map(|v| match v {
                    AMQPValue::LongString(s) => s.to_string(),
                    other => format!("{other:?}"),
                })
                .unwrap_or_default();
            dead.push(ReadDeadLetter {
                body: m.delivery.data,
                reason,
            });
        }
        Ok(dead.clone())
    }
    /// A routing key on a topic exchange of the test client, whose queue takes every key.
    async fn make_target(&self, name: &str) -> Result<Option<Target>> {
        let (exchange, queue) = testing_targets(&self.config);
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        self.channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                durable,
                FieldTable::default(),
            )
            .await
            .map_err(|e| unavailable("declaring the targets exchange", e))?;
        declare_queue(&self.channel, &queue).await?;
        bind_queue(&self.channel, &queue, &exchange, "#").await?;
        let mut fields = serde_json::Map::new();
        fields.insert("exchange".into(), exchange.into());
        fields.insert("routingKey".into(), name.into());
        Ok(Some(Target::new(fields)))
    }
    async fn read_target(&self, target: &Target) -> Result<Vec<ReadMessage>> {
        let (_, queue) = testing_targets(&self.config);
        let new = self.drain(&queue).await?;
        let mut targeted = self
            .targeted
            .lock()
            .map_err(|_| Error::internal("poisoned"))?;
        for m in new {
            let properties = &m.delivery.properties;
            let headers: BTreeMap<String, String> = properties
                .headers()
                .as_ref()
                .map(|h| {
                    h.inner()
                        .iter()
                        .map(|(name, value)| {
                            let value = match value {
                                AMQPValue::LongString(s) => s.to_string(),
                                other => format!("{other:?}"),
                            };
                            (name.to_string(), value)
                        })
                        .collect()
                })
                .unwrap_or_default();
            let key = m.delivery.routing_key.to_string();
            targeted.push((
                key.clone(),
                ReadMessage {
                    id: properties
                        .message_id()
                        .as_ref()
                        .and_then(|id| uuid::Uuid::parse_str(id.as_str()).ok()),
                    body: m.delivery.data,
                    content_type: properties.content_type().as_ref().map(|c| c.to_string()),
                    headers,
                    key: Some(key.into_bytes()),
                },
            ));
        }
        let wanted = target.text("routingKey").unwrap_or_default();
        Ok(targeted
            .iter()
            .filter(|(key, _)| key == wanted)
            .map(|(_, m)| m.clone())
            .collect())
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
