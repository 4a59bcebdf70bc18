//! `rabbitmq`: AMQP 0-9-1 (lapin). Commands come from a durable queue that every instance
//! consumes (competing consumers) and are acknowledged after the store committed them; events
//! are persistent messages on a topic exchange (routing key = tenant) with publisher confirms,
//! many in flight, counted only when every confirm arrived. After a lost connection the next
//! call connects again and declares the topology again; unacknowledged commands of the lost
//! connection are requeued by the broker.
//!
//! The rest is the plugin's page of the book (`README.md` beside this file).
#![doc = include_str!("README.md")]

mod config;
mod delay;
mod outbound;
mod plugin;
#[cfg(feature = "testing")]
mod testing;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
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
use timer_core::redact::hide_userinfo;
use timer_core::{
    Broker, Delivery, Error, KeyLimit, MessageMeta, OutboundEvent, Result, Target, TimerKey,
    Undelivered,
};

use crate::shared::{DeliveryTags, Lookups, Unusable, LOOKUP_TTL, MISSING_TTL};
use outbound::{check_exchange, properties_of, routing_key, target_route, trace_of};

pub use config::RabbitmqConfig;
pub use delay::{DELAY_HEADER, DELIVER_AT_HEADER, TARGET_EXCHANGE_HEADER, TENANT_HEADER};
pub use plugin::PLUGIN;
#[cfg(feature = "testing")]
pub use plugin::TEST_SERVER;
#[cfg(feature = "testing")]
pub use testing::RabbitmqTestClient;

/// Header carrying the reason of a dead letter.
pub const REASON_HEADER: &str = "x-timer-dead-letter-reason";

pub struct RabbitmqBroker {
    config: RabbitmqConfig,
    /// The live connection and its channels; locked to read it, or to replace it (which waits
    /// for the reconnect), never while waiting for commands, so publishing never waits behind
    /// a receive.
    session: tokio::sync::Mutex<Option<Arc<Session>>>,
    /// The consumer of the current session (its generation); only `receive` waits on it.
    consumer: tokio::sync::Mutex<Option<(u64, lapin::Consumer)>>,
    /// Delivered, not yet acknowledged: (session generation, AMQP delivery tag).
    pending: DeliveryTags<(u64, u64)>,
    /// Target exchanges looked up: `None` when declared, else why not.
    exchanges: Lookups<Option<String>>,
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
}

fn unavailable(what: &str, e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Error {
    Error::unavailable(format!("rabbitmq broker: {what}")).with_source(e)
}

async fn open_channel(connection: &Connection) -> Result<Channel> {
    connection
        .create_channel()
        .await
        .map_err(|e| unavailable("opening a channel", e))
}

/// AMQP's short strings (names, routing keys, property values) hold at most 255 bytes.
const MAX_SHORT_STRING: usize = 255;

/// How long a receive goes on taking deliveries after its first: what a lone command's ingest
/// waits more, and what lets a backlog be read in batches.
const BATCH_GATHER: Duration = Duration::from_millis(1);

/// `text` as an AMQP short string; `what` names it in the error when it is longer than
/// [`MAX_SHORT_STRING`] bytes (lapin's `From` would panic).
fn s(what: &str, text: &str) -> Result<ShortString> {
    ShortString::try_new(text).map_err(|e| {
        Error::invalid(format!(
            "rabbitmq broker: {what} is {} bytes; AMQP allows at most {MAX_SHORT_STRING}",
            text.len()
        ))
        .with_source(e)
    })
}

async fn connection(config: &RabbitmqConfig) -> Result<Connection> {
    // A CA of one's own for amqps, besides the webpki roots compiled in.
    let tls = match &config.tls_root_cert {
        Some(path) => lapin::tcp::OwnedTLSConfig {
            identity: None,
            cert_chain: Some(std::fs::read_to_string(path).map_err(|e| {
                Error::config(format!(
                    "broker.tls_root_cert {}: cannot read it",
                    path.display()
                ))
                .with_source(e)
            })?),
        },
        None => lapin::tcp::OwnedTLSConfig::default(),
    };
    let runtime = lapin::runtime::default_runtime()
        .map_err(|e| Error::internal("rabbitmq broker: no async runtime").with_source(e))?;
    tokio::time::timeout(
        config.connect_timeout,
        Connection::connect_with_config(&config.url, ConnectionProperties::default(), tls, runtime),
    )
    .await
    .map_err(|_| {
        Error::unavailable(format!(
            "rabbitmq broker: cannot connect to {}: no answer within {:?}",
            hide_userinfo(&config.url),
            config.connect_timeout
        ))
    })?
    .map_err(|e| {
        unavailable(
            &format!("cannot connect to {}", hide_userinfo(&config.url)),
            e,
        )
    })
}

impl RabbitmqBroker {
    /// Connects and declares the topology, so a wrong URL or a conflicting declaration fails
    /// at start-up with a clear error.
    pub async fn connect(config: &RabbitmqConfig) -> Result<Self> {
        let broker = RabbitmqBroker {
            config: config.clone(),
            session: tokio::sync::Mutex::new(None),
            consumer: tokio::sync::Mutex::new(None),
            pending: DeliveryTags::new("rabbitmq"),
            exchanges: Lookups::new(),
            generation: AtomicU64::new(0),
        };
        broker.session().await?;
        Ok(broker)
    }

    async fn open(&self) -> Result<Session> {
        let c = &self.config;
        let connection = connection(c).await?;
        let consume = open_channel(&connection).await?;
        declare(&consume, c).await?;
        consume
            .basic_qos(c.prefetch, BasicQosOptions::default())
            .await
            .map_err(|e| unavailable("setting the prefetch", e))?;
        let publish = open_channel(&connection).await?;
        publish
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| unavailable("enabling publisher confirms", e))?;
        Ok(Session {
            generation: self.generation.fetch_add(1, Ordering::SeqCst) + 1,
            connection,
            consume,
            publish,
        })
    }

    /// The live session, opening a new one when there is none or it broke.
    async fn session(&self) -> Result<Arc<Session>> {
        let mut guard = self.session.lock().await;
        if let Some(session) = guard.as_ref() {
            if session.connection.status().connected() {
                return Ok(session.clone());
            }
        }
        *guard = None;
        let session = Arc::new(self.open().await?);
        tracing::info!(
            generation = session.generation,
            "rabbitmq broker: connected"
        );
        *guard = Some(session.clone());
        Ok(session)
    }

    /// Drops `session` (if it is still the current one), so the next call reconnects.
    async fn discard(&self, session: &Session) {
        let mut guard = self.session.lock().await;
        if guard
            .as_ref()
            .is_some_and(|s| s.generation == session.generation)
        {
            *guard = None;
        }
    }

    fn remember(&self, generation: u64, delivery: lapin::message::Delivery) -> Result<Delivery> {
        // The user-id RabbitMQ checked against the publishing connection's user.
        let tenant = self.config.bind_tenant.then(|| {
            let user = delivery.properties.user_id().as_ref();
            user.map_or_else(String::new, |u| u.as_str().to_owned())
        });
        let trace = trace_of(&delivery.properties);
        // A message of the delay exchange is the ScheduleTimer it stands for.
        let body = if delivery.exchange.as_str() == self.config.delay_exchange {
            delay::command_of(&delivery, &self.config.delay_tenant)
        } else {
            delivery.data
        };
        self.pending
            .remember((generation, delivery.delivery_tag), body, tenant, trace)
    }

    /// The target exchanges of `events` that cannot be published to, with the server's reason.
    /// A publish to an exchange that does not exist closes the channel, and would fail every
    /// other event of the batch with it: each one named is checked first (a passive declare on
    /// a channel of its own; remembered for a while, [`Lookups::known`]), and the events for
    /// one that is missing are refused alone (those not looked up in this publish left for a later one).
    async fn missing_exchanges(
        &self,
        session: &Session,
        events: &[OutboundEvent],
    ) -> Result<Vec<(String, Unusable)>> {
        // Routes it may publish to only: another is refused alone, without a lookup.
        let named: Vec<(&str, &str)> = events
            .iter()
            .filter_map(|e| {
                let (exchange, _) = target_route(e.target.as_ref()?, &self.config).ok()?;
                (!exchange.is_empty()).then_some((e.key.tenant_id.as_str(), exchange))
            })
            .collect();
        let known = self
            .exchanges
            .known(named, |exchange| {
                let exchange = exchange.to_owned();
                async move {
                    let missing = check_exchange(session, &exchange).await?;
                    let ttl = if missing.is_some() { MISSING_TTL } else { LOOKUP_TTL };
                    Ok((missing, ttl))
                }
            })
            .await?;
        let mut missing: Vec<(String, Unusable)> = known
            .found
            .into_iter()
            .filter_map(|(exchange, why)| Some((exchange.to_owned(), Unusable::Refused(why?))))
            .collect();
        missing.extend(
            known
                .later
                .into_iter()
                .map(|e| (e.to_owned(), Unusable::NotLookedUp)),
        );
        Ok(missing)
    }


    /// Publishes on the confirm channel with `mandatory`, so an event no queue would take comes
    /// back instead of vanishing.
    async fn publish_one(
        &self,
        session: &Session,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<lapin::PublisherConfirm> {
        session
            .publish
            .basic_publish(
                s("the exchange name", exchange)?,
                s("the routing key", routing_key)?,
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body,
                properties,
            )
            .await
            .map_err(|e| unavailable(&format!("publishing to exchange {exchange}"), e))
    }
}

/// The exchange the test client makes its targets on, and the queue bound to it for every
/// routing key (`#`).
fn testing_targets(config: &RabbitmqConfig) -> (String, String) {
    let exchange = format!("{}.targets", config.events_exchange);
    let queue = format!("{exchange}.all");
    (exchange, queue)
}

/// The name of the queue [`declare_sink`] binds.
pub fn sink_queue(config: &RabbitmqConfig) -> String {
    format!("{}.sink", config.events_exchange)
}

/// Declares the events exchange and a durable queue bound to it for every routing key (`#`),
/// so events have somewhere to go (benchmarks and tests; consumers bind their own queues).
pub async fn declare_sink(config: &RabbitmqConfig) -> Result<String> {
    let connection = connection(config).await?;
    let channel = open_channel(&connection).await?;
    declare(&channel, config).await?;
    let queue = sink_queue(config);
    declare_queue(&channel, &queue).await?;
    bind_queue(&channel, &queue, &config.events_exchange, "#").await?;
    let _ = connection.close(200, "done".into()).await;
    Ok(queue)
}

/// Deletes the queues (the sink of [`declare_sink`] too) and exchanges of `config`
/// (benchmarks and tests clean up with it).
pub async fn delete_topology(config: &RabbitmqConfig) -> Result<()> {
    use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
    let connection = connection(config).await?;
    let channel = open_channel(&connection).await?;
    for queue in [
        &config.commands_queue,
        &config.dead_letter_queue,
        &sink_queue(config),
    ] {
        channel
            .queue_delete(s("a queue name", queue)?, QueueDeleteOptions::default())
            .await
            .map_err(|e| unavailable(&format!("deleting queue {queue}"), e))?;
    }
    let (targets_exchange, targets_queue) = testing_targets(config);
    channel
        .queue_delete(s("a queue name", &targets_queue)?, QueueDeleteOptions::default())
        .await
        .map_err(|e| unavailable(&format!("deleting queue {targets_queue}"), e))?;
    for exchange in [
        &config.events_exchange,
        &config.dead_letter_exchange,
        &config.delay_exchange,
        &targets_exchange,
    ] {
        channel
            .exchange_delete(s("an exchange name", exchange)?, ExchangeDeleteOptions::default())
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
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    declare_queue(channel, &c.commands_queue).await?;
    for (exchange, kind) in [
        (&c.events_exchange, ExchangeKind::Topic),
        (&c.dead_letter_exchange, ExchangeKind::Fanout),
    ] {
        channel
            .exchange_declare(s("an exchange name", exchange)?, kind, durable, FieldTable::default())
            .await
            .map_err(|e| unavailable(&format!("declaring exchange {exchange}"), e))?;
    }
    declare_queue(channel, &c.dead_letter_queue).await?;
    bind_queue(channel, &c.dead_letter_queue, &c.dead_letter_exchange, "").await?;
    // The delay exchange feeds the commands queue: every message, whatever its routing key.
    channel
        .exchange_declare(
            s("broker.delay_exchange", &c.delay_exchange)?,
            ExchangeKind::Fanout,
            durable,
            FieldTable::default(),
        )
        .await
        .map_err(|e| unavailable(&format!("declaring exchange {}", c.delay_exchange), e))?;
    bind_queue(channel, &c.commands_queue, &c.delay_exchange, "").await
}

/// A durable queue.
async fn declare_queue(channel: &Channel, queue: &str) -> Result<()> {
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel
        .queue_declare(s("a queue name", queue)?, durable, FieldTable::default())
        .await
        .map(|_| ())
        .map_err(|e| unavailable(&format!("declaring queue {queue}"), e))
}

async fn bind_queue(channel: &Channel, queue: &str, exchange: &str, key: &str) -> Result<()> {
    channel
        .queue_bind(
            s("a queue name", queue)?,
            s("an exchange name", exchange)?,
            s("a binding key", key)?,
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| unavailable(&format!("binding queue {queue}"), e))
}

/// Waits for one publisher confirm. A lost channel is an error of the connection (`Err`); a
/// message returned as unroutable (no queue bound for its routing key) or nacked (the broker
/// refused to store it) is an error of that event alone (`Ok(Some)`): it counts as not
/// published and is retried, never dropped.
async fn confirmed(confirm: lapin::PublisherConfirm) -> Result<Option<Error>> {
    match confirm
        .await
        .map_err(|e| unavailable("awaiting a publisher confirm", e))?
    {
        Confirmation::Ack(None) | Confirmation::NotRequested => Ok(None),
        Confirmation::Ack(Some(returned)) => Ok(Some(Error::unavailable(format!(
            "rabbitmq broker: no queue is bound to exchange {} for routing key {:?}; \
             the event was returned, not delivered (bind a queue, it will be retried)",
            returned.delivery.exchange,
            returned.delivery.routing_key.as_str()
        )))),
        // The broker refused this message alone (a queue it routes to is full with
        // `x-overflow: reject-publish`, or it could not store it); the others have answers of
        // their own.
        Confirmation::Nack(_) => Ok(Some(Error::unavailable(
            "rabbitmq broker: the broker refused the event (a nack: a queue it routes to is full \
             with x-overflow reject-publish, or it could not be stored); it is retried",
        ))),
    }
}

#[async_trait]
impl Broker for RabbitmqBroker {
    fn name(&self) -> &'static str {
        "rabbitmq"
    }

    async fn receive(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>> {
        let session = self.session().await?;
        let mut consumer = self.consumer.lock().await;
        if consumer.as_ref().map(|(g, _)| *g) != Some(session.generation) {
            let tag = format!(
                "timer-service-{}-{}",
                std::process::id(),
                session.generation
            );
            let created = session
                .consume
                .basic_consume(
                    s("broker.commands_queue", &self.config.commands_queue)?,
                    s("the consumer tag", &tag)?,
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await;
            let created = match created {
                Ok(created) => created,
                Err(e) => {
                    // The server closed the channel (queue gone, no access): start over.
                    self.discard(&session).await;
                    let what = format!("consuming queue {}", self.config.commands_queue);
                    return Err(unavailable(&what, e));
                }
            };
            *consumer = Some((session.generation, created));
        }
        let Some((generation, stream)) = consumer.as_mut() else {
            return Ok(Vec::new());
        };
        let generation = *generation;
        let first = match tokio::time::timeout(wait, stream.next()).await {
            Err(_) => return Ok(Vec::new()),
            Ok(Some(Ok(delivery))) => delivery,
            Ok(Some(Err(e))) => {
                *consumer = None;
                self.discard(&session).await;
                return Err(unavailable("reading commands", e));
            }
            Ok(None) => {
                *consumer = None;
                self.discard(&session).await;
                return Err(Error::unavailable(
                    "rabbitmq broker: the consumer was cancelled",
                ));
            }
        };
        let mut out = vec![self.remember(generation, first)?];
        // The server pushes a backlog at once, but lapin's reader thread hands it over one
        // delivery at a time: take what arrives within BATCH_GATHER of the first, or a backlog
        // read on a busy machine comes one delivery per receive (a transaction each).
        let gathered = tokio::time::Instant::now() + BATCH_GATHER;
        while out.len() < max {
            let next = match stream.next().now_or_never() {
                Some(next) => Some(next),
                None => tokio::time::timeout_at(gathered, stream.next()).await.ok(),
            };
            match next {
                Some(Some(Ok(delivery))) => out.push(self.remember(generation, delivery)?),
                Some(Some(Err(e))) => {
                    tracing::warn!(error = %e, "rabbitmq broker: consumer error; reconnecting");
                    *consumer = None;
                    self.discard(&session).await;
                    break;
                }
                _ => break,
            }
        }
        Ok(out)
    }

    async fn ack(&self, tags: &[u64]) -> Result<()> {
        let deliveries = self.pending.take(tags)?;
        let Some(session) = self.session.lock().await.clone() else {
            // The connection they came on is gone; the broker requeued them already.
            return Ok(());
        };
        for (generation, delivery_tag) in deliveries {
            if generation != session.generation {
                continue; // delivered on a lost connection: requeued by the broker
            }
            if let Err(e) = session
                .consume
                .basic_ack(delivery_tag, BasicAckOptions::default())
                .await
            {
                // The channel is broken: dropping the connection makes the broker requeue
                // every command it still holds for us.
                self.discard(&session).await;
                return Err(unavailable("acknowledging a command", e));
            }
        }
        Ok(())
    }

    fn check_key(&self, key: &TimerKey) -> std::result::Result<(), KeyLimit> {
        routing_key(&key.tenant_id).map(|_| ())
    }

    fn check_target(&self, target: &Target) -> std::result::Result<String, String> {
        target_route(target, &self.config).map(|(exchange, key)| format!("{exchange}/{key}"))
    }

    fn check_message(&self, meta: &MessageMeta) -> std::result::Result<(), String> {
        outbound::check_message(meta)
    }

    fn events_destination(&self, _key: &TimerKey) -> Option<String> {
        Some(self.config.events_exchange.clone())
    }

    async fn publish(&self, events: &[OutboundEvent]) -> Result<Vec<Undelivered>> {
        let session = self.session().await?;
        let missing = self.missing_exchanges(&session, events).await?;
        let frame_max = session.connection.configuration().frame_max() as usize;
        let mut confirms = Vec::with_capacity(events.len());
        let mut undelivered = Vec::new();
        for (index, event) in events.iter().enumerate() {
            let exchange = event.target.as_ref().and_then(|t| t.text("exchange"));
            let unusable = missing.iter().find(|(e, _)| Some(e.as_str()) == exchange);
            if let (Some(_), Some((exchange, unusable))) = (&event.target, unusable) {
                undelivered.push(unusable.undelivered(index, |why| {
                    format!("rabbitmq broker: the target exchange {exchange:?} cannot be used ({why})")
                }));
                continue;
            }
            let route = match &event.target {
                Some(target) => target_route(target, &self.config)
                    .map(|(exchange, key)| (exchange.to_owned(), key.to_owned()))
                    .map_err(|why| Error::invalid(format!("rabbitmq broker: target: {why}"))),
                None => routing_key(&event.key.tenant_id)
                    .map(|key| (self.config.events_exchange.clone(), key))
                    .map_err(|limit| {
                        Error::invalid(format!(
                            "rabbitmq broker: {} {}",
                            limit.field, limit.message
                        ))
                    }),
            };
            let properties = |route| {
                let properties = properties_of(event, frame_max).map_err(|why| {
                    Error::invalid(format!("rabbitmq broker: the message cannot be sent: {why}"))
                })?;
                Ok((route, properties))
            };
            let ((exchange, routing_key), properties) = match route.and_then(properties) {
                Ok(publish) => publish,
                Err(error) => {
                    // Refused alone: a limit not yet checked when it was stored.
                    undelivered.push(Undelivered::new(index, error));
                    continue;
                }
            };
            match self
                .publish_one(&session, &exchange, &routing_key, &event.body, properties)
                .await
            {
                Ok(confirm) => confirms.push((index, confirm)),
                Err(e) => {
                    self.discard(&session).await;
                    return Err(e);
                }
            }
        }
        let (indexes, confirms): (Vec<usize>, Vec<_>) = confirms.into_iter().unzip();
        for (index, result) in indexes
            .into_iter()
            .zip(futures::future::join_all(confirms.into_iter().map(confirmed)).await)
        {
            match result {
                Ok(None) => {}
                Ok(Some(error)) => undelivered.push(Undelivered::new(index, error)),
                Err(e) => {
                    self.discard(&session).await;
                    return Err(e);
                }
            }
        }
        undelivered.sort_by_key(|u| u.index);
        Ok(undelivered)
    }

    async fn dead_letter(&self, body: &[u8], reason: &str) -> Result<()> {
        let session = self.session().await?;
        let mut headers = FieldTable::default();
        headers.insert(REASON_HEADER.into(), AMQPValue::LongString(reason.into()));
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(headers);
        let result = match self
            .publish_one(
                &session,
                &self.config.dead_letter_exchange,
                "",
                body,
                properties,
            )
            .await
        {
            Ok(confirm) => match confirmed(confirm).await {
                Ok(None) => Ok(()),
                Ok(Some(returned)) => Err(returned),
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        };
        if result.is_err() {
            self.discard(&session).await;
        }
        result
    }

    async fn health(&self) -> Result<()> {
        self.session().await.map(|_| ())
    }
}
