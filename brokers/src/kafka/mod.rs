//! `kafka`: Apache Kafka and Kafka-protocol brokers, through rdkafka (bundled librdkafka).
//!
//! Commands (and delayed records, `delay.rs`) come from a consumer group with auto-commit off;
//! a partition's offset is committed only up to the last command the store committed with no
//! unacknowledged command before it (per partition, in order), and never for a partition this
//! instance no longer owns after a rebalance. Events go out through an idempotent producer (`acks=all`), keyed by tenant, with
//! the envelope id in the `timer-event-id` header; a batch counts as published only once every
//! delivery report is OK, with all of them in flight together.
//!
//! The rest is the plugin's page of the book (`README.md` beside this file).
#![doc = include_str!("README.md")]

mod config;
mod delay;
mod outbound;
mod plugin;
#[cfg(feature = "testing")]
mod testing;
mod topics;

#[cfg(all(test, feature = "testing"))]
mod tests;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Header, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use timer_core::{
    Broker, Delivery, Error, OutboundEvent, Result, Target, TimerKey, Undelivered,
};

use crate::shared::{DeliveryTags, Lookups, Unusable, LOOKUP_TTL, MISSING_TTL};
pub use outbound::CONTENT_TYPE_HEADER;
use outbound::{delivery_failed, headers_of, target_route, trace_of, Route};
use topics::{ensure_topics, topic_exists, topic_state, TopicState};

pub use config::{KafkaConfig, FIXED_PROPERTIES};
pub use delay::{DELAY_HEADER, DELIVER_AT_HEADER, ID_HEADER, TARGET_TOPIC_HEADER, TENANT_HEADER};
pub use plugin::PLUGIN;
#[cfg(feature = "testing")]
pub use plugin::TEST_SERVER;
/// The client library, for tests and tools that talk to the same cluster.
pub use rdkafka;
#[cfg(feature = "testing")]
pub use testing::KafkaTestClient;

/// Header carrying the envelope id of a `DueTimeReached` event.
pub const EVENT_ID_HEADER: &str = "timer-event-id";
/// Header carrying the reason of a dead letter.
pub const REASON_HEADER: &str = "timer-dead-letter-reason";

fn unavailable(what: &str, e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Error {
    Error::unavailable(format!("kafka broker: {what}")).with_source(e)
}

/// The settings every client shares: the servers, the connect timeout and the user's
/// properties (TLS, SASL, tuning).
pub fn client_config(config: &KafkaConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &config.brokers)
        .set("client.id", "timer-service")
        .set(
            "socket.connection.setup.timeout.ms",
            millis(config.connect_timeout),
        );
    for (key, value) in &config.properties {
        c.set(key, value);
    }
    c
}

fn millis(d: Duration) -> String {
    d.as_millis().clamp(1, i32::MAX as u128).to_string()
}

/// Our `tuning`, then [`client_config`] (the user's properties win over tuning); the caller
/// sets what the guarantees rest on last, so nothing overrides that.
fn tuned(config: &KafkaConfig, tuning: &[(&str, &str)]) -> ClientConfig {
    let mut c = ClientConfig::new();
    for (key, value) in tuning {
        c.set(*key, *value);
    }
    for (key, value) in client_config(config).config_map() {
        c.set(key, value);
    }
    c
}

/// The idempotent producer events and dead letters go out with.
fn producer(config: &KafkaConfig) -> Result<FutureProducer> {
    let mut c = tuned(config, &[("linger.ms", "1")]);
    c.set("message.timeout.ms", millis(config.publish_timeout))
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("allow.auto.create.topics", "false");
    c.create()
        .map_err(|e| Error::config("kafka broker: producer settings").with_source(e))
}

/// How often the health check makes a producer with a fatal error anew, at most.
const REMAKE_FROM_HEALTH_EVERY: Duration = Duration::from_secs(10);

/// A partition of the commands topic or of the delay topic.
type Partition = (Read, i32);

/// Which of the two topics the consumer reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Read {
    Commands,
    Delayed,
}

/// Which commands were delivered and which of them the store committed, per partition.
#[derive(Default)]
struct Tracking {
    /// Bumped at every revocation, so acks of deliveries from before it are recognised.
    epoch: u64,
    partitions: HashMap<Partition, PartitionTrack>,
}

struct PartitionTrack {
    epoch: u64,
    /// Delivered offsets → acknowledged yet.
    offsets: BTreeMap<i64, bool>,
}

/// The consumer's context: forgets the commands of revoked partitions so nothing is ever
/// committed for a partition another instance now owns.
struct GroupContext {
    commands_topic: String,
    delay_topic: String,
    tracking: Arc<Mutex<Tracking>>,
}

impl GroupContext {
    fn read(&self, topic: &str) -> Option<Read> {
        if topic == self.commands_topic {
            Some(Read::Commands)
        } else if topic == self.delay_topic {
            Some(Read::Delayed)
        } else {
            None
        }
    }
}

impl ClientContext for GroupContext {}

impl ConsumerContext for GroupContext {
    fn pre_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(list) = rebalance {
            let Ok(mut tracking) = self.tracking.lock() else {
                return;
            };
            tracking.epoch += 1;
            for element in list.elements() {
                if let Some(read) = self.read(element.topic()) {
                    tracking.partitions.remove(&(read, element.partition()));
                }
            }
            tracing::info!(
                partitions = list.count(),
                "kafka broker: partitions revoked; their unacknowledged commands go to the next owner"
            );
        }
    }

    fn post_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(list) => {
                let partitions: Vec<String> = list
                    .elements()
                    .iter()
                    .map(|e| format!("{}[{}]", e.topic(), e.partition()))
                    .collect();
                tracing::info!(?partitions, "kafka broker: partitions assigned");
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "kafka broker: rebalance failed"),
            Rebalance::Revoke(_) => {}
        }
    }
}

pub struct KafkaBroker {
    consumer: Member,
    /// Made anew after a fatal error ([`KafkaBroker::after_failure`]).
    producer: std::sync::RwLock<FutureProducer>,
    /// When it was last made anew (the health check does so at most every
    /// [`REMAKE_FROM_HEALTH_EVERY`]).
    remade: Mutex<Option<std::time::Instant>>,
    tracking: Arc<Mutex<Tracking>>,
    /// Delivered, not yet acknowledged: (partition, offset, epoch of the partition's track).
    tags: DeliveryTags<(Partition, i64, u64)>,
    /// Target topics looked up: `None` when usable, else why not.
    topics: Lookups<Option<String>>,
    config: KafkaConfig,
}

impl KafkaBroker {
    /// Connects, checks (or creates) the four topics and joins the consumer group (commands
    /// and delayed records).
    pub async fn connect(config: &KafkaConfig) -> Result<Self> {
        config.check()?;
        let producer = producer(config)?;
        ensure_topics(config, &producer).await?;
        let tracking = Arc::new(Mutex::new(Tracking::default()));
        let mut c = tuned(
            config,
            &[
                ("fetch.wait.max.ms", "100"),
                ("session.timeout.ms", "10000"),
                ("auto.offset.reset", "earliest"),
            ],
        );
        c.set("group.id", &config.group_id)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("allow.auto.create.topics", "false");
        let consumer: StreamConsumer<GroupContext> = c
            .create_with_context(GroupContext {
                commands_topic: config.commands_topic.clone(),
                delay_topic: config.delay_topic.clone(),
                tracking: tracking.clone(),
            })
            .map_err(|e| Error::config("kafka broker: consumer settings").with_source(e))?;
        consumer
            .subscribe(&[config.commands_topic.as_str(), config.delay_topic.as_str()])
            .map_err(|e| {
                unavailable(
                    &format!(
                        "subscribing to topics {} and {}",
                        config.commands_topic, config.delay_topic
                    ),
                    e,
                )
            })?;
        Ok(KafkaBroker {
            consumer: Member(Some(Arc::new(consumer))),
            producer: std::sync::RwLock::new(producer),
            remade: Mutex::new(None),
            tracking,
            tags: DeliveryTags::new("kafka"),
            topics: Lookups::new(),
            config: config.clone(),
        })
    }

    /// The producer events and dead letters go out with now.
    fn producer(&self) -> FutureProducer {
        match self.producer.read() {
            Ok(producer) => producer.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// After a send of `used` failed: when the producer has hit a fatal error (an idempotent
    /// producer whose sequence a broker failover broke, a cluster that refuses idempotent
    /// writes), librdkafka sends nothing more on it, so it is logged with its cause and made
    /// anew; what it had in hand is retried by the engine, as after any failed publish. The old
    /// one is dropped on a thread of the blocking pool (a producer's drop flushes and joins its
    /// polling thread). True once a healthy producer is in place.
    fn after_failure(&self, used: FutureProducer) -> bool {
        let Some((code, reason)) = used.client().fatal_error() else {
            return true;
        };
        let Ok(mut producer) = self.producer.write() else {
            return false;
        };
        // Another send that failed with it may have made it anew already.
        if producer.client().native_ptr() != used.client().native_ptr() {
            return true;
        }
        match self::producer(&self.config) {
            Ok(fresh) => {
                tracing::warn!(?code, %reason, "kafka broker: the producer hit a fatal error; made anew, the events it had are retried");
                let old = std::mem::replace(&mut *producer, fresh);
                drop(producer);
                if let Ok(mut remade) = self.remade.lock() {
                    *remade = Some(std::time::Instant::now());
                }
                tokio::task::spawn_blocking(move || drop((old, used)));
                true
            }
            Err(e) => {
                tracing::error!(?code, %reason, error = %e.chain(), "kafka broker: the producer hit a fatal error and cannot be made anew");
                false
            }
        }
    }

    /// Records a received command (or delayed record) as delivered and not yet acknowledged.
    fn remember(&self, message: &BorrowedMessage<'_>) -> Result<Delivery> {
        let read = if message.topic() == self.config.delay_topic {
            Read::Delayed
        } else {
            Read::Commands
        };
        let (partition, offset) = ((read, message.partition()), message.offset());
        let trace = trace_of(message);
        let track_epoch = {
            let mut tracking = self
                .tracking
                .lock()
                .map_err(|_| Error::internal("kafka broker: tracking poisoned"))?;
            let epoch = tracking.epoch;
            let track = tracking
                .partitions
                .entry(partition)
                .or_insert_with(|| PartitionTrack {
                    epoch,
                    offsets: BTreeMap::new(),
                });
            track.offsets.insert(offset, false);
            track.epoch
        };
        if read == Read::Delayed {
            // The ScheduleTimer it stands for; with `bind_tenant`, bound to
            // `broker.delay_tenant`.
            let body = delay::command_of(message, &self.config.delay_tenant);
            let tenant = self
                .config
                .bind_tenant
                .then(|| self.config.delay_tenant.clone());
            return self
                .tags
                .remember((partition, offset, track_epoch), body, tenant, trace);
        }
        let body = message.payload().unwrap_or_default().to_vec();
        // The record key as the tenant; a key that is not UTF-8 names no tenant.
        let tenant = self.config.bind_tenant.then(|| {
            let key = message.key().unwrap_or_default();
            String::from_utf8(key.to_vec()).unwrap_or_else(|_| "(a key not UTF-8)".to_owned())
        });
        self.tags
            .remember((partition, offset, track_epoch), body, tenant, trace)
    }

    /// Marks `tags` acknowledged and returns, per partition, the offset to commit: one past
    /// the last acknowledged command with no unacknowledged one before it.
    fn settle(&self, tags: &[u64]) -> Result<Vec<(Partition, i64)>> {
        let settled = self.tags.take(tags)?;
        let mut tracking = self
            .tracking
            .lock()
            .map_err(|_| Error::internal("kafka broker: tracking poisoned"))?;
        let mut touched = HashSet::new();
        for (partition, offset, epoch) in settled {
            if let Some(track) = tracking.partitions.get_mut(&partition) {
                if track.epoch == epoch {
                    if let Some(acked) = track.offsets.get_mut(&offset) {
                        *acked = true;
                        touched.insert(partition);
                    }
                }
            }
        }
        let mut commits = Vec::new();
        for partition in touched {
            let Some(track) = tracking.partitions.get_mut(&partition) else {
                continue;
            };
            let mut next = None;
            while let Some((&offset, &true)) = track.offsets.first_key_value() {
                track.offsets.pop_first();
                next = Some(offset + 1);
            }
            if let Some(next) = next {
                commits.push((partition, next));
            }
        }
        Ok(commits)
    }
}

/// How long dropping a [`KafkaBroker`] waits for its consumer to leave the group.
const LEAVE_WAIT: Duration = Duration::from_secs(5);

/// The broker's place in the consumer group. Leaving it (rdkafka's `Drop` of the consumer)
/// waits, without a bound, until librdkafka has closed the consumer, and with the server gone
/// that can be never: the service would not stop, a test would not end. So the consumer is
/// closed on a thread of its own, waited for at most [`LEAVE_WAIT`]; past that it is left to
/// finish (or to end with the process) and the group's session timeout hands its partitions
/// on, as after a crash. Nothing is lost either way: unacknowledged offsets are never
/// committed, so their commands are delivered again.
struct Member(Option<Arc<StreamConsumer<GroupContext>>>);

impl std::ops::Deref for Member {
    type Target = Arc<StreamConsumer<GroupContext>>;

    fn deref(&self) -> &Self::Target {
        // Only `drop` takes it.
        self.0.as_ref().expect("the consumer lives until the broker is dropped")
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let Some(consumer) = self.0.take() else {
            return;
        };
        let (left, leaving) = std::sync::mpsc::channel();
        let closing = std::thread::Builder::new()
            .name("kafka-leave".to_owned())
            .spawn(move || {
                drop(consumer);
                let _ = left.send(());
            });
        match closing {
            Ok(_) => {
                if leaving.recv_timeout(LEAVE_WAIT).is_err() {
                    tracing::warn!(
                        "kafka broker: the consumer did not leave its group within {LEAVE_WAIT:?} \
                         (server unreachable?); going on without it: the group's session \
                         timeout hands its partitions to the other members"
                    );
                }
            }
            // The closure, consumer included, was dropped here: it closed on this thread.
            Err(e) => tracing::warn!(error = %e, "kafka broker: no thread to leave the group on"),
        }
    }
}

/// Runs a blocking librdkafka call off the async workers.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::internal("kafka broker: blocking call failed").with_source(e))
}

#[async_trait]
impl Broker for KafkaBroker {
    fn name(&self) -> &'static str {
        "kafka"
    }

    async fn receive(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>> {
        let mut out = Vec::new();
        let first = match tokio::time::timeout(wait, self.consumer.recv()).await {
            Err(_) => return Ok(out),
            Ok(Err(e)) => return Err(unavailable("reading commands", e)),
            Ok(Ok(message)) => message,
        };
        out.push(self.remember(&first)?);
        drop(first);
        // Whatever librdkafka already fetched joins the batch without waiting.
        while out.len() < max.max(1) {
            match self.consumer.recv().now_or_never() {
                Some(Ok(message)) => out.push(self.remember(&message)?),
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "kafka broker: reading commands");
                    break;
                }
                None => break,
            }
        }
        Ok(out)
    }

    async fn ack(&self, tags: &[u64]) -> Result<()> {
        let commits = self.settle(tags)?;
        if commits.is_empty() {
            return Ok(());
        }
        let mut list = TopicPartitionList::new();
        for ((read, partition), offset) in commits {
            let topic = match read {
                Read::Commands => &self.config.commands_topic,
                Read::Delayed => &self.config.delay_topic,
            };
            list.add_partition_offset(topic, partition, Offset::Offset(offset))
            .map_err(|e| Error::internal("kafka broker: offset list").with_source(e))?;
        }
        let consumer = self.consumer.clone();
        blocking(move || consumer.commit(&list, CommitMode::Sync))
            .await?
            .map_err(|e| unavailable("committing offsets", e))
    }

    async fn publish(&self, events: &[OutboundEvent]) -> Result<Vec<Undelivered>> {
        let ids: Vec<String> = events.iter().map(|e| e.id.to_string()).collect();
        // A record for a topic that does not exist waits out the whole delivery timeout, and
        // the batch with it: the target topics are looked up first (one found is trusted for a
        // while), and a record for one that is missing or cannot be used now (its metadata
        // came with an error) is refused alone (retried later).
        let producer = self.producer();
        // Only the topics of routes that parse: one that does not is refused below, alone.
        let targeted: Vec<(&str, &str)> = events
            .iter()
            .filter_map(|e| {
                let route = target_route(e.target.as_ref()?, &self.config).ok()?;
                Some((e.key.tenant_id.as_str(), route.topic))
            })
            .collect();
        let known = self
            .topics
            .known(targeted, |topic| {
                let (config, producer, topic) = (&self.config, &producer, topic.to_owned());
                async move {
                    Ok(match topic_state(config, producer, &topic).await? {
                        TopicState::Usable => (None, LOOKUP_TTL),
                        TopicState::Missing => (Some("does not exist".to_owned()), MISSING_TTL),
                        TopicState::Unusable(code) => {
                            (Some(format!("cannot be used now ({code})")), MISSING_TTL)
                        }
                    })
                }
            })
            .await?;
        let mut unusable: HashMap<&str, Unusable> = known
            .found
            .into_iter()
            .filter_map(|(topic, why)| Some((topic, Unusable::Refused(why?))))
            .collect();
        for topic in known.later {
            unusable.insert(topic, Unusable::NotLookedUp);
        }
        let mut refused = Vec::new();
        let mut sends = Vec::with_capacity(events.len());
        for (index, (event, id)) in events.iter().zip(&ids).enumerate() {
            let route = match &event.target {
                Some(target) => match target_route(target, &self.config) {
                    Ok(route) => match unusable.get(route.topic) {
                        Some(unusable) => {
                            refused.push(unusable.undelivered(index, |why| {
                                format!("kafka broker: the target topic {} {why}", route.topic)
                            }));
                            continue;
                        }
                        None => route,
                    },
                    Err(why) => {
                        // Stored before the broker's limits were checked at admission.
                        let error = Error::invalid(format!("kafka broker: target: {why}"));
                        refused.push(Undelivered::new(index, error));
                        continue;
                    }
                },
                None => Route {
                    topic: &self.config.events_topic,
                    key: Some(&event.key.tenant_id),
                    partition: None,
                },
            };
            let mut record = FutureRecord::<str, [u8]>::to(route.topic)
                .payload(&event.body)
                .headers(headers_of(event, id));
            if let Some(key) = route.key {
                record = record.key(key);
            }
            if let Some(partition) = route.partition {
                record = record.partition(partition);
            }
            // A full local queue fails the batch at once (retried later) instead of adding its
            // wait to the delivery timeout.
            let send = producer.send(record, Duration::ZERO);
            sends.push(send.map(move |r| (index, route.topic, r)));
        }
        let results = futures::future::join_all(sends).await;
        let what = |topic: &str| format!("publishing events to {topic}");
        let failed: Vec<(usize, &str, KafkaError)> = results
            .into_iter()
            .filter_map(|(index, topic, r)| r.err().map(|(e, _)| (index, topic, e)))
            .collect();
        if !failed.is_empty() {
            self.after_failure(producer);
        }
        if refused.is_empty() && failed.len() == events.len() {
            // Nothing went out: the broker (not one record) is the problem.
            if let Some((_, topic, first)) = failed.into_iter().next() {
                return Err(delivery_failed(what(topic), first));
            }
            return Ok(Vec::new());
        }
        // Some records were refused on their own (too large, their partition's leader
        // unavailable, a target topic that does not exist): the others are delivered.
        refused.extend(
            failed
                .into_iter()
                .map(|(index, topic, e)| Undelivered::new(index, delivery_failed(what(topic), e))),
        );
        refused.sort_by_key(|u| u.index);
        Ok(refused)
    }

    fn check_target(&self, target: &Target) -> std::result::Result<String, String> {
        target_route(target, &self.config).map(|route| route.topic.to_owned())
    }

    fn events_destination(&self, _key: &TimerKey) -> Option<String> {
        Some(self.config.events_topic.clone())
    }

    async fn dead_letter(&self, body: &[u8], reason: &str) -> Result<()> {
        let headers = OwnedHeaders::new().insert(Header {
            key: REASON_HEADER,
            value: Some(reason.as_bytes()),
        });
        let record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&self.config.dead_letter_topic)
            .payload(body)
            .headers(headers);
        let producer = self.producer();
        match producer.send(record, Duration::ZERO).await {
            Ok(_) => Ok(()),
            Err((e, _)) => {
                self.after_failure(producer);
                Err(delivery_failed(
                    format!("dead-lettering to {}", self.config.dead_letter_topic),
                    e,
                ))
            }
        }
    }

    async fn health(&self) -> Result<()> {
        let producer = self.producer();
        if let Some((code, reason)) = producer.client().fatal_error() {
            // Made anew here too (a fire may be far off, and HTTP schedules do not come to an
            // instance out of the rotation), but not at every probe while the error comes back.
            let recently = self
                .remade
                .lock()
                .ok()
                .and_then(|at| *at)
                .is_some_and(|at| at.elapsed() < REMAKE_FROM_HEALTH_EVERY);
            let made = !recently && self.after_failure(producer);
            let next = if made { "made anew" } else { "made anew at the next failed publish" };
            return Err(Error::unavailable(format!(
                "kafka broker: the producer hit a fatal error ({code:?}: {reason}); {next}"
            )));
        }
        topic_exists(&self.config, &producer, &self.config.commands_topic)
            .await?
            .then_some(())
            .ok_or_else(|| {
                Error::unavailable(format!(
                    "kafka broker: topic {} is gone",
                    self.config.commands_topic
                ))
            })
    }
}
