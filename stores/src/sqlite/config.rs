use std::time::Duration;

use serde::{Deserialize, Serialize};
use timer_core::config::duration;

/// Config section of `store.kind = "sqlite"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SqliteConfig {
    /// Always `sqlite`; checked by the binary.
    pub kind: String,
    /// `sqlite://PATH` or a plain file path (seed name: `TIMER_DB_PATH`). Created if missing.
    pub url: String,
    /// `full` (default: an acknowledged command survives power loss) or `normal` (survives a
    /// process crash; faster).
    pub synchronous: Synchronous,
    /// How long a statement waits for a lock held by another process on the same file.
    #[serde(with = "duration")]
    pub busy_timeout: Duration,
    /// Connections for reads (`get`, `next_due_at`, health); writes use one connection.
    pub read_connections: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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
