//! Fixtures: a fresh, isolated resource per check for every compiled-in plugin, and the rule for
//! servers that are not there (ignored with a reason locally; a failure when
//! `TIMER_TEST_REQUIRE=1`, as CI sets).

use std::sync::Arc;

use async_trait::async_trait;
use timer_brokers::memory::{MemoryConfig as MemoryBrokerConfig, MemoryHub};
use timer_core::{Broker, Result, Store};
use timer_stores::memory::MemoryStore;

use crate::broker::{BrokerFixture, ReadDeadLetter, ReadEvent};

/// Whether missing servers must fail the run instead of skipping (`TIMER_TEST_REQUIRE=1`).
pub fn require_servers() -> bool {
    std::env::var("TIMER_TEST_REQUIRE").is_ok_and(|v| v == "1")
}

/// A store under test with whatever keeps its resource alive (a temp dir, a schema).
pub struct FreshStore {
    pub store: Arc<dyn Store>,
    _guard: Box<dyn Send + Sync>,
}

/// Makes fresh stores of one plugin.
#[async_trait]
pub trait StoreFactory: Send + Sync + 'static {
    fn name(&self) -> &'static str;
    /// Why this plugin's server is unavailable, if it is.
    fn unavailable(&self) -> Option<String> {
        None
    }
    async fn fresh(&self) -> Result<FreshStore>;
}

/// Makes fresh broker fixtures of one plugin.
#[async_trait]
pub trait BrokerFactory: Send + Sync + 'static {
    fn name(&self) -> &'static str;
    fn unavailable(&self) -> Option<String> {
        None
    }
    async fn fresh(&self) -> Result<Arc<dyn BrokerFixture>>;
}

pub struct MemoryStores;

#[async_trait]
impl StoreFactory for MemoryStores {
    fn name(&self) -> &'static str {
        "memory"
    }
    async fn fresh(&self) -> Result<FreshStore> {
        Ok(FreshStore {
            store: Arc::new(MemoryStore::new()),
            _guard: Box::new(()),
        })
    }
}

#[cfg(feature = "sqlite")]
pub struct SqliteStores;

#[cfg(feature = "sqlite")]
#[async_trait]
impl StoreFactory for SqliteStores {
    fn name(&self) -> &'static str {
        "sqlite"
    }
    async fn fresh(&self) -> Result<FreshStore> {
        use timer_stores::sqlite::{SqliteConfig, SqliteStore};
        let dir = tempfile::tempdir()
            .map_err(|e| timer_core::Error::internal("cannot create a temp dir").with_source(e))?;
        let store =
            SqliteStore::open(&SqliteConfig::for_path(dir.path().join("timers.db"))).await?;
        Ok(FreshStore {
            store: Arc::new(store),
            _guard: Box::new(dir),
        })
    }
}

/// The PostgreSQL server the tests use (`scripts/servers/postgres.sh start` prints it).
pub const POSTGRES_URL_VAR: &str = "TIMER_TEST_POSTGRES_URL";

/// Each check gets a schema of its own (`t_<random>`) in the test database.
#[cfg(feature = "postgres")]
pub struct PostgresStores;

#[cfg(feature = "postgres")]
impl PostgresStores {
    /// A config for a new random schema on the test server, if one is configured.
    pub fn config() -> Option<timer_stores::postgres::PostgresConfig> {
        let url = std::env::var(POSTGRES_URL_VAR).ok()?;
        let id = uuid::Uuid::new_v4().simple().to_string();
        Some(timer_stores::postgres::PostgresConfig {
            url,
            schema: format!("t_{}", &id[..16]),
            max_connections: 8,
            ..Default::default()
        })
    }
}

#[cfg(feature = "postgres")]
#[async_trait]
impl StoreFactory for PostgresStores {
    fn name(&self) -> &'static str {
        "postgres"
    }
    fn unavailable(&self) -> Option<String> {
        std::env::var(POSTGRES_URL_VAR).is_err().then(|| {
            format!(
                "{POSTGRES_URL_VAR} is not set (bash scripts/test.sh starts a PostgreSQL server)"
            )
        })
    }
    async fn fresh(&self) -> Result<FreshStore> {
        let config = Self::config()
            .ok_or_else(|| timer_core::Error::config(format!("{POSTGRES_URL_VAR} is not set")))?;
        let store = timer_stores::postgres::PostgresStore::open(&config).await?;
        // Schemas stay behind in the throwaway test database; names never collide.
        Ok(FreshStore {
            store: Arc::new(store),
            _guard: Box::new(()),
        })
    }
}

/// Every store plugin compiled into this build.
pub fn store_factories() -> Vec<Box<dyn StoreFactory>> {
    #[allow(unused_mut)]
    let mut all: Vec<Box<dyn StoreFactory>> = vec![Box::new(MemoryStores)];
    #[cfg(feature = "sqlite")]
    all.push(Box::new(SqliteStores));
    #[cfg(feature = "postgres")]
    all.push(Box::new(PostgresStores));
    all
}

/// Every broker plugin compiled into this build.
pub fn broker_factories() -> Vec<Box<dyn BrokerFactory>> {
    #[allow(unused_mut)]
    let mut all: Vec<Box<dyn BrokerFactory>> = vec![Box::new(MemoryBrokers)];
    #[cfg(feature = "nats")]
    all.push(Box::new(nats::NatsBrokers));
    #[cfg(feature = "rabbitmq")]
    all.push(Box::new(rabbitmq::RabbitmqBrokers));
    #[cfg(feature = "kafka")]
    all.push(Box::new(kafka::KafkaBrokers));
    all
}

/// The Kafka-protocol server the tests use (`scripts/servers/kafka.sh start` prints it).
pub const KAFKA_BROKERS_VAR: &str = "TIMER_TEST_KAFKA_BROKERS";

#[cfg(feature = "kafka")]
pub mod kafka {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use async_trait::async_trait;
    use rdkafka::config::ClientConfig;
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::{Headers, Message, OwnedMessage};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    use rdkafka::{Offset, TopicPartitionList};
    use timer_brokers::kafka::{
        client_config, KafkaBroker, KafkaConfig, EVENT_ID_HEADER, REASON_HEADER,
    };
    use timer_core::{Broker, Error, Result};

    use super::{BrokerFactory, KAFKA_BROKERS_VAR};
    use crate::broker::{BrokerFixture, ReadDeadLetter, ReadEvent};

    /// Each check gets topics and a consumer group of its own (`<random>`-named).
    pub struct KafkaBrokers;

    impl KafkaBrokers {
        /// A config with fresh names on the test server, if one is configured.
        pub fn config() -> Option<KafkaConfig> {
            let brokers = std::env::var(KAFKA_BROKERS_VAR).ok()?;
            let id = &uuid::Uuid::new_v4().simple().to_string()[..12];
            Some(KafkaConfig {
                brokers,
                group_id: format!("g{id}"),
                commands_topic: format!("t{id}.commands"),
                events_topic: format!("t{id}.events"),
                dead_letter_topic: format!("t{id}.dead"),
                ..KafkaConfig::default()
            })
        }
    }

    #[async_trait]
    impl BrokerFactory for KafkaBrokers {
        fn name(&self) -> &'static str {
            "kafka"
        }
        fn unavailable(&self) -> Option<String> {
            std::env::var(KAFKA_BROKERS_VAR).is_err().then(|| {
                format!("{KAFKA_BROKERS_VAR} is not set (bash scripts/test.sh starts tansu)")
            })
        }
        async fn fresh(&self) -> Result<Arc<dyn BrokerFixture>> {
            let config = Self::config()
                .ok_or_else(|| Error::config(format!("{KAFKA_BROKERS_VAR} is not set")))?;
            Ok(Arc::new(KafkaFixture::new(config).await?))
        }
    }

    fn unavailable(what: &str, e: impl std::fmt::Display) -> Error {
        Error::unavailable(format!("kafka fixture: {what}: {e}"))
    }

    /// An independent Kafka client on one config's topics: produces commands, reads topics.
    pub struct KafkaFixture {
        pub config: KafkaConfig,
        producer: FutureProducer,
    }

    impl KafkaFixture {
        /// Creates the topics (through the plugin, as the service does) and a producer.
        pub async fn new(config: KafkaConfig) -> Result<Self> {
            drop(KafkaBroker::connect(&config).await?);
            let producer = ClientConfig::new()
                .set("bootstrap.servers", &config.brokers)
                .set("linger.ms", "0")
                .create()
                .map_err(|e| unavailable("producer", e))?;
            Ok(KafkaFixture { config, producer })
        }

        /// Produces `body` to the commands topic (keyed, as a service would) and waits for the ack.
        pub async fn produce(&self, key: &str, body: &[u8]) -> Result<()> {
            self.producer
                .send(
                    FutureRecord::to(&self.config.commands_topic)
                        .key(key)
                        .payload(body),
                    Duration::from_secs(10),
                )
                .await
                .map(|_| ())
                .map_err(|(e, _)| unavailable("produce", e))
        }

        /// Produces many `(key, body)` commands, all in flight together, and waits for every ack.
        pub async fn produce_many(&self, commands: &[(String, String)]) -> Result<()> {
            for chunk in commands.chunks(1_000) {
                let sends = chunk.iter().map(|(key, body)| {
                    self.producer.send(
                        FutureRecord::to(&self.config.commands_topic)
                            .key(key)
                            .payload(body),
                        Duration::from_secs(10),
                    )
                });
                for result in futures::future::join_all(sends).await {
                    result.map_err(|(e, _)| unavailable("produce", e))?;
                }
            }
            Ok(())
        }

        /// Every message of `topic` from the beginning up to its current end.
        pub async fn read_all(&self, topic: &str) -> Result<Vec<OwnedMessage>> {
            let config = self.config.clone();
            let topic = topic.to_owned();
            tokio::task::spawn_blocking(move || read_topic(&config, &topic))
                .await
                .map_err(|e| unavailable("reader task", e))?
        }
    }

    fn read_topic(config: &KafkaConfig, topic: &str) -> Result<Vec<OwnedMessage>> {
        let consumer: BaseConsumer = client_config(config)
            .set("group.id", format!("reader-{}", uuid::Uuid::new_v4()))
            .set("enable.auto.commit", "false")
            .set("fetch.wait.max.ms", "10")
            .create()
            .map_err(|e| unavailable("reader", e))?;
        let timeout = Duration::from_secs(10);
        let metadata = consumer
            .fetch_metadata(Some(topic), timeout)
            .map_err(|e| unavailable("metadata", e))?;
        let partitions: Vec<i32> = metadata
            .topics()
            .iter()
            .filter(|t| t.name() == topic)
            .flat_map(|t| t.partitions().iter().map(|p| p.id()))
            .collect();
        let mut list = TopicPartitionList::new();
        let mut remaining = 0usize;
        let mut ends = std::collections::HashMap::new();
        for p in partitions {
            let (low, high) = consumer
                .fetch_watermarks(topic, p, timeout)
                .map_err(|e| unavailable("watermarks", e))?;
            if high > low {
                remaining += (high - low) as usize;
                ends.insert(p, high);
                list.add_partition_offset(topic, p, Offset::Beginning)
                    .map_err(|e| unavailable("assignment", e))?;
            }
        }
        if remaining == 0 {
            return Ok(Vec::new());
        }
        consumer
            .assign(&list)
            .map_err(|e| unavailable("assign", e))?;
        let mut out = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !ends.is_empty() {
            if Instant::now() > deadline {
                return Err(unavailable(
                    "reading",
                    format!("{topic}: {} of {remaining} messages after 30 s", out.len()),
                ));
            }
            match consumer.poll(Duration::from_millis(100)) {
                None => {}
                Some(Err(e)) => return Err(unavailable("reading", e)),
                Some(Ok(m)) => {
                    let (p, offset) = (m.partition(), m.offset());
                    if ends.get(&p).is_some_and(|end| offset + 1 >= *end) {
                        ends.remove(&p);
                    }
                    out.push(m.detach());
                }
            }
        }
        Ok(out)
    }

    fn header(m: &OwnedMessage, key: &str) -> Option<String> {
        let headers = m.headers()?;
        headers
            .iter()
            .find(|h| h.key == key)
            .and_then(|h| h.value)
            .map(|v| String::from_utf8_lossy(v).into_owned())
    }

    #[async_trait]
    impl BrokerFixture for KafkaFixture {
        async fn connect(&self) -> Result<Box<dyn Broker>> {
            Ok(Box::new(KafkaBroker::connect(&self.config).await?))
        }
        async fn send_command(&self, body: &[u8]) -> Result<()> {
            self.produce("test", body).await
        }
        async fn events(&self) -> Result<Vec<ReadEvent>> {
            let mut out = Vec::new();
            for m in self.read_all(&self.config.events_topic).await? {
                let id = header(&m, EVENT_ID_HEADER)
                    .and_then(|v| uuid::Uuid::parse_str(&v).ok())
                    .ok_or_else(|| Error::internal("event without a timer-event-id header"))?;
                out.push(ReadEvent {
                    id,
                    body: m.payload().unwrap_or_default().to_vec(),
                });
            }
            Ok(out)
        }
        async fn dead_letters(&self) -> Result<Vec<ReadDeadLetter>> {
            Ok(self
                .read_all(&self.config.dead_letter_topic)
                .await?
                .into_iter()
                .map(|m| ReadDeadLetter {
                    reason: header(&m, REASON_HEADER).unwrap_or_default(),
                    body: m.payload().unwrap_or_default().to_vec(),
                })
                .collect())
        }
    }
}

/// The RabbitMQ server the tests use (`scripts/servers/rabbitmq.sh start` prints it).
pub const RABBITMQ_URL_VAR: &str = "TIMER_TEST_RABBITMQ_URL";

#[cfg(feature = "rabbitmq")]
pub mod rabbitmq {
    use std::sync::{Arc, Mutex};

    use async_trait::async_trait;
    use lapin::options::{
        BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions,
        QueueDeclareOptions,
    };
    use lapin::types::{AMQPValue, FieldTable};
    use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
    use timer_brokers::rabbitmq::{RabbitmqBroker, RabbitmqConfig, REASON_HEADER};
    use timer_core::{Broker, Error, Result};

    use super::{BrokerFactory, RABBITMQ_URL_VAR};
    use crate::broker::{BrokerFixture, ReadDeadLetter, ReadEvent};

    /// Each check gets queues and exchanges of its own (`<random>`-named).
    pub struct RabbitmqBrokers;

    impl RabbitmqBrokers {
        /// A config with fresh names on the test server, if one is configured.
        pub fn config() -> Option<RabbitmqConfig> {
            let url = std::env::var(RABBITMQ_URL_VAR).ok()?;
            let id = &uuid::Uuid::new_v4().simple().to_string()[..12];
            Some(RabbitmqConfig {
                url,
                commands_queue: format!("t{id}.commands"),
                events_exchange: format!("t{id}.events"),
                dead_letter_exchange: format!("t{id}.dead"),
                dead_letter_queue: format!("t{id}.dead"),
                ..RabbitmqConfig::default()
            })
        }
    }

    fn unavailable(what: &str, e: impl std::fmt::Display) -> Error {
        Error::unavailable(format!("rabbitmq fixture: {what}: {e}"))
    }

    #[async_trait]
    impl BrokerFactory for RabbitmqBrokers {
        fn name(&self) -> &'static str {
            "rabbitmq"
        }
        fn unavailable(&self) -> Option<String> {
            std::env::var(RABBITMQ_URL_VAR).is_err().then(|| {
                format!("{RABBITMQ_URL_VAR} is not set (bash scripts/test.sh starts RabbitMQ)")
            })
        }
        async fn fresh(&self) -> Result<Arc<dyn BrokerFixture>> {
            let config = Self::config()
                .ok_or_else(|| Error::config(format!("{RABBITMQ_URL_VAR} is not set")))?;
            Ok(Arc::new(RabbitmqFixture::new(config).await?))
        }
    }

    /// A producer and reader of its own: a channel with confirms, and a queue bound to the
    /// events exchange (`#`) that collects every event.
    pub struct RabbitmqFixture {
        pub config: RabbitmqConfig,
        _connection: Connection,
        channel: Channel,
        events_queue: String,
        events: Mutex<Vec<ReadEvent>>,
        dead: Mutex<Vec<ReadDeadLetter>>,
    }

    impl RabbitmqFixture {
        pub async fn new(config: RabbitmqConfig) -> Result<Self> {
            // Declares the topology, so commands can be sent before a connect.
            drop(RabbitmqBroker::connect(&config).await?);
            let connection = Connection::connect(&config.url, ConnectionProperties::default())
                .await
                .map_err(|e| unavailable("connect", e))?;
            let channel = connection
                .create_channel()
                .await
                .map_err(|e| unavailable("channel", e))?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .map_err(|e| unavailable("confirms", e))?;
            let events_queue = format!("{}.reader", config.events_exchange);
            channel
                .queue_declare(
                    events_queue.as_str().into(),
                    QueueDeclareOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|e| unavailable("reader queue", e))?;
            channel
                .queue_bind(
                    events_queue.as_str().into(),
                    config.events_exchange.as_str().into(),
                    "#".into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|e| unavailable("reader binding", e))?;
            Ok(RabbitmqFixture {
                config,
                _connection: connection,
                channel,
                events_queue,
                events: Mutex::new(Vec::new()),
                dead: Mutex::new(Vec::new()),
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
    impl BrokerFixture for RabbitmqFixture {
        async fn connect(&self) -> Result<Box<dyn Broker>> {
            Ok(Box::new(RabbitmqBroker::connect(&self.config).await?))
        }
        async fn send_command(&self, body: &[u8]) -> Result<()> {
            let confirm = self
                .channel
                .basic_publish(
                    "".into(),
                    self.config.commands_queue.as_str().into(),
                    BasicPublishOptions::default(),
                    body,
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .map_err(|e| unavailable("publish", e))?;
            match confirm.await.map_err(|e| unavailable("confirm", e))? {
                lapin::Confirmation::Ack(None) => Ok(()),
                other => Err(unavailable("publish", format!("not confirmed: {other:?}"))),
            }
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
    }
}

/// The NATS server the tests use (`scripts/servers/nats.sh start` prints it).
pub const NATS_URL_VAR: &str = "TIMER_TEST_NATS_URL";

#[cfg(feature = "nats")]
pub mod nats {
    use std::sync::Arc;
    use std::time::Duration;

    use async_nats::jetstream::{self, consumer};
    use async_trait::async_trait;
    use futures::StreamExt;
    use timer_brokers::nats::{connect_client, NatsBroker, NatsConfig, REASON_HEADER};
    use timer_core::{Broker, Error, Result};

    use super::{BrokerFactory, NATS_URL_VAR};
    use crate::broker::{BrokerFixture, ReadDeadLetter, ReadEvent};

    /// Each check gets streams, subjects and a consumer of its own (`<random>`-named).
    pub struct NatsBrokers;

    impl NatsBrokers {
        /// A config with fresh names on the test server, if one is configured.
        pub fn config() -> Option<NatsConfig> {
            let url = std::env::var(NATS_URL_VAR).ok()?;
            let id = &uuid::Uuid::new_v4().simple().to_string()[..12];
            Some(NatsConfig {
                url,
                commands_stream: format!("C_{id}"),
                commands_subject: format!("t{id}.commands.>"),
                consumer: format!("c{id}"),
                events_stream: format!("E_{id}"),
                events_subject: format!("t{id}.events"),
                dead_letter_stream: format!("D_{id}"),
                dead_letter_subject: format!("t{id}.dead"),
                // Redelivery within a check's patience.
                ack_wait: Duration::from_secs(2),
                ..NatsConfig::default()
            })
        }
    }

    #[async_trait]
    impl BrokerFactory for NatsBrokers {
        fn name(&self) -> &'static str {
            "nats"
        }
        fn unavailable(&self) -> Option<String> {
            std::env::var(NATS_URL_VAR).is_err().then(|| {
                format!("{NATS_URL_VAR} is not set (bash scripts/test.sh starts nats-server)")
            })
        }
        async fn fresh(&self) -> Result<Arc<dyn BrokerFixture>> {
            let config = Self::config()
                .ok_or_else(|| Error::config(format!("{NATS_URL_VAR} is not set")))?;
            // Creates the streams and the consumer, so commands can be sent before a connect.
            drop(NatsBroker::connect(&config).await?);
            let js = jetstream::new(connect_client(&config).await?);
            Ok(Arc::new(NatsFixture { config, js }))
        }
    }

    pub struct NatsFixture {
        pub config: NatsConfig,
        pub js: jetstream::Context,
    }

    fn unavailable(what: &str, e: impl std::fmt::Display) -> Error {
        Error::unavailable(format!("nats fixture: {what}: {e}"))
    }

    impl NatsFixture {
        /// Every message of `stream` from the start, read by a throwaway consumer.
        pub async fn read_all(&self, stream: &str) -> Result<Vec<jetstream::Message>> {
            let stream = self
                .js
                .get_stream(stream)
                .await
                .map_err(|e| unavailable("stream", e))?;
            let reader = stream
                .create_consumer(consumer::pull::Config {
                    ack_policy: consumer::AckPolicy::None,
                    deliver_policy: consumer::DeliverPolicy::All,
                    inactive_threshold: Duration::from_secs(30),
                    ..Default::default()
                })
                .await
                .map_err(|e| unavailable("reader consumer", e))?;
            let mut out = Vec::new();
            loop {
                let mut batch = reader
                    .fetch()
                    .max_messages(1_000)
                    .messages()
                    .await
                    .map_err(|e| unavailable("fetch", e))?;
                let before = out.len();
                while let Some(message) = batch.next().await {
                    out.push(message.map_err(|e| unavailable("fetch", e))?);
                }
                if out.len() == before {
                    return Ok(out);
                }
            }
        }
    }

    #[async_trait]
    impl BrokerFixture for NatsFixture {
        async fn connect(&self) -> Result<Box<dyn Broker>> {
            Ok(Box::new(NatsBroker::connect(&self.config).await?))
        }
        async fn send_command(&self, body: &[u8]) -> Result<()> {
            let subject = self.config.commands_subject.replace('>', "test");
            self.js
                .publish(subject, body.to_vec().into())
                .await
                .map_err(|e| unavailable("publish", e))?
                .await
                .map_err(|e| unavailable("PubAck", e))?;
            Ok(())
        }
        async fn events(&self) -> Result<Vec<ReadEvent>> {
            let mut out = Vec::new();
            for m in self.read_all(&self.config.events_stream).await? {
                let id = m
                    .headers
                    .as_ref()
                    .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
                    .and_then(|v| uuid::Uuid::parse_str(v.as_str()).ok())
                    .ok_or_else(|| Error::internal("event without a Nats-Msg-Id"))?;
                out.push(ReadEvent {
                    id,
                    body: m.payload.to_vec(),
                });
            }
            Ok(out)
        }
        async fn dead_letters(&self) -> Result<Vec<ReadDeadLetter>> {
            Ok(self
                .read_all(&self.config.dead_letter_stream)
                .await?
                .into_iter()
                .map(|m| ReadDeadLetter {
                    reason: m
                        .headers
                        .as_ref()
                        .and_then(|h| h.get(REASON_HEADER))
                        .map(|v| v.as_str().to_owned())
                        .unwrap_or_default(),
                    body: m.payload.to_vec(),
                })
                .collect())
        }
    }
}

pub struct MemoryBrokers;

#[async_trait]
impl BrokerFactory for MemoryBrokers {
    fn name(&self) -> &'static str {
        "memory"
    }
    async fn fresh(&self) -> Result<Arc<dyn BrokerFixture>> {
        Ok(Arc::new(MemoryFixture {
            hub: MemoryHub::new(MemoryBrokerConfig::default()),
        }))
    }
}

pub struct MemoryFixture {
    pub hub: MemoryHub,
}

#[async_trait]
impl BrokerFixture for MemoryFixture {
    async fn connect(&self) -> Result<Box<dyn Broker>> {
        Ok(Box::new(self.hub.connect()))
    }
    async fn send_command(&self, body: &[u8]) -> Result<()> {
        self.hub.send_command(body)
    }
    async fn events(&self) -> Result<Vec<ReadEvent>> {
        Ok(self
            .hub
            .events()?
            .into_iter()
            .map(|e| ReadEvent {
                id: e.id,
                body: e.body,
            })
            .collect())
    }
    async fn dead_letters(&self) -> Result<Vec<ReadDeadLetter>> {
        Ok(self
            .hub
            .dead_letters()?
            .into_iter()
            .map(|d| ReadDeadLetter {
                body: d.body.into_bytes(),
                reason: d.reason,
            })
            .collect())
    }
}
