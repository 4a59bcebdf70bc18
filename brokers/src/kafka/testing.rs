//! An independent Kafka client on one config's topics, for tests: produces commands (keyed, as
//! a service would) and reads whole topics from the beginning with a throwaway reader.

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use timer_core::plugin::{
    DelayedMessage, DelayedUntil, ReadDeadLetter, ReadEvent, ReadMessage, TestClient,
};
use timer_core::{Broker, Error, Result, Target};

use super::topics::create_topics;
use super::{
    client_config, KafkaBroker, KafkaConfig, CONTENT_TYPE_HEADER, DELAY_HEADER,
    DELIVER_AT_HEADER, EVENT_ID_HEADER, ID_HEADER, REASON_HEADER, TARGET_TOPIC_HEADER,
    TENANT_HEADER,
};

fn unavailable(what: &str, e: impl std::fmt::Display) -> Error {
    Error::unavailable(format!("kafka test client: {what}: {e}"))
}

/// An independent Kafka client on one config's topics: produces commands, reads topics.
pub struct KafkaTestClient {
    pub config: KafkaConfig,
    producer: FutureProducer,
    /// What was read of each topic so far, so a read takes only what is new.
    read: tokio::sync::Mutex<HashMap<String, TopicRead>>,
}

impl KafkaTestClient {
    /// Creates the topics (through the plugin, as the service does) and a producer.
    pub async fn new(config: KafkaConfig) -> Result<Self> {
        drop(KafkaBroker::connect(&config).await?);
        let producer = ClientConfig::new()
            .set("bootstrap.servers", &config.brokers)
            .set("linger.ms", "0")
            .create()
            .map_err(|e| unavailable("producer", e))?;
        Ok(KafkaTestClient {
            config,
            producer,
            read: tokio::sync::Mutex::new(HashMap::new()),
        })
    }

    /// Produces `body` to the commands topic (keyed, as a service would) and waits for the ack.
    pub async fn produce(&self, key: &str, body: &[u8]) -> Result<()> {
        self.produce_all(vec![(key, body)]).await
    }

    /// Produces many `(key, body)` commands, all in flight together, and waits for every ack.
    pub async fn produce_many(&self, commands: &[(String, String)]) -> Result<()> {
        self.produce_all(
            commands
                .iter()
                .map(|(key, body)| (key.as_str(), body.as_bytes()))
                .collect(),
        )
        .await
    }

    /// Produces one command with `headers`, and waits for its ack.
    async fn produce_with_headers(
        &self,
        key: &str,
        body: &[u8],
        headers: &BTreeMap<String, String>,
    ) -> Result<()> {
        let mut owned = OwnedHeaders::new();
        for (name, value) in headers {
            owned = owned.insert(Header {
                key: name.as_str(),
                value: Some(value.as_bytes()),
            });
        }
        let record = FutureRecord::to(&self.config.commands_topic)
            .key(key)
            .payload(body)
            .headers(owned);
        self.producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| unavailable("produce", e))?;
        Ok(())
    }

    /// Produces `(key, body)` commands, a thousand in flight at a time, waiting for every ack.
    async fn produce_all(&self, commands: Vec<(&str, &[u8])>) -> Result<()> {
        for chunk in commands.chunks(1_000) {
            let sends = chunk.iter().map(|(key, body)| {
                self.producer.send(
                    FutureRecord::to(&self.config.commands_topic)
                        .key(*key)
                        .payload(*body),
                    Duration::from_secs(10),
                )
            });
            for result in futures::future::join_all(sends).await {
                result.map_err(|(e, _)| unavailable("produce", e))?;
            }
        }
        Ok(())
    }

    /// Every message of `topic` from the beginning up to its current end: what an earlier call
    /// read, and what came after it.
    pub async fn read_all(&self, topic: &str) -> Result<Vec<OwnedMessage>> {
        let mut read = self.read.lock().await;
        let known = read.entry(topic.to_owned()).or_default();
        let config = self.config.clone();
        let (name, from) = (topic.to_owned(), known.next.clone());
        let new = tokio::task::spawn_blocking(move || read_topic(&config, &name, &from))
            .await
            .map_err(|e| unavailable("reader task", e))??;
        for m in new {
            known.next.insert(m.partition(), m.offset() + 1);
            known.messages.push(m);
        }
        Ok(known.messages.clone())
    }
}

/// What the test client read of a topic so far.
#[derive(Default)]
struct TopicRead {
    /// The offset to read next, per partition.
    next: HashMap<i32, i64>,
    messages: Vec<OwnedMessage>,
}

/// The messages of `topic` from `from` (per partition; the beginning where it names none) up
/// to the current end.
fn read_topic(
    config: &KafkaConfig,
    topic: &str,
    from: &HashMap<i32, i64>,
) -> Result<Vec<OwnedMessage>> {
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
    let mut ends = HashMap::new();
    for p in partitions {
        let (low, high) = consumer
            .fetch_watermarks(topic, p, timeout)
            .map_err(|e| unavailable("watermarks", e))?;
        let start = from.get(&p).copied().unwrap_or(low).max(low);
        if high > start {
            remaining += (high - start) as usize;
            ends.insert(p, high);
            list.add_partition_offset(topic, p, Offset::Offset(start))
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

/// The topic the test client makes its targets on.
fn targets_topic(config: &KafkaConfig) -> String {
    format!("{}-targets", config.events_topic)
}

/// A record's headers, values read as UTF-8 (lossy).
fn headers_of(m: &OwnedMessage) -> BTreeMap<String, String> {
    m.headers()
        .map(|h| {
            h.iter()
                .map(|h| {
                    let value = h.value.map(String::from_utf8_lossy).unwrap_or_default();
                    (h.key.to_owned(), value.into_owned())
                })
                .collect()
        })
        .unwrap_or_default()
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
impl TestClient for KafkaTestClient {
    async fn connect(&self) -> Result<Box<dyn Broker>> {
        Ok(Box::new(KafkaBroker::connect(&self.config).await?))
    }
    async fn send_command(&self, body: &[u8]) -> Result<()> {
        self.produce("test", body).await
    }
    async fn send_command_with_headers(
        &self,
        body: &[u8],
        headers: &BTreeMap<String, String>,
    ) -> Result<()> {
        self.produce_with_headers("test", body, headers).await
    }
    async fn send_commands(&self, bodies: &[Vec<u8>]) -> Result<()> {
        self.produce_all(bodies.iter().map(|b| ("test", b.as_slice())).collect())
            .await
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
                headers: headers_of(&m),
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
    /// A key on a topic of the test client (`<events_topic>-targets`).
    async fn make_target(&self, name: &str) -> Result<Option<Target>> {
        let topic = targets_topic(&self.config);
        create_topics(&self.config, &[&topic]).await?;
        let mut fields = serde_json::Map::new();
        fields.insert("topic".into(), topic.into());
        fields.insert("key".into(), name.into());
        Ok(Some(Target::new(fields)))
    }
    /// Produces to `broker.delay_topic` (the target's key, its topic in `timer-target-topic`),
    /// a thousand awaiting their ack at a time.
    async fn send_delayed(&self, messages: &[DelayedMessage]) -> Result<bool> {
        for chunk in messages.chunks(1_000) {
            let mut sends = Vec::with_capacity(chunk.len());
            for m in chunk {
                let (name, ms) = match m.when {
                    DelayedUntil::DelayMs(ms) => (DELAY_HEADER, ms.to_string()),
                    DelayedUntil::AtMs(ms) => (DELIVER_AT_HEADER, ms.to_string()),
                };
                let topic = m.target.text("topic").unwrap_or_default();
                let mut headers = OwnedHeaders::new()
                    .insert(Header {
                        key: name,
                        value: Some(&ms),
                    })
                    .insert(Header {
                        key: TARGET_TOPIC_HEADER,
                        value: Some(topic),
                    });
                for (key, value) in [(ID_HEADER, &m.id), (TENANT_HEADER, &m.tenant)] {
                    if let Some(value) = value {
                        headers = headers.insert(Header {
                            key,
                            value: Some(value),
                        });
                    }
                }
                for (key, value) in &m.headers {
                    headers = headers.insert(Header {
                        key,
                        value: Some(value),
                    });
                }
                let mut record = FutureRecord::<str, [u8]>::to(&self.config.delay_topic)
                    .payload(&m.body)
                    .headers(headers);
                if let Some(key) = m.target.text("key") {
                    record = record.key(key);
                }
                sends.push(self.producer.send(record, Duration::from_secs(10)));
            }
            for result in futures::future::join_all(sends).await {
                result.map_err(|(e, _)| unavailable("produce", e))?;
            }
        }
        Ok(true)
    }
    async fn read_target(&self, target: &Target) -> Result<Vec<ReadMessage>> {
        let topic = target.text("topic").unwrap_or_default();
        let key = target.text("key").map(str::as_bytes);
        let mut out = Vec::new();
        for m in self.read_all(topic).await? {
            if m.key() != key {
                continue;
            }
            let headers = headers_of(&m);
            out.push(ReadMessage {
                id: header(&m, EVENT_ID_HEADER).and_then(|v| uuid::Uuid::parse_str(&v).ok()),
                body: m.payload().unwrap_or_default().to_vec(),
                content_type: header(&m, CONTENT_TYPE_HEADER),
                headers,
                key: m.key().map(<[u8]>::to_vec),
                arrived_ms: m.timestamp().to_millis(),
            });
        }
        Ok(out)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
