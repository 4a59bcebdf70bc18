//! An independent RabbitMQ client on one config's topology, for tests: publishes commands with
//! confirms as a producing service would, and drains the events sink and the dead-letter queue.

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use futures::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};
use timer_core::plugin::{
    DelayedMessage, DelayedUntil, ReadDeadLetter, ReadEvent, ReadMessage, TestClient,
};
use timer_core::{Broker, Error, Result, Target};

use super::{
    bind_queue, connection, declare_queue, declare_sink, testing_targets, RabbitmqBroker,
    RabbitmqConfig, DELAY_HEADER, DELIVER_AT_HEADER, REASON_HEADER, TARGET_EXCHANGE_HEADER,
    TENANT_HEADER,
};

/// A channel with confirms, and the sink queue ([`declare_sink`]) that collects every event.
/// Drained messages are kept, so `events()` and `dead_letters()` return everything so far;
/// what arrives at the targets a consumer of their queue collects as it arrives.
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
    targeted: Arc<Mutex<Vec<(String, ReadMessage)>>>,
    /// Whether the consumer of the targets' queue runs.
    consuming: tokio::sync::Mutex<bool>,
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> Error {
    Error::unavailable(format!("rabbitmq test client: {what}: {e}"))
}

impl RabbitmqTestClient {
    /// Publishes one command to the commands queue as its producer (user id set), with
    /// `headers` if given; its confirm, not awaited.
    async fn publish_command(
        &self,
        body: &[u8],
        headers: Option<FieldTable>,
    ) -> Result<lapin::PublisherConfirm> {
        let mut properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_user_id(self.user.as_str().into());
        if let Some(headers) = headers {
            properties = properties.with_headers(headers);
        }
        self.channel
            .basic_publish(
                "".into(),
                self.config.commands_queue.as_str().into(),
                BasicPublishOptions::default(),
                body,
                properties,
            )
            .await
            .map_err(|e| unavailable("publish", e))
    }

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
            targeted: Arc::new(Mutex::new(Vec::new())),
            consuming: tokio::sync::Mutex::new(false),
        })
    }

    /// Starts (once) the consumer of the targets' queue, which stamps each message as it
    /// arrives: RabbitMQ stamps nothing itself.
    async fn consume_targets(&self) -> Result<()> {
        let mut started = self.consuming.lock().await;
        if *started {
            return Ok(());
        }
        let (_, queue) = testing_targets(&self.config);
        let channel = self
            ._connection
            .create_channel()
            .await
            .map_err(|e| unavailable("channel", e))?;
        let mut consumer = channel
            .basic_consume(
                queue.as_str().into(),
                "".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| unavailable("consuming the targets' queue", e))?;
        let targeted = self.targeted.clone();
        tokio::spawn(async move {
            // Ends with the connection (the client dropped).
            let _channel = channel;
            while let Some(Ok(delivery)) = consumer.next().await {
                let arrived_ms = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis() as i64)
                    .ok();
                let key = delivery.routing_key.to_string();
                let message = read_message(&delivery, arrived_ms);
                match targeted.lock() {
                    Ok(mut targeted) => targeted.push((key, message)),
                    Err(_) => return,
                }
            }
        });
        *started = true;
        Ok(())
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
    async fn send_command_with_headers(
        &self,
        body: &[u8],
        headers: &BTreeMap<String, String>,
    ) -> Result<()> {
        let mut table = FieldTable::default();
        for (name, value) in headers {
            table.insert(
                name.as_str().into(),
                AMQPValue::LongString(value.as_str().into()),
            );
        }
        let confirm = self.publish_command(body, Some(table)).await?;
        confirmed(vec![confirm]).await
    }
    async fn send_commands(&self, bodies: &[Vec<u8>]) -> Result<()> {
        for chunk in bodies.chunks(1_000) {
            let mut confirms = Vec::with_capacity(chunk.len());
            for body in chunk {
                confirms.push(self.publish_command(body, None).await?);
            }
            confirmed(confirms).await?;
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
                headers: headers_of(&m.delivery.properties),
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
        self.consume_targets().await?;
        fields.insert("exchange".into(), exchange.into());
        fields.insert("routingKey".into(), name.into());
        Ok(Some(Target::new(fields)))
    }
    async fn read_target(&self, target: &Target) -> Result<Vec<ReadMessage>> {
        let wanted = target.text("routingKey").unwrap_or_default();
        let targeted = self
            .targeted
            .lock()
            .map_err(|_| Error::internal("poisoned"))?;
        Ok(targeted
            .iter()
            .filter(|(key, _)| key == wanted)
            .map(|(_, m)| m.clone())
            .collect())
    }
    /// Publishes to `broker.delay_exchange` with confirms (the target's routing key, its
    /// exchange in `x-target-exchange`), a thousand awaiting their confirm at a time.
    async fn send_delayed(&self, messages: &[DelayedMessage]) -> Result<bool> {
        for chunk in messages.chunks(1_000) {
            let mut confirms = Vec::with_capacity(chunk.len());
            for m in chunk {
                let mut headers = FieldTable::default();
                for (name, value) in &m.headers {
                    headers.insert(name.as_str().into(), AMQPValue::LongString(value.as_str().into()));
                }
                let (name, ms) = match m.when {
                    DelayedUntil::DelayMs(ms) => (DELAY_HEADER, ms),
                    DelayedUntil::AtMs(ms) => (DELIVER_AT_HEADER, ms),
                };
                headers.insert(name.into(), AMQPValue::LongLongInt(ms));
                let exchange = m.target.text("exchange").unwrap_or_default();
                headers.insert(
                    TARGET_EXCHANGE_HEADER.into(),
                    AMQPValue::LongString(exchange.into()),
                );
                if let Some(tenant) = &m.tenant {
                    headers.insert(TENANT_HEADER.into(), AMQPValue::LongString(tenant.as_str().into()));
                }
                let mut properties = BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_headers(headers);
                if let Some(id) = &m.id {
                    properties = properties.with_message_id(id.as_str().into());
                }
                let routing_key = m.target.text("routingKey").unwrap_or_default();
                confirms.push(
                    self.channel
                        .basic_publish(
                            self.config.delay_exchange.as_str().into(),
                            routing_key.into(),
                            BasicPublishOptions::default(),
                            &m.body,
                            properties,
                        )
                        .await
                        .map_err(|e| unavailable("publish", e))?,
                );
            }
            confirmed(confirms).await?;
        }
        Ok(true)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Waits for every confirm; anything but a plain ack is an error.
async fn confirmed(confirms: Vec<lapin::PublisherConfirm>) -> Result<()> {
    for confirm in futures::future::join_all(confirms).await {
        match confirm.map_err(|e| unavailable("confirm", e))? {
            lapin::Confirmation::Ack(None) => {}
            other => return Err(unavailable("publish", format!("not confirmed: {other:?}"))),
        }
    }
    Ok(())
}

/// A message that arrived at a target, as the tests read it.
fn read_message(delivery: &lapin::message::Delivery, arrived_ms: Option<i64>) -> ReadMessage {
    let properties = &delivery.properties;
    ReadMessage {
        id: properties
            .message_id()
            .as_ref()
            .and_then(|id| uuid::Uuid::parse_str(id.as_str()).ok()),
        body: delivery.data.clone(),
        content_type: properties.content_type().as_ref().map(|c| c.to_string()),
        headers: headers_of(properties),
        key: Some(delivery.routing_key.as_str().as_bytes().to_vec()),
        arrived_ms,
    }
}

/// A message's headers: strings as they are, other values in their debug form.
fn headers_of(properties: &BasicProperties) -> BTreeMap<String, String> {
    properties
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
        .unwrap_or_default()
}
