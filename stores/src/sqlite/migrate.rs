//! Migrating a database file when a new release opens it (`docs/src/operations/upgrades.md`).
//!
//! - 0.1.0's migrations (`migrations/sqlite/`, 1 to 9) stay with sqlx's migrator and its table;
//!   from 0.2.0 on (`migrations/sqlite-releases/`) each is recorded in `timer_migrations` with
//!   the oldest release that works with it, and a binary older than the highest of those
//!   refuses the file, naming both releases.
//! - Before a migration changes a file that holds data, a copy of it is written next to it,
//!   `<file>.before-<release>` (`VACUUM INTO`: consistent, and compact), and kept: going back
//!   to the release before is stopping and putting the copy back.
//! - One instance opens a file (its lock), so nothing waits for older instances; a migration
//!   that contracts writes a row in sqlx's table too, so that a 0.1.0 binary refuses the file
//!   ([`releases::record`]).

use std::time::Instant;

use semver::Version;
use sqlx::migrate::Migrator;
use sqlx::{Executor, SqlitePool};
use timer_core::{Error, Result};
use tracing::info;

use super::db_err;
use crate::sql::migrations::releases::{self, Applied};

/// The migrations from 0.2.0 on.
pub(super) fn migrator() -> Migrator {
    sqlx::migrate!("./migrations/sqlite-releases")
}

const TABLE: &str = "CREATE TABLE IF NOT EXISTS timer_migrations ( \
      version INTEGER PRIMARY KEY, \
      description TEXT NOT NULL, \
      checksum BLOB NOT NULL, \
      oldest_release TEXT NOT NULL, \
      applied_by TEXT NOT NULL, \
      applied_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP, \
      took_ms INTEGER NOT NULL)";

/// Migrates the file at `path` (open on `write`) as release `this`: 0.1.0's migrations, then
/// `releases`; a copy of the file first if it holds data and a migration is pending.
pub(super) async fn run(
    write: &SqlitePool,
    path: &str,
    this: &Version,
    releases: &Migrator,
) -> Result<()> {
    // The rows a contracting migration writes in sqlx's table are ours: not missing ones.
    let mut legacy = sqlx::migrate!("./migrations/sqlite");
    legacy.set_ignore_missing(true);
    let steps = releases::steps(releases)?;
    let op = "reading the applied migrations";
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'table' \
         AND name IN ('_sqlx_migrations', 'timer_migrations')",
    )
    .fetch_all(write)
    .await
    .map_err(|e| db_err(op, e))?;
    let legacy_applied: Vec<i64> = if tables.iter().any(|t| t == "_sqlx_migrations") {
        sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success")
            .fetch_all(write)
            .await
            .map_err(|e| db_err(op, e))?
    } else {
        Vec::new()
    };
    let applied: Vec<Applied> = if tables.iter().any(|t| t == "timer_migrations") {
        sqlx::query_as(releases::APPLIED)
            .fetch_all(write)
            .await
            .map_err(|e| db_err(op, e))?
    } else {
        Vec::new()
    };
    releases::check_applied(
        &format!("sqlite store: {path:?}"),
        &format!(
            "stop and put back the copy the newer release wrote before it migrated \
             ({path}.before-<its release>)"
        ),
        this,
        &steps,
        &applied,
    )?;
    let pending_legacy = legacy
        .iter()
        .any(|m| !legacy_applied.contains(&m.version));
    let pending = releases::pending(&steps, &applied);
    if !legacy_applied.is_empty() && (pending_legacy || !pending.is_empty()) {
        back_up(write, path, this).await?;
    }
    legacy.run(write).await.map_err(|e| {
        Error::unavailable(format!("sqlite store: migrating {path:?} failed")).with_source(e)
    })?;
    write
        .execute(TABLE)
        .await
        .map_err(|e| db_err("creating timer_migrations", e))?;
    for step in pending {
        let started = Instant::now();
        let failed = |e: sqlx::Error| {
            Error::unavailable(format!(
                "sqlite store: migrating {path:?} failed at migration {}",
                step.label()
            ))
            .with_source(e)
        };
        let mut tx = write.begin().await.map_err(failed)?;
        tx.execute(&*step.migration.sql).await.map_err(failed)?;
        let took_ms = i64::try_from(started.elapsed().as_millis()).unwrap_or(i64::MAX);
        releases::record::<sqlx::Sqlite>(&mut tx, step, this, took_ms)
            .await
            .map_err(failed)?;
        tx.commit().await.map_err(failed)?;
        info!(
            migration = %step.label(),
            took_ms = started.elapsed().as_millis() as u64,
            "sqlite store: migration applied"
        );
    }
    Ok(())
}

/// Writes a copy of the file next to it, `<path>.before-<this>` (a suffix with the time when
/// that exists already), before a migration changes it.
async fn back_up(write: &SqlitePool, path: &str, this: &Version) -> Result<()> {
    let mut copy = format!("{path}.before-{this}");
    if std::path::Path::new(&copy).exists() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        copy = format!("{copy}-{now}");
    }
    let started = Instant::now();
    sqlx::query("VACUUM INTO $1")
        .bind(&copy)
        .execute(write)
        .await
        .map_err(|e| {
            Error::unavailable(format!(
                "sqlite store: cannot write the copy {copy:?} before migrating {path:?} (free \
                 space next to it, or move the file where there is)"
            ))
            .with_source(e)
        })?;
    info!(
        copy = %copy,
        took_ms = started.elapsed().as_millis() as u64,
        "sqlite store: wrote a copy of the database before migrating it (delete it once this \
         release runs well)"
    );
    Ok(())
}
