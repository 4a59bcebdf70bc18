//! Migrating a schema while instances of the release before run on it (rolling upgrades;
//! `docs/src/operations/upgrades.md`).
//!
//! - 0.1.0's migrations (`migrations/postgres/`, 1 to 14) stay with sqlx's migrator and its
//!   table (run here, after the record is checked, under the same lock). From 0.2.0 on
//!   (`migrations/postgres-releases/`) this runner applies them and records each in
//!   `timer_migrations` with the oldest release that works with it
//!   ([`releases`](crate::sql::migrations::releases)); a binary older than the highest of those
//!   refuses to start, naming both releases.
//! - One instance migrates at a time: it holds a session advisory lock of the schema while it
//!   runs, taken by polling (`pg_try_advisory_lock`), never by waiting in a statement: a
//!   statement waiting for the lock would hold a snapshot, which `CREATE INDEX CONCURRENTLY`
//!   in the instance that holds it waits for (a deadlock the server breaks by failing one).
//! - A `-- no-transaction` migration (an index build `CONCURRENTLY`) runs outside a
//!   transaction, so writes go on while it builds. A build that fails leaves an invalid index:
//!   invalid indexes of the schema are dropped (`CONCURRENTLY`) before each try, and a failed
//!   try is made again, [`ATTEMPTS`] in all. Such a migration is written to be applied twice
//!   (`IF NOT EXISTS`): an instance that stops between the build and its record builds nothing
//!   the next time.
//! - A migration whose oldest release is newer than a live instance's (one that contracts the
//!   schema under it) is not applied while that instance is alive: the runner waits, saying
//!   every [`SAY_EVERY`] which instances it waits for, and goes on once they are gone.
//!   ([`releases::record`] also makes a 0.1.0 binary refuse the schema then.)

use std::time::{Duration, Instant};

use semver::Version;
use sqlx::migrate::Migrator;
use sqlx::postgres::PgConnection;
use sqlx::{Connection, Executor};
use timer_core::{Error, Result};
use tracing::{info, warn};

use super::{db_err, owners, root_cause};
use crate::sql::migrations::releases::{self, Applied, Step, BEFORE_RECORDS};

/// Tries of a `-- no-transaction` migration before the start fails.
pub const ATTEMPTS: u32 = 3;
/// How often a waiting runner says what it waits for.
pub const SAY_EVERY: Duration = Duration::from_secs(10);
/// How often a waiting runner looks again.
const LOOK_EVERY: Duration = Duration::from_millis(200);

/// The migrations from 0.2.0 on.
pub(super) fn migrator() -> Migrator {
    sqlx::migrate!("./migrations/postgres-releases")
}

const TABLE: &str = "CREATE TABLE timer_migrations ( \
      version BIGINT PRIMARY KEY, \
      description TEXT NOT NULL, \
      checksum BYTEA NOT NULL, \
      oldest_release TEXT NOT NULL, \
      applied_by TEXT NOT NULL, \
      applied_at TIMESTAMPTZ NOT NULL DEFAULT now(), \
      took_ms BIGINT NOT NULL)";

/// Applies what `migrator` has that the schema lacks, as release `this`.
pub(super) async fn run(
    conn: &mut PgConnection,
    schema: &str,
    this: &Version,
    migrator: &Migrator,
) -> Result<()> {
    let steps = releases::steps(migrator)?;
    let lock = format!("timer-service migrate {schema}");
    take_lock(conn, &lock).await?;
    let result = migrate(conn, schema, this, &steps).await;
    let unlocked = sqlx::query("SELECT pg_advisory_unlock(hashtextextended($1, 0))")
        .bind(&lock)
        .execute(&mut *conn)
        .await;
    result?;
    unlocked
        .map(drop)
        .map_err(|e| db_err("unlocking the migration", e))
}

/// Takes the schema's migration lock, polling.
async fn take_lock(conn: &mut PgConnection, lock: &str) -> Result<()> {
    let started = Instant::now();
    let mut said = started;
    loop {
        let locked: bool =
            sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtextextended($1, 0))")
                .bind(lock)
                .fetch_one(&mut *conn)
                .await
                .map_err(|e| db_err("taking the migration lock", e))?;
        if locked {
            return Ok(());
        }
        if said.elapsed() >= SAY_EVERY {
            said = Instant::now();
            info!(
                waited_s = started.elapsed().as_secs(),
                "postgres store: another instance is migrating the schema; waiting for it"
            );
        }
        tokio::time::sleep(LOOK_EVERY).await;
    }
}

async fn migrate(
    conn: &mut PgConnection,
    schema: &str,
    this: &Version,
    steps: &[Step<'_>],
) -> Result<()> {
    let op = "reading the applied migrations";
    let exists: Option<String> =
        sqlx::query_scalar("SELECT to_regclass('timer_migrations')::text")
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| db_err(op, e))?;
    let applied: Vec<Applied> = match exists {
        None => Vec::new(),
        Some(_) => sqlx::query_as(releases::APPLIED)
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| db_err(op, e))?,
    };
    // Before anything changes: a schema a newer release needs is left as it is.
    releases::check_applied(
        &format!("postgres store: schema {schema}"),
        "restore the schema from the backup taken before the upgrade to go back",
        this,
        steps,
        &applied,
    )?;
    // 0.1.0's migrations: sqlx's migrator (under its own advisory lock too). The rows a
    // contracting migration writes in its table are ours: not missing migrations.
    let mut legacy = sqlx::migrate!("./migrations/postgres");
    legacy.set_ignore_missing(true);
    legacy.run_direct(&mut *conn).await.map_err(|e| {
        Error::unavailable(format!("postgres store: migrating schema {schema} failed"))
            .with_source(e)
    })?;
    if exists.is_none() {
        conn.execute(TABLE)
            .await
            .map_err(|e| db_err("creating timer_migrations", e))?;
    }
    for step in releases::pending(steps, &applied) {
        let contracts = step.oldest_release > BEFORE_RECORDS;
        if contracts {
            wait_for_older(conn, schema, step).await?;
        }
        let started = Instant::now();
        if step.migration.no_tx {
            info!(
                migration = %step.label(),
                "postgres store: applying a migration outside a transaction (an index build \
                 CONCURRENTLY: writes go on; on a big table it takes a while)"
            );
            apply_outside(conn, schema, step).await?;
            record(&mut *conn, step, this, started).await?;
        } else {
            let mut tx = conn.begin().await.map_err(|e| db_err("migrating", e))?;
            tx.execute(&*step.migration.sql)
                .await
                .map_err(|e| failed(schema, step, &e))?;
            record(&mut tx, step, this, started).await?;
            tx.commit().await.map_err(|e| failed(schema, step, &e))?;
        }
        info!(
            migration = %step.label(),
            took_ms = started.elapsed().as_millis() as u64,
            "postgres store: migration applied"
        );
    }
    Ok(())
}

fn failed(schema: &str, step: &Step<'_>, e: &sqlx::Error) -> Error {
    Error::unavailable(format!(
        "postgres store: migrating schema {schema} failed at migration {}: {}",
        step.label(),
        root_cause(e)
    ))
}

/// Runs a `-- no-transaction` migration, dropping the invalid indexes a failed build leaves
/// before each of [`ATTEMPTS`] tries.
async fn apply_outside(conn: &mut PgConnection, schema: &str, step: &Step<'_>) -> Result<()> {
    let mut attempt = 1;
    loop {
        drop_invalid_indexes(conn, schema).await?;
        match conn.execute(&*step.migration.sql).await {
            Ok(_) => break,
            Err(e) if attempt < ATTEMPTS => {
                warn!(
                    migration = %step.label(),
                    attempt,
                    error = %root_cause(&e),
                    "postgres store: a migration outside a transaction failed; trying again"
                );
                attempt += 1;
            }
            Err(e) => return Err(failed(schema, step, &e)),
        }
    }
    // A build that reported success left no invalid index; one that did is not done.
    let invalid = invalid_indexes(conn, schema).await?;
    if invalid.is_empty() {
        Ok(())
    } else {
        Err(Error::unavailable(format!(
            "postgres store: migration {} left invalid indexes in schema {schema}: {}",
            step.label(),
            invalid.join(", ")
        )))
    }
}

async fn invalid_indexes(conn: &mut PgConnection, schema: &str) -> Result<Vec<String>> {
    sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_index i \
           JOIN pg_class c ON c.oid = i.indexrelid \
           JOIN pg_namespace n ON n.oid = c.relnamespace \
          WHERE n.nspname = $1 AND NOT i.indisvalid ORDER BY 1",
    )
    .bind(schema)
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| db_err("looking for invalid indexes", e))
}

async fn drop_invalid_indexes(conn: &mut PgConnection, schema: &str) -> Result<()> {
    for index in invalid_indexes(conn, schema).await? {
        warn!(
            index = %index,
            "postgres store: dropping an invalid index a failed build left, to build it again"
        );
        // The name comes from the catalog; quoted as an identifier all the same.
        let sql = format!(
            "DROP INDEX CONCURRENTLY IF EXISTS {schema}.\"{}\"",
            index.replace('"', "\"\"")
        );
        conn.execute(sql.as_str())
            .await
            .map_err(|e| db_err("dropping an invalid index", e))?;
    }
    Ok(())
}

/// [`releases::record`] on PostgreSQL.
async fn record(conn: &mut PgConnection, step: &Step<'_>, this: &Version, started: Instant) -> Result<()> {
    let took_ms = i64::try_from(started.elapsed().as_millis()).unwrap_or(i64::MAX);
    releases::record::<sqlx::Postgres>(conn, step, this, took_ms)
        .await
        .map_err(|e| db_err("recording a migration", e))
}

/// The release an instance runs, as the instance list says: one that did not say is older than
/// the record ([`BEFORE_RECORDS`]), one that cannot be read older still.
fn instance_release(version: Option<&str>) -> Version {
    match version {
        None => BEFORE_RECORDS,
        Some(v) => Version::parse(v).unwrap_or(Version::new(0, 0, 0)),
    }
}

/// Waits until no live instance runs a release older than `step` works with.
async fn wait_for_older(conn: &mut PgConnection, schema: &str, step: &Step<'_>) -> Result<()> {
    let started = Instant::now();
    let mut said: Option<Instant> = None;
    loop {
        let older: Vec<String> = owners::live_instances(&mut *conn, schema)
            .await?
            .into_iter()
            .map(|i| (i.id, i.release.map(|r| r.version)))
            .filter(|(_, version)| instance_release(version.as_deref()) < step.oldest_release)
            .map(|(id, version)| {
                let version = version.unwrap_or_else(|| BEFORE_RECORDS.to_string());
                format!("{id} ({version})")
            })
            .collect();
        if older.is_empty() {
            if said.is_some() {
                info!(
                    migration = %step.label(),
                    waited_s = started.elapsed().as_secs(),
                    "postgres store: the older instances are gone; applying the migration"
                );
            }
            return Ok(());
        }
        if said.is_none_or(|at| at.elapsed() >= SAY_EVERY) {
            said = Some(Instant::now());
            warn!(
                migration = %step.label(),
                needs = %step.oldest_release,
                waiting_for = %older.join(", "),
                waited_s = started.elapsed().as_secs(),
                "postgres store: this migration removes what older releases use; waiting until \
                 no instance of an older release is alive (replace them with this release, or \
                 with {} or newer, first)",
                step.oldest_release
            );
        }
        tokio::time::sleep(LOOK_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Released migrations never change (`sql::migrations`); a new one adds its line.
    #[test]
    fn released_migrations_never_change() {
        crate::sql::migrations::assert_released(
            "postgres (from 0.2.0)",
            &migrator(),
            &[
                (15, "35f4a1a50c66c518"),
                (16, "18610c2162b2ef71"),
                (17, "6692a1c5e09682c4"),
            ],
        );
    }

    #[test]
    fn an_instance_that_did_not_say_is_older_than_the_record() {
        assert_eq!(instance_release(None), Version::new(0, 1, 0));
        assert_eq!(instance_release(Some("0.2.0")), Version::new(0, 2, 0));
        assert_eq!(instance_release(Some("junk")), Version::new(0, 0, 0));
    }

    #[test]
    fn every_migration_names_its_oldest_release() {
        let migrator = migrator();
        let steps = releases::steps(&migrator).expect("every file has its line");
        assert!(steps.iter().all(|s| s.oldest_release >= BEFORE_RECORDS));
    }
}

/// The runner on a real server (`TIMER_TEST_POSTGRES_URL`): refusing a schema a newer release
/// needs, waiting for older instances before a migration that contracts, building an index
/// again that a failed build left invalid.
#[cfg(all(test, feature = "testing"))]
pub(super) mod server_tests {
    use std::borrow::Cow;
    use std::sync::Arc;

    use sqlx::migrate::{Migration, MigrationType};
    use sqlx::PgPool;
    use timer_core::plugin::fresh_name;
    use timer_core::{LeaseOwners, Release, Store, Timestamp};

    use super::*;
    use crate::postgres::{plugin::TEST_SERVER, PostgresConfig, PostgresStore};

    /// The server's URL; `None` (skipped) without one, unless `TIMER_TEST_REQUIRE=1`.
    pub(in crate::postgres) fn server() -> Option<String> {
        match TEST_SERVER.address() {
            Ok(url) => Some(url),
            Err(e) if std::env::var("TIMER_TEST_REQUIRE").is_ok_and(|v| v == "1") => {
                panic!("server required (TIMER_TEST_REQUIRE=1) but {e}")
            }
            Err(e) => {
                eprintln!("skipped: {e}");
                None
            }
        }
    }

    /// A fresh schema's config, and a pool on it.
    pub(in crate::postgres) async fn fresh(url: String) -> (PostgresConfig, PgPool) {
        let config = PostgresConfig {
            url,
            schema: fresh_name("migrate_"),
            max_connections: 4,
            ..PostgresConfig::default()
        };
        let options = super::super::connect_options(&config)
            .expect("options")
            .options([("search_path", config.schema.as_str())]);
        let pool = PgPool::connect_with(options).await.expect("connect");
        (config, pool)
    }

    /// A store on `config`'s fresh schema and instance `id` of 0.2.0 joined on it.
    async fn joined(
        config: &PostgresConfig,
        id: &str,
    ) -> (Arc<PostgresStore>, Box<dyn timer_core::Membership>, Release) {
        let store = Arc::new(PostgresStore::open(config).await.expect("opens"));
        let release = Release {
            version: "0.2.0".into(),
            revision: "abc".into(),
        };
        let t0 = Timestamp::from_millis(0);
        let owners: &dyn LeaseOwners = store.lease_owners().expect("postgres has owners");
        let member = owners.join(id, &release, t0, t0).await.expect("joins");
        (store, member, release)
    }

    pub(in crate::postgres) async fn drop_schema(pool: &PgPool, schema: &str) {
        let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
            .execute(pool)
            .await;
    }

    fn version(v: &str) -> Version {
        Version::parse(v).expect("a version")
    }

    /// This build's migrations from 0.2.0 on, then `extra`.
    fn with(extra: &[(i64, &'static str)]) -> Migrator {
        let mut migrations: Vec<Migration> = migrator().iter().cloned().collect();
        for (v, sql) in extra {
            migrations.push(Migration::new(
                *v,
                Cow::Borrowed("test step"),
                MigrationType::Simple,
                Cow::Borrowed(sql),
                sql.starts_with("-- no-transaction"),
            ));
        }
        Migrator {
            migrations: Cow::Owned(migrations),
            ..Migrator::DEFAULT
        }
    }

    /// 0.3.0 removes what 0.2.0 uses (a stand-in: the statement does not matter, its line does).
    const CONTRACTS: &str = "-- oldest release: 0.3.0\nCREATE TABLE contracted (x INT)";

    async fn applied(pool: &PgPool, version: i64) -> bool {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM timer_migrations WHERE version = $1")
            .bind(version)
            .fetch_one(pool)
            .await
            .expect("read timer_migrations");
        n == 1
    }

    #[tokio::test]
    async fn an_older_binary_refuses_a_schema_a_newer_release_needs() {
        let Some(url) = server() else { return };
        let (config, pool) = fresh(url).await;
        let schema = config.schema.clone();
        PostgresStore::prepare_schema(&pool, &schema, &version("0.3.0"), &with(&[(90, CONTRACTS)]))
            .await
            .expect("0.3.0 migrates");
        let e = PostgresStore::prepare_schema(&pool, &schema, &version("0.2.0"), &migrator())
            .await
            .expect_err("0.2.0 refuses")
            .to_string();
        assert!(
            e.contains("was migrated by timer-service 0.3.0")
                && e.contains("works with timer-service 0.3.0 or newer only (migration 90)")
                && e.contains("this binary is timer-service 0.2.0")
                && e.contains(&schema),
            "{e}"
        );
        // A 0.1.0 binary refuses it too: sqlx's table has a migration it does not know.
        let marker: Option<String> =
            sqlx::query_scalar("SELECT description FROM _sqlx_migrations WHERE version = 90")
                .fetch_optional(&pool)
                .await
                .expect("read _sqlx_migrations");
        assert_eq!(
            marker.as_deref(),
            Some("needs timer-service 0.3.0 or newer (timer_migrations)")
        );
        // Expanding migrations leave no such row: 0.1.0 starts on a 0.2.0 schema.
        let expanding: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM _sqlx_migrations WHERE version IN (15, 16)")
                .fetch_one(&pool)
                .await
                .expect("read _sqlx_migrations");
        assert_eq!(expanding, 0);
        PostgresStore::prepare_schema(&pool, &schema, &version("0.3.1"), &with(&[(90, CONTRACTS)]))
            .await
            .expect("a newer binary starts");
        drop_schema(&pool, &schema).await;
    }

    #[tokio::test]
    async fn a_contracting_migration_waits_while_an_older_instance_is_alive() {
        let Some(url) = server() else { return };
        let (config, pool) = fresh(url).await;
        let schema = config.schema.clone();
        let (store, member, old) = joined(&config, "old-1").await;
        let owners: &dyn LeaseOwners = store.lease_owners().expect("postgres has owners");
        let live = owners.live().await.expect("live");
        assert_eq!(live.len(), 1);
        assert_eq!(live[0].id, "old-1");
        assert_eq!(live[0].release.as_ref(), Some(&old));
        assert!(live[0].last_seen_at.is_some());
        let newer = with(&[(90, CONTRACTS)]);
        let migrating = {
            let (pool, schema) = (pool.clone(), schema.clone());
            tokio::spawn(async move {
                PostgresStore::prepare_schema(&pool, &schema, &version("0.3.0"), &newer).await
            })
        };
        tokio::pin!(migrating);
        // It does not apply it while old-1 is alive (it would in milliseconds otherwise).
        let early = tokio::time::timeout(std::time::Duration::from_secs(2), &mut migrating).await;
        assert!(early.is_err(), "did not wait: {early:?}");
        assert!(!applied(&pool, 90).await);
        member.leave().await.expect("leaves");
        tokio::time::timeout(std::time::Duration::from_secs(20), &mut migrating)
            .await
            .expect("applied once old-1 left")
            .expect("task")
            .expect("migrated");
        assert!(applied(&pool, 90).await);
        drop(store);
        drop_schema(&pool, &schema).await;
    }

    /// A row whose `last_seen_at` stopped long ago names a release its instance may not run: a
    /// 0.1.0 instance that joined under the id of a 0.2.0 one that died keeps that row's
    /// release (0.1.0 writes none). Such an instance is listed as one that does not say, so a
    /// migration that contracts waits for it.
    #[tokio::test]
    async fn an_instance_whose_last_seen_stopped_is_taken_for_one_that_does_not_say() {
        let Some(url) = server() else { return };
        let (config, pool) = fresh(url).await;
        let schema = config.schema.clone();
        let (store, member, release) = joined(&config, "i-1").await;
        let owners: &dyn LeaseOwners = store.lease_owners().expect("postgres has owners");
        let live = owners.live().await.expect("live");
        assert_eq!(live[0].release.as_ref(), Some(&release));
        sqlx::query("UPDATE timer_instances SET last_seen_at = last_seen_at - 60000")
            .execute(&pool)
            .await
            .expect("a minute ago");
        let live = owners.live().await.expect("live");
        assert_eq!(
            (live[0].release.as_ref(), live[0].last_seen_at),
            (None, None),
            "{live:?}"
        );
        member.leave().await.expect("leaves");
        drop(store);
        drop_schema(&pool, &schema).await;
    }

    /// A migration that holds `timer_instances` (an `ALTER TABLE` waits for the table's lock,
    /// then holds it) does not end the membership of the instances running meanwhile: their
    /// `last_seen_at` writes wait, their pings (what says they live) do not.
    #[tokio::test]
    async fn an_instance_lives_on_while_a_migration_holds_the_instances_table() {
        let Some(url) = server() else { return };
        let (config, pool) = fresh(url).await;
        let schema = config.schema.clone();
        let (store, mut member, _) = joined(&config, "i-1").await;
        let mut migration = pool.begin().await.expect("begin");
        sqlx::query("LOCK TABLE timer_instances IN ACCESS EXCLUSIVE MODE")
            .execute(&mut *migration)
            .await
            .expect("lock");
        // Three seconds: a write of last_seen_at waits for the lock all that time, far longer
        // than a ping may take.
        let lost = tokio::time::timeout(std::time::Duration::from_secs(3), member.lost()).await;
        assert!(lost.is_err(), "the membership ended: {lost:?}");
        migration.rollback().await.expect("rollback");
        let _ = member.leave().await;
        drop(store);
        drop_schema(&pool, &schema).await;
    }

    #[tokio::test]
    async fn an_index_a_failed_build_left_invalid_is_built_again() {
        let Some(url) = server() else { return };
        let (config, pool) = fresh(url).await;
        let schema = config.schema.clone();
        let only_15 = Migrator {
            migrations: Cow::Owned(migrator().iter().take(1).cloned().collect()),
            ..Migrator::DEFAULT
        };
        PostgresStore::prepare_schema(&pool, &schema, &version("0.2.0"), &only_15)
            .await
            .expect("migrates to 15");
        // Two failed timers of one tenant: a unique build on the tenant fails on them and
        // leaves an invalid index of migration 16's name, as a build cut short would.
        for id in ["a", "b"] {
            sqlx::query(
                "INSERT INTO timers (tenant_id, service_call_id, due_at, available_at, state, registered_at) \
                 VALUES ('t', $1, 0, 0, 3, 0)",
            )
            .bind(id)
            .execute(&pool)
            .await
            .expect("insert");
        }
        let broken = sqlx::query(
            "CREATE UNIQUE INDEX CONCURRENTLY timers_failed ON timers (tenant_id) WHERE state = 3",
        )
        .execute(&pool)
        .await;
        assert!(broken.is_err(), "the unique build should fail");
        let mut conn = pool.acquire().await.expect("conn");
        assert_eq!(invalid_indexes(&mut conn, &schema).await.unwrap(), ["timers_failed"]);
        drop(conn);
        PostgresStore::prepare_schema(&pool, &schema, &version("0.2.0"), &migrator())
            .await
            .expect("migration 16 builds it again");
        let mut conn = pool.acquire().await.expect("conn");
        assert!(invalid_indexes(&mut conn, &schema).await.unwrap().is_empty());
        let definition: String =
            sqlx::query_scalar("SELECT indexdef FROM pg_indexes WHERE indexname = 'timers_failed' AND schemaname = $1")
                .bind(&schema)
                .fetch_one(&mut *conn)
                .await
                .expect("the index");
        assert!(definition.contains("(tenant_id, due_at, service_call_id)"), "{definition}");
        assert!(applied(&pool, 16).await);
        // An instance that stopped between the build and its record: the next start builds
        // nothing and records it.
        sqlx::query("DELETE FROM timer_migrations WHERE version = 16")
            .execute(&mut *conn)
            .await
            .expect("forget the record");
        PostgresStore::prepare_schema(&pool, &schema, &version("0.2.0"), &migrator())
            .await
            .expect("applied again over the index it built");
        assert!(applied(&pool, 16).await);
        drop(conn);
        drop_schema(&pool, &schema).await;
    }
}
