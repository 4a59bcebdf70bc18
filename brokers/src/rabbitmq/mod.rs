//! `rabbitmq`: AMQP 0-9-1 (lapin). Commands come from a durable queue that every instance
//! consumes (competing consumers) and are acknowledged after the store committed them; events
//! are persistent messages on a topic exchange (routing key = tenant) with publisher confirms,
//! many in flight, counted only when every confirm arrived. After a lost connection the next
//! call connects again and declares the topology again; unacknowledged commands of the lost
//! connection are requeued by the broker.

mod config;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use futures::{FutureExt, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};

use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
};
use timer_core::broker::routing_token;
use timer_core::{Broker, Delivery, Error, OutboundEvent, Result};

pub use config::RabbitmqConfig;

/// Header carrying the reason of a dead letter.
pub const REASON_HEADER: &str = "x-timer-dead-letter-reason";

pub struct RabbitmqBroker {
    config: RabbitmqConfig,
    session: tokio::sync::Mutex<Option<Session>>,
    /// Delivered, not yet acknowledged: our tag → (session generation, AMQP delivery tag).
    pending: Mutex<HashMap<u64, (u64, u64)>>,
    next_tag: AtomicU64,
    generation: AtomicU64,
}

impl Drop for RabbitmqBroker {
    fn drop(&mut self) {
        // Close the connection, so the broker requeues what this connection left unacknowledged
        // at once (a dropped but open connection would keep it until the socket times out).
        if let Some(session) = self.session.get_mut().take() {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move {
                    let _ = session
                        .connection
                        .close(200, "timer-service closing".into())
                        .await;
                });
            }
        }
    }
}

struct Session {
    generation: u64,
    connection: Connection,
    consume: Channel,
    publish: Channel,
    consumer: lapin::Consumer,
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> Error {
    Error::unavailable(format!("rabbitmq broker: {what}: {e}"))
}

/// The URL without credentials, for messages.
fn redacted(url: &str) -> String {
    match url.split_once('@') {
        Some((scheme_and_user, host)) => {
            let scheme = scheme_and_user.split("://").next().unwrap_or("amqp");
            format!("{scheme}://***@{host}")
        }
        None => url.to_owned(),
    }
}

fn s(text: &str) -> ShortString {
    text.into()
}

impl RabbitmqBroker {
    /// Connects and declares the topology, so a wrong URL or a conflicting declaration fails
    /// at start-up with a clear error.
    pub async fn connect(config: &RabbitmqConfig) -> Result<Self> {
        let broker = RabbitmqBroker {
            config: config.clone(),
            session: tokio::sync::Mutex::new(None),
            pending: Mutex::new(HashMap::new()),
            next_tag: AtomicU64::new(1),
            generation: AtomicU64::new(0),
        };
        let session = broker.open().await?;
        *broker.session.lock().await = Some(session);
        Ok(broker)
    }

    async fn open(&self) -> Result<Session> {
        let c = &self.config;
        let connection = tokio::time::timeout(
            c.connect_timeout,
            Connection::connect(&c.url, ConnectionProperties::default()),
        )
        .await
        .map_err(|_| {
            Error::unavailable(format!(
                "rabbitmq broker: cannot connect to {}: no answer within {:?}",
                redacted(&c.url),
                c.connect_timeout
            ))
        })?
        .map_err(|e| {
            Error::unavailable(format!(
                "rabbitmq broker: cannot connect to {}: {e}",
                redacted(&c.url)
            ))
        })?;
        let consume = connection
            .create_channel()
            .await
            .map_err(|e| unavailable("opening a channel", e))?;
        declare(&consume, c).await?;
        consume
            .basic_qos(c.prefetch, BasicQosOptions::default())
            .await
            .map_err(|e| unavailable("setting the prefetch", e))?;
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        let consumer = consume
            .basic_consume(
                s(&c.commands_queue),
                s(&format!(
                    "timer-service-{}-{generation}",
                    std::process::id()
                )),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| unavailable(&format!("consuming queue {}", c.commands_queue), e))?;
        let publish = connection
            .create_channel()
            .await
            .map_err(|e| unavailable("opening a channel", e))?;
        publish
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| unavailable("enabling publisher confirms", e))?;
        Ok(Session {
            generation,
            connection,
            consume,
            publish,
            consumer,
        })
    }

    /// The live session, opening a new one when there is none.
    async fn session(&self) -> Result<tokio::sync::MutexGuard<'_, Option<Session>>> {
        let mut guard = self.session.lock().await;
        let alive = guard
            .as_ref()
            .is_some_and(|s| s.connection.status().connected());
        if !alive {
            *guard = None;
            *guard = Some(self.open().await?);
            tracing::info!("rabbitmq broker: connected");
        }
        Ok(guard)
    }

    fn remember(&self, generation: u64, delivery: lapin::message::Delivery) -> Result<Delivery> {
        let tag = self.next_tag.fetch_add(1, Ordering::Relaxed);
        self.pending
            .lock()
            .map_err(|_| Error::internal("rabbitmq broker: pending map poisoned"))?
            .insert(tag, (generation, delivery.delivery_tag));
        Ok(Delivery {
            tag,
            body: delivery.data,
        })
    }
}

/// Deletes the queues and exchanges of `config` (benchmarks and tests clean up with it).
pub async fn delete_topology(config: &RabbitmqConfig) -> Result<()> {
    use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
    let connection = Connection::connect(&config.url, ConnectionProperties::default())
        .await
        .map_err(|e| unavailable("connecting", e))?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| unavailable("opening a channel", e))?;
    for queue in [&config.commands_queue, &config.dead_letter_queue] {
        channel
            .queue_delete(s(queue), QueueDeleteOptions::default())
            .await
            .map_err(|e| unavailable(&format!("deleting queue {queue}"), e))?;
    }
    for exchange in [&config.events_exchange, &config.dead_letter_exchange] {
        channel
            .exchange_delete(s(exchange), ExchangeDeleteOptions::default())
            .await
            .map_err(|e| unavailable(&format!("deleting exchange {exchange}"), e))?;
    }
    let _ = connection.close(200, "done".into()).await;
    Ok(())
}

/// Durable command queue, durable topic exchange for events, durable fanout exchange and queue
/// for dead letters. Declaring what exists with the same settings is a no-op; with other
/// settings the broker refuses and the error says so.
async fn declare(channel: &Channel, c: &RabbitmqConfig) -> Result<()> {
    let durable_queue = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let durable_exchange = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel
        .queue_declare(s(&c.commands_queue), durable_queue, FieldTable::default())
        .await
        .map_err(|e| unavailable(&format!("declaring queue {}", c.commands_queue), e))?;
    channel
        .exchange_declare(
            s(&c.events_exchange),
            ExchangeKind::Topic,
            durable_exchange,
            FieldTable::default(),
        )
        .await
        .map_err(|e| unavailable(&format!("declaring exchange {}", c.events_exchange), e))?;
    channel
        .exchange_declare(
            s(&c.dead_letter_exchange),
            ExchangeKind::Fanout,
            durable_exchange,
            FieldTable::default(),
        )
        .await
        .map_err(|e| unavailable(&format!("declaring exchange {}", c.dead_letter_exchange), e))?;
    channel
        .queue_declare(
            s(&c.dead_letter_queue),
            durable_queue,
            FieldTable::default(),
        )
        .await
        .map_err(|e| unavailable(&format!("declaring queue {}", c.dead_letter_queue), e))?;
    channel
        .queue_bind(
            s(&c.dead_letter_queue),
            s(&c.dead_letter_exchange),
            s(""),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| unavailable("binding the dead-letter queue", e))
}

/// Waits for every publisher confirm; a nack or a lost channel is an error.
async fn confirmed(confirms: Vec<lapin::PublisherConfirm>) -> Result<()> {
    for result in futures::future::join_all(confirms).await {
        match result.map_err(|e| unavailable("awaiting a publisher confirm", e))? {
            Confirmation::Ack(_) | Confirmation::NotRequested => {}
            Confirmation::Nack(_) => {
                return Err(Error::unavailable(
                    "rabbitmq broker: the broker nacked a publish",
                ))
            }
        }
    }
    Ok(())
}

#[async_trait]
impl Broker for RabbitmqBroker {
    fn name(&self) -> &'static str {
        "rabbitmq"
    }

    async fn receive(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>> {
        let mut guard = self.session().await?;
        let Some(session) = guard.as_mut() else {
            return Ok(Vec::new());
        };
        let generation = session.generation;
        let first = match tokio::time::timeout(wait, session.consumer.next()).await {
            Err(_) => return Ok(Vec::new()),
            Ok(Some(Ok(delivery))) => delivery,
            Ok(Some(Err(e))) => {
                *guard = None;
                return Err(unavailable("reading commands", e));
            }
            Ok(None) => {
                *guard = None;
                return Err(Error::unavailable(
                    "rabbitmq broker: the consumer was cancelled",
                ));
            }
        };
        let mut out = vec![self.remember(generation, first)?];
        while out.len() < max {
            match session.consumer.next().now_or_never() {
                Some(Some(Ok(delivery))) => out.push(self.remember(generation, delivery)?),
                Some(Some(Err(e))) => {
                    tracing::warn!(error = %e, "rabbitmq broker: consumer error; reconnecting");
                    *guard = None;
                    break;
                }
                _ => break,
            }
        }
        Ok(out)
    }

    async fn ack(&self, tags: &[u64]) -> Result<()> {
        let deliveries: Vec<(u64, u64)> = {
            let mut pending = self
                .pending
                .lock()
                .map_err(|_| Error::internal("rabbitmq broker: pending map poisoned"))?;
            tags.iter().filter_map(|t| pending.remove(t)).collect()
        };
        let guard = self.session.lock().await;
        let Some(session) = guard.as_ref() else {
            // The connection they came on is gone; the broker requeued them already.
            return Ok(());
        };
        for (generation, delivery_tag) in deliveries {
            if generation != session.generation {
                continue; // delivered on a lost connection: requeued by the broker
            }
            session
                .consume
                .basic_ack(delivery_tag, BasicAckOptions::default())
                .await
                .map_err(|e| unavailable("acknowledging a command", e))?;
        }
        Ok(())
    }

    async fn publish(&self, events: &[OutboundEvent]) -> Result<()> {
        let mut guard = self.session().await?;
        let Some(session) = guard.as_ref() else {
            return Err(Error::unavailable("rabbitmq broker: not connected"));
        };
        let mut confirms = Vec::with_capacity(events.len());
        let mut failed = None;
        for event in events {
            let properties = BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type(s("application/json"))
                .with_message_id(s(&event.id.to_string()))
                .with_type(s("DueTimeReached"));
            match session
                .publish
                .basic_publish(
                    s(&self.config.events_exchange),
                    s(&routing_token(&event.key.tenant_id)),
                    BasicPublishOptions::default(),
                    &event.body,
                    properties,
                )
                .await
            {
                Ok(confirm) => confirms.push(confirm),
                Err(e) => {
                    failed = Some(unavailable("publishing an event", e));
                    break;
                }
            }
        }
        let result = match failed {
            Some(e) => Err(e),
            None => confirmed(confirms).await,
        };
        if result.is_err() {
            *guard = None; // reconnect on the next call
        }
        result
    }

    async fn dead_letter(&self, body: &[u8], reason: &str) -> Result<()> {
        let guard = self.session().await?;
        let Some(session) = guard.as_ref() else {
            return Err(Error::unavailable("rabbitmq broker: not connected"));
        };
        let mut headers = FieldTable::default();
        headers.insert(s(REASON_HEADER), AMQPValue::LongString(reason.into()));
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(headers);
        let confirm = session
            .publish
            .basic_publish(
                s(&self.config.dead_letter_exchange),
                s(""),
                BasicPublishOptions::default(),
                body,
                properties,
            )
            .await
            .map_err(|e| unavailable("publishing a dead letter", e))?;
        confirmed(vec![confirm]).await
    }

    async fn health(&self) -> Result<()> {
        self.session().await.map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_credentials_in_messages() {
        assert_eq!(
            redacted("amqp://u:p@host:5672/%2f"),
            "amqp://***@host:5672/%2f"
        );
        assert_eq!(redacted("amqp://host"), "amqp://host");
    }
}
