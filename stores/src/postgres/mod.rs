//! `postgres`: timers in PostgreSQL (sqlx). Several instances share one schema: claiming uses
//! `FOR UPDATE SKIP LOCKED`, so two instances never lease the same row, and a NOTIFY on every
//! scheduled batch wakes every instance's firing task when a sooner timer arrives.

mod config;
mod owners;
mod plugin;

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{
    PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions, PgSslMode,
    Postgres,
};
use sqlx::{Connection, Row};
use timer_core::control::DEFAULT_HISTORY;
use timer_core::policy::{Policy, Work};
use timer_core::{
    Action, CancelOutcome, Change, ClaimedTimer, ControlOutcome, Error, HistoryEntry, Lease,
    NewTimer, PageAfter, Recurrence, Result, ScheduleOutcome, Settlement, Store, TenantCounts,
    TenantSummary, Timer, TimerControl, TimerFilter, TimerHistory, TimerKey, TimerQueries,
    TimerState, Timestamp,
};
use tokio::sync::broadcast;
use tracing::{info, warn};

pub use config::PostgresConfig;
pub use plugin::{PLUGIN, TEST_SERVER};

type PgQuery<'q> = sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>;

use crate::sql::{self, Dialect, Statements, TimerRow};

pub struct PostgresStore {
    pool: PgPool,
    schema: String,
    /// NOTIFY channel of this schema, when wake-ups are on.
    channel: Option<String>,
    wakeups: broadcast::Sender<Timestamp>,
    listener: Option<tokio::task::JoinHandle<()>>,
    /// History entries kept per timer ([`TimerHistory::set_limit`]).
    history: AtomicUsize,
    /// `store.connect_timeout`, for connections opened later (the lease owner's).
    connect_timeout: Duration,
}

impl Drop for PostgresStore {
    fn drop(&mut self) {
        if let Some(task) = &self.listener {
            task.abort();
        }
    }
}

impl Dialect for PostgresStore {
    type Db = Postgres;
    type State = i16;
    type Count = i32;
    const NAME: &'static str = "postgres";
    // SKIP LOCKED: concurrent claimers take different rows instead of waiting on each other.
    const CLAIM: &'static str =
        "UPDATE timers t SET lease_owner = $1, available_at = $2, lease_until = $2 \
         FROM (SELECT tenant_id, service_call_id FROM timers \
               WHERE state = 0 AND available_at <= $3 \
               ORDER BY available_at LIMIT $4 FOR UPDATE SKIP LOCKED) c \
         WHERE t.tenant_id = c.tenant_id AND t.service_call_id = c.service_call_id \
         RETURNING t.tenant_id, t.service_call_id, t.due_at, t.registered_at, \
                   t.correlation_id, t.payload, t.attempts, t.revision, t.recurrence, \
                   t.occurrences, t.policy, t.work";
    // Row locks (FOR UPDATE) order writers; the transaction needs no lock up front.
    const LOCK_FOR_WRITE: Option<&'static str> = None;
    // A claim locks the row too: it and the action are ordered.
    const LOCK_ROW: &'static str = " FOR UPDATE";
    // The history goes in the same statement (timer_history has no foreign key: migration 0005).
    const PURGE: &'static str = "WITH gone AS (DELETE FROM timers WHERE ctid IN (SELECT ctid \
        FROM timers WHERE state <> 0 AND finished_at < $1 LIMIT $2) \
        RETURNING tenant_id, service_call_id), \
        history AS (DELETE FROM timer_history h USING gone \
        WHERE h.tenant_id = gone.tenant_id AND h.service_call_id = gone.service_call_id) \
        SELECT 1 FROM gone";

    fn retryable(e: &sqlx::Error) -> bool {
        match e {
            // SQLSTATE classes that pass: connection (08), transaction rollback such as deadlock
            // or serialization (40), insufficient resources (53), operator intervention (57).
            // Others (permission denied, syntax, constraint) will fail again the same way.
            sqlx::Error::Database(db) => db.code().is_some_and(|c| {
                ["08", "40", "53", "57"]
                    .iter()
                    .any(|class| c.starts_with(class))
            }),
            _ => true,
        }
    }

}

fn db_err(op: &str, e: sqlx::Error) -> Error {
    sql::db_err::<PostgresStore>(op, e)
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
        let statement_timeout = config.statement_timeout.as_millis().to_string();
        let options = options
            .options([
                ("search_path", config.schema.as_str()),
                ("statement_timeout", statement_timeout.as_str()),
            ])
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
            history: AtomicUsize::new(DEFAULT_HISTORY),
            connect_timeout: config.connect_timeout,
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
        // Index builds on a big table take as long as they take: store.statement_timeout
        // bounds the service's own statements, not its migrations (RESET goes back to the
        // connection's own setting before it returns to the pool).
        let mut conn = pool.acquire().await.map_err(|e| db_err(op, e))?;
        sqlx::query("SET statement_timeout = 0")
            .execute(&mut *conn)
            .await
            .map_err(|e| db_err(op, e))?;
        // sqlx's migrator holds a PostgreSQL advisory lock while it runs.
        sqlx::migrate!("./migrations/postgres")
            .run_direct(&mut *conn)
            .await
            .map_err(|e| {
                Error::unavailable(format!("postgres store: migrating schema {schema} failed"))
                    .with_source(e)
            })?;
        sqlx::query("RESET statement_timeout")
            .execute(&mut *conn)
            .await
            .map(|_| ())
            .map_err(|e| db_err(op, e))
    }

    /// Drops this store's schema and everything in it (benchmarks and tests clean up with it).
    pub async fn drop_schema(&self) -> Result<()> {
        sqlx::query(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema))
            .execute(&self.pool)
            .await
            .map(|_| ())
            .map_err(|e| db_err("dropping the schema", e))
    }

    fn statements(&self) -> Statements<'_, Self> {
        sql::on(&self.pool)
    }

    fn history_limit(&self) -> i64 {
        i64::try_from(self.history.load(Ordering::Relaxed)).unwrap_or(i64::MAX)
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
        let policies: Vec<Option<String>> = rows
            .iter()
            .map(|t| t.policy.as_ref().map(Policy::to_json))
            .collect();
        let works: Vec<Option<String>> = rows
            .iter()
            .map(|t| t.work.as_ref().map(Work::to_json))
            .collect();
        // What the history records for each row, whichever way it is written.
        let created: Vec<String> = rows
            .iter()
            .map(|t| Change::Created { due_at: t.due_at }.to_json())
            .collect();
        let rescheduled: Vec<String> = rows
            .iter()
            .map(|t| Change::Rescheduled { due_at: t.due_at }.to_json())
            .collect();

        let mut tx = self.pool.begin().await.map_err(|e| db_err(op, e))?;
        // `xmax = 0` holds for a row this statement inserted, not for one it updated.
        // A repeat of the same recurring series keeps its place (next occurrence, count,
        // revision): a redelivered command neither skips a catch-up nor re-anchors the series.
        let same_series =
            "EXCLUDED.recurrence IS NOT NULL AND t.recurrence IS NOT DISTINCT FROM EXCLUDED.recurrence";
        let upsert = format!(
            "INSERT INTO timers AS t (tenant_id, service_call_id, due_at, registered_at, \
                                      correlation_id, payload, available_at, recurrence, \
                                      history_seq, policy, work) \
             SELECT i.tenant_id, i.service_call_id, i.due_at, $6, i.correlation_id, i.payload, \
                    i.due_at, i.recurrence, 1, i.policy, i.work \
             FROM UNNEST($1::text[], $2::text[], $3::bigint[], $4::text[], $5::text[], $7::text[], \
                         $11::text[], $12::text[]) \
                  AS i(tenant_id, service_call_id, due_at, correlation_id, payload, recurrence, \
                       policy, work) \
             ON CONFLICT (tenant_id, service_call_id) DO UPDATE SET \
                work = CASE WHEN {same_series} THEN t.work \
                    WHEN t.due_at <> EXCLUDED.due_at \
                    OR t.recurrence IS DISTINCT FROM EXCLUDED.recurrence THEN EXCLUDED.work \
                    ELSE t.work END, \
                policy = EXCLUDED.policy, \
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
                recurrence = EXCLUDED.recurrence, \
                history_seq = t.history_seq + 1 \
             WHERE t.state IN (0, 4)"
        );
        let upsert = recorded(
            &upsert,
            ", (t.xmax = 0) AS inserted",
            "UNNEST($1::text[], $2::text[], $8::text[], $9::text[]) \
             AS c(tenant_id, service_call_id, created, rescheduled)",
            "CASE WHEN s.inserted THEN c.created ELSE c.rescheduled END",
            (6, 10),
            "SELECT tenant_id, service_call_id, inserted FROM s",
        );
        let written = sqlx::query(&upsert)
            .bind(&tenants)
            .bind(&ids)
            .bind(&dues)
            .bind(&correlations)
            .bind(&payloads)
            .bind(now.as_millis())
            .bind(&recurrences)
            .bind(&created)
            .bind(&rescheduled)
            .bind(self.history_limit())
            .bind(&policies)
            .bind(&works)
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
            outcome.insert(TimerRow::<Self>::of(row).key()?, o);
        }
        if outcome.len() < rows.len() {
            // The rest already fired, failed or were cancelled: say which.
            let finished = sqlx::query(
                "SELECT t.tenant_id, t.service_call_id, t.state FROM timers t \
                 JOIN UNNEST($1::text[], $2::text[]) AS k(tenant_id, service_call_id) \
                   USING (tenant_id, service_call_id) WHERE t.state IN (1, 2, 3)",
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
                outcome.insert(TimerRow::<Self>::of(row).key()?, o);
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
        self.statements().claim(now, limit, lease).await
    }

    async fn settle(
        &self,
        claims: &[(ClaimedTimer, Settlement)],
        owner: &str,
        at: Timestamp,
    ) -> Result<u64> {
        let op = "settling claimed timers";
        // One statement per kind of settlement, each over arrays of its rows, recording each
        // row's change (`Change::of_settlement`) in the same statement.
        let mut reached = Vec::new();
        let mut next = Vec::new();
        let mut failed = Vec::new();
        let mut retry = Vec::new();
        let mut steps = Vec::new();
        for (t, settlement) in claims {
            let change = Change::of_settlement(t, settlement, owner, at).map(|c| c.to_json());
            match settlement {
                // Row by row, in the transaction of the others (below).
                Settlement::Step(step) => steps.push((t, step)),
                Settlement::Reached => reached.push((t, change)),
                Settlement::Next(at) => next.push((t, (at.as_millis(), change))),
                Settlement::Failed(error) => failed.push((t, (error.as_str(), change))),
                Settlement::Retry { at, error } => {
                    retry.push((t, (at.as_millis(), error.as_deref(), change)))
                }
            }
        }
        let (reached, reached_changes) = Columns::split(reached);
        let (next, next_rest) = Columns::split(next);
        let (nexts, next_changes): (Vec<i64>, Vec<Option<String>>) = next_rest.into_iter().unzip();
        let (failed, failed_rest) = Columns::split(failed);
        let (errors, failed_changes): (Vec<&str>, Vec<Option<String>>) =
            failed_rest.into_iter().unzip();
        let (retry_claims, retry_rest) = Columns::split(retry);
        let mut retry_at = Vec::new();
        let mut retry_errors = Vec::new();
        let mut retry_changes = Vec::new();
        for (at, error, change) in retry_rest {
            retry_at.push(at);
            retry_errors.push(error);
            retry_changes.push(change);
        }
        let history = self.history_limit();

        // (whether its rows count as settled, the statement)
        let mut queries = Vec::new();
        if !reached.is_empty() {
            let sql = SETTLE_REACHED.get_or_init(|| settled(SETTLE_REACHED_SQL, (6, 5, 7)));
            queries.push((
                true,
                reached.bind(sql, owner, at).bind(&reached_changes).bind(history),
            ));
        }
        if !next.is_empty() {
            let sql = SETTLE_NEXT.get_or_init(|| settled(SETTLE_NEXT_SQL, (7, 5, 8)));
            queries.push((
                true,
                next.bind(sql, owner, at)
                    .bind(&nexts)
                    .bind(&next_changes)
                    .bind(history),
            ));
            if let (Some(channel), Some(soonest)) = (&self.channel, nexts.iter().min()) {
                // Other instances may sleep past the next occurrence: tell them.
                queries.push((
                    false,
                    sqlx::query("SELECT pg_notify($1, $2)")
                        .bind(channel)
                        .bind(soonest.to_string()),
                ));
            }
        }
        if !failed.is_empty() {
            let sql = SETTLE_FAILED.get_or_init(|| settled(SETTLE_FAILED_SQL, (7, 5, 8)));
            queries.push((
                true,
                failed
                    .bind(sql, owner, at)
                    .bind(&errors)
                    .bind(&failed_changes)
                    .bind(history),
            ));
        }
        if !retry_claims.is_empty() {
            let sql = SETTLE_RETRY.get_or_init(|| settled(SETTLE_RETRY_SQL, (6, 7, 8)));
            let retry = sqlx::query(sql)
                .bind(&retry_claims.tenants)
                .bind(&retry_claims.ids)
                .bind(&retry_at)
                .bind(&retry_errors)
                .bind(owner)
                .bind(&retry_changes)
                .bind(at.as_millis())
                .bind(history);
            queries.push((true, retry));
        }
        let settled_rows = |row: &sqlx::postgres::PgRow| -> Result<u64> {
            let n: i64 = row.try_get(0).map_err(|e| db_err(op, e))?;
            Ok(u64::try_from(n).unwrap_or(0))
        };
        if queries.len() == 1 && steps.is_empty() {
            if let Some((_, query)) = queries.pop() {
                // One statement commits by itself: no transaction round trips on the hot path.
                let row = query.fetch_one(&self.pool).await.map_err(|e| db_err(op, e))?;
                return settled_rows(&row);
            }
        }
        let mut changed = 0;
        let mut tx = self.pool.begin().await.map_err(|e| db_err(op, e))?;
        for (counts, query) in queries {
            let row = query.fetch_one(&mut *tx).await.map_err(|e| db_err(op, e))?;
            if counts {
                changed += settled_rows(&row)?;
            }
        }
        let limit = usize::try_from(history).unwrap_or(usize::MAX);
        for (t, step) in steps {
            let seq = sql::settle_step::<Self>(&mut tx, t, step, owner, at)
                .await
                .map_err(|e| db_err(op, e))?;
            if let Some(seq) = seq {
                changed += 1;
                sql::record::<Self>(&mut tx, &t.key, seq, at, &step.changes, limit)
                    .await
                    .map_err(|e| db_err(op, e))?;
            }
        }
        tx.commit().await.map_err(|e| db_err(op, e))?;
        Ok(changed)
    }

    async fn renew(&self, keys: &[TimerKey], owner: &str, until: Timestamp) -> Result<u64> {
        let (tenants, ids) = Self::key_arrays(keys.iter());
        sqlx::query(RENEW_SQL)
            .bind(&tenants)
            .bind(&ids)
            .bind(owner)
            .bind(until.as_millis())
            .execute(&self.pool)
            .await
            .map(|done| done.rows_affected())
            .map_err(|e| db_err("renewing leases", e))
    }

    async fn next_due_at(&self) -> Result<Option<Timestamp>> {
        self.statements().next_due_at().await
    }

    async fn get(&self, key: &TimerKey) -> Result<Option<Timer>> {
        self.statements().get(key).await
    }

    async fn cancel(&self, key: &TimerKey, now: Timestamp) -> Result<CancelOutcome> {
        self.cancel_one(key, now).await
    }

    async fn purge(&self, older_than: Timestamp, limit: usize) -> Result<u64> {
        self.statements().purge(older_than, limit).await
    }

    async fn scheduled_count(&self) -> Result<u64> {
        self.statements().scheduled_count().await
    }

    async fn health(&self) -> Result<()> {
        self.statements().health().await
    }

    fn wakeups(&self) -> Option<broadcast::Receiver<Timestamp>> {
        self.channel.as_ref().map(|_| self.wakeups.subscribe())
    }

    fn tenant_counts(&self) -> Option<&dyn TenantCounts> {
        Some(self)
    }

    fn queries(&self) -> Option<&dyn TimerQueries> {
        Some(self)
    }

    fn control(&self) -> Option<&dyn TimerControl> {
        Some(self)
    }

    fn history(&self) -> Option<&dyn TimerHistory> {
        Some(self)
    }

    fn lease_owners(&self) -> Option<&dyn timer_core::LeaseOwners> {
        Some(self)
    }
}

#[async_trait]
impl TimerControl for PostgresStore {
    async fn apply(
        &self,
        keys: &[TimerKey],
        action: &Action,
        now: Timestamp,
    ) -> Result<Vec<ControlOutcome>> {
        let limit = self.history.load(Ordering::Relaxed);
        self.statements().apply(keys, action, now, limit).await
    }
}

#[async_trait]
impl TimerHistory for PostgresStore {
    fn set_limit(&self, per_timer: usize) {
        self.history.store(per_timer, Ordering::Relaxed);
    }

    async fn read(&self, key: &TimerKey, after: u64, limit: usize) -> Result<Vec<HistoryEntry>> {
        self.statements().history(key, after, limit).await
    }

    async fn record(&self, key: &TimerKey, at: Timestamp, change: &Change) -> Result<bool> {
        let limit = self.history.load(Ordering::Relaxed);
        self.statements().record(key, at, change, limit).await
    }
}

#[async_trait]
impl TimerQueries for PostgresStore {
    async fn list(
        &self,
        tenant: &str,
        filter: &TimerFilter,
        after: Option<&PageAfter>,
        limit: usize,
    ) -> Result<Vec<Timer>> {
        self.statements().list(tenant, filter, after, limit).await
    }

    async fn tenants(&self, after: Option<&str>, limit: usize) -> Result<Vec<String>> {
        self.statements().tenants(after, limit).await
    }

    async fn summaries(
        &self,
        tenants: &[String],
        failed_since: Timestamp,
        fired_since: Timestamp,
    ) -> Result<Vec<TenantSummary>> {
        self.statements()
            .summaries(tenants, failed_since, fired_since)
            .await
    }

    async fn count(&self, state: TimerState) -> Result<u64> {
        self.statements().count(state).await
    }
}

#[async_trait]
impl TenantCounts for PostgresStore {
    async fn live_by_tenant(&self, tenants: &[String]) -> Result<HashMap<String, u64>> {
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT tenant_id, COUNT(*) FROM timers WHERE state IN (0, 4) \
             AND tenant_id = ANY($1) GROUP BY tenant_id",
        )
        .bind(tenants)
        .fetch_all(&self.pool)
        .await
        .map_err(|e| db_err("counting Scheduled and Paused timers per tenant", e))?;
        Ok(rows
            .into_iter()
            .map(|(tenant, n)| (tenant, u64::try_from(n).unwrap_or(0)))
            .collect())
    }
}

/// A settlement over arrays of claims, all or none of them at once. Parameters: $1 tenants,
/// $2 service call ids, $3 claimed revisions, $4 the lease owner, $5 the settle time, then the
/// settlement's own arrays from $6 (`arrays`), named in `m` after the revision (`columns`).
/// Only rows still Scheduled, leased by the owner, at the claimed revision change.
macro_rules! settle_sql {
    ($set:literal, $arrays:literal, $columns:literal) => {
        concat!(
            "UPDATE timers t SET ",
            $set,
            ", history_seq = t.history_seq + 1",
            " FROM UNNEST($1::text[], $2::text[], $3::bigint[]",
            $arrays,
            ") AS m(tenant_id, service_call_id, revision",
            $columns,
            ") WHERE t.tenant_id = m.tenant_id AND t.service_call_id = m.service_call_id \
               AND t.state = 0 AND t.lease_owner = $4 AND t.revision = m.revision"
        )
    };
}

const SETTLE_REACHED_SQL: &str = settle_sql!(
    "state = 1, reached_at = $5, finished_at = $5, \
     occurrences = t.occurrences + CASE WHEN t.recurrence IS NULL THEN 0 ELSE 1 END",
    "",
    ""
);

/// $6 the next occurrences.
const SETTLE_NEXT_SQL: &str = settle_sql!(
    "due_at = m.next, available_at = m.next, revision = t.revision + 1, attempts = 0, \
     last_error = NULL, lease_owner = NULL, lease_until = NULL, reached_at = $5, \
     occurrences = t.occurrences + 1",
    ", $6::bigint[]",
    ", next"
);

/// $6 the errors.
const SETTLE_FAILED_SQL: &str = settle_sql!(
    "state = 3, finished_at = $5, attempts = t.attempts + 1, last_error = m.error",
    ", $6::text[]",
    ", error"
);

/// $1 tenants, $2 service call ids, $3 when each becomes claimable, $4 the errors (NULL for
/// none; an error is a failed publish, recorded in the history), $5 the lease owner. At any
/// revision: the lease goes back even when the timer changed meanwhile.
const SETTLE_RETRY_SQL: &str = "UPDATE timers t SET lease_owner = NULL, lease_until = NULL, \
      available_at = GREATEST(m.retry_at, t.due_at), \
      attempts = t.attempts + CASE WHEN m.error IS NULL THEN 0 ELSE 1 END, \
      last_error = COALESCE(m.error, t.last_error), \
      history_seq = t.history_seq + CASE WHEN m.error IS NULL THEN 0 ELSE 1 END \
    FROM UNNEST($1::text[], $2::text[], $3::bigint[], $4::text[]) \
         AS m(tenant_id, service_call_id, retry_at, error) \
    WHERE t.tenant_id = m.tenant_id AND t.service_call_id = m.service_call_id \
      AND t.state = 0 AND t.lease_owner = $5";

/// $1 tenants, $2 ids, $3 the lease owner, $4 the new end of the lease.
const RENEW_SQL: &str = "UPDATE timers t SET available_at = GREATEST($4, t.due_at), lease_until = $4 \
    FROM UNNEST($1::text[], $2::text[]) AS k(tenant_id, service_call_id) \
    WHERE t.tenant_id = k.tenant_id AND t.service_call_id = k.service_call_id \
      AND t.state = 0 AND t.lease_owner = $3 AND t.lease_until IS NOT NULL";

/// The settlements as they run: each recording its changes and counting its rows
/// ([`settled`]), made once.
static SETTLE_REACHED: OnceLock<String> = OnceLock::new();
static SETTLE_NEXT: OnceLock<String> = OnceLock::new();
static SETTLE_FAILED: OnceLock<String> = OnceLock::new();
static SETTLE_RETRY: OnceLock<String> = OnceLock::new();

/// A settlement statement (its first two parameters are the keys) as one statement that also
/// records each settled row's change and answers how many rows it settled. `(changes, at,
/// limit)` number the parameters of the changes (JSON, NULL for none; in the order of the
/// keys), the settle time and the history limit.
fn settled(update: &str, (changes, at, limit): (usize, usize, usize)) -> String {
    recorded(
        update,
        "",
        &format!(
            "UNNEST($1::text[], $2::text[], ${changes}::text[]) \
             AS c(tenant_id, service_call_id, change)"
        ),
        "c.change",
        (at, limit),
        "SELECT COUNT(*) FROM s",
    )
}

/// `write` (an INSERT or UPDATE of `timers AS t`, without RETURNING) as one statement that
/// also records a history entry for each row it wrote and drops that row's entries beyond the
/// newest `$limit` (none are recorded, and none dropped, when it is 0). The written rows are `s` (key,
/// `history_seq`, and `returning`); `changes` is a relation `c` with the key columns, joined to
/// them, and `change` the SQL of each row's change (JSON text; NULL records none); `at` and
/// `limit` are the numbers of the parameters holding the time and the limit; `select` what the
/// whole statement answers (from `s`).
fn recorded(
    write: &str,
    returning: &str,
    changes: &str,
    change: &str,
    (at, limit): (usize, usize),
    select: &str,
) -> String {
    format!(
        "WITH s AS ({write} RETURNING t.tenant_id, t.service_call_id, t.history_seq{returning}), \
         h AS (INSERT INTO timer_history (tenant_id, service_call_id, seq, at, change) \
               SELECT s.tenant_id, s.service_call_id, s.history_seq, ${at}, {change} \
               FROM s JOIN {changes} USING (tenant_id, service_call_id) \
               WHERE {change} IS NOT NULL AND ${limit} > 0), \
         d AS (DELETE FROM timer_history x USING s \
               WHERE ${limit} > 0 AND s.history_seq > ${limit} AND x.tenant_id = s.tenant_id \
                 AND x.service_call_id = s.service_call_id \
                 AND x.seq <= s.history_seq - ${limit}) \
         {select}"
    )
}

/// Keys and claimed revisions of some claims, as the arrays an `UNNEST` reads.
struct Columns<'a> {
    tenants: Vec<&'a str>,
    ids: Vec<&'a str>,
    revisions: Vec<i64>,
}

impl<'a> Columns<'a> {
    fn of(claims: impl Iterator<Item = &'a ClaimedTimer>) -> Self {
        let mut columns = Columns {
            tenants: Vec::new(),
            ids: Vec::new(),
            revisions: Vec::new(),
        };
        for t in claims {
            columns.tenants.push(t.key.tenant_id.as_str());
            columns.ids.push(t.key.service_call_id.as_str());
            columns.revisions.push(t.revision);
        }
        columns
    }

    /// The columns of the claims in `pairs`, and what goes with each, in the same order.
    fn split<T>(pairs: Vec<(&'a ClaimedTimer, T)>) -> (Self, Vec<T>) {
        let (claims, rest): (Vec<&ClaimedTimer>, Vec<T>) = pairs.into_iter().unzip();
        (Columns::of(claims.into_iter()), rest)
    }

    fn is_empty(&self) -> bool {
        self.tenants.is_empty()
    }

    /// `sql` (of [`settle_sql!`]) with these claims, the lease owner and the settle time bound
    /// as its first parameters.
    fn bind<'q>(&'q self, sql: &'q str, owner: &'q str, at: Timestamp) -> PgQuery<'q> {
        sqlx::query(sql)
            .bind(&self.tenants)
            .bind(&self.ids)
            .bind(&self.revisions)
            .bind(owner)
            .bind(at.as_millis())
    }
}
