use std::path::PathBuf;
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use timer_core::config::duration;

/// The NATS JetStream broker: commands from a stream through one durable pull consumer that
/// every instance shares, events to a stream of their own, dead letters to a third.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct NatsConfig {
    /// Always `nats`; checked by the binary.
    pub kind: String,
    /// One server: `nats://HOST:PORT`, or `tls://HOST:PORT` for TLS. A comma-separated list is
    /// not accepted; the client learns a cluster's other servers from the one it reaches. A
    /// `user:password@` in the URL logs in when `broker.user` and `broker.password` are not set,
    /// and a lone `TOKEN@` is a token (`broker.token` wins). `check-config` shows either as
    /// `***`.
    pub url: String,
    /// User for user and password authentication; give `broker.password` with it.
    pub user: Option<String>,
    /// Password for user and password authentication; give `broker.user` with it.
    pub password: Option<String>,
    /// Token authentication.
    pub token: Option<String>,
    /// NKey authentication: the user's seed (`SU…`).
    pub nkey: Option<String>,
    /// A `.creds` file (JWT and NKey seed), for decentralized authentication.
    pub credentials_file: Option<PathBuf>,
    /// Insist on TLS also with a `nats://` URL. A server that requires TLS gets it in any case.
    pub tls_required: bool,
    /// PEM file of the CA that signed the server certificate. Without it, a server certificate
    /// from a private CA fails with `invalid peer certificate: UnknownIssuer`.
    pub tls_root_cert: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS; give `broker.tls_client_key` with it.
    pub tls_client_cert: Option<PathBuf>,
    /// Client key (PEM) for mutual TLS; give `broker.tls_client_cert` with it.
    pub tls_client_key: Option<PathBuf>,
    /// How long connecting may take. When the first connection fails, `run` exits 1.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub connect_timeout: Duration,
    /// The JetStream stream that holds the commands.
    pub commands_stream: String,
    /// The one subject of the commands stream; producers publish to any subject it matches.
    pub commands_subject: String,
    /// The durable pull consumer on the commands stream, shared by every instance, with
    /// explicit acks: a command is acknowledged after the store committed it.
    pub consumer: String,
    /// A delivered command that is not acknowledged within this time is delivered again,
    /// possibly to another instance. Applies when the consumer is created.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub ack_wait: Duration,
    /// Most commands delivered and not yet acknowledged, across all instances. Applies when the
    /// consumer is created.
    pub max_ack_pending: i64,
    /// The stream that holds the `DueTimeReached` events.
    pub events_stream: String,
    /// An event goes to `<events_subject>.<tenant>`; the events stream captures
    /// `<events_subject>.>`.
    pub events_subject: String,
    /// The stream that holds rejected commands and `TimerFailed` envelopes.
    pub dead_letter_stream: String,
    /// The subject of dead letters; the reason is in the header `Timer-Dead-Letter-Reason`.
    pub dead_letter_subject: String,
    /// De-duplication window of the streams the service creates: JetStream drops a message whose
    /// `Nats-Msg-Id` (the envelope id) it has seen within this time.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub duplicate_window: Duration,
    /// Create the four streams when they are missing, at start-up and when the server has lost
    /// one while the service runs. `false`: a missing stream is an error (at start-up, the
    /// service does not start). An existing stream is checked, never changed.
    pub create_streams: bool,
    /// Bind each command to the tenant of its subject: the last token of the subject it was
    /// published on is the tenant (as events' subjects write it: every byte but letters,
    /// digits, `-` and `_` as `%XX`), and a command naming another `tenantId` is refused
    /// (`invalid_id`, a dead letter). With NATS permissions that allow a producer to publish
    /// only on `timer.commands.acme`, it can act on tenant `acme` alone. `false`: the tenant
    /// is the command's `tenantId`, whatever the subject.
    pub bind_tenant: bool,
    /// Delayed messages: a message published on `<delay_prefix>.<subject>` with the header
    /// `Timer-Delay` (milliseconds) or `Timer-Deliver-At` (RFC 3339, or epoch milliseconds) is
    /// stored as a timer and published at that time on `<subject>` with its own body and
    /// headers. Its `Nats-Msg-Id` is the timer's `serviceCallId` (without one, an id derived
    /// from its subject and body), its header `Timer-Tenant` the tenant (else
    /// `broker.delay_tenant`).
    pub delay_prefix: String,
    /// The stream that holds delayed messages until the service stored them (it captures
    /// `<delay_prefix>.>`), read by the durable consumer `<consumer>-delay`.
    pub delay_stream: String,
    /// The tenant of a delayed message without a `Timer-Tenant` header; with
    /// `broker.bind_tenant`, the only tenant delayed messages may name.
    pub delay_tenant: String,
}

impl NatsConfig {
    /// Checks what can be checked without a server: the URL and settings that go in pairs.
    /// `check-config` calls it; connecting does too.
    pub fn check(&self) -> timer_core::Result<()> {
        super::connect::check_endpoint(self)
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
            bind_tenant: false,
            delay_prefix: "delay".into(),
            delay_stream: "TIMER_DELAY".into(),
            delay_tenant: "default".into(),
        }
    }
}
