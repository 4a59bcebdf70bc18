//! An independent NATS client on one config's streams, for tests: publishes commands as a
//! producing service would and reads the event and dead-letter streams from the start.

use std::any::Any;
use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use async_trait::async_trait;
use futures::StreamExt;
use timer_core::plugin::{
    DelayedMessage, DelayedUntil, ReadDeadLetter, ReadEvent, ReadMessage, TestClient,
};
use timer_core::{Broker, Error, Result, Target};

use super::streams::ensure_stream;
use super::{
    connect_client, testing_targets, NatsBroker, NatsConfig, CONTENT_TYPE, DELAY_HEADER,
    DELIVER_AT_HEADER, REASON_HEADER, TENANT_HEADER,
};

pub struct NatsTestClient {
    pub config: NatsConfig,
    pub js: jetstream::Context,
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> Error {
    Error::unavailable(format!("nats test client: {what}: {e}"))
}

impl NatsTestClient {
    /// Creates the streams and the consumer (through the plugin, as the service does), so
    /// commands can be sent before a connect.
    pub async fn new(config: NatsConfig) -> Result<Self> {
        drop(NatsBroker::connect(&config).await?);
        let js = jetstream::new(connect_client(&config).await?);
        Ok(NatsTestClient { config, js })
    }

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
impl TestClient for NatsTestClient {
    async fn connect(&self) -> Result<Box<dyn Broker>> {
        Ok(Box::new(NatsBroker::connect(&self.config).await?))
    }
    async fn send_command(&self, body: &[u8]) -> Result<()> {
        self.send_commands(&[body.to_vec()]).await
    }
    async fn send_command_with_headers(
        &self,
        body: &[u8],
        headers: &BTreeMap<String, String>,
    ) -> Result<()> {
        let subject = self.config.commands_subject.replace('>', "test");
        let mut map = async_nats::HeaderMap::new();
        for (name, value) in headers {
            map.insert(name.as_str(), value.as_str());
        }
        self.js
            .publish_with_headers(subject, map, body.to_vec().into())
            .await
            .map_err(|e| unavailable("publish", e))?
            .await
            .map_err(|e| unavailable("PubAck", e))?;
        Ok(())
    }
    async fn send_commands(&self, bodies: &[Vec<u8>]) -> Result<()> {
        let subject = self.config.commands_subject.replace('>', "test");
        for chunk in bodies.chunks(1_000) {
            let mut acks = Vec::with_capacity(chunk.len());
            for body in chunk {
                acks.push(
                    self.js
                        .publish(subject.clone(), body.clone().into())
                        .await
                        .map_err(|e| unavailable("publish", e))?,
                );
            }
            for ack in futures::future::join_all(
                acks.into_iter().map(std::future::IntoFuture::into_future),
            )
            .await
            {
                ack.map_err(|e| unavailable("PubAck", e))?;
            }
        }
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
                headers: headers_of(&m),
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
    /// A subject under `<events_subject>_targets`, captured by a stream of the test client.
    async fn make_target(&self, name: &str) -> Result<Option<Target>> {
        let (stream, prefix) = testing_targets(&self.config);
        ensure_stream(&self.js, &self.config, &stream, format!("{prefix}.>"), "test targets")
            .await?;
        let mut fields = serde_json::Map::new();
        fields.insert("subject".into(), format!("{prefix}.{name}").into());
        Ok(Some(Target::new(fields)))
    }
    /// Publishes on `<delay_prefix>.<subject>`, a thousand awaiting their PubAck at a time.
    async fn send_delayed(&self, messages: &[DelayedMessage]) -> Result<bool> {
        for chunk in messages.chunks(1_000) {
            let mut acks = Vec::with_capacity(chunk.len());
            for m in chunk {
                let mut headers = async_nats::HeaderMap::new();
                for (name, value) in &m.headers {
                    headers.insert(name.as_str(), value.as_str());
                }
                match m.when {
                    DelayedUntil::DelayMs(ms) => headers.insert(DELAY_HEADER, ms.to_string()),
                    DelayedUntil::AtMs(ms) => headers.insert(DELIVER_AT_HEADER, ms.to_string()),
                }
                if let Some(id) = &m.id {
                    headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
                }
                if let Some(tenant) = &m.tenant {
                    headers.insert(TENANT_HEADER, tenant.as_str());
                }
                let subject = m.target.text("subject").unwrap_or_default();
                let on = format!("{}.{subject}", self.config.delay_prefix);
                acks.push(
                    self.js
                        .publish_with_headers(on, headers, m.body.clone().into())
                        .await
                        .map_err(|e| unavailable("publish", e))?,
                );
            }
            for ack in acks {
                ack.await.map_err(|e| unavailable("PubAck", e))?;
            }
        }
        Ok(true)
    }
    async fn read_target(&self, target: &Target) -> Result<Vec<ReadMessage>> {
        let (stream, _) = testing_targets(&self.config);
        let subject = target.text("subject").unwrap_or_default();
        let mut out = Vec::new();
        for m in self.read_all(&stream).await? {
            if m.subject.as_str() != subject {
                continue;
            }
            let headers = headers_of(&m);
            out.push(ReadMessage {
                id: headers
                    .get("Nats-Msg-Id")
                    .and_then(|v| uuid::Uuid::parse_str(v).ok()),
                content_type: headers.get(CONTENT_TYPE).cloned(),
                body: m.payload.to_vec(),
                headers,
                key: None,
                arrived_ms: m
                    .info()
                    .ok()
                    .map(|info| (info.published.unix_timestamp_nanos() / 1_000_000) as i64),
            });
        }
        Ok(out)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A message's headers, each name with its first value.
fn headers_of(m: &jetstream::Message) -> BTreeMap<String, String> {
    m.headers
        .iter()
        .flat_map(|h| h.iter())
        .filter_map(|(name, values)| {
            let value = values.first()?;
            Some((name.to_string(), value.as_str().to_owned()))
        })
        .collect()
}
