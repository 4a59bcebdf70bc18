use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use timer_core::config::duration;
use timer_core::{Error, Result};

/// Config section of `broker.kind = "kafka"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KafkaConfig {
    /// Always `kafka`; checked by the binary.
    pub kind: String,
    /// Bootstrap servers, `host:port[,host:port...]` (librdkafka `bootstrap.servers`).
    pub brokers: String,
    /// The consumer group every instance joins; the command partitions are split among them.
    pub group_id: String,
    /// The topic commands arrive on.
    pub commands_topic: String,
    /// The topic `DueTimeReached` events go to, keyed by tenant.
    pub events_topic: String,
    /// The topic rejected commands go to (reason in the `timer-dead-letter-reason` header).
    pub dead_letter_topic: String,
    /// Create missing topics at start-up with the admin API. When off, or when the broker
    /// refuses, a missing topic stops the start with an error naming it.
    pub create_topics: bool,
    /// Partitions and replication factor of topics the service creates.
    pub partitions: i32,
    pub replication_factor: i32,
    /// How long connecting, metadata and admin requests may take.
    #[serde(with = "duration")]
    pub connect_timeout: Duration,
    /// How long a publish may wait for the broker's acknowledgement (`message.timeout.ms`);
    /// keep it below the engine's lease so a stuck publish is retried by this instance.
    #[serde(with = "duration")]
    pub publish_timeout: Duration,
    /// Extra librdkafka properties for every client (consumer, producer, admin), e.g.
    /// `security.protocol = "SASL_SSL"`, `sasl.mechanisms = "SCRAM-SHA-512"`,
    /// `sasl.username`, `sasl.password`, `ssl.ca.location`. They override the service's own
    /// settings, except the ones its guarantees rest on (see [`FIXED_PROPERTIES`]).
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
        ] {
            if value.is_empty() {
                return Err(Error::config(format!("{key} is empty")));
            }
        }
        if self.commands_topic == self.events_topic
            || self.commands_topic == self.dead_letter_topic
            || self.events_topic == self.dead_letter_topic
        {
            return Err(Error::config(
                "broker.commands_topic, broker.events_topic and broker.dead_letter_topic must \
                 be three different topics",
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
            create_topics: true,
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
    fn defaults_pass_and_mistakes_are_named() {
        assert!(KafkaConfig::default().check().is_ok());
        let refused = |config: KafkaConfig| config.check().unwrap_err().to_string();
        let same = KafkaConfig {
            events_topic: "timer.commands".into(),
            ..KafkaConfig::default()
        };
        assert!(refused(same).contains("three different"));
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
