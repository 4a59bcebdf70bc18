use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use timer_core::config::duration;

/// Config section of `broker.kind = "nats"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsConfig {
    /// Always `nats`; checked by the binary.
    pub kind: String,
    /// Server URL: `nats://127.0.0.1:4222` (`tls://` for TLS). A `user:password@` in it is
    /// used when `user`/`password` are not set.
    pub url: String,
    /// User and password authentication.
    pub user: Option<String>,
    pub password: Option<String>,
    /// Token authentication.
    pub token: Option<String>,
    /// NKey seed (`SU...`) authentication.
    pub nkey: Option<String>,
    /// A `.creds` file (JWT + NKey seed).
    pub credentials_file: Option<PathBuf>,
    /// Require TLS even for `nats://` URLs.
    pub tls_required: bool,
    /// PEM file of the CA that signed the server certificate.
    pub tls_root_cert: Option<PathBuf>,
    /// Client certificate and key (PEM) for mutual TLS.
    pub tls_client_cert: Option<PathBuf>,
    pub tls_client_key: Option<PathBuf>,
    /// How long connecting may take.
    #[serde(with = "duration")]
    pub connect_timeout: Duration,
    /// The JetStream stream holding commands, and the subjects it captures.
    pub commands_stream: String,
    pub commands_subject: String,
    /// The durable pull consumer all instances share.
    pub consumer: String,
    /// A delivered command not acknowledged within this time is delivered again.
    #[serde(with = "duration")]
    pub ack_wait: Duration,
    /// Most commands delivered and not yet acknowledged, across all instances.
    pub max_ack_pending: i64,
    /// The stream holding `DueTimeReached` events; events go to `<events_subject>.<tenant>`.
    pub events_stream: String,
    pub events_subject: String,
    /// The stream and subject of dead letters (rejected commands, reason in a header).
    pub dead_letter_stream: String,
    pub dead_letter_subject: String,
    /// How long JetStream remembers an envelope id to drop a duplicate publish.
    #[serde(with = "duration")]
    pub duplicate_window: Duration,
    /// Create missing streams at start-up (an existing stream is checked, never changed).
    pub create_streams: bool,
}

impl NatsConfig {
    /// Checks what can be checked without a server: the URL and settings that go in pairs.
    /// `check-config` calls it; connecting does too.
    pub fn check(&self) -> timer_core::Result<()> {
        super::connect_target(self).map(|_| ())
    }
}

impl Default for NatsConfig {
    fn default() -> Self {
        NatsConfig {
            kind: "nats".into(),
            url: "nats://127.0.0.1:4222".into(),
            user: None,
            password: None,
            token: None,
            nkey: None,
            credentials_file: None,
            tls_required: false,
            tls_root_cert: None,
            tls_client_cert: None,
            tls_client_key: None,
            connect_timeout: Duration::from_secs(5),
            commands_stream: "TIMER_COMMANDS".into(),
            commands_subject: "timer.commands.>".into(),
            consumer: "timer-service".into(),
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 10_000,
            events_stream: "TIMER_EVENTS".into(),
            events_subject: "timer.events".into(),
            dead_letter_stream: "TIMER_DEAD_LETTERS".into(),
            dead_letter_subject: "timer.deadletters".into(),
            duplicate_window: Duration::from_secs(120),
            create_streams: true,
        }
    }
}
