//! `sqlite`: timers in one SQLite file (sqlx, WAL). Writes go through a single connection, so
//! they never contend inside the process; reads use a small pool.

mod config;
mod plugin;

use std::collections::HashMap;
use std::str::FromStr;

use async_trait::async_trait;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::Row;
use timer_core::{
    CancelOutcome, ClaimedTimer, Error, Lease, NewTimer, Recurrence, Result, ScheduleOutcome,
    Store, Timer, TimerKey, TimerState, Timestamp,
};

pub use config::{SqliteConfig, Synchronous};
pub use plugin::PLUGIN;

pub struct SqliteStore {
    write: SqlitePool,
    read: SqlitePool,
}

fn db_err(op: &str, e: sqlx::Error) -> Error {
    let retryable = !matches!(
        e,
        sqlx::Error::ColumnDecode { .. } | sqlx::Error::ColumnNotFound(_) | sqlx::Error::Decode(_)
    );
    let kind = if retryable {
        timer_core::ErrorKind::Unavailable
    } else {
        timer_core::ErrorKind::Internal
    };
    Error::new(kind, format!("sqlite store: {op} failed"))
        .with_retryable(retryable)
        .with_source(e)
}

impl SqliteStore {
    /// Opens (creating if missing) the database and runs pending migrations.
    pub async fn open(config: &SqliteConfig) -> Result<Self> {
        let path = config.path();
        if path.is_empty() || path.starts_with(":memory:") {
            return Err(Error::config(format!(
                "store.url {:?}: the sqlite store needs a file path (an in-memory database is \
                 not durable; use store.kind = \"memory\" for that)",
                config.url
            )));
        }
        if config.url.contains('?') {
            return Err(Error::config(format!(
                "store.url {:?}: query parameters are not supported; use store.synchronous and \
                 store.busy_timeout",
                config.url
            )));
        }
        let options = SqliteConnectOptions::from_str(&format!("sqlite://{path}"))
            .map_err(|e| {
                Error::config(format!(
                    "store.url {:?} is not a valid sqlite URL",
                    config.url
                ))
                .with_source(e)
            })?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(match config.synchronous {
                Synchronous::Full => SqliteSynchronous::Full,
                Synchronous::Normal => SqliteSynchronous::Normal,
            })
            .busy_timeout(config.busy_timeout);
        let open_err = |e: sqlx::Error| {
            Error::unavailable(format!("sqlite store: cannot open database file {path:?}"))
                .with_source(e)
        };
        let write = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone())
            .await
            .map_err(open_err)?;
        sqlx::migrate!("./migrations/sqlite")
            .run(&write)
            .await
            .map_err(|e| {
                Error::unavailable(format!("sqlite store: migrating {path:?} failed"))
                    .with_source(e)
            })?;
        let read = SqlitePoolOptions::new()
            .max_connections(config.read_connections.max(1))
            .connect_with(options.read_only(true))
            .await
            .map_err(open_err)?;
        Ok(SqliteStore { write, read })
    }
}

/// ?1 tenant, ?2 service call id, ?3 due, ?4 now, ?5 correlation id, ?6 payload, ?7 recurrence.
const INSERT_TIMER: &str = "INSERT INTO timers (tenant_id, service_call_id, due_at, \
    registered_at, correlation_id, payload, available_at, recurrence) \
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?3, ?7)";

/// Same parameters. Unqualified columns on the right-hand side are the old values. A repeat of
/// the same recurring series (same recurrence) keeps its place: its next occurrence, count and
/// revision stay, so a redelivered command neither skips a catch-up nor re-anchors the series.
const RESCHEDULE_TIMER: &str = "UPDATE timers SET \
    revision = revision + (NOT (?7 IS NOT NULL AND recurrence IS ?7) \
                           AND (due_at <> ?3 OR recurrence IS NOT ?7)), \
    attempts = CASE WHEN NOT (?7 IS NOT NULL AND recurrence IS ?7) \
                     AND (due_at <> ?3 OR recurrence IS NOT ?7) THEN 0 ELSE attempts END, \
    available_at = CASE WHEN ?7 IS NOT NULL AND recurrence IS ?7 THEN available_at \
                        WHEN lease_until > ?4 THEN MAX(lease_until, ?3) ELSE ?3 END, \
    due_at = CASE WHEN ?7 IS NOT NULL AND recurrence IS ?7 THEN due_at ELSE ?3 END, \
    correlation_id = ?5, payload = ?6, \
    occurrences = CASE WHEN recurrence IS ?7 THEN occurrences ELSE 0 END, recurrence = ?7 \
    WHERE tenant_id = ?1 AND service_call_id = ?2";

const TIMER_COLUMNS: &str = "tenant_id, service_call_id, due_at, state, registered_at, \
    reached_at, correlation_id, payload, attempts, last_error, lease_owner, available_at, \
    recurrence, occurrences";

fn recurrence_from_row(row: &SqliteRow) -> Result<Option<Recurrence>> {
    row.try_get::<Option<String>, _>("recurrence")
        .map_err(|e| db_err("reading a timer", e))?
        .as_deref()
        .map(Recurrence::from_json)
        .transpose()
}

fn occurrences_from_row(row: &SqliteRow) -> Result<u32> {
    Ok(row
        .try_get::<i64, _>("occurrences")
        .map_err(|e| db_err("reading a timer", e))?
        .try_into()
        .unwrap_or(u32::MAX))
}

fn timer_from_row(row: &SqliteRow) -> Result<Timer> {
    let code: i64 = row
        .try_get("state")
        .map_err(|e| db_err("reading a timer", e))?;
    let state = TimerState::from_code(code)
        .ok_or_else(|| Error::internal(format!("sqlite store: unknown state code {code}")))?;
    let get = |e| db_err("reading a timer", e);
    Ok(Timer {
        key: TimerKey {
            tenant_id: row.try_get("tenant_id").map_err(get)?,
            service_call_id: row.try_get("service_call_id").map_err(get)?,
        },
        due_at: Timestamp::from_millis(row.try_get("due_at").map_err(get)?),
        state,
        registered_at: Timestamp::from_millis(row.try_get("registered_at").map_err(get)?),
        reached_at: row
            .try_get::<Option<i64>, _>("reached_at")
            .map_err(get)?
            .map(Timestamp::from_millis),
        correlation_id: row.try_get("correlation_id").map_err(get)?,
        payload: row.try_get("payload").map_err(get)?,
        attempts: row
            .try_get::<i64, _>("attempts")
            .map_err(get)?
            .try_into()
            .unwrap_or(u32::MAX),
        last_error: row.try_get("last_error").map_err(get)?,
        lease_owner: row.try_get("lease_owner").map_err(get)?,
        available_at: Timestamp::from_millis(row.try_get("available_at").map_err(get)?),
        recurrence: recurrence_from_row(row)?,
        occurrences: occurrences_from_row(row)?,
    })
}

fn claimed_from_row(row: &SqliteRow) -> Result<ClaimedTimer> {
    let get = |e| db_err("reading a claimed timer", e);
    Ok(ClaimedTimer {
        key: TimerKey {
            tenant_id: row.try_get("tenant_id").map_err(get)?,
            service_call_id: row.try_get("service_call_id").map_err(get)?,
        },
        due_at: Timestamp::from_millis(row.try_get("due_at").map_err(get)?),
        registered_at: Timestamp::from_millis(row.try_get("registered_at").map_err(get)?),
        correlation_id: row.try_get("correlation_id").map_err(get)?,
        payload: row.try_get("payload").map_err(get)?,
        attempts: row
            .try_get::<i64, _>("attempts")
            .map_err(get)?
            .try_into()
            .unwrap_or(u32::MAX),
        revision: row.try_get("revision").map_err(get)?,
        recurrence: recurrence_from_row(row)?,
        occurrences: occurrences_from_row(row)?,
    })
}

/// One statement per row, prepared with its parameters.
type RowUpdate<'q> = sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments<'q>>;

impl SqliteStore {
    /// Runs `updates` in one write transaction, all or nothing; returns the rows they changed.
    async fn update_rows(&self, op: &str, updates: Vec<RowUpdate<'_>>) -> Result<u64> {
        let mut tx = self.write.begin().await.map_err(|e| db_err(op, e))?;
        let mut changed = 0;
        for update in updates {
            changed += update
                .execute(&mut *tx)
                .await
                .map_err(|e| db_err(op, e))?
                .rows_affected();
        }
        tx.commit().await.map_err(|e| db_err(op, e))?;
        Ok(changed)
    }
}

#[async_trait]
impl Store for SqliteStore {
    fn name(&self) -> &'static str {
        "sqlite"
    }

    async fn schedule(&self, timers: &[NewTimer], now: Timestamp) -> Result<Vec<ScheduleOutcome>> {
        let op = "scheduling timers";
        let mut tx = self.write.begin().await.map_err(|e| db_err(op, e))?;
        let mut outcomes = Vec::with_capacity(timers.len());
        for t in timers {
            let existing: Option<i64> = sqlx::query_scalar(
                "SELECT state FROM timers WHERE tenant_id = ?1 AND service_call_id = ?2",
            )
            .bind(&t.key.tenant_id)
            .bind(&t.key.service_call_id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(|e| db_err(op, e))?;
            // Both statements take the same parameters; only which one runs differs.
            let (sql, outcome) = match existing.and_then(TimerState::from_code) {
                None => (INSERT_TIMER, ScheduleOutcome::Created),
                Some(TimerState::Scheduled) => (RESCHEDULE_TIMER, ScheduleOutcome::Updated),
                Some(TimerState::Reached) => {
                    outcomes.push(ScheduleOutcome::AlreadyReached);
                    continue;
                }
                Some(TimerState::Cancelled) => {
                    outcomes.push(ScheduleOutcome::AlreadyCancelled);
                    continue;
                }
                Some(TimerState::Failed) => {
                    outcomes.push(ScheduleOutcome::AlreadyFailed);
                    continue;
                }
            };
            sqlx::query(sql)
                .bind(&t.key.tenant_id)
                .bind(&t.key.service_call_id)
                .bind(t.due_at.as_millis())
                .bind(now.as_millis())
                .bind(&t.correlation_id)
                .bind(&t.payload)
                .bind(t.recurrence.as_ref().map(Recurrence::to_json))
                .execute(&mut *tx)
                .await
                .map_err(|e| db_err(op, e))?;
            outcomes.push(outcome);
        }
        tx.commit().await.map_err(|e| db_err(op, e))?;
        Ok(outcomes)
    }

    async fn claim_due(
        &self,
        now: Timestamp,
        limit: usize,
        lease: &Lease,
    ) -> Result<Vec<ClaimedTimer>> {
        // One statement, so one implicit transaction: the select and the lease are atomic.
        let rows = sqlx::query(
            "UPDATE timers SET lease_owner = ?1, available_at = ?2, lease_until = ?2 \
             WHERE rowid IN (SELECT rowid FROM timers WHERE state = 0 AND available_at <= ?3 \
                             ORDER BY available_at LIMIT ?4) \
             RETURNING tenant_id, service_call_id, due_at, registered_at, correlation_id, \
                       payload, attempts, revision, recurrence, occurrences",
        )
        .bind(&lease.owner)
        .bind(lease.until.as_millis())
        .bind(now.as_millis())
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&self.write)
        .await
        .map_err(|e| db_err("claiming due timers", e))?;
        let mut claimed = rows
            .iter()
            .map(claimed_from_row)
            .collect::<Result<Vec<_>>>()?;
        claimed.sort_by_key(|c| c.due_at);
        Ok(claimed)
    }

    async fn mark_reached(
        &self,
        timers: &[ClaimedTimer],
        owner: &str,
        at: Timestamp,
    ) -> Result<u64> {
        let updates = timers
            .iter()
            .map(|t| {
                sqlx::query(
                    "UPDATE timers SET state = 1, reached_at = ?3, finished_at = ?3, \
                       occurrences = occurrences + (recurrence IS NOT NULL) \
                     WHERE tenant_id = ?1 AND service_call_id = ?2 AND state = 0 \
                       AND lease_owner = ?4 AND revision = ?5",
                )
                .bind(&t.key.tenant_id)
                .bind(&t.key.service_call_id)
                .bind(at.as_millis())
                .bind(owner)
                .bind(t.revision)
            })
            .collect();
        self.update_rows("marking timers reached", updates).await
    }

    async fn advance(
        &self,
        timers: &[(ClaimedTimer, Timestamp)],
        owner: &str,
        at: Timestamp,
    ) -> Result<u64> {
        let updates = timers
            .iter()
            .map(|(t, next)| {
                sqlx::query(
                    "UPDATE timers SET due_at = ?3, available_at = ?3, revision = revision + 1, \
                       attempts = 0, last_error = NULL, lease_owner = NULL, lease_until = NULL, \
                       reached_at = ?4, occurrences = occurrences + 1 \
                     WHERE tenant_id = ?1 AND service_call_id = ?2 AND state = 0 \
                       AND lease_owner = ?5 AND revision = ?6",
                )
                .bind(&t.key.tenant_id)
                .bind(&t.key.service_call_id)
                .bind(next.as_millis())
                .bind(at.as_millis())
                .bind(owner)
                .bind(t.revision)
            })
            .collect();
        self.update_rows("moving recurring timers to their next occurrence", updates)
            .await
    }

    async fn fail(
        &self,
        timers: &[ClaimedTimer],
        owner: &str,
        at: Timestamp,
        error: &str,
    ) -> Result<u64> {
        let updates = timers
            .iter()
            .map(|t| {
                sqlx::query(
                    "UPDATE timers SET state = 3, finished_at = ?3, attempts = attempts + 1, \
                       last_error = ?4 \
                     WHERE tenant_id = ?1 AND service_call_id = ?2 AND state = 0 \
                       AND lease_owner = ?5 AND revision = ?6",
                )
                .bind(&t.key.tenant_id)
                .bind(&t.key.service_call_id)
                .bind(at.as_millis())
                .bind(error)
                .bind(owner)
                .bind(t.revision)
            })
            .collect();
        self.update_rows("marking timers failed", updates).await
    }

    async fn release(
        &self,
        timers: &[ClaimedTimer],
        owner: &str,
        retry_at: Timestamp,
        error: Option<&str>,
    ) -> Result<()> {
        let updates = timers
            .iter()
            .map(|t| {
                sqlx::query(
                    "UPDATE timers SET lease_owner = NULL, lease_until = NULL, \
                       available_at = MAX(?3, due_at), \
                       attempts = attempts + ?4, last_error = COALESCE(?5, last_error) \
                     WHERE tenant_id = ?1 AND service_call_id = ?2 AND state = 0 \
                       AND lease_owner = ?6",
                )
                .bind(&t.key.tenant_id)
                .bind(&t.key.service_call_id)
                .bind(retry_at.as_millis())
                .bind(i64::from(error.is_some()))
                .bind(error)
                .bind(owner)
            })
            .collect();
        self.update_rows("releasing timers", updates)
            .await
            .map(|_| ())
    }

    async fn next_due_at(&self) -> Result<Option<Timestamp>> {
        let next: Option<i64> =
            sqlx::query_scalar("SELECT MIN(available_at) FROM timers WHERE state = 0")
                .fetch_one(&self.read)
                .await
                .map_err(|e| db_err("reading the next due time", e))?;
        Ok(next.map(Timestamp::from_millis))
    }

    async fn get(&self, key: &TimerKey) -> Result<Option<Timer>> {
        let row = sqlx::query(&format!(
            "SELECT {TIMER_COLUMNS} FROM timers WHERE tenant_id = ?1 AND service_call_id = ?2"
        ))
        .bind(&key.tenant_id)
        .bind(&key.service_call_id)
        .fetch_optional(&self.read)
        .await
        .map_err(|e| db_err("reading a timer", e))?;
        row.as_ref().map(timer_from_row).transpose()
    }

    async fn cancel(&self, key: &TimerKey, now: Timestamp) -> Result<CancelOutcome> {
        let op = "cancelling a timer";
        let mut tx = self.write.begin().await.map_err(|e| db_err(op, e))?;
        let row: Option<(i64, bool)> = sqlx::query_as(
            "SELECT state, COALESCE(lease_until > ?3, 0) FROM timers \
             WHERE tenant_id = ?1 AND service_call_id = ?2",
        )
        .bind(&key.tenant_id)
        .bind(&key.service_call_id)
        .bind(now.as_millis())
        .fetch_optional(&mut *tx)
        .await
        .map_err(|e| db_err(op, e))?;
        let state = row.map(|(code, firing)| (TimerState::from_code(code), firing));
        let outcome = match state {
            None | Some((None, _)) => CancelOutcome::NotFound,
            Some((Some(TimerState::Reached), _)) => CancelOutcome::AlreadyReached,
            Some((Some(TimerState::Cancelled), _)) => CancelOutcome::AlreadyCancelled,
            Some((Some(TimerState::Failed), _)) => CancelOutcome::AlreadyFailed,
            Some((Some(TimerState::Scheduled), true)) => CancelOutcome::Firing,
            Some((Some(TimerState::Scheduled), false)) => {
                sqlx::query(
                    "UPDATE timers SET state = 2, finished_at = ?3 \
                     WHERE tenant_id = ?1 AND service_call_id = ?2",
                )
                .bind(&key.tenant_id)
                .bind(&key.service_call_id)
                .bind(now.as_millis())
                .execute(&mut *tx)
                .await
                .map_err(|e| db_err(op, e))?;
                CancelOutcome::Cancelled
            }
        };
        tx.commit().await.map_err(|e| db_err(op, e))?;
        Ok(outcome)
    }

    async fn purge(&self, older_than: Timestamp, limit: usize) -> Result<u64> {
        let result = sqlx::query(
            "DELETE FROM timers WHERE rowid IN (SELECT rowid FROM timers \
             WHERE state <> 0 AND finished_at < ?1 LIMIT ?2)",
        )
        .bind(older_than.as_millis())
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .execute(&self.write)
        .await
        .map_err(|e| db_err("purging finished timers", e))?;
        Ok(result.rows_affected())
    }

    async fn pending(&self) -> Result<u64> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM timers WHERE state = 0")
            .fetch_one(&self.read)
            .await
            .map_err(|e| db_err("counting pending timers", e))?;
        Ok(n.try_into().unwrap_or(0))
    }

    async fn pending_by_tenant(&self, tenants: &[String]) -> Result<HashMap<String, u64>> {
        let mut counts = HashMap::new();
        // SQLite allows 32,766 parameters per statement; a batch names far fewer tenants, but
        // stay well below the limit whatever the batch size.
        for chunk in tenants.chunks(500) {
            let marks = vec!["?"; chunk.len()].join(", ");
            let sql = format!(
                "SELECT tenant_id, COUNT(*) FROM timers WHERE state = 0 AND tenant_id IN ({marks}) \
                 GROUP BY tenant_id"
            );
            let mut query = sqlx::query_as::<_, (String, i64)>(&sql);
            for tenant in chunk {
                query = query.bind(tenant);
            }
            for (tenant, n) in query
                .fetch_all(&self.read)
                .await
                .map_err(|e| db_err("counting pending timers per tenant", e))?
            {
                counts.insert(tenant, u64::try_from(n).unwrap_or(0));
            }
        }
        Ok(counts)
    }

    async fn health(&self) -> Result<()> {
        sqlx::query("SELECT 1")
            .execute(&self.read)
            .await
            .map(|_| ())
            .map_err(|e| db_err("health check", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use timer_core::ErrorKind;

    async fn open_err(url: &str) -> Error {
        let config = SqliteConfig {
            url: url.into(),
            ..SqliteConfig::default()
        };
        match SqliteStore::open(&config).await {
            Ok(_) => panic!("{url} should not open"),
            Err(e) => e,
        }
    }

    #[tokio::test]
    async fn unusable_urls_are_config_errors_naming_the_url() {
        for url in ["sqlite::memory:", "sqlite://", "sqlite://t.db?mode=ro"] {
            let e = open_err(url).await;
            assert_eq!(e.kind(), ErrorKind::Config, "{url}: {e}");
            assert!(e.to_string().contains(url), "{url}: {e}");
        }
    }

    #[tokio::test]
    async fn a_missing_directory_is_unavailable_naming_the_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("no/such/dir/t.db");
        let e = open_err(&format!("sqlite://{}", path.display())).await;
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        assert!(
            e.chain().contains(&path.display().to_string()),
            "{}",
            e.chain()
        );
    }
}
