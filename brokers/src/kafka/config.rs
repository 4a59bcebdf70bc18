use std::collections::BTreeMap;
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use timer_core::config::duration;
use timer_core::{Error, Result};

/// The Kafka broker (through librdkafka): commands from a topic that the instances read as one
/// consumer group, events to a topic keyed by tenant, dead letters to a third topic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct KafkaConfig {
    /// Always `kafka`; checked by the binary.
    pub kind: String,
    /// Bootstrap servers, `HOST:PORT[,HOST:PORT...]` (librdkafka `bootstrap.servers`).
    pub brokers: String,
    /// The consumer group every instance joins; the partitions of the commands topic are split
    /// among its members. Auto-commit is off: an offset is committed after the store committed
    /// the commands before it. A new group reads every retained command again.
    pub group_id: String,
    /// The topic commands arrive on.
    pub commands_topic: String,
    /// The topic events are published to, keyed by tenant, with the envelope id in the header
    /// `timer-event-id`.
    pub events_topic: String,
    /// The topic rejected commands and `TimerFailed` envelopes go to; the reason is in the
    /// header `timer-dead-letter-reason`. The four topics (with `delay_topic`) must differ.
    pub dead_letter_topic: String,
    /// Create missing topics at start-up with the admin API. `false`: a missing topic is an
    /// error at start-up, naming the topic and its key. An existing topic is used as it is.
    pub create_topics: bool,
    /// Bind each command to the tenant of its record key: the key is the tenant id, and a
    /// command naming another `tenantId` (or without a key) is refused (`invalid_id`, a dead
    /// letter). Producers key commands by tenant anyway (it keeps a tenant's commands in
    /// order); with it, a gateway that fixes the key fixes the tenant (Kafka's ACLs cannot).
    /// `false`: the
    /// tenant is the command's `tenantId`, whatever the key.
    pub bind_tenant: bool,
    /// Delayed records: a record produced to this topic with the header `timer-delay`
    /// (milliseconds) or `timer-deliver-at` (RFC 3339, or epoch milliseconds) and the header
    /// `timer-target-topic` is stored as a timer and produced at that time to the target topic
    /// with its own key, value and headers. Its header `timer-id` is the timer's
    /// `serviceCallId` (without one, an id derived from its target topic, key and value), its
    /// header `timer-tenant` the tenant (else `broker.delay_tenant`). Read by the consumer group
    /// `broker.group_id` with the commands topic; created with the other topics.
    pub delay_topic: String,
    /// The tenant of a delayed record without a `timer-tenant` header; with
    /// `broker.bind_tenant`, the only tenant delayed records may name.
    pub delay_tenant: String,
    /// Partitions of the topics the service creates. At least 1.
    pub partitions: i32,
    /// Replication factor of the topics the service creates. At least 1.
    pub replication_factor: i32,
    /// How long connecting, metadata requests and topic creation may take. When the servers
    /// cannot be reached at start-up, `run` exits 1.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub connect_timeout: Duration,
    /// How long a publish may wait for the broker's acknowledgement (librdkafka
    /// `message.timeout.ms`). Must be below `engine.publish_timeout`, where the engine stops
    /// waiting, so no event arrives after a cancel that succeeded.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub publish_timeout: Duration,
    /// Extra librdkafka properties for every client (consumer, producer, admin): TLS, SASL,
    /// tuning, e.g. `"security.protocol" = "SASL_SSL"`. The ones the delivery guarantees rest on
    /// are refused: `bootstrap.servers`, `group.id`, `enable.auto.commit`,
    /// `enable.auto.offset.store`, `enable.idempotence`, `acks`, `request.required.acks`,
    /// `message.timeout.ms`, `delivery.timeout.ms` and `allow.auto.create.topics`.
    /// `check-config` shows values whose key contains `password`, `secret` or `token` as `***`.
    pub properties: BTreeMap<String, String>,
}

/// Properties the delivery guarantees rest on; setting them in `broker.properties` is an error.
pub const FIXED_PROPERTIES: &[&str] = &[
    "bootstrap.servers",
    "group.id",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "enable.idempotence",
    "acks",
    "request.required.acks",
    // The engine stops waiting for a publish after half of its lease; librdkafka must give up
    // by then too (broker.publish_timeout), or an event could arrive after a cancel succeeded.
    "message.timeout.ms",
    "delivery.timeout.ms",
    // Checking a topic must never create it (broker.create_topics decides).
    "allow.auto.create.topics",
];

impl KafkaConfig {
    /// The topics the service reads or writes itself, never a target: commands, events, dead
    /// letters, delayed records.
    pub fn own_topics(&self) -> [&str; 4] {
        [
            &self.commands_topic,
            &self.events_topic,
            &self.dead_letter_topic,
            &self.delay_topic,
        ]
    }

    /// Checks what can be checked without a server. `check-config` calls it; connecting does too.
    pub fn check(&self) -> Result<()> {
        if self.brokers.trim().is_empty() {
            return Err(Error::config(
                "broker.brokers is empty (e.g. \"127.0.0.1:9092\")",
            ));
        }
        for (key, value) in [
            ("broker.group_id", &self.group_id),
            ("broker.commands_topic", &self.commands_topic),
            ("broker.events_topic", &self.events_topic),
            ("broker.dead_letter_topic", &self.dead_letter_topic),
            ("broker.delay_topic", &self.delay_topic),
            ("broker.delay_tenant", &self.delay_tenant),
        ] {
            if value.is_empty() {
                return Err(Error::config(format!("{key} is empty")));
            }
        }
        let topics = self.own_topics();
        if (1..topics.len()).any(|i| topics[..i].contains(&topics[i])) {
            return Err(Error::config(
                "broker.commands_topic, broker.events_topic, broker.dead_letter_topic and \
                 broker.delay_topic must be four different topics",
            ));
        }
        if self.partitions < 1 {
            return Err(Error::config("broker.partitions must be at least 1"));
        }
        if self.replication_factor < 1 {
            return Err(Error::config(
                "broker.replication_factor must be at least 1",
            ));
        }
        if let Some(key) = self
            .properties
            .keys()
            .find(|k| FIXED_PROPERTIES.contains(&k.as_str()))
        {
            return Err(Error::config(format!(
                "broker.properties.{key:?} cannot be set: timer-service sets it itself (its \
                 delivery guarantees depend on it); use broker.brokers, broker.group_id, \
                 broker.publish_timeout or broker.create_topics instead"
            )));
        }
        Ok(())
    }
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            kind: "kafka".into(),
            brokers: "127.0.0.1:9092".into(),
            group_id: "timer-service".into(),
            commands_topic: "timer.commands".into(),
            events_topic: "timer.events".into(),
            dead_letter_topic: "timer.dead-letters".into(),
            delay_topic: "timer.delay".into(),
            delay_tenant: "default".into(),
            create_topics: true,
            bind_tenant: false,
            partitions: 3,
            replication_factor: 1,
            connect_timeout: Duration::from_secs(10),
            publish_timeout: Duration::from_secs(10),
            properties: BTreeMap::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_lists_every_fixed_property() {
        let schema = schemars::schema_for!(KafkaConfig);
        let doc = schema
            .get("properties")
            .and_then(|p| p.get("properties"))
            .and_then(|p| p.get("description"))
            .and_then(|d| d.as_str())
            .unwrap_or_default();
        for property in FIXED_PROPERTIES {
            assert!(doc.contains(&format!("`{property}`")), "{property}: {doc}");
        }
    }

    #[test]
    fn defaults_pass_and_mistakes_are_named() {
        assert!(KafkaConfig::default().check().is_ok());
        let refused = |config: KafkaConfig| config.check().unwrap_err().to_string();
        let same = KafkaConfig {
            events_topic: "timer.commands".into(),
            ..KafkaConfig::default()
        };
        assert!(refused(same).contains("four different"));
        let mut fixed = KafkaConfig::default();
        fixed
            .properties
            .insert("enable.auto.commit".into(), "true".into());
        let e = refused(fixed);
        assert!(e.contains("enable.auto.commit"), "{e}");
        let empty = KafkaConfig {
            brokers: " ".into(),
            ..KafkaConfig::default()
        };
        assert!(refused(empty).contains("broker.brokers"));
    }
}
