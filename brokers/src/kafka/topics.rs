//! What the cluster says of a topic (usable, missing, or unusable for a reason of its own), and
//! the service's own topics checked and created at start-up.

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{FutureProducer, Producer};
use rdkafka::types::RDKafkaErrorCode;
use timer_core::{Error, Result};

use super::{blocking, client_config, unavailable, KafkaConfig};

/// What the cluster says of a topic.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum TopicState {
    /// It exists, with partitions.
    Usable,
    /// It does not exist.
    Missing,
    /// It cannot be used now: its metadata came with this error (not authorized, its
    /// partitions' leader not elected yet, ...), which concerns it alone.
    Unusable(RDKafkaErrorCode),
}

impl TopicState {
    /// Of a topic's metadata: its error, if any, and how many partitions it has.
    fn of(error: Option<RDKafkaErrorCode>, partitions: usize) -> Self {
        match error {
            None if partitions > 0 => TopicState::Usable,
            None => TopicState::Missing,
            Some(RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic) => {
                TopicState::Missing
            }
            Some(code) => TopicState::Unusable(code),
        }
    }
}

/// What the cluster says of `topic`: a metadata request for it, naming the server when it
/// cannot be reached (an error of the whole broker, not of the topic).
pub(super) async fn topic_state(
    config: &KafkaConfig,
    producer: &FutureProducer,
    topic: &str,
) -> Result<TopicState> {
    let producer = producer.clone();
    let name = topic.to_owned();
    let timeout = config.connect_timeout;
    let metadata = blocking(move || producer.client().fetch_metadata(Some(&name), timeout))
        .await?
        .map_err(|e| unavailable(&format!("cannot reach {}", config.brokers), e))?;
    let Some(found) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Ok(TopicState::Missing);
    };
    Ok(TopicState::of(
        found.error().map(RDKafkaErrorCode::from),
        found.partitions().len(),
    ))
}

/// Whether `topic` exists; an error when it cannot be used, or the server cannot be reached.
pub(super) async fn topic_exists(config: &KafkaConfig, producer: &FutureProducer, topic: &str) -> Result<bool> {
    match topic_state(config, producer, topic).await? {
        TopicState::Usable => Ok(true),
        TopicState::Missing => Ok(false),
        TopicState::Unusable(code) => Err(unavailable(&format!("topic {topic}"), code)),
    }
}

/// Checks the four topics and creates the missing ones, or fails naming the topic.
pub(super) async fn ensure_topics(config: &KafkaConfig, producer: &FutureProducer) -> Result<()> {
    let mut missing = Vec::new();
    for (key, topic) in [
        ("broker.commands_topic", &config.commands_topic),
        ("broker.events_topic", &config.events_topic),
        ("broker.dead_letter_topic", &config.dead_letter_topic),
        ("broker.delay_topic", &config.delay_topic),
    ] {
        if !topic_exists(config, producer, topic).await? {
            if !config.create_topics {
                return Err(Error::config(format!(
                    "kafka broker: topic {topic} ({key}) does not exist and \
                     broker.create_topics is off"
                )));
            }
            missing.push(topic.as_str());
        }
    }
    create_topics(config, &missing).await
}

/// Creates `names` with `broker.partitions` and `broker.replication_factor` (one another
/// instance created meanwhile counts as created).
pub(crate) async fn create_topics(config: &KafkaConfig, names: &[&str]) -> Result<()> {
    if names.is_empty() {
        return Ok(());
    }
    let admin: AdminClient<DefaultClientContext> = client_config(config)
        .create()
        .map_err(|e| Error::config("kafka broker: admin client settings").with_source(e))?;
    let new: Vec<NewTopic<'_>> = names
        .iter()
        .map(|name| {
            NewTopic::new(
                name,
                config.partitions,
                TopicReplication::Fixed(config.replication_factor),
            )
        })
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(config.connect_timeout));
    let results = admin
        .create_topics(new.iter(), &options)
        .await
        .map_err(|e| unavailable("creating topics", e))?;
    for result in results {
        match result {
            Ok(name) => tracing::info!(
                topic = %name,
                partitions = config.partitions,
                "kafka broker: created topic"
            ),
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {} // another instance was quicker
            Err((name, code)) => {
                return Err(Error::config(format!(
                    "kafka broker: topic {name} does not exist and cannot be created: {code}; \
                     create it, or allow this client to create topics"
                )))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_topic_error_concerns_that_topic_alone() {
        assert_eq!(TopicState::of(None, 3), TopicState::Usable);
        assert_eq!(TopicState::of(None, 0), TopicState::Missing);
        for missing in [
            RDKafkaErrorCode::UnknownTopicOrPartition,
            RDKafkaErrorCode::UnknownTopic,
        ] {
            assert_eq!(TopicState::of(Some(missing), 0), TopicState::Missing);
        }
        // Refused to this producer, or not led yet: its records are refused alone.
        for unusable in [
            RDKafkaErrorCode::TopicAuthorizationFailed,
            RDKafkaErrorCode::LeaderNotAvailable,
        ] {
            assert_eq!(
                TopicState::of(Some(unusable), 1),
                TopicState::Unusable(unusable)
            );
        }
    }
}
