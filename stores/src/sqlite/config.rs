use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use timer_core::config::duration;

/// The SQLite store, the embedded default: timers in one local file, used by one instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct SqliteConfig {
    /// Always `sqlite`; checked by the binary.
    pub kind: String,
    /// `sqlite://PATH` or a plain path, relative to the working directory. The file is created
    /// if missing and migrated at start-up. `:memory:` and query parameters (`?mode=...`) are
    /// refused.
    pub url: String,
    /// `full`: an accepted timer survives power loss. `normal`: it survives a crash of the
    /// process, and writes are faster.
    pub synchronous: Synchronous,
    /// How long a statement waits for a lock held by another process on the same file.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub busy_timeout: Duration,
    /// Connections for reads (get, next due time, health); writes use a single connection.
    pub read_connections: u32,
}

/// SQLite's `synchronous` setting for the database file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Synchronous {
    Full,
    Normal,
}

impl Default for SqliteConfig {
    fn default() -> Self {
        SqliteConfig {
            kind: "sqlite".into(),
            url: "sqlite://timer-service.db".into(),
            synchronous: Synchronous::Full,
            busy_timeout: Duration::from_secs(5),
            read_connections: 4,
        }
    }
}

impl SqliteConfig {
    /// A config for the file at `path`, other settings default.
    pub fn for_path(path: impl AsRef<std::path::Path>) -> Self {
        SqliteConfig {
            url: format!("sqlite://{}", path.as_ref().display()),
            ..Self::default()
        }
    }

    /// The file path inside `url`.
    pub fn path(&self) -> &str {
        let rest = self
            .url
            .strip_prefix("sqlite://")
            .or_else(|| self.url.strip_prefix("sqlite:"))
            .unwrap_or(&self.url);
        rest
    }
}
