//! `sqlite`: timers in one SQLite file (sqlx, WAL). Writes go through a single connection, so
//! they never contend inside the process; reads use a small pool.
//!
//! The rest is the plugin's page of the book (`README.md` beside this file).
#![doc = include_str!("README.md")]

mod config;
mod fair;
mod migrate;
mod plugin;
mod settle;

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use sqlx::sqlite::{
    Sqlite, SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool,
    SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::QueryBuilder;
use timer_core::control::DEFAULT_HISTORY;
use timer_core::fair::FairShare;
use timer_core::policy::{Policy, Work};
use timer_core::{
    CancelOutcome, Change, ClaimedTimer, Due, Error, Lease, NewTimer, Recurrence, Result,
    ScheduleOutcome, Settlement, Store, Target, TenantCounts, Timer, TimerControl, TimerKey,
    TimerState, Timestamp, TraceContext,
};
use tracing::info;

pub use config::{SqliteConfig, Synchronous};
pub use plugin::PLUGIN;

use crate::sql::{self, Dialect, Entry, SqlAbilities, Statements, ROWS_PER_STATEMENT};

pub struct SqliteStore {
    write: SqlitePool,
    read: SqlitePool,
    /// History entries kept per timer ([`TimerHistory::set_limit`]).
    history: AtomicUsize,
    /// The lock on `PATH.lock` that keeps other services off the file while this one runs
    /// (`None`: [`SqliteStore::attach`]ed beside one).
    _lock: Option<std::fs::File>,
    /// Claims shared between tenants ([`timer_core::fair`]).
    fair: FairShare,
}

/// Who opens the file: the service that owns it, or a tool beside it.
#[derive(Clone, Copy)]
enum Owner {
    Service,
    Beside,
}

impl Dialect for SqliteStore {
    type Db = Sqlite;
    type State = i64;
    type Count = i64;
    const NAME: &'static str = "sqlite";
    // One statement, so one implicit transaction: the select and the lease are atomic.
    const CLAIM: &'static str =
        "UPDATE timers SET lease_owner = ?1, available_at = ?2, lease_until = ?2 \
         WHERE rowid IN (SELECT rowid FROM timers WHERE state = 0 AND available_at <= ?5 \
                         AND (available_at <= ?3 OR available_at = due_at) \
                         ORDER BY available_at LIMIT ?4) \
         RETURNING tenant_id, service_call_id, due_at, registered_at, correlation_id, payload, \
                   attempts, revision, recurrence, occurrences, policy, work, target, message, \
                   message_meta, traceparent, tracestate";
    const LOCK_FOR_WRITE: Option<&'static str> = Some("UPDATE timers SET state = state WHERE 0");
    // The write transaction holds SQLite's one write lock from its start.
    const LOCK_ROW: &'static str = "";
    const KEYS_OF_JSON: Option<&'static str> = None;
    // The history goes with the timer (ON DELETE CASCADE).
    const PURGE: &'static str = "DELETE FROM timers WHERE rowid IN (SELECT rowid FROM timers \
        WHERE state <> 0 AND finished_at < ?1 LIMIT ?2) RETURNING 1";
    // The history goes by its foreign key's cascade.
    const PURGE_HISTORY: Option<&'static str> = None;

    /// Every error but a decoding one: a busy or locked database, a full disk, I/O.
    fn retryable(_: &sqlx::Error) -> bool {
        true
    }

    fn placeholder(_: usize) -> String {
        "?".to_owned()
    }
}

fn db_err(op: &str, e: sqlx::Error) -> Error {
    sql::db_err::<SqliteStore>(op, e)
}

impl SqliteStore {
    /// Opens (creating if missing) the database and runs pending migrations.
    pub async fn open(config: &SqliteConfig) -> Result<Self> {
        Self::open_as(config, Owner::Service).await
    }

    /// Opens a database that a running service holds, beside it and without its lock: for
    /// tests and tools that play a second writer (another instance, an operator's script). It
    /// runs no migrations and releases no leases; the leases it takes are released when the
    /// service next starts. Not for running an engine on.
    pub async fn attach(config: &SqliteConfig) -> Result<Self> {
        Self::open_as(config, Owner::Beside).await
    }

    async fn open_as(config: &SqliteConfig, owner: Owner) -> Result<Self> {
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
            .busy_timeout(config.busy_timeout)
            // A timer's history goes with it (ON DELETE CASCADE); sqlx's default, made explicit.
            .foreign_keys(true);
        let open_err = |e: sqlx::Error| {
            Error::unavailable(format!("sqlite store: cannot open database file {path:?}"))
                .with_source(e)
        };
        let write = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone())
            .await
            .map_err(open_err)?;
        let lock = match owner {
            Owner::Service => Some(lock_exclusively(path)?),
            Owner::Beside => None,
        };
        if lock.is_some() {
            let this = crate::sql::migrations::releases::this_release()?;
            migrate::run(&write, path, &this, &migrate::migrator()).await?;
            // No other service has the file open: every lease in it is a dead one's.
            let released = sqlx::query(RELEASE_ALL)
                .execute(&write)
                .await
                .map_err(|e| db_err("releasing the leases of the previous run", e))?
                .rows_affected();
            if released > 0 {
                info!(
                    leases = released,
                    "sqlite store: released the leases of the previous run; their timers fire now"
                );
            }
        }
        let read = SqlitePoolOptions::new()
            .max_connections(config.read_connections.max(1))
            .connect_with(options.read_only(true))
            .await
            .map_err(open_err)?;
        Ok(SqliteStore {
            write,
            read,
            history: AtomicUsize::new(DEFAULT_HISTORY),
            _lock: lock,
            fair: FairShare::new(),
        })
    }
}

/// Every lease in the file, released: claimable at the timer's due time.
const RELEASE_ALL: &str = "UPDATE timers SET available_at = due_at, lease_owner = NULL, \
    lease_until = NULL WHERE state = 0 AND lease_until IS NOT NULL";

/// Takes the lock that keeps a second service off the database at `path` (an exclusive
/// `flock` on `PATH.lock`, which holds the pid of its holder), for as long as the returned
/// file is open. The operating system releases it when the process ends, however it ends.
fn lock_exclusively(path: &str) -> Result<std::fs::File> {
    use std::io::{Read, Seek, Write};
    let lock_path = format!("{path}.lock");
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)
        .map_err(|e| {
            Error::unavailable(format!(
                "sqlite store: cannot open the lock file {lock_path:?}"
            ))
            .with_source(e)
        })?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let pid = if holder.is_empty() {
                String::new()
            } else {
                format!(" (pid {holder})")
            };
            return Err(Error::config(format!(
                "sqlite store: the database {path:?} is in use by another timer-service{pid}, \
                 which holds {lock_path:?}; one service at a time uses a SQLite file (for \
                 several instances use the postgres store)"
            )));
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(
                Error::unavailable(format!("sqlite store: cannot lock {lock_path:?}"))
                    .with_source(e),
            )
        }
    }
    // Who holds it, for the error above; a failure here only loses that hint.
    let _ = file
        .set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| writeln!(file, "{}", std::process::id()));
    Ok(file)
}

/// New timers, many rows per statement (see [`insert_new`]); a key that exists is left alone
/// and not returned.
const INSERT_TIMERS: &str = "INSERT INTO timers (tenant_id, service_call_id, due_at, \
    registered_at, correlation_id, payload, available_at, recurrence, history_seq, policy, work, \
    target, message, message_meta, traceparent, tracestate) ";
const INSERT_TIMERS_END: &str = " ON CONFLICT DO NOTHING RETURNING tenant_id, service_call_id";

/// ?1 tenant, ?2 service call id, ?3 due, ?4 now, ?5 correlation id, ?6 payload, ?7 recurrence,
/// ?8 policy, ?9 work, ?10 target, ?11 message, ?12 message meta, ?13 traceparent,
/// ?14 tracestate. Unqualified columns on the right-hand side are the old values. A repeat
/// of the same recurring series (same recurrence) keeps its place: its next occurrence, count,
/// revision and work stay, so a redelivered command neither skips a catch-up nor re-anchors
/// the series. The work starts anew with a new revision. What a fire sends (payload,
/// correlation id, target, message, policy) changed at the same due time bumps the revision
/// too, so a fire in flight with the old content does not settle the timer: it fires again
/// with the new.
const RESCHEDULE_TIMER: &str = "UPDATE timers SET \
    work = CASE WHEN NOT (?7 IS NOT NULL AND recurrence IS ?7) \
                 AND (due_at <> ?3 OR recurrence IS NOT ?7) THEN ?9 ELSE work END, \
    policy = ?8, \
    revision = revision + (NOT (?7 IS NOT NULL AND recurrence IS ?7) \
                           AND (due_at <> ?3 OR recurrence IS NOT ?7 \
                                OR correlation_id IS NOT ?5 OR payload IS NOT ?6 \
                                OR policy IS NOT ?8 OR target IS NOT ?10 OR message IS NOT ?11 \
                                OR message_meta IS NOT ?12)), \
    attempts = CASE WHEN NOT (?7 IS NOT NULL AND recurrence IS ?7) \
                     AND (due_at <> ?3 OR recurrence IS NOT ?7) THEN 0 ELSE attempts END, \
    available_at = CASE WHEN ?7 IS NOT NULL AND recurrence IS ?7 THEN available_at \
                        WHEN lease_until > ?4 THEN MAX(lease_until, ?3) ELSE ?3 END, \
    due_at = CASE WHEN ?7 IS NOT NULL AND recurrence IS ?7 THEN due_at ELSE ?3 END, \
    correlation_id = ?5, payload = ?6, target = ?10, message = ?11, message_meta = ?12, \
    traceparent = ?13, tracestate = ?14, \
    occurrences = CASE WHEN recurrence IS ?7 THEN occurrences ELSE 0 END, recurrence = ?7, \
    history_seq = history_seq + 1 \
    WHERE tenant_id = ?1 AND service_call_id = ?2 RETURNING history_seq";

/// ?1 tenant, ?2 service call id, ?3 lease owner, ?4 the new end of the lease.
const RENEW: &str = "UPDATE timers SET available_at = MAX(?4, due_at), lease_until = ?4 \
    WHERE tenant_id = ?1 AND service_call_id = ?2 AND state = 0 AND lease_owner = ?3 \
      AND lease_until IS NOT NULL";

/// Inserts the timers whose key is new, in multi-row statements; says for each timer whether it
/// was inserted. Of a key given twice, the first is inserted and the second is not (it then
/// updates the first, as one after the other would).
async fn insert_new(
    conn: &mut SqliteConnection,
    timers: &[NewTimer],
    now: Timestamp,
) -> std::result::Result<Vec<bool>, sqlx::Error> {
    let mut inserted: HashSet<TimerKey> = HashSet::new();
    for chunk in timers.chunks(ROWS_PER_STATEMENT) {
        let mut insert = QueryBuilder::<Sqlite>::new(INSERT_TIMERS);
        insert.push_values(chunk, |mut row, t| {
            row.push_bind(t.key.tenant_id.as_str())
                .push_bind(t.key.service_call_id.as_str())
                .push_bind(t.due_at.as_millis())
                .push_bind(now.as_millis())
                .push_bind(t.correlation_id.as_deref())
                .push_bind(t.payload.as_deref())
                .push_bind(t.due_at.as_millis())
                .push_bind(t.recurrence.as_ref().map(Recurrence::to_json))
                .push_bind(1_i64)
                .push_bind(t.policy.as_ref().map(Policy::to_json))
                .push_bind(t.work.as_ref().map(Work::to_json))
                .push_bind(t.target.as_ref().map(Target::to_json))
                .push_bind(t.message.as_ref().map(|m| m.body.as_slice()))
                .push_bind(t.message.as_ref().map(|m| m.meta.to_json()))
                .push_bind(t.trace.as_ref().map(TraceContext::traceparent))
                .push_bind(t.trace.as_ref().and_then(TraceContext::tracestate));
        });
        insert.push(INSERT_TIMERS_END);
        let keys: Vec<(String, String)> = insert.build_query_as().fetch_all(&mut *conn).await?;
        inserted.extend(keys.into_iter().map(|(t, s)| TimerKey::new(t, s)));
    }
    // `remove`: only the first of a repeated key was inserted.
    Ok(timers.iter().map(|t| inserted.remove(&t.key)).collect())
}

impl SqliteStore {
    fn history_limit(&self) -> usize {
        self.history.load(Ordering::Relaxed)
    }
}

impl SqlAbilities for SqliteStore {
    fn reads(&self) -> Statements<'_, Self> {
        sql::on(&self.read)
    }

    fn writes(&self) -> Statements<'_, Self> {
        sql::on(&self.write)
    }

    fn history_kept(&self) -> &AtomicUsize {
        &self.history
    }
}

#[async_trait]
impl Store for SqliteStore {
    fn name(&self) -> &'static str {
        "sqlite"
    }

    async fn schedule(&self, timers: &[NewTimer], now: Timestamp) -> Result<Vec<ScheduleOutcome>> {
        let op = "scheduling timers";
        let history = self.history_limit();
        let mut tx = sql::begin_write::<Self>(&self.write)
            .await
            .map_err(|e| db_err(op, e))?;
        // New keys go in with a few statements; only the others are read and updated one by one.
        let created = insert_new(&mut tx, timers, now)
            .await
            .map_err(|e| db_err(op, e))?;
        let mut entries = Vec::with_capacity(timers.len());
        let mut outcomes = Vec::with_capacity(timers.len());
        for (t, created) in timers.iter().zip(created) {
            if created {
                entries.push(Entry {
                    key: &t.key,
                    seq: 1,
                    change: Change::Created { due_at: t.due_at },
                });
                outcomes.push(ScheduleOutcome::Created);
                continue;
            }
            let existing: Option<i64> = sqlx::query_scalar(
                "SELECT state FROM timers WHERE tenant_id = ?1 AND service_call_id = ?2",
            )
            .bind(&t.key.tenant_id)
            .bind(&t.key.service_call_id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(|e| db_err(op, e))?;
            let outcome = match existing.and_then(TimerState::from_code) {
                Some(TimerState::Scheduled | TimerState::Paused) => ScheduleOutcome::Updated,
                // Gone since the insert, which cannot happen inside this transaction.
                None => {
                    return Err(Error::internal(format!(
                        "timer {} neither inserted nor found while scheduling",
                        t.key
                    )))
                }
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
            let seq: i64 = sqlx::query_scalar(RESCHEDULE_TIMER)
                .bind(&t.key.tenant_id)
                .bind(&t.key.service_call_id)
                .bind(t.due_at.as_millis())
                .bind(now.as_millis())
                .bind(&t.correlation_id)
                .bind(&t.payload)
                .bind(t.recurrence.as_ref().map(Recurrence::to_json))
                .bind(t.policy.as_ref().map(Policy::to_json))
                .bind(t.work.as_ref().map(Work::to_json))
                .bind(t.target.as_ref().map(Target::to_json))
                .bind(t.message.as_ref().map(|m| m.body.as_slice()))
                .bind(t.message.as_ref().map(|m| m.meta.to_json()))
                .bind(t.trace.as_ref().map(TraceContext::traceparent))
                .bind(t.trace.as_ref().and_then(TraceContext::tracestate))
                .fetch_one(&mut *tx)
                .await
                .map_err(|e| db_err(op, e))?;
            entries.push(Entry {
                key: &t.key,
                seq,
                change: Change::Rescheduled { due_at: t.due_at },
            });
            outcomes.push(outcome);
        }
        sql::record_all::<Self>(&mut tx, &entries, now, history)
            .await
            .map_err(|e| db_err(op, e))?;
        tx.commit().await.map_err(|e| db_err(op, e))?;
        Ok(outcomes)
    }

    async fn claim_due(
        &self,
        due: Due,
        limit: usize,
        lease: &Lease,
    ) -> Result<Vec<ClaimedTimer>> {
        self.fair.claim(self, due, limit, lease).await
    }

    async fn settle(
        &self,
        claims: &[(ClaimedTimer, Settlement)],
        owner: &str,
        at: Timestamp,
    ) -> Result<u64> {
        let op = "settling claimed timers";
        let history = self.history_limit();
        let mut tx = sql::begin_write::<Self>(&self.write)
            .await
            .map_err(|e| db_err(op, e))?;
        let mut entries = Vec::with_capacity(claims.len());
        let changed = settle::settle(&mut tx, claims, owner, at, &mut entries)
            .await
            .map_err(|e| db_err(op, e))?;
        sql::record_all::<Self>(&mut tx, &entries, at, history)
            .await
            .map_err(|e| db_err(op, e))?;
        tx.commit().await.map_err(|e| db_err(op, e))?;
        Ok(changed)
    }

    async fn renew(&self, keys: &[TimerKey], owner: &str, until: Timestamp) -> Result<u64> {
        let op = "renewing leases";
        let mut tx = sql::begin_write::<Self>(&self.write)
            .await
            .map_err(|e| db_err(op, e))?;
        let mut renewed = 0;
        for key in keys {
            renewed += sqlx::query(RENEW)
                .bind(&key.tenant_id)
                .bind(&key.service_call_id)
                .bind(owner)
                .bind(until.as_millis())
                .execute(&mut *tx)
                .await
                .map_err(|e| db_err(op, e))?
                .rows_affected();
        }
        tx.commit().await.map_err(|e| db_err(op, e))?;
        Ok(renewed)
    }

    async fn next_due_at(&self) -> Result<Option<Timestamp>> {
        self.reads().next_due_at().await
    }

    async fn get(&self, key: &TimerKey) -> Result<Option<Timer>> {
        self.reads().get(key).await
    }

    async fn cancel(&self, key: &TimerKey, now: Timestamp) -> Result<CancelOutcome> {
        self.cancel_one(key, now).await
    }

    async fn purge(&self, older_than: Timestamp, limit: usize) -> Result<u64> {
        self.writes().purge(older_than, limit).await
    }

    async fn scheduled_count(&self) -> Result<u64> {
        self.reads().scheduled_count().await
    }

    async fn health(&self) -> Result<()> {
        self.reads().health().await
    }

    timer_core::own_abilities!();
}

crate::sql::sql_abilities!(SqliteStore);

#[async_trait]
impl TenantCounts for SqliteStore {
    async fn live_by_tenant(&self, tenants: &[String]) -> Result<HashMap<String, u64>> {
        let mut counts = HashMap::new();
        // SQLite allows 32,766 parameters per statement; a batch names far fewer tenants, but
        // stay well below the limit whatever the batch size.
        for chunk in tenants.chunks(500) {
            let marks = vec!["?"; chunk.len()].join(", ");
            // Each state from its partial index (`state IN (0, 4)` matches neither, and read
            // every row of the tenant, the finished ones of its retention too).
            let sql = format!(
                "SELECT tenant_id, COUNT(*) FROM (SELECT tenant_id FROM timers \
                 WHERE state = 0 AND available_at IS NOT NULL AND tenant_id IN ({marks}) \
                 UNION ALL SELECT tenant_id FROM timers WHERE state = 4 \
                 AND tenant_id IN ({marks})) GROUP BY tenant_id"
            );
            let mut query = sqlx::query_as::<_, (String, i64)>(&sql);
            for tenant in chunk.iter().chain(chunk) {
                query = query.bind(tenant);
            }
            for (tenant, n) in query
                .fetch_all(&self.read)
                .await
                .map_err(|e| db_err("counting Scheduled and Paused timers per tenant", e))?
            {
                counts.insert(tenant, u64::try_from(n).unwrap_or(0));
            }
        }
        Ok(counts)
    }
}

#[cfg(test)]
mod tests;
