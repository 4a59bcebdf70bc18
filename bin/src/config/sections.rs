//! The binary's own sections: `[http]` (the API, its limits, access and TLS) and `[log]`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use timer_core::config::duration;

use super::auth::{ApiKey, JwtConfig};

/// The HTTP API, with health and metrics on the same address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// Address of the API, health and metrics. Without `http.token`, `http.keys` or `http.jwt`
    /// the API has no authentication: bind it to a private address, or set one.
    #[schemars(with = "String")]
    pub addr: SocketAddr,
    /// Longest a request may take (not the event stream); a slower one is answered 408.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub request_timeout: Duration,
    /// When set, every `/v1/...` request (the event stream too) needs `Authorization: Bearer
    /// <token>` (or a key of `http.keys`, or a JWT of `http.jwt`), and is answered 401 without
    /// it; `/healthz`, `/readyz` and `/metrics` stay open. This token may use every tenant with
    /// every scope (audit name `token`). The CLI client sends it (`--token`, by default this
    /// key). Must not be empty. `check-config` shows `***`.
    pub token: Option<String>,
    /// API keys, each with a name, the SHA-256 of the key (`timer-service hash-token KEY`),
    /// the tenants it may use (or `["*"]`) and its scopes (`read`, `write`, `admin`). Any key,
    /// `http.token` or `http.jwt` turns authentication on.
    pub keys: Vec<ApiKey>,
    /// JWT bearer tokens from an identity provider: `hs256_secret` or `jwks_file`, `audience`,
    /// `issuer`, `tenants_claim` (default `tenants`), `scopes_claim` (default `scope`).
    pub jwt: Option<JwtConfig>,
    /// Serve HTTPS with this certificate chain (PEM); needs `http.tls_key`.
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of `http.tls_cert`.
    pub tls_key: Option<PathBuf>,
    /// With HTTPS: require a client certificate signed by a CA of this file (PEM).
    pub tls_client_ca: Option<PathBuf>,
    /// Serve the web dashboard at `/ui/` (its files are in the binary; it reads and steers
    /// timers through the API, with the same token). `false` leaves `/ui/` unrouted (404).
    pub ui: bool,
    /// How old the counts in `GET /v1/status` and in the first page of `GET /v1/summary` may
    /// be. Counting reads every timer of a tenant, so the counts are shared by every reader
    /// and counted again in the background once half this old (`countedAt` in the answers
    /// says when); `0s` counts for every request.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub counts_max_age: Duration,
    /// Most connections served at once (the event streams count); further clients wait in the
    /// listen backlog until one closes, so slow or idle clients cannot take every task and
    /// file descriptor. At least 1.
    pub max_connections: usize,
    /// How long a client may take to send a request's headers before its connection is closed
    /// (a client that trickles them in, byte by byte, would hold a connection for ever).
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub header_read_timeout: Duration,
    /// Most `GET /v1/events` streams open at once; one more is answered 503.
    pub max_event_streams: usize,
    /// How many bytes of events one event stream may have waiting for its client. A client
    /// that reads slower than its events come is sent `lagged` (how many of its events it
    /// missed) and its stream is closed; it connects again to go on. No reader, however slow,
    /// makes the service keep more than this for it.
    pub event_stream_buffer: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            addr: SocketAddr::from(([127, 0, 0, 1], 8080)),
            request_timeout: Duration::from_secs(10),
            token: None,
            keys: Vec::new(),
            jwt: None,
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
            ui: true,
            counts_max_age: Duration::from_secs(5),
            max_connections: 1_024,
            header_read_timeout: Duration::from_secs(10),
            max_event_streams: 256,
            event_stream_buffer: 1024 * 1024,
        }
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// For people.
    Text,
    /// One JSON object per line, for log shippers.
    Json,
}

/// Logging. Logs go to stderr.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// `text` for people, `json` (one object per line) for log shippers.
    pub format: LogFormat,
    /// A tracing filter such as `info` or `timer_core=debug,info`. The `RUST_LOG` environment
    /// variable overrides it.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::Text,
            level: "info".into(),
        }
    }
}
