//! The binary's own sections: `[http]` (the API, its limits, access and TLS), `[log]` and
//! `[telemetry]` (span export over OTLP).

use std::collections::BTreeMap;
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
    /// Longest a request may take (not the event stream, nor a bulk action once its body
    /// arrived); a slower one is answered 408. More than 0s.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub request_timeout: Duration,
    /// After the first SIGTERM or SIGINT, how long the instance goes on as before (serving,
    /// firing, taking commands) while `/readyz` answers 503 `draining`, before it stops: time for
    /// a load balancer, or Kubernetes' endpoints, to take it out of the rotation, so that no
    /// client is sent to a closed port. `0s` (the default): it stops at once. A second signal
    /// stops it at once, also while it drains.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub shutdown_delay: Duration,
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
    /// Host names (of the `Host` header, without its port) the API answers; another is answered
    /// 403 `host_not_allowed`, so that a web page whose site points a DNS name at this address
    /// cannot reach the API (DNS rebinding). Loopback addresses and `localhost` are always
    /// allowed. Unset: only those when `http.addr` is a loopback address, any name otherwise;
    /// `[]`: any name. A write from a web page is taken when its `Origin` is the request's host
    /// or one of these names (behind a proxy that sends another `Host`, list the public one).
    /// `/healthz`, `/readyz`, `/metrics` and `/ui/` answer any host.
    pub allowed_hosts: Option<Vec<String>>,
    /// Serve the web dashboard at `/ui/` (its files are in the binary; it reads and steers
    /// timers through the API, with the same token). `false` leaves `/ui/` unrouted (404).
    pub ui: bool,
    /// How long the counts in `GET /v1/status` and in the first page of `GET /v1/summary` are
    /// served after their count ended. Counting reads every timer of a tenant, so the counts
    /// are shared by every reader and counted again in the background once half this old
    /// (`countedAt` in the answers says when a count started); `0s` counts for every request.
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
    /// Most `GET /v1/events` streams open at once; one more is answered 503. At least 1, and
    /// less than `http.max_connections` (streams held open must leave room for `/healthz`).
    pub max_event_streams: usize,
    /// Most of them one key (a key of `http.keys`, `http.token`, one JWT subject) may have open
    /// at once; one more is answered 503, so one tenant's key cannot take every stream. Only
    /// with several keys or JWTs (without, every caller is one). At least 1.
    pub max_event_streams_per_key: usize,
    /// How many bytes of events one event stream may have waiting for its client. A client
    /// that reads slower than its events come is sent `lagged` (how many of its events it
    /// missed) and its stream is closed; it connects again to go on. No reader, however slow,
    /// makes the service keep more than this for it (but one event: a reader with nothing
    /// waiting takes an event of any size). A batch of fires comes at once: give it room for
    /// `engine.batch_size` of its tenants' events. At least 64 KiB (65536).
    pub event_stream_buffer: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            addr: SocketAddr::from(([127, 0, 0, 1], 8080)),
            request_timeout: Duration::from_secs(10),
            shutdown_delay: Duration::ZERO,
            token: None,
            keys: Vec::new(),
            jwt: None,
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
            allowed_hosts: None,
            ui: true,
            counts_max_age: Duration::from_secs(5),
            max_connections: 1_024,
            header_read_timeout: Duration::from_secs(10),
            max_event_streams: 256,
            max_event_streams_per_key: 32,
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
    /// A tracing filter such as `info` or `timer_core=debug,info`: a level, or `target=level`
    /// directives (a word that is not a level, such as `warning`, is refused: it would name a
    /// target and leave every other line out). The `RUST_LOG` environment variable, when set
    /// and not empty, overrides it and is checked the same way.
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

/// How spans are exported over OTLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum OtlpProtocol {
    /// OTLP over gRPC (a collector's port 4317).
    Grpc,
    /// OTLP as protobuf over HTTP (port 4318; `/v1/traces` is added to an endpoint without a
    /// path).
    Http,
}

/// Tracing: the spans of scheduling, claims, publishes, settles and control actions, exported
/// over OTLP. A timer's trace context (`traceparent`) is kept and sent with its fires whether
/// or not spans are exported.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// Where spans go, e.g. `http://127.0.0.1:4317` (gRPC) or `http://127.0.0.1:4318`
    /// (HTTP). Unset: the service makes and exports no spans.
    pub otlp_endpoint: Option<String>,
    /// `grpc` or `http` (protobuf over HTTP).
    pub protocol: OtlpProtocol,
    /// Headers sent with every export (a backend's API key, ...); `check-config` shows their
    /// values as `***`.
    pub headers: BTreeMap<String, String>,
    /// The share of new traces recorded, from 0 to 1. A command that comes with a trace
    /// context follows its parent's choice (its sampled flag).
    pub sampling_ratio: f64,
    /// Resource attributes besides `service.name` (`timer-service`), `service.version` and
    /// `service.instance.id` (this instance's id: `engine.instance_id`, or the one made at
    /// start), e.g. `{"deployment.environment" = "prod"}`.
    pub resource: BTreeMap<String, String>,
    /// CA certificates (PEM) an `https://` endpoint's certificate may be signed by, besides the
    /// system's.
    pub tls_ca: Option<PathBuf>,
    /// A link to a trace in a tracing UI, shown on the dashboard's timer page: `{traceId}` is
    /// replaced by the timer's trace id, e.g. `https://tempo.example/trace/{traceId}`.
    pub trace_url: Option<String>,
    /// Longest one export may take; the spans of a slower or failed one are dropped and
    /// counted (`timer.telemetry.spans_dropped`).
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub export_timeout: Duration,
    /// Most finished spans waiting for export. More are dropped and counted: an exporter
    /// that cannot keep up never slows firing.
    pub max_queued_spans: usize,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: None,
            protocol: OtlpProtocol::Grpc,
            headers: BTreeMap::new(),
            sampling_ratio: 1.0,
            resource: BTreeMap::new(),
            tls_ca: None,
            trace_url: None,
            export_timeout: Duration::from_secs(10),
            max_queued_spans: 8_192,
        }
    }
}

impl TelemetryConfig {
    /// Checks the values, naming the key at fault.
    pub fn check(&self) -> Result<(), timer_core::Error> {
        use timer_core::Error;
        if !(0.0..=1.0).contains(&self.sampling_ratio) {
            return Err(Error::config(format!(
                "telemetry.sampling_ratio is {}; give a share from 0 to 1",
                self.sampling_ratio
            )));
        }
        if let Some(endpoint) = &self.otlp_endpoint {
            let parsed = url::Url::parse(endpoint).map_err(|e| {
                Error::config(format!(
                    "telemetry.otlp_endpoint {endpoint:?} is not a URL ({e}); give one like \
                     http://127.0.0.1:4317"
                ))
            })?;
            if !matches!(parsed.scheme(), "http" | "https") {
                return Err(Error::config(format!(
                    "telemetry.otlp_endpoint {endpoint:?} must start with http:// or https://"
                )));
            }
        }
        if let Some(url) = &self.trace_url {
            if !url.contains("{traceId}") {
                return Err(Error::config(format!(
                    "telemetry.trace_url {url:?} has no {{traceId}} to replace with a trace id"
                )));
            }
        }
        if self.export_timeout.is_zero() || self.max_queued_spans == 0 {
            return Err(Error::config(
                "telemetry.export_timeout must be more than 0s and telemetry.max_queued_spans at \
                 least 1",
            ));
        }
        Ok(())
    }
}
