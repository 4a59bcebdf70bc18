//! `postgres`: timers in PostgreSQL (sqlx). Several instances share one schema: claiming uses
//! `FOR UPDATE SKIP LOCKED`, so two instances never lease the same row, and a NOTIFY on every
//! scheduled batch wakes every instance's firing task when a sooner timer arrives.
//!
//! The rest is the plugin's page of the book (`README.md` beside this file).
#![doc = include_str!("README.md")]

mod allowances;
mod config;
mod fair;
mod migrate;
mod notify;
mod owners;
mod plugin;
mod settle;
mod store;
#[cfg(all(test, feature = "testing"))]
mod store_tests;

use std::str::FromStr;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions, PgSslMode, Postgres};
use sqlx::Connection;
use timer_core::control::DEFAULT_HISTORY;
use timer_core::fair::FairShare;
use timer_core::{Error, Result, Timestamp};
use tokio::sync::broadcast;

pub use config::PostgresConfig;
pub use plugin::PLUGIN;
#[cfg(feature = "testing")]
pub use plugin::TEST_SERVER;

use crate::sql::{self, Dialect};
use notify::listen;

pub struct PostgresStore {
    pool: PgPool,
    schema: String,
    /// NOTIFY channel of this schema, when wake-ups are on.
    channel: Option<String>,
    wakeups: broadcast::Sender<Timestamp>,
    listener: Option<tokio::task::JoinHandle<()>>,
    /// History entries kept per timer
    /// ([`TimerHistory::set_limit`](timer_core::TimerHistory::set_limit)).
    history: AtomicUsize,
    /// `store.connect_timeout`, for connections opened later (the lease owner's).
    connect_timeout: Duration,
    /// Claims shared between tenants ([`timer_core::fair`]).
    fair: FairShare,
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
               WHERE state = 0 AND available_at <= $5 \
               AND (available_at <= $3 OR available_at = due_at) \
               ORDER BY available_at LIMIT $4 FOR UPDATE SKIP LOCKED) c \
         WHERE t.tenant_id = c.tenant_id AND t.service_call_id = c.service_call_id \
         RETURNING t.tenant_id, t.service_call_id, t.due_at, t.registered_at, \
                   t.correlation_id, t.payload, t.attempts, t.revision, t.recurrence, \
                   t.occurrences, t.policy, t.work, t.target, t.message, t.message_meta, \
                   t.traceparent, t.tracestate";
    // Row locks (FOR UPDATE) order writers; the transaction needs no lock up front.
    const LOCK_FOR_WRITE: Option<&'static str> = None;
    // A claim locks the row too: it and the action are ordered.
    const LOCK_ROW: &'static str = " FOR UPDATE";
    const KEYS_OF_JSON: Option<&'static str> =
        Some("SELECT k.t, k.i FROM jsonb_to_recordset($1::jsonb) AS k(t TEXT, i TEXT)");
    // Rows another transaction holds (a retry, a completion) are skipped, and what is deleted
    // is checked again: a row that stopped being finished while the purge ran stays. (The
    // outer DELETE alone would delete a new version of a row it found by its old one.)
    const PURGE: &'static str = "DELETE FROM timers t USING (SELECT tenant_id, \
        service_call_id FROM timers WHERE state <> 0 AND finished_at < $1 LIMIT $2 \
        FOR UPDATE SKIP LOCKED) old \
        WHERE t.tenant_id = old.tenant_id AND t.service_call_id = old.service_call_id \
        AND t.state <> 0 AND t.finished_at < $1 \
        RETURNING t.tenant_id, t.service_call_id";
    // timer_history has no foreign key (migration 0005). A statement of its own: one in the
    // purge's statement would not see the entry of a completion that committed after the purge
    // began, before it reached the row (it would outlive its timer).
    const PURGE_HISTORY: Option<&'static str> = Some(
        "DELETE FROM timer_history h USING jsonb_to_recordset($1::jsonb) AS gone(t TEXT, i TEXT) \
         WHERE h.tenant_id = gone.t AND h.service_call_id = gone.i",
    );

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

    fn placeholder(n: usize) -> String {
        format!("${n}")
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
        let this = crate::sql::migrations::releases::this_release()?;
        Self::prepare_schema(&pool, &config.schema, &this, &migrate::migrator()).await?;
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
            fair: FairShare::new(),
        })
    }

    /// Creates the schema if missing and migrates it as release `this`, with `releases` the
    /// migrations from 0.2.0 on.
    async fn prepare_schema(
        pool: &PgPool,
        schema: &str,
        this: &semver::Version,
        releases: &sqlx::migrate::Migrator,
    ) -> Result<()> {
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
        // bounds the service's own statements, not its migrations. A connection of its own,
        // closed after: it held advisory locks and a changed setting.
        let mut conn = pool
            .acquire()
            .await
            .map_err(|e| db_err(op, e))?
            .detach();
        let migrated = Self::migrate(&mut conn, schema, this, releases).await;
        let _ = conn.close().await;
        migrated
    }

    async fn migrate(
        conn: &mut PgConnection,
        schema: &str,
        this: &semver::Version,
        releases: &sqlx::migrate::Migrator,
    ) -> Result<()> {
        sqlx::query("SET statement_timeout = 0")
            .execute(&mut *conn)
            .await
            .map_err(|e| db_err("preparing the schema", e))?;
        migrate::run(conn, schema, this, releases).await
    }

    /// Drops this store's schema and everything in it (benchmarks and tests clean up with it).
    pub async fn drop_schema(&self) -> Result<()> {
        sqlx::query(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema))
            .execute(&self.pool)
            .await
            .map(|_| ())
            .map_err(|e| db_err("dropping the schema", e))
    }
}

#[cfg(test)]
mod tests {
    /// Released migrations never change (`sql::migrations`). 0.1.0's are closed: a new one
    /// goes to `migrations/postgres-releases/` (`migrate.rs`).
    #[test]
    fn released_migrations_never_change() {
        let closed = sqlx::migrate!("./migrations/postgres").iter().count();
        assert_eq!(closed, 14, "a new migration goes to migrations/postgres-releases/");
        crate::sql::migrations::assert_released(
            "postgres",
            &sqlx::migrate!("./migrations/postgres"),
            &[
                (1, "3546f08e18fabb60"),
                (2, "38a46a28733e9a7b"),
                (3, "59899fd934de3d51"),
                (4, "b68a6f8582e5cce5"),
                (5, "768c37816d4c20dd"),
                (6, "868a336adc57f5b3"),
                (7, "36b6de9588a5e059"),
                (8, "1fc1464b68324cc6"),
                (9, "9123b73b94d65e79"),
                (10, "1783b7d3e4b8df8d"),
                (11, "4001dff2d0c38f51"),
                (12, "560aa4e0ead33ef4"),
                (13, "3d519865c346309b"),
                (14, "4e5d8af88d0e8393"),
            ],
        );
    }
}
