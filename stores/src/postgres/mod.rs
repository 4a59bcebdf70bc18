//! `postgres`: timers in PostgreSQL (sqlx). Several instances share one schema: claiming uses
//! `FOR UPDATE SKIP LOCKED`, so two instances never lease the same row, and a NOTIFY on every
//! scheduled batch wakes every instance's firing task when a sooner timer arrives.

mod config;
mod plugin;

use std::collections::HashMap;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{
    PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions, PgRow, PgSslMode,
};
use sqlx::{Connection, Row};
use timer_core::{
    CancelOutcome, ClaimedTimer, Error, ErrorKind, Lease, NewTimer, Recurrence, Result,
    ScheduleOutcome, Store, Timer, TimerKey, TimerState, Timestamp,
};
use tokio::sync::broadcast;
use tracing::{info, warn};

pub use config::PostgresConfig;
pub use plugin::{PLUGIN, TEST_SERVER};

pub struct PostgresStore {
    pool: PgPool,
    schema: String,
    /// NOTIFY channel of this schema, when wake-ups are on.
    channel: Option<String>,
    wakeups: broadcast::Sender<Timestamp>,
    listener: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for PostgresStore {
    fn drop(&mut self) {
        if let Some(task) = &self.listener {
            task.abort();
        }
    }
}

fn db_err(op: &str, e: sqlx::Error) -> Error {
    let retryable = match &e {
        sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::Decode(_) => false,
        // SQLSTATE classes that pass: connection (08), transaction rollback such as deadlock or
        // serialization (40), insufficient resources (53), operator intervention (57). Others
        // (permission denied, syntax, constraint) will fail again the same way.
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            ["08", "40", "53", "57"]
                .iter()
                .any(|class| c.starts_with(class))
        }),
        _ => true,
    };
    let kind = if retryable {
        ErrorKind::Unavailable
    } else {
        ErrorKind::Internal
    };
    Error::new(kind, format!("postgres store: {op} failed"))
        .with_retryable(retryable)
        .with_source(e)
}

/// A schema name used unquoted in SQL and in the NOTIFY channel name.
fn check_schema(schema: &str) -> Result<()> {
    let ok = !schema.is_empty()
        && schema.len() <= 50
        && schema.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && schema
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(Error::config(format!(
            "store.schema {schema:?}: use 1 to 50 lowercase letters, digits or underscores, not \
             starting with a digit"
        )))
    }
}

fn ssl_mode(mode: &str) -> Result<PgSslMode> {
    PgSslMode::from_str(mode).map_err(|_| {
        Error::config(format!(
            "store.ssl_mode {mode:?} is not one of disable, allow, prefer, require, verify-ca, \
             verify-full"
        ))
    })
}

fn humantime_secs(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

/// The deepest cause of an error, for one-line messages.
fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = e;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

/// The connect options for `config`, checked: URL, schema name, TLS mode.
fn connect_options(config: &PostgresConfig) -> Result<PgConnectOptions> {
    check_schema(&config.schema)?;
    let mut options = PgConnectOptions::from_str(&config.url).map_err(|e| {
        Error::config(format!(
            "store.url is not a valid PostgreSQL URL ({})",
            root_cause(&e)
        ))
    })?;
    if let Some(mode) = &config.ssl_mode {
        options = options.ssl_mode(ssl_mode(mode)?);
    }
    if let Some(cert) = &config.ssl_root_cert {
        options = options.ssl_root_cert(cert);
    }
    Ok(options)
}

impl PostgresStore {
    /// Connects, creates the schema if missing and runs pending migrations (under an advisory
    /// lock, so instances starting together do not race), then starts listening for wake-ups.
    pub async fn open(config: &PostgresConfig) -> Result<Self> {
        let options = connect_options(config)?;
        let target = format!(
            "{}:{} as user {}",
            options.get_host(),
            options.get_port(),
            options.get_username()
        );
        let options = options
            .options([("search_path", config.schema.as_str())])
            .application_name("timer-service");
        let cannot = |cause: String| {
            Error::unavailable(format!(
                "postgres store: cannot connect to {target}: {cause}"
            ))
        };
        // One plain connection first: the pool would retry until its timeout and report only
        // that, hiding the cause (refused, wrong password, unknown database).
        match tokio::time::timeout(config.connect_timeout, PgConnection::connect_with(&options))
            .await
        {
            Ok(Ok(conn)) => {
                let _ = conn.close().await;
            }
            Ok(Err(e)) => return Err(cannot(root_cause(&e))),
            Err(_) => {
                return Err(cannot(format!(
                    "no answer within {} (store.connect_timeout)",
                    humantime_secs(config.connect_timeout)
                )))
            }
        }
        let pool = PgPoolOptions::new()
            .max_connections(config.max_connections.max(1))
            .acquire_timeout(config.connect_timeout)
            .connect_with(options)
            .await
            .map_err(|e| cannot(root_cause(&e)))?;
        Self::prepare_schema(&pool, &config.schema).await?;
        let channel = config
            .notify
            .then(|| format!("timer_wakeup_{}", config.schema));
        let (wakeups, _) = broadcast::channel(1024);
        // LISTEN holds its connection for good: give it one of its own, outside the pool.
        let listen_pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(config.connect_timeout)
            .connect_lazy_with(pool.connect_options().as_ref().clone());
        let listener = channel
            .clone()
            .map(|ch| tokio::spawn(listen(listen_pool, ch, wakeups.clone())));
        Ok(PostgresStore {
            pool,
            schema: config.schema.clone(),
            channel,
            wakeups,
            listener,
        })
    }

    async fn prepare_schema(pool: &PgPool, schema: &str) -> Result<()> {
        let op = "preparing the schema";
        let mut tx = pool.begin().await.map_err(|e| db_err(op, e))?;
        // One instance at a time creates the schema (IF NOT EXISTS still races otherwise).
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('timer-service schema ' || $1))")
            .bind(schema)
            .execute(&mut *tx)
            .await
            .map_err(|e| db_err(op, e))?;
        // CREATE SCHEMA checks the CREATE privilege even when the schema exists: ask first,
        // so a user without it can use a schema an administrator made.
        let exists: Option<i32> =
            sqlx::query_scalar("SELECT 1 FROM pg_namespace WHERE nspname = $1")
                .bind(schema)
                .fetch_optional(&mut *tx)
                .await
                .map_err(|e| db_err(op, e))?;
        if exists.is_none() {
            sqlx::query(&format!("CREATE SCHEMA {schema}"))
                .execute(&mut *tx)
                .await
                .map_err(|e| db_err(op, e))?;
        }
        tx.commit().await.map_err(|e| db_err(op, e))?;
        // sqlx's migrator holds a PostgreSQL advisory lock while it runs.
        sqlx::migrate!("./migrations/postgres")
            .run(pool)
            .await
            .map_err(|e| {
                Error::unavailable(format!("postgres store: migrating schema {schema} failed"))
                    .with_source(e)
            })
    }

    /// Drops this store's schema and everything in it (benchmarks and tests clean up with it).
    pub async fn drop_schema(&self) -> Result<()> {
        sqlx::query(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema))
            .execute(&self.pool)
            .await
            .map(|_| ())
            .map_err(|e| db_err("dropping the schema", e))
    }

    /// Keys of `timers` as two parallel arrays, for `UNNEST`.
    fn key_arrays<'a>(keys: impl Iterator<Item = &'a TimerKey>) -> (Vec<&'a str>, Vec<&'a str>) {
        keys.map(|k| (k.tenant_id.as_str(), k.service_call_id.as_str()))
            .unzip()
    }
}

/// Forwards NOTIFYs of `channel` to `tx`, reconnecting on loss. Whenever listening (re)starts it
/// sends the epoch so firing tasks replan (notices sent meanwhile are gone).
async fn listen(pool: PgPool, channel: String, tx: broadcast::Sender<Timestamp>) {
    let pause = |failures: u32| Duration::from_millis(100 * u64::from(failures.min(50)));
    let mut failures = 0u32;
    loop {
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(e) => {
                failures += 1;
                warn!(error = %root_cause(&e), "postgres store: LISTEN connection failed; retrying");
                tokio::time::sleep(pause(failures)).await;
                continue;
            }
        };
        if let Err(e) = listener.listen(&channel).await {
            failures += 1;
            warn!(error = %root_cause(&e), "postgres store: LISTEN failed; retrying");
            tokio::time::sleep(pause(failures)).await;
            continue;
        }
        failures = 0;
        // Schedules by other instances before LISTEN answered (at start, or while the
        // connection was down) went unheard: have the firing tasks replan.
        info!(channel = %channel, "postgres store: listening for wake-ups");
        let _ = tx.send(Timestamp::EPOCH);
        loop {
            match listener.try_recv().await {
                Ok(Some(n)) => {
                    if let Ok(ms) = n.payload().parse::<i64>() {
                        let _ = tx.send(Timestamp::from_millis(ms));
                    }
                }
                // The connection dropped; the next call reconnects and listens again.
                Ok(None) => {
                    warn!("postgres store: LISTEN connection lost; reconnecting");
                    let _ = tx.send(Timestamp::EPOCH);
                }
                Err(e) => {
                    warn!(error = %root_cause(&e), "postgres store: LISTEN connection failed");
                    break;
                }
            }
        }
        // A server that accepts and then drops connections must not make this a tight loop.
        failures += 1;
        tokio::time::sleep(pause(failures)).await;
    }
}

fn int(row: &PgRow, col: &str) -> Result<i64> {
    row.try_get::<i64, _>(col)
        .map_err(|e| db_err("reading a timer", e))
}

fn text(row: &PgRow, col: &str) -> Result<String> {
    row.try_get::<String, _>(col)
        .map_err(|e| db_err("reading a timer", e))
}

fn opt_text(row: &PgRow, col: &str) -> Result<Option<String>> {
    row.try_get::<Option<String>, _>(col)
        .map_err(|e| db_err("reading a timer", e))
}

fn key_of(row: &PgRow) -> Result<TimerKey> {
    Ok(TimerKey {
        tenant_id: text(row, "tenant_id")?,
        service_call_id: text(row, "service_call_id")?,
    })
}

fn attempts_of(row: &PgRow) -> Result<u32> {
    let n = row
        .try_get::<i32, _>("attempts")
        .map_err(|e| db_err("reading a timer", e))?;
    Ok(u32::try_from(n).unwrap_or(0))
}

fn recurrence_of(row: &PgRow) -> Result<Option<Recurrence>> {
    opt_text(row, "recurrence")?
        .as_deref()
        .map(Recurrence::from_json)
        .transpose()
}

fn occurrences_of(row: &PgRow) -> Result<u32> {
    let n = row
        .try_get::<i32, _>("occurrences")
        .map_err(|e| db_err("reading a timer", e))?;
    Ok(u32::try_from(n).unwrap_or(0))
}

fn timer_from_row(row: &PgRow) -> Result<Timer> {
    let code = row
        .try_get::<i16, _>("state")
        .map_err(|e| db_err("reading a timer", e))?;
    let state = TimerState::from_code(i64::from(code))
        .ok_or_else(|| Error::internal(format!("postgres store: unknown state code {code}")))?;
    Ok(Timer {
        key: key_of(row)?,
        due_at: Timestamp::from_millis(int(row, "due_at")?),
        state,
        registered_at: Timestamp::from_millis(int(row, "registered_at")?),
        reached_at: row
            .try_get::<Option<i64>, _>("reached_at")
            .map_err(|e| db_err("reading a timer", e))?
            .map(Timestamp::from_millis),
        correlation_id: opt_text(row, "correlation_id")?,
        payload: opt_text(row, "payload")?,
        attempts: attempts_of(row)?,
        last_error: opt_text(row, "last_error")?,
        lease_owner: opt_text(row, "lease_owner")?,
        available_at: Timestamp::from_millis(int(row, "available_at")?),
        recurrence: recurrence_of(row)?,
        occurrences: occurrences_of(row)?,
    })
}

fn claimed_from_row(row: &PgRow) -> Result<ClaimedTimer> {
    Ok(ClaimedTimer {
        key: key_of(row)?,
        due_at: Timestamp::from_millis(int(row, "due_at")?),
        registered_at: Timestamp::from_millis(int(row, "registered_at")?),
        correlation_id: opt_text(row, "correlation_id")?,
        payload: opt_text(row, "payload")?,
        attempts: attempts_of(row)?,
        revision: int(row, "revision")?,
        recurrence: recurrence_of(row)?,
        occurrences: occurrences_of(row)?,
    })
}

#[async_trait]
impl Store for PostgresStore {
    fn name(&self) -> &'static str {
        "postgres"
    }

    async fn schedule(&self, timers: &[NewTimer], now: Timestamp) -> Result<Vec<ScheduleOutcome>> {
        let op = "scheduling timers";
        if timers.is_empty() {
            return Ok(Vec::new());
        }
        // ON CONFLICT cannot touch a row twice in one statement: write the last entry per key,
        // and derive the outcomes of earlier duplicates from it.
        let mut last: std::collections::HashMap<&TimerKey, usize> = Default::default();
        for (i, t) in timers.iter().enumerate() {
            last.insert(&t.key, i);
        }
        // Key order: concurrent batches lock the rows they share in the same order (no deadlock).
        let mut unique: Vec<usize> = last.values().copied().collect();
        unique.sort_unstable_by(|a, b| timers[*a].key.cmp(&timers[*b].key));
        let rows: Vec<&NewTimer> = unique.iter().map(|i| &timers[*i]).collect();
        let (tenants, ids) = Self::key_arrays(rows.iter().map(|t| &t.key));
        let dues: Vec<i64> = rows.iter().map(|t| t.due_at.as_millis()).collect();
        let correlations: Vec<Option<&str>> =
            rows.iter().map(|t| t.correlation_id.as_deref()).collect();
        let payloads: Vec<Option<&str>> = rows.iter().map(|t| t.payload.as_deref()).collect();
        let recurrences: Vec<Option<String>> = rows
            .iter()
            .map(|t| t.recurrence.as_ref().map(Recurrence::to_json))
            .collect();

        let mut tx = self.pool.begin().await.map_err(|e| db_err(op, e))?;
        // `xmax = 0` holds for a row this statement inserted, not for one it updated.
        // A repeat of the same recurring series keeps its place (next occurrence, count,
        // revision): a redelivered command neither skips a catch-up nor re-anchors the series.
        let same_series =
            "EXCLUDED.recurrence IS NOT NULL AND t.recurrence IS NOT DISTINCT FROM EXCLUDED.recurrence";
        let upsert = format!(
            "INSERT INTO timers AS t (tenant_id, service_call_id, due_at, registered_at, \
                                      correlation_id, payload, available_at, recurrence) \
             SELECT i.tenant_id, i.service_call_id, i.due_at, $6, i.correlation_id, i.payload, \
                    i.due_at, i.recurrence \
             FROM UNNEST($1::text[], $2::text[], $3::bigint[], $4::text[], $5::text[], $7::text[]) \
                  AS i(tenant_id, service_call_id, due_at, correlation_id, payload, recurrence) \
             ON CONFLICT (tenant_id, service_call_id) DO UPDATE SET \
                revision = t.revision + CASE WHEN {same_series} THEN 0 \
                    WHEN t.due_at <> EXCLUDED.due_at \
                    OR t.recurrence IS DISTINCT FROM EXCLUDED.recurrence THEN 1 ELSE 0 END, \
                attempts = CASE WHEN {same_series} THEN t.attempts \
                    WHEN t.due_at <> EXCLUDED.due_at \
                    OR t.recurrence IS DISTINCT FROM EXCLUDED.recurrence THEN 0 ELSE t.attempts END, \
                available_at = CASE WHEN {same_series} THEN t.available_at \
                               WHEN t.lease_until > $6 \
                               THEN GREATEST(t.lease_until, EXCLUDED.due_at) ELSE EXCLUDED.due_at END, \
                due_at = CASE WHEN {same_series} THEN t.due_at ELSE EXCLUDED.due_at END, \
                correlation_id = EXCLUDED.correlation_id, \
                payload = EXCLUDED.payload, \
                occurrences = CASE WHEN t.recurrence IS NOT DISTINCT FROM EXCLUDED.recurrence \
                              THEN t.occurrences ELSE 0 END, \
                recurrence = EXCLUDED.recurrence \
             WHERE t.state = 0 \
             RETURNING t.tenant_id, t.service_call_id, (t.xmax = 0) AS inserted"
        );
        let written = sqlx::query(&upsert)
            .bind(&tenants)
            .bind(&ids)
            .bind(&dues)
            .bind(&correlations)
            .bind(&payloads)
            .bind(now.as_millis())
            .bind(&recurrences)
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| db_err(op, e))?;
        let mut outcome: std::collections::HashMap<TimerKey, ScheduleOutcome> = Default::default();
        for row in &written {
            let inserted: bool = row.try_get("inserted").map_err(|e| db_err(op, e))?;
            let o = if inserted {
                ScheduleOutcome::Created
            } else {
                ScheduleOutcome::Updated
            };
            outcome.insert(key_of(row)?, o);
        }
        if outcome.len() < rows.len() {
            // The rest already fired or were cancelled: say which.
            let finished = sqlx::query(
                "SELECT t.tenant_id, t.service_call_id, t.state FROM timers t \
                 JOIN UNNEST($1::text[], $2::text[]) AS k(tenant_id, service_call_id) \
                   USING (tenant_id, service_call_id) WHERE t.state <> 0",
            )
            .bind(&tenants)
            .bind(&ids)
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| db_err(op, e))?;
            for row in &finished {
                let state: i16 = row.try_get("state").map_err(|e| db_err(op, e))?;
                let o = match TimerState::from_code(i64::from(state)) {
                    Some(TimerState::Reached) => ScheduleOutcome::AlreadyReached,
                    Some(TimerState::Failed) => ScheduleOutcome::AlreadyFailed,
                    _ => ScheduleOutcome::AlreadyCancelled,
                };
                outcome.insert(key_of(row)?, o);
            }
        }
        if let Some(channel) = &self.channel {
            let soonest = rows
                .iter()
                .filter(|t| {
                    matches!(
                        outcome.get(&t.key),
                        Some(ScheduleOutcome::Created | ScheduleOutcome::Updated)
                    )
                })
                .map(|t| t.due_at.as_millis())
                .min();
            if let Some(due) = soonest {
                // Delivered at commit, to every instance listening (this one included).
                sqlx::query("SELECT pg_notify($1, $2)")
                    .bind(channel)
                    .bind(due.to_string())
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| db_err(op, e))?;
            }
        }
        tx.commit().await.map_err(|e| db_err(op, e))?;

        // Outcomes in input order; an earlier duplicate of a key written later in the batch was
        // created or updated by the batch as a whole.
        let mut seen: std::collections::HashSet<&TimerKey> = Default::default();
        timers
            .iter()
            .map(|t| {
                let batch_outcome = outcome.get(&t.key).copied().ok_or_else(|| {
                    Error::internal(format!("postgres store: no outcome for {}", t.key))
                })?;
                let first = seen.insert(&t.key);
                Ok(match batch_outcome {
                    ScheduleOutcome::Created if !first => ScheduleOutcome::Updated,
                    other => other,
                })
            })
            .collect()
    }

    async fn claim_due(
        &self,
        now: Timestamp,
        limit: usize,
        lease: &Lease,
    ) -> Result<Vec<ClaimedTimer>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        // SKIP LOCKED: concurrent claimers take different rows instead of waiting on each other.
        let rows = sqlx::query(
            "UPDATE timers t SET lease_owner = $1, available_at = $2, lease_until = $2 \
             FROM (SELECT tenant_id, service_call_id FROM timers \
                   WHERE state = 0 AND available_at <= $3 \
                   ORDER BY available_at LIMIT $4 FOR UPDATE SKIP LOCKED) c \
             WHERE t.tenant_id = c.tenant_id AND t.service_call_id = c.service_call_id \
             RETURNING t.tenant_id, t.service_call_id, t.due_at, t.registered_at, \
                       t.correlation_id, t.payload, t.attempts, t.revision, t.recurrence, \
                       t.occurrences",
        )
        .bind(&lease.owner)
        .bind(lease.until.as_millis())
        .bind(now.as_millis())
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&self.pool)
        .await
        .map_err(|e| db_err("claiming due timers", e))?;
        let mut claimed = rows
            .iter()
            .map(claimed_from_row)
            .collect::<Result<Vec<_>>>()?;
        claimed.sort_by(|a, b| a.due_at.cmp(&b.due_at).then_with(|| a.key.cmp(&b.key)));
        Ok(claimed)
    }

    async fn mark_reached(
        &self,
        timers: &[ClaimedTimer],
        owner: &str,
        at: Timestamp,
    ) -> Result<u64> {
        let (tenants, ids) = Self::key_arrays(timers.iter().map(|t| &t.key));
        let revisions: Vec<i64> = timers.iter().map(|t| t.revision).collect();
        let done = sqlx::query(
            "UPDATE timers t SET state = 1, reached_at = $4, finished_at = $4, \
               occurrences = t.occurrences + CASE WHEN t.recurrence IS NULL THEN 0 ELSE 1 END \
             FROM UNNEST($1::text[], $2::text[], $3::bigint[]) AS m(tenant_id, service_call_id, revision) \
             WHERE t.tenant_id = m.tenant_id AND t.service_call_id = m.service_call_id \
               AND t.revision = m.revision AND t.state = 0 AND t.lease_owner = $5",
        )
        .bind(&tenants)
        .bind(&ids)
        .bind(&revisions)
        .bind(at.as_millis())
        .bind(owner)
        .execute(&self.pool)
        .await
        .map_err(|e| db_err("marking timers reached", e))?;
        Ok(done.rows_affected())
    }

    async fn advance(
        &self,
        timers: &[(ClaimedTimer, Timestamp)],
        owner: &str,
        at: Timestamp,
    ) -> Result<u64> {
        let (tenants, ids) = Self::key_arrays(timers.iter().map(|(t, _)| &t.key));
        let revisions: Vec<i64> = timers.iter().map(|(t, _)| t.revision).collect();
        let nexts: Vec<i64> = timers.iter().map(|(_, next)| next.as_millis()).collect();
        let mut tx = self
            .pool
            .begin()
            .await
            .map_err(|e| db_err("moving recurring timers", e))?;
        let done = sqlx::query(
            "UPDATE timers t SET due_at = m.next, available_at = m.next, \
               revision = t.revision + 1, attempts = 0, last_error = NULL, lease_owner = NULL, \
               lease_until = NULL, \
               reached_at = $5, occurrences = t.occurrences + 1 \
             FROM UNNEST($1::text[], $2::text[], $3::bigint[], $4::bigint[]) \
                  AS m(tenant_id, service_call_id, revision, next) \
             WHERE t.tenant_id = m.tenant_id AND t.service_call_id = m.service_call_id \
               AND t.revision = m.revision AND t.state = 0 AND t.lease_owner = $6",
        )
        .bind(&tenants)
        .bind(&ids)
        .bind(&revisions)
        .bind(&nexts)
        .bind(at.as_millis())
        .bind(owner)
        .execute(&mut *tx)
        .await
        .map_err(|e| db_err("moving recurring timers to their next occurrence", e))?;
        if let (Some(channel), Some(soonest)) = (&self.channel, nexts.iter().min()) {
            // Other instances may sleep past the next occurrence: tell them.
            sqlx::query("SELECT pg_notify($1, $2)")
                .bind(channel)
                .bind(soonest.to_string())
                .execute(&mut *tx)
                .await
                .map_err(|e| db_err("notifying the next occurrence", e))?;
        }
        tx.commit()
            .await
            .map_err(|e| db_err("moving recurring timers", e))?;
        Ok(done.rows_affected())
    }

    async fn fail(
        &self,
        timers: &[ClaimedTimer],
        owner: &str,
        at: Timestamp,
        error: &str,
    ) -> Result<u64> {
        let (tenants, ids) = Self::key_arrays(timers.iter().map(|t| &t.key));
        let revisions: Vec<i64> = timers.iter().map(|t| t.revision).collect();
        let done = sqlx::query(
            "UPDATE timers t SET state = 3, finished_at = $4, attempts = t.attempts + 1, \
               last_error = $5 \
             FROM UNNEST($1::text[], $2::text[], $3::bigint[]) AS m(tenant_id, service_call_id, revision) \
             WHERE t.tenant_id = m.tenant_id AND t.service_call_id = m.service_call_id \
               AND t.revision = m.revision AND t.state = 0 AND t.lease_owner = $6",
        )
        .bind(&tenants)
        .bind(&ids)
        .bind(&revisions)
        .bind(at.as_millis())
        .bind(error)
        .bind(owner)
        .execute(&self.pool)
        .await
        .map_err(|e| db_err("marking timers failed", e))?;
        Ok(done.rows_affected())
    }

    async fn release(
        &self,
        timers: &[ClaimedTimer],
        owner: &str,
        retry_at: Timestamp,
        error: Option<&str>,
    ) -> Result<()> {
        let (tenants, ids) = Self::key_arrays(timers.iter().map(|t| &t.key));
        sqlx::query(
            "UPDATE timers t SET lease_owner = NULL, lease_until = NULL, \
               available_at = GREATEST($3, t.due_at), \
               attempts = t.attempts + $4, last_error = COALESCE($5, t.last_error) \
             FROM UNNEST($1::text[], $2::text[]) AS m(tenant_id, service_call_id) \
             WHERE t.tenant_id = m.tenant_id AND t.service_call_id = m.service_call_id \
               AND t.state = 0 AND t.lease_owner = $6",
        )
        .bind(&tenants)
        .bind(&ids)
        .bind(retry_at.as_millis())
        .bind(i32::from(error.is_some()))
        .bind(error)
        .bind(owner)
        .execute(&self.pool)
        .await
        .map_err(|e| db_err("releasing timers", e))?;
        Ok(())
    }

    async fn next_due_at(&self) -> Result<Option<Timestamp>> {
        let next: Option<i64> =
            sqlx::query_scalar("SELECT MIN(available_at) FROM timers WHERE state = 0")
                .fetch_one(&self.pool)
                .await
                .map_err(|e| db_err("reading the next due time", e))?;
        Ok(next.map(Timestamp::from_millis))
    }

    async fn get(&self, key: &TimerKey) -> Result<Option<Timer>> {
        let row = sqlx::query(
            "SELECT tenant_id, service_call_id, due_at, state, registered_at, reached_at, \
                    correlation_id, payload, attempts, last_error, lease_owner, available_at, \
                    recurrence, occurrences \
             FROM timers WHERE tenant_id = $1 AND service_call_id = $2",
        )
        .bind(&key.tenant_id)
        .bind(&key.service_call_id)
        .fetch_optional(&self.pool)
        .await
        .map_err(|e| db_err("reading a timer", e))?;
        row.as_ref().map(timer_from_row).transpose()
    }

    async fn cancel(&self, key: &TimerKey, now: Timestamp) -> Result<CancelOutcome> {
        let op = "cancelling a timer";
        let mut tx = self.pool.begin().await.map_err(|e| db_err(op, e))?;
        // FOR UPDATE: a claim (which locks the row too) and this cancel are ordered.
        let row: Option<(i16, bool)> = sqlx::query_as(
            "SELECT state, COALESCE(lease_until > $3, false) FROM timers \
             WHERE tenant_id = $1 AND service_call_id = $2 FOR UPDATE",
        )
        .bind(&key.tenant_id)
        .bind(&key.service_call_id)
        .bind(now.as_millis())
        .fetch_optional(&mut *tx)
        .await
        .map_err(|e| db_err(op, e))?;
        let state = row.map(|(code, firing)| (TimerState::from_code(i64::from(code)), firing));
        let outcome = match state {
            None | Some((None, _)) => CancelOutcome::NotFound,
            Some((Some(TimerState::Reached), _)) => CancelOutcome::AlreadyReached,
            Some((Some(TimerState::Cancelled), _)) => CancelOutcome::AlreadyCancelled,
            Some((Some(TimerState::Failed), _)) => CancelOutcome::AlreadyFailed,
            Some((Some(TimerState::Scheduled), true)) => CancelOutcome::Firing,
            Some((Some(TimerState::Scheduled), false)) => {
                sqlx::query(
                    "UPDATE timers SET state = 2, finished_at = $3 \
                     WHERE tenant_id = $1 AND service_call_id = $2",
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
        let done = sqlx::query(
            "DELETE FROM timers WHERE ctid IN (SELECT ctid FROM timers \
             WHERE state <> 0 AND finished_at < $1 LIMIT $2)",
        )
        .bind(older_than.as_millis())
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .execute(&self.pool)
        .await
        .map_err(|e| db_err("purging finished timers", e))?;
        Ok(done.rows_affected())
    }

    async fn pending(&self) -> Result<u64> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM timers WHERE state = 0")
            .fetch_one(&self.pool)
            .await
            .map_err(|e| db_err("counting pending timers", e))?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    async fn pending_by_tenant(&self, tenants: &[String]) -> Result<HashMap<String, u64>> {
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT tenant_id, COUNT(*) FROM timers WHERE state = 0 AND tenant_id = ANY($1) \
             GROUP BY tenant_id",
        )
        .bind(tenants)
        .fetch_all(&self.pool)
        .await
        .map_err(|e| db_err("counting pending timers per tenant", e))?;
        Ok(rows
            .into_iter()
            .map(|(tenant, n)| (tenant, u64::try_from(n).unwrap_or(0)))
            .collect())
    }

    async fn health(&self) -> Result<()> {
        sqlx::query("SELECT 1")
            .execute(&self.pool)
            .await
            .map(|_| ())
            .map_err(|e| db_err("health check", e))
    }

    fn wakeups(&self) -> Option<broadcast::Receiver<Timestamp>> {
        self.channel.as_ref().map(|_| self.wakeups.subscribe())
    }
}
