//! The streams and durable consumers the service uses: checked at start, and made again when
//! the server has lost them (see the README's "Streams the server lost").

use async_nats::jetstream::{self, consumer, stream, ErrorCode};
use timer_core::{Error, Result};

use super::{connect_client, testing_targets, unavailable, NatsConfig};

/// The durable consumers the service reads from.
pub(super) struct Consumers {
    pub(super) commands: consumer::PullConsumer,
    /// Of delayed messages (`broker.delay_stream`).
    pub(super) delays: consumer::PullConsumer,
}

/// The streams the service uses, in this order: commands, events, dead letters, delayed
/// messages. Each with the subject it captures and the config key that sets that subject.
fn own_streams(config: &NatsConfig) -> [(&str, String, &'static str); 4] {
    [
        (
            &config.commands_stream,
            config.commands_subject.clone(),
            "broker.commands_subject",
        ),
        (
            &config.events_stream,
            format!("{}.>", config.events_subject),
            "broker.events_subject",
        ),
        (
            &config.dead_letter_stream,
            config.dead_letter_subject.clone(),
            "broker.dead_letter_subject",
        ),
        (
            &config.delay_stream,
            format!("{}.>", config.delay_prefix),
            "broker.delay_prefix",
        ),
    ]
}

/// Deletes the streams of `config` (benchmarks and tests clean up with it); missing ones are
/// fine.
pub async fn delete_streams(config: &NatsConfig) -> Result<()> {
    let js = jetstream::new(connect_client(config).await?);
    let targets = testing_targets(config).0;
    let own = own_streams(config);
    for name in own.iter().map(|(name, _, _)| *name).chain([targets.as_str()]) {
        match js.delete_stream(name).await {
            Ok(_) => {}
            Err(e) if e.to_string().contains("not found") => {}
            Err(e) => return Err(unavailable(&format!("deleting stream {name}"), e)),
        }
    }
    Ok(())
}

/// Checks (or creates) every stream the service uses, and the consumers it reads with.
pub(super) async fn streams_and_consumers(
    js: &jetstream::Context,
    config: &NatsConfig,
) -> Result<Consumers> {
    let [commands, _, _, delays] = ensure_streams(js, config).await?;
    let [(_, commands_subject, _), _, _, (_, delays_subject, _)] = own_streams(config);
    let delays_consumer = format!("{}-delay", config.consumer);
    Ok(Consumers {
        commands: durable_consumer(&commands, config, &config.consumer, &commands_subject).await?,
        delays: durable_consumer(&delays, config, &delays_consumer, &delays_subject).await?,
    })
}

/// Checks (or creates) the streams of [`own_streams`], in its order.
pub(super) async fn ensure_streams(
    js: &jetstream::Context,
    config: &NatsConfig,
) -> Result<[stream::Stream; 4]> {
    let [commands, events, dead_letters, delays] = own_streams(config)
        .map(|(name, subject, key)| ensure_stream(js, config, name, subject, key));
    Ok([
        commands.await?,
        events.await?,
        dead_letters.await?,
        delays.await?,
    ])
}

/// The durable pull consumer `name` on `stream` of the messages on `subject`, shared by every
/// instance, with explicit acks and the config's ack wait and most pending; an existing one is
/// used as it is.
async fn durable_consumer(
    stream: &stream::Stream,
    config: &NatsConfig,
    name: &str,
    subject: &str,
) -> Result<consumer::PullConsumer> {
    let stream_name = &stream.cached_info().config.name;
    stream
        .get_or_create_consumer(
            name,
            consumer::pull::Config {
                durable_name: Some(name.to_owned()),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait: config.ack_wait,
                max_ack_pending: config.max_ack_pending,
                filter_subject: subject.to_owned(),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| unavailable(&format!("consumer {name} on stream {stream_name}"), e))
}

/// Checks that `name` exists and captures exactly `subject`, or creates it. An existing stream
/// that differs is an error saying what differs; it is never changed.
pub(super) async fn ensure_stream(
    js: &jetstream::Context,
    config: &NatsConfig,
    name: &str,
    subject: String,
    key: &str,
) -> Result<stream::Stream> {
    match js.get_stream(name).await {
        Ok(mut existing) => {
            let info = existing
                .info()
                .await
                .map_err(|e| unavailable(&format!("stream {name}"), e))?;
            let subjects = &info.config.subjects;
            if subjects.len() != 1 || subjects[0] != subject {
                return Err(Error::config(format!(
                    "nats broker: stream {name} exists with subjects {subjects:?}, but {key} \
                     needs [{subject:?}]; change the config or the stream (timer-service never \
                     changes an existing stream)"
                )));
            }
            Ok(existing)
        }
        Err(e)
            if matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(ref j)
                if j.error_code() == ErrorCode::STREAM_NOT_FOUND) =>
        {
            if !config.create_streams {
                return Err(Error::config(format!(
                    "nats broker: stream {name} does not exist and broker.create_streams is off"
                )));
            }
            js.create_stream(stream::Config {
                name: name.to_owned(),
                subjects: vec![subject],
                storage: stream::StorageType::File,
                duplicate_window: config.duplicate_window,
                ..Default::default()
            })
            .await
            .map_err(|e| unavailable(&format!("creating stream {name}"), e))
        }
        Err(e) => Err(unavailable(&format!("stream {name}"), e)),
    }
}
