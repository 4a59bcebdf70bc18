use std::path::PathBuf;
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use timer_core::config::duration;

/// The PostgreSQL store: timers in one schema that several instances share; they claim due
/// timers with `FOR UPDATE SKIP LOCKED` and wake each other with LISTEN/NOTIFY.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct PostgresConfig {
    /// Always `postgres`; checked by the binary.
    pub kind: String,
    /// `postgres://USER:PASSWORD@HOST:PORT/DATABASE` (`postgresql://` works too). libpq URL
    /// parameters such as `sslmode` and `sslrootcert` are honoured. `check-config` shows the
    /// password as `***`.
    pub url: String,
    /// The schema that holds the tables; created if missing, and migrated at start-up. 1 to 50
    /// lowercase letters, digits or `_`, not starting with a digit. Instances that share timers
    /// use the same `store.url` and `store.schema`.
    pub schema: String,
    /// Most connections in the pool. With `store.notify` on, LISTEN uses one more connection of
    /// its own, outside the pool.
    pub max_connections: u32,
    /// How long connecting may take at start-up, and how long a query waits for a connection
    /// from the pool.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub connect_timeout: Duration,
    /// Longest one statement may run on the server (PostgreSQL's `statement_timeout`), waits
    /// for locks included; a longer one is cancelled by the server, fails and is retried. Keeps
    /// a stuck statement from holding locks and connections for ever. Migrations at start-up
    /// are not bound by it. `0s` sets no limit.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub statement_timeout: Duration,
    /// TLS: `disable`, `allow`, `prefer`, `require`, `verify-ca` or `verify-full` (rustls, with
    /// Mozilla's root certificates and `store.ssl_root_cert`). Overrides `sslmode` in the URL;
    /// when not set, the URL's `sslmode`, else `PGSSLMODE`, else `prefer`.
    pub ssl_mode: Option<String>,
    /// PEM file of the CA that signed the server certificate, for `verify-ca` and
    /// `verify-full`. Overrides `sslrootcert` in the URL.
    pub ssl_root_cert: Option<PathBuf>,
    /// Wake every instance at once when a timer due sooner is scheduled, by LISTEN/NOTIFY.
    /// `false`: this instance neither sends nor hears wake-ups, and finds timers other instances
    /// scheduled by polling (`engine.poll_interval`).
    pub notify: bool,
}

impl PostgresConfig {
    /// Checks what can be checked without a server: the URL, the schema name, the TLS mode.
    /// `check-config` calls it; `open` does too.
    pub fn check(&self) -> timer_core::Result<()> {
        super::connect_options(self).map(|_| ())
    }
}

impl Default for PostgresConfig {
    fn default() -> Self {
        PostgresConfig {
            kind: "postgres".into(),
            url: "postgres://postgres@127.0.0.1:5432/postgres".into(),
            schema: "public".into(),
            max_connections: 10,
            connect_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(30),
            ssl_mode: None,
            ssl_root_cert: None,
            notify: true,
        }
    }
}
