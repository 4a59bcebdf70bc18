use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use timer_core::config::duration;

/// Config section of `store.kind = "postgres"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PostgresConfig {
    /// Always `postgres`; checked by the binary.
    pub kind: String,
    /// `postgres://USER:PASSWORD@HOST:PORT/DATABASE` (libpq URL parameters such as `sslmode`
    /// are honoured too).
    pub url: String,
    /// The schema holding the tables; created if missing. Instances sharing timers share it.
    pub schema: String,
    /// Most connections in the pool (LISTEN uses one more, of its own).
    pub max_connections: u32,
    /// How long connecting (and waiting for a pooled connection) may take.
    #[serde(with = "duration")]
    pub connect_timeout: Duration,
    /// `disable`, `allow`, `prefer`, `require`, `verify-ca` or `verify-full` (TLS by rustls,
    /// Mozilla's root certificates); overrides `sslmode` in the URL.
    pub ssl_mode: Option<String>,
    /// PEM file of the CA that signed the server certificate (for `verify-ca`/`verify-full`);
    /// overrides `sslrootcert` in the URL.
    pub ssl_root_cert: Option<PathBuf>,
    /// Wake every instance at once when a timer due sooner is inserted (LISTEN/NOTIFY); polling
    /// remains the safety net.
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
            ssl_mode: None,
            ssl_root_cert: None,
            notify: true,
        }
    }
}
