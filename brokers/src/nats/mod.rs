//! `nats`: NATS JetStream. Commands come from a durable pull consumer shared by every instance
//! and are acknowledged after the store committed them; events are published with
//! `Nats-Msg-Id` = envelope id, many in flight, and count as published only once every PubAck
//! arrived. The client reconnects by itself; a broken pull stream is opened again.
//!
//! The rest is the plugin's page of the book (`README.md` beside this file).
#![doc = include_str!("README.md")]

mod config;
mod connect;
mod delay;
mod outbound;
mod plugin;
mod streams;
#[cfg(feature = "testing")]
mod testing;

use std::collections::HashSet;
use std::future::IntoFuture;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_nats::header::HeaderMap;
use async_nats::jetstream::context::{GetStreamByNameErrorKind, PublishErrorKind};
use async_nats::jetstream::{self, AckKind};
use async_trait::async_trait;
use futures::future::join_all;
use futures::{FutureExt, StreamExt};
use timer_core::broker::{routing_token, tenant_of_token};
use timer_core::{
    Broker, Delivery, Error, KeyLimit, MessageMeta, OutboundEvent, Result, Target, TimerKey,
    TraceHeaders, Undelivered,
};

use crate::shared::{not_looked_up, DeliveryTags, Lookups, LOOKUP_TTL};

pub use config::NatsConfig;
pub use connect::connect_client;
pub use delay::{DELAY_HEADER, DELIVER_AT_HEADER, TENANT_HEADER};
pub use plugin::PLUGIN;
pub use streams::delete_streams;
use outbound::{
    headers_of, is_jetstream_header, refused_by_the_stream, target_subject, JETSTREAM_HEADERS,
    MAX_SUBJECT_BYTES,
};
pub use outbound::CONTENT_TYPE;
use streams::{ensure_streams, streams_and_consumers, Consumers};
#[cfg(feature = "testing")]
pub use plugin::TEST_SERVER;
#[cfg(feature = "testing")]
pub use testing::NatsTestClient;

/// Header carrying the reason of a dead letter.
pub const REASON_HEADER: &str = "Timer-Dead-Letter-Reason";

/// Commands and delayed messages as they arrive.
type Incoming = futures::stream::BoxStream<
    'static,
    std::result::Result<jetstream::Message, Box<dyn std::error::Error + Send + Sync>>,
>;

pub struct NatsBroker {
    client: async_nats::Client,
    js: jetstream::Context,
    /// What the streams and consumers are made from, again when the server lost them.
    config: NatsConfig,
    /// The reader's: made again with the streams before it opens after a failure.
    consumers: tokio::sync::Mutex<Consumers>,
    /// The open pull streams of both, merged; dropped and opened again after an error.
    messages: tokio::sync::Mutex<Option<Incoming>>,
    /// Reading failed: before the reader opens again, the streams and consumers are checked,
    /// and made again when the server has lost them (its JetStream store wiped, a stream
    /// deleted), so that the service does not read from nothing for ever.
    reader_failed: AtomicBool,
    /// A PubAck did not come (no stream took the event, or the connection dropped): the next
    /// publish first checks the streams, and makes again one the server has lost.
    publish_failed: AtomicBool,
    /// Delivered, not yet acknowledged.
    pending: DeliveryTags<jetstream::Message>,
    /// Target subjects: whether a stream captures each (else it gets a plain publish).
    captured: Lookups<bool>,
    events_subject: String,
    dead_letter_subject: String,
    /// The subjects the service reads or writes itself (commands, events, dead letters, delayed
    /// messages): never a timer's target.
    own_subjects: [String; 4],
    /// `broker.delay_prefix` and a dot: the start of a delayed message's subject.
    delay_prefix: String,
    delay_tenant: String,
    /// `broker.bind_tenant`: the subject's last token is the command's tenant.
    bind_tenant: bool,
    /// The commands consumer's ack wait as the server has it, in milliseconds (an existing
    /// consumer keeps its own; read again when the consumers are checked after a failure).
    ack_wait_ms: AtomicU64,
}

/// The commands consumer's ack wait as the server has it, in milliseconds.
fn ack_wait_ms(consumers: &Consumers) -> u64 {
    let ack_wait = consumers.commands.cached_info().config.ack_wait;
    u64::try_from(ack_wait.as_millis()).unwrap_or(u64::MAX)
}

fn unavailable(what: &str, e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Error {
    Error::unavailable(format!("nats broker: {what}")).with_source(e)
}

impl NatsBroker {
    /// Connects, checks (or creates) the streams and the shared consumer.
    pub async fn connect(config: &NatsConfig) -> Result<Self> {
        let client = connect_client(config).await?;
        // The engine bounds the events it publishes at once (`engine.batch_size`); the
        // client's own bound (5,000 by default) made concurrent batches above it wait for each
        // other's permits, each holding its own, until they timed out. (A publish cut off
        // leaves its PubAcks to the client for up to 30 s: far below this bound too.)
        let js = jetstream::ContextBuilder::new()
            .max_ack_inflight(MAX_ACKS_IN_FLIGHT)
            .build(client.clone());
        let consumers = streams_and_consumers(&js, config).await?;
        let ack_wait_ms = AtomicU64::new(ack_wait_ms(&consumers));
        Ok(NatsBroker {
            client,
            js,
            config: config.clone(),
            consumers: tokio::sync::Mutex::new(consumers),
            reader_failed: AtomicBool::new(false),
            publish_failed: AtomicBool::new(false),
            delay_prefix: format!("{}.", config.delay_prefix),
            delay_tenant: config.delay_tenant.clone(),
            ack_wait_ms,
            messages: tokio::sync::Mutex::new(None),
            pending: DeliveryTags::new("nats"),
            captured: Lookups::new(),
            events_subject: config.events_subject.clone(),
            dead_letter_subject: config.dead_letter_subject.clone(),
            own_subjects: [
                config.commands_subject.clone(),
                format!("{}.>", config.events_subject),
                config.dead_letter_subject.clone(),
                format!("{}.>", config.delay_prefix),
            ],
            bind_tenant: config.bind_tenant,
        })
    }

    fn remember(&self, message: jetstream::Message) -> Result<Delivery> {
        let trace = message
            .headers
            .as_ref()
            .map(|headers| {
                TraceHeaders::from_pairs(headers.iter().flat_map(|(name, values)| {
                    values.iter().map(move |v| (name.as_ref(), v.as_str()))
                }))
            })
            .unwrap_or_default();
        // A delayed message is the ScheduleTimer it stands for; with `bind_tenant`, bound to
        // `broker.delay_tenant`.
        if let Some(target) = message.subject.as_str().strip_prefix(&self.delay_prefix) {
            let body = delay::command_of(&message, target, &self.delay_tenant);
            let tenant = self.bind_tenant.then(|| self.delay_tenant.clone());
            return self.pending.remember(message, body, tenant, trace);
        }
        let body = message.payload.to_vec();
        let tenant = self.bind_tenant.then(|| {
            let token = message.subject.rsplit('.').next().unwrap_or_default();
            // A token that is not one names no tenant: no tenantId matches it.
            tenant_of_token(token).unwrap_or_else(|| format!("(not a tenant token: {token})"))
        });
        self.pending.remember(message, body, tenant, trace)
    }

    /// After a PubAck that did not come (no stream took the message: the server may have lost
    /// it), checks the streams and makes again those the server lost, before the next publish;
    /// again before the one after when that fails (or is cut off).
    async fn streams_again_after_a_lost_puback(&self) -> Result<()> {
        if self.publish_failed.load(Ordering::SeqCst) {
            ensure_streams(&self.js, &self.config).await?;
            self.publish_failed.store(false, Ordering::SeqCst);
        }
        Ok(())
    }

    /// Drops the reader after an error: the next receive checks the streams and consumers (and
    /// makes again what the server lost, a deleted consumer's error being one such) first.
    fn close_reader(&self, reader: &mut Option<Incoming>) {
        *reader = None;
        self.reader_failed.store(true, Ordering::SeqCst);
    }

    /// The subject of a tenant's events, when it fits [`MAX_SUBJECT_BYTES`].
    fn event_subject(&self, tenant: &str) -> std::result::Result<String, KeyLimit> {
        let subject = format!("{}.{}", self.events_subject, routing_token(tenant));
        if subject.len() > MAX_SUBJECT_BYTES {
            return Err(KeyLimit {
                field: "tenantId",
                message: format!(
                    "makes the event subject {} bytes; at most {MAX_SUBJECT_BYTES} fit the NATS \
                     protocol line (every byte but letters, digits, - and _ takes 3)",
                    subject.len()
                ),
            });
        }
        Ok(subject)
    }

    /// Awaits the PubAcks of a batch's publishes. A stream that answered no to one message
    /// (full with discard new, ...) refuses that event alone: the others it took stay taken.
    /// An answer that did not come (a timeout, a lost connection) fails the batch, which may
    /// be half sent.
    async fn pub_acks(
        &self,
        acks: Vec<(usize, jetstream::context::PublishAckFuture)>,
        undelivered: &mut Vec<Undelivered>,
    ) -> Result<()> {
        let (indexes, acks): (Vec<usize>, Vec<_>) = acks.into_iter().unzip();
        let answers = join_all(acks.into_iter().map(IntoFuture::into_future)).await;
        for (index, answer) in indexes.into_iter().zip(answers) {
            match answer {
                Ok(_) => {}
                Err(e) if refused_by_the_stream(&e) => {
                    let error = Error::unavailable(format!(
                        "nats broker: the stream refused the event: {}; it is retried",
                        timer_core::error::one_line(&e)
                    ));
                    undelivered.push(Undelivered::new(index, error));
                }
                Err(e) => {
                    self.publish_failed.store(true, Ordering::SeqCst);
                    return Err(unavailable("awaiting a PubAck", e));
                }
            }
        }
        Ok(())
    }
}

/// Room kept in a dead letter's `max_payload` for the header block around its reason and the
/// words a cut body adds to it.
const DEAD_LETTER_HEADROOM: usize = 256;

/// Most PubAcks one publish leaves un-awaited (each holds one of the JetStream context's
/// [`MAX_ACKS_IN_FLIGHT`] permits, and its future, until it is awaited): bounds what a large
/// batch holds.
const ACKS_AT_ONCE: usize = 1_000;

/// The JetStream context's permits for publishes waiting for their PubAck: far above what the
/// engine sends at once (`engine.batch_size`), which is the bound that counts.
const MAX_ACKS_IN_FLIGHT: usize = 1 << 20;

/// The stream (and the subjects it captures) the test client makes its targets in.
fn testing_targets(config: &NatsConfig) -> (String, String) {
    (
        format!("{}_TARGETS", config.events_stream),
        format!("{}_targets", config.events_subject),
    )
}

#[async_trait]
impl Broker for NatsBroker {
    fn name(&self) -> &'static str {
        "nats"
    }

    async fn receive(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>> {
        let mut guard = self.messages.lock().await;
        if guard.is_none() {
            // Cleared once the reader is open: an open that fails repairs next time.
            let repair = self.reader_failed.swap(true, Ordering::SeqCst);
            let mut consumers = self.consumers.lock().await;
            if repair {
                *consumers = streams_and_consumers(&self.js, &self.config).await?;
                self.ack_wait_ms
                    .store(ack_wait_ms(&consumers), Ordering::SeqCst);
            }
            let batch = max.clamp(1, 10_000);
            let commands = consumers
                .commands
                .stream()
                .max_messages_per_batch(batch)
                .messages()
                .await
                .map_err(|e| unavailable("opening the command stream", e))?;
            let delays = consumers
                .delays
                .stream()
                .max_messages_per_batch(batch)
                .messages()
                .await
                .map_err(|e| unavailable("opening the stream of delayed messages", e))?;
            let incoming = futures::stream::select(
                commands.map(|m| m.map_err(|e| e.into())),
                delays.map(|m| m.map_err(|e| e.into())),
            );
            *guard = Some(incoming.boxed());
            self.reader_failed.store(false, Ordering::SeqCst);
        }
        let Some(stream) = guard.as_mut() else {
            return Ok(Vec::new());
        };
        let first = match tokio::time::timeout(wait, stream.next()).await {
            Err(_) => return Ok(Vec::new()),
            Ok(Some(Ok(message))) => message,
            Ok(Some(Err(e))) => {
                self.close_reader(&mut guard);
                return Err(unavailable("reading commands", e));
            }
            Ok(None) => {
                self.close_reader(&mut guard);
                return Err(Error::unavailable("nats broker: the command stream ended"));
            }
        };
        let mut out = vec![self.remember(first)?];
        // Take what has already arrived, without waiting for more.
        while out.len() < max {
            match stream.next().now_or_never() {
                Some(Some(Ok(message))) => out.push(self.remember(message)?),
                Some(Some(Err(e))) => {
                    tracing::warn!(error = %e, "nats broker: command stream error; reopening");
                    self.close_reader(&mut guard);
                    break;
                }
                _ => break,
            }
        }
        Ok(out)
    }

    async fn ack(&self, tags: &[u64]) -> Result<()> {
        for message in &self.pending.take(tags)? {
            message
                .ack()
                .await
                .map_err(|e| unavailable("acknowledging a command", e))?;
        }
        self.client
            .flush()
            .await
            .map_err(|e| unavailable("flushing acknowledgements", e))
    }

    fn ack_wait(&self) -> Option<Duration> {
        Some(Duration::from_millis(
            self.ack_wait_ms.load(Ordering::SeqCst),
        ))
    }

    /// An in-progress acknowledgement (`+WPI`) per command: JetStream restarts its ack wait.
    /// Naks what the engine received and did not acknowledge, and what the pull stream holds
    /// that it never saw: JetStream delivers a nak'ed message again at once, to whichever
    /// consumer asks next, where an unacknowledged one waits for the ack wait (30 s by
    /// default). What the server is sending at this moment still waits for it.
    async fn give_back(&self) -> Result<()> {
        let mut handed = self.pending.take_all()?;
        if let Some(mut stream) = self.messages.lock().await.take() {
            while let Some(Some(Ok(message))) = stream.next().now_or_never() {
                handed.push(message);
            }
        }
        if handed.is_empty() {
            return Ok(());
        }
        for message in &handed {
            message
                .ack_with(AckKind::Nak(None))
                .await
                .map_err(|e| unavailable("handing back a command (nak)", e))?;
        }
        self.client
            .flush()
            .await
            .map_err(|e| unavailable("flushing the naks", e))?;
        tracing::info!(
            commands = handed.len(),
            "nats broker: handed back the commands not acknowledged, for another instance"
        );
        Ok(())
    }

    async fn keep(&self, tags: &[u64]) -> Result<()> {
        for message in &self.pending.get(tags)? {
            message
                .ack_with(AckKind::Progress)
                .await
                .map_err(|e| unavailable("keeping a held command (in-progress ack)", e))?;
        }
        self.client
            .flush()
            .await
            .map_err(|e| unavailable("flushing in-progress acknowledgements", e))
    }

    fn check_key(&self, key: &TimerKey) -> std::result::Result<(), KeyLimit> {
        self.event_subject(&key.tenant_id).map(|_| ())
    }

    async fn publish(&self, events: &[OutboundEvent]) -> Result<Vec<Undelivered>> {
        self.streams_again_after_a_lost_puback().await?;
        // A target subject a stream captures gets a JetStream publish, confirmed by the stream;
        // one no stream captures a plain publish (a JetStream publish there would reach its
        // subscribers and then wait for a PubAck that never comes, and go out again on retry).
        // Subjects it may publish to only: another is refused below, alone.
        let targeted: Vec<(&str, &str)> = events
            .iter()
            .filter_map(|e| {
                let subject = target_subject(e.target.as_ref()?, &self.own_subjects).ok()?;
                Some((e.key.tenant_id.as_str(), subject))
            })
            .collect();
        let known = self
            .captured
            .known(targeted, |subject| {
                let subject = subject.to_owned();
                async move {
                match self.js.stream_by_subject(subject.as_str()).await {
                    Ok(_) => Ok((true, LOOKUP_TTL)),
                    Err(e) if e.kind() == GetStreamByNameErrorKind::NotFound => {
                        Ok((false, LOOKUP_TTL))
                    }
                    // Refused below (check_target): it is not a subject at all.
                    Err(e) if e.kind() == GetStreamByNameErrorKind::InvalidSubject => {
                        Ok((true, LOOKUP_TTL))
                    }
                    Err(e) => Err(unavailable(
                        &format!("looking up the stream of subject {subject}"),
                        e,
                    )),
                }
                }
            })
            .await?;
        let plain_subjects: HashSet<&str> = known
            .found
            .iter()
            .filter_map(|(subject, captured)| (!captured).then_some(*subject))
            .collect();
        let later: HashSet<&str> = known.later.into_iter().collect();
        let mut acks = Vec::with_capacity(events.len());
        let mut undelivered = Vec::new();
        let mut plain = 0;
        for (index, event) in events.iter().enumerate() {
            let subject = match &event.target {
                Some(target) => target_subject(target, &self.own_subjects)
                    .map(str::to_owned)
                    .map_err(|why| Error::invalid(format!("nats broker: target: {why}"))),
                None => self.event_subject(&event.key.tenant_id).map_err(|limit| {
                    Error::invalid(format!("nats broker: {} {}", limit.field, limit.message))
                }),
            };
            let subject = match subject {
                Ok(subject) if later.contains(subject.as_str()) => {
                    let error = Error::unavailable(format!(
                        "nats broker: subject {subject} {}; it is sent later",
                        not_looked_up()
                    ));
                    undelivered.push(Undelivered::deferred(index, error));
                    continue;
                }
                Ok(subject) => subject,
                Err(error) => {
                    // Stored before the broker's limits were checked at admission.
                    undelivered.push(Undelivered::new(index, error));
                    continue;
                }
            };
            let headers = headers_of(event);
            // An event over the server's max_payload (with its headers) fails alone.
            let too_large = |e: &dyn std::fmt::Display| {
                let error = Error::invalid(format!(
                    "nats broker: the event is larger than the server takes (its max_payload): \
                     {e}"
                ));
                Undelivered::new(index, error)
            };
            if plain_subjects.contains(subject.as_str()) {
                match self
                    .client
                    .publish_with_headers(subject, headers, event.body.clone().into())
                    .await
                {
                    Ok(()) => plain += 1,
                    Err(e) if e.kind() == async_nats::client::PublishErrorKind::MaxPayloadExceeded => {
                        undelivered.push(too_large(&e));
                    }
                    Err(e) => return Err(unavailable("publishing to a target", e)),
                }
                continue;
            }
            match self
                .js
                .publish_with_headers(subject, headers, event.body.clone().into())
                .await
            {
                Ok(ack) => acks.push((index, ack)),
                Err(e) if e.kind() == PublishErrorKind::MaxPayloadExceeded => {
                    undelivered.push(too_large(&e));
                }
                Err(e) => return Err(unavailable("publishing an event", e)),
            }
            // A PubAck not awaited holds one of the context's permits (and its future): a
            // batch awaits them every ACKS_AT_ONCE publishes.
            if acks.len() >= ACKS_AT_ONCE {
                self.pub_acks(std::mem::take(&mut acks), &mut undelivered)
                    .await?;
            }
        }
        self.pub_acks(acks, &mut undelivered).await?;
        undelivered.sort_by_key(|u| u.index);
        if plain > 0 {
            self.client
                .flush()
                .await
                .map_err(|e| unavailable("flushing plain publishes to targets", e))?;
        }
        Ok(undelivered)
    }

    fn check_target(&self, target: &Target) -> std::result::Result<String, String> {
        target_subject(target, &self.own_subjects).map(str::to_owned)
    }

    fn check_message(&self, meta: &MessageMeta) -> std::result::Result<(), String> {
        match meta.headers.keys().find(|name| is_jetstream_header(name)) {
            Some(name) => Err(format!(
                "message.headers.{name}: a header starting with {JETSTREAM_HEADERS} is an \
                 instruction to the stream that stores the event (Nats-Expected-Stream, \
                 Nats-Rollup, ...), not part of the message; the service sets Nats-Msg-Id itself"
            )),
            None => Ok(()),
        }
    }

    fn events_destination(&self, key: &TimerKey) -> Option<String> {
        self.event_subject(&key.tenant_id).ok()
    }

    async fn dead_letter(&self, body: &[u8], reason: &str) -> Result<()> {
        let mut headers = HeaderMap::new();
        // Header values are one line.
        let mut reason: String = reason
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        // Whole, it must fit the server's max_payload with its header: one refused every time
        // would be retried for ever, and hold every command behind it.
        let room = self
            .client
            .server_info()
            .max_payload
            .saturating_sub(REASON_HEADER.len() + reason.len() + DEAD_LETTER_HEADROOM);
        let body = if body.len() > room {
            reason.push_str(&format!(
                " (the dead letter holds its first {room} of {} bytes: the server's max_payload)",
                body.len()
            ));
            &body[..room]
        } else {
            body
        };
        headers.insert(REASON_HEADER, reason.as_str());
        self.streams_again_after_a_lost_puback().await?;
        self.js
            .publish_with_headers(
                self.dead_letter_subject.clone(),
                headers,
                body.to_vec().into(),
            )
            .await
            .map_err(|e| unavailable("publishing a dead letter", e))?
            .await
            .map_err(|e| {
                self.publish_failed.store(true, Ordering::SeqCst);
                unavailable("awaiting the dead letter's PubAck", e)
            })?;
        Ok(())
    }

    async fn health(&self) -> Result<()> {
        match self.client.connection_state() {
            async_nats::connection::State::Connected => {}
            state => {
                return Err(Error::unavailable(format!(
                    "nats broker: connection {state}"
                )))
            }
        }
        // A round trip to the server: a connection cut off without a close still reads as
        // connected until the client's pings fail (minutes).
        self.client
            .request("$JS.API.INFO", Vec::new().into())
            .await
            .map(|_| ())
            .map_err(|e| unavailable("no answer to a JetStream request ($JS.API.INFO)", e))
    }
}
