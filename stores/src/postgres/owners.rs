//! Which instances are alive ([`LeaseOwners`]): each holds a session-level advisory lock on a
//! connection of its own for as long as it runs, and is listed in `timer_instances`. PostgreSQL
//! releases a session's locks the moment the session ends, so an instance whose lock is free
//! died (or lost its connection), and any instance can take its leases over at once.
//!
//! Invariants:
//! - An owner is in `timer_instances` only while, or after, it held its lock: `join` takes the
//!   lock first. A listed owner whose lock can be taken is dead; `take_over` takes it for its
//!   transaction, so two instances never take one owner over twice, and a new run of the same
//!   owner cannot join meanwhile.
//! - The keeper connection asks the server every [`PING_EVERY`]; a ping that fails or takes
//!   longer than [`PING_TIMEOUT`] resolves [`Membership::lost`]. So `lost` resolves at most
//!   [`LOST_WITHIN`] after the server ended the session, and released leases are claimable only
//!   that much later: the instance that lost its lock stopped firing them before.
//! - `last_seen_at` is written every [`SEEN_EVERY`] pings on a connection of the pool, beside
//!   the pings: a write waits for its commit (the WAL on disk, a synchronous standby) and for
//!   locks on `timer_instances` (a migration's), which say nothing of whether the instance is
//!   alive; one that fails is logged, one that waits is let wait (no other starts meanwhile), and
//!   neither ends the membership.
//! - The keeper asks the server to probe it with TCP keepalives (`tcp_keepalives_*`), so a
//!   session whose host vanished ends after about [`KEEPALIVE_GONE_AFTER`] instead of hours;
//!   the instance itself gives up its membership much sooner (`PING_TIMEOUT`), so it always
//!   stops firing before the server frees its lock.

use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::Connection;
use timer_core::{
    Error, LeaseOwners, LiveInstance, Membership, Release, Result, TakenOver, Timestamp,
};
use tracing::warn;

use super::{db_err, root_cause, PostgresStore};

/// How often the keeper connection asks the server whether it is still there.
pub const PING_EVERY: Duration = Duration::from_millis(100);
/// A ping not answered within this counts as a lost connection.
pub const PING_TIMEOUT: Duration = Duration::from_millis(500);
/// Every how many pings `last_seen_at` is written (on the pool, beside the ping).
pub const SEEN_EVERY: u32 = 10;
/// The bound `Membership::lost` keeps ([`LeaseOwners::lost_within`]): one ping interval, one
/// timeout and a margin for scheduling.
pub const LOST_WITHIN: Duration = Duration::from_millis(750);
/// Keepalive probes the server sends on an idle keeper connection: after this many seconds
/// idle, every second, this many times (so about 6 s after its host vanished).
const KEEPALIVE: [(&str, &str); 3] = [
    ("tcp_keepalives_idle", "3"),
    ("tcp_keepalives_interval", "1"),
    ("tcp_keepalives_count", "3"),
];
/// About when the server ends the session of a host that vanished ([`KEEPALIVE`]).
pub const KEEPALIVE_GONE_AFTER: Duration = Duration::from_secs(6);

/// The text whose hash is an owner's advisory lock key: the schema is part of it, since
/// advisory locks are per database and instances of different schemas may share names.
fn lock_prefix(schema: &str) -> String {
    format!("timer-service {schema} ")
}

/// Releases the leases of the owners `$1` (an array), claimable at `$2` at the earliest, and
/// counts them per owner.
const RELEASE: &str = "WITH released AS ( \
      UPDATE timers t SET available_at = GREATEST(t.due_at, $2), lease_owner = NULL, \
             lease_until = NULL \
        FROM UNNEST($1::text[]) AS d(owner) \
       WHERE t.lease_owner = d.owner AND t.state = 0 AND t.lease_until IS NOT NULL \
      RETURNING d.owner) \
    SELECT d.owner, (SELECT COUNT(*) FROM released r WHERE r.owner = d.owner) AS leases \
      FROM UNNEST($1::text[]) AS d(owner)";

/// The server's clock in milliseconds since the epoch: one clock for every instance's
/// `last_seen_at`.
const SERVER_MS: &str = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

/// Whether the owner of row `i` holds its lock now (`$1`: [`lock_prefix`]). An advisory lock
/// on a bigint key shows in `pg_locks` with the key's high half in `classid`, its low half in
/// `objid`, and `objsubid` 1.
const HOLDS_LOCK: &str = "EXISTS (SELECT 1 FROM pg_locks l \
     WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
       AND ((l.classid::int8 << 32) | l.objid::int8) = hashtextextended($1 || i.owner, 0))";

/// How old an instance's `last_seen_at` may be for its row's release to be its own: 0.2.0 and
/// later write it every second (or try to: a write may wait for a lock); a 0.1.0
/// instance that joined under the id of a 0.2.0 one that died (a rollback with a fixed
/// `engine.instance_id`) keeps that row's release and `last_seen_at`, which then stop.
const STALE_AFTER_MS: i64 = 30_000;

/// The instances alive on `schema` now, ordered by id, their leases counted from
/// `timers_leased`: [`LeaseOwners::live`], and the migration runner's look for older ones. A
/// row whose `last_seen_at` is older than [`STALE_AFTER_MS`] is an instance that does not say
/// (0.1.0): its release and `last_seen_at` show as unknown.
pub(super) async fn live_instances<'c, E>(conn: E, schema: &str) -> Result<Vec<LiveInstance>>
where
    E: sqlx::Executor<'c, Database = sqlx::Postgres>,
{
    type Row = (String, Option<String>, Option<String>, i64, Option<i64>, i64);
    let rows: Vec<Row> = sqlx::query_as(&format!(
        "WITH i AS (SELECT owner, joined_at, \
                CASE WHEN last_seen_at >= {SERVER_MS} - {STALE_AFTER_MS} THEN version END AS version, \
                CASE WHEN last_seen_at >= {SERVER_MS} - {STALE_AFTER_MS} THEN revision END AS revision, \
                CASE WHEN last_seen_at >= {SERVER_MS} - {STALE_AFTER_MS} THEN last_seen_at END AS last_seen_at \
              FROM timer_instances) \
         SELECT i.owner, i.version, i.revision, i.joined_at, i.last_seen_at, \
                (SELECT COUNT(*) FROM timers t WHERE t.lease_owner = i.owner \
                    AND t.state = 0 AND t.lease_until IS NOT NULL) \
           FROM i WHERE {HOLDS_LOCK} ORDER BY i.owner"
    ))
    .bind(lock_prefix(schema))
    .fetch_all(conn)
    .await
    .map_err(|e| db_err("listing the live instances", e))?;
    Ok(rows
        .into_iter()
        .map(
            |(id, version, revision, joined, seen, leases)| LiveInstance {
                id,
                release: version.map(|version| Release {
                    version,
                    revision: revision.unwrap_or_else(|| "unknown".to_owned()),
                }),
                started_at: Timestamp::from_millis(joined),
                last_seen_at: seen.map(Timestamp::from_millis),
                leases: u64::try_from(leases).unwrap_or(0),
            },
        )
        .collect())
}

struct PgMembership {
    /// The session that holds the owner's lock; `None` once lost or left.
    conn: Option<PgConnection>,
    /// Where `last_seen_at` is written.
    pool: sqlx::PgPool,
    owner: String,
    schema: String,
}

/// Writes `owner`'s `last_seen_at` on `pool`, on a task of its own, unless the `last` write is
/// still under way; a failed one is logged. Not bounded in time: one waiting for a lock holds
/// one connection until it gets it, where a write given up would leave its connection waiting
/// all the same (returned to the pool only once the server answers) and the next write take
/// another.
fn write_seen(
    pool: &sqlx::PgPool,
    owner: &str,
    last: Option<tokio::task::JoinHandle<()>>,
) -> Option<tokio::task::JoinHandle<()>> {
    if last.as_ref().is_some_and(|task| !task.is_finished()) {
        return last;
    }
    let (pool, owner) = (pool.clone(), owner.to_owned());
    Some(tokio::spawn(async move {
        let seen =
            format!("UPDATE timer_instances SET last_seen_at = {SERVER_MS} WHERE owner = $1");
        if let Err(e) = sqlx::query(&seen).bind(&owner).execute(&pool).await {
            let why = root_cause(&e);
            warn!(
                owner,
                "postgres store: writing this instance's last_seen_at failed: {why}; it lives on"
            );
        }
    }))
}

#[async_trait]
impl Membership for PgMembership {
    async fn lost(&mut self) -> Error {
        let Some(conn) = self.conn.as_mut() else {
            return Error::unavailable("postgres store: this instance's lock connection is closed");
        };
        let mut pings = 0u32;
        let mut seen = None;
        let error = loop {
            tokio::time::sleep(PING_EVERY).await;
            pings = pings.wrapping_add(1);
            if pings.is_multiple_of(SEEN_EVERY) {
                seen = write_seen(&self.pool, &self.owner, seen);
            }
            match tokio::time::timeout(PING_TIMEOUT, conn.ping()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    break Error::unavailable(format!(
                        "postgres store: the connection holding instance {:?} alive failed: {}",
                        self.owner,
                        root_cause(&e)
                    ))
                }
                Err(_) => {
                    break Error::unavailable(format!(
                        "postgres store: the connection holding instance {:?} alive did not \
                         answer within {} ms",
                        self.owner,
                        PING_TIMEOUT.as_millis()
                    ))
                }
            }
        };
        // Closing it ends the session (when the server hears of it), which frees the lock.
        self.conn = None;
        error
    }

    async fn leave(mut self: Box<Self>) -> Result<()> {
        let Some(mut conn) = self.conn.take() else {
            return Ok(());
        };
        let op = "leaving the live instances";
        sqlx::query("DELETE FROM timer_instances WHERE owner = $1")
            .bind(&self.owner)
            .execute(&mut conn)
            .await
            .map_err(|e| db_err(op, e))?;
        sqlx::query("SELECT pg_advisory_unlock(hashtextextended($1, 0))")
            .bind(format!("{}{}", lock_prefix(&self.schema), self.owner))
            .execute(&mut conn)
            .await
            .map_err(|e| db_err(op, e))?;
        let _ = conn.close().await;
        Ok(())
    }
}

/// Connects the keeper: the pool's options plus keepalive probes from the server's side.
async fn keeper(options: &PgConnectOptions, timeout: Duration) -> Result<PgConnection> {
    let options = options.clone().options(KEEPALIVE);
    match tokio::time::timeout(timeout, PgConnection::connect_with(&options)).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(Error::unavailable(format!(
            "postgres store: cannot open the connection that holds this instance alive: {}",
            root_cause(&e)
        ))),
        Err(_) => Err(Error::unavailable(format!(
            "postgres store: cannot open the connection that holds this instance alive: no \
             answer within {} ms (store.connect_timeout)",
            timeout.as_millis()
        ))),
    }
}

#[async_trait]
impl LeaseOwners for PostgresStore {
    async fn join(
        &self,
        owner: &str,
        build: &Release,
        started_at: Timestamp,
        release_at: Timestamp,
    ) -> Result<Box<dyn Membership>> {
        let op = "joining the live instances";
        let mut conn = keeper(&self.pool.connect_options(), self.connect_timeout).await?;
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtextextended($1, 0))")
            .bind(format!("{}{owner}", lock_prefix(&self.schema)))
            .fetch_one(&mut conn)
            .await
            .map_err(|e| db_err(op, e))?;
        if !locked {
            let _ = conn.close().await;
            return Err(Error::config(format!(
                "engine.instance_id {owner:?} is in use by another running instance on schema \
                 {} (give every instance its own, or leave it empty; an instance that died a \
                 moment ago frees it within about {} s)",
                self.schema,
                KEEPALIVE_GONE_AFTER.as_secs()
            )));
        }
        // Holding the lock, this owner's leases are an earlier run's: dead.
        let released = release(&mut conn, &[owner], release_at).await?;
        sqlx::query(&format!(
            "INSERT INTO timer_instances (owner, joined_at, version, revision, last_seen_at) \
             VALUES ($1, $2, $3, $4, {SERVER_MS}) \
             ON CONFLICT (owner) DO UPDATE SET joined_at = EXCLUDED.joined_at, \
               version = EXCLUDED.version, revision = EXCLUDED.revision, \
               last_seen_at = EXCLUDED.last_seen_at"
        ))
        .bind(owner)
        .bind(started_at.as_millis())
        .bind(&build.version)
        .bind(&build.revision)
        .execute(&mut conn)
        .await
        .map_err(|e| db_err(op, e))?;
        if let Some(gone) = released.into_iter().find(|t| t.leases > 0) {
            warn!(
                owner = %gone.owner,
                leases = gone.leases,
                "postgres store: released the leases of this instance's previous run"
            );
        }
        Ok(Box::new(PgMembership {
            conn: Some(conn),
            pool: self.pool.clone(),
            owner: owner.to_owned(),
            schema: self.schema.clone(),
        }))
    }

    async fn take_over(&self, release_at: Timestamp) -> Result<Vec<TakenOver>> {
        let op = "taking over dead instances";
        let mut tx = self.pool.begin().await.map_err(|e| db_err(op, e))?;
        // A lock taken here is held until the commit: nobody else takes these owners over,
        // and no new run of them joins before their leases are released.
        let dead: Vec<String> = sqlx::query_scalar(
            "SELECT owner FROM timer_instances \
              WHERE pg_try_advisory_xact_lock(hashtextextended($1 || owner, 0))",
        )
        .bind(lock_prefix(&self.schema))
        .fetch_all(&mut *tx)
        .await
        .map_err(|e| db_err(op, e))?;
        if dead.is_empty() {
            tx.commit().await.map_err(|e| db_err(op, e))?;
            return Ok(Vec::new());
        }
        let owners: Vec<&str> = dead.iter().map(String::as_str).collect();
        let taken = release(&mut tx, &owners, release_at).await?;
        sqlx::query("DELETE FROM timer_instances WHERE owner = ANY($1)")
            .bind(&owners)
            .execute(&mut *tx)
            .await
            .map_err(|e| db_err(op, e))?;
        tx.commit().await.map_err(|e| db_err(op, e))?;
        Ok(taken)
    }

    fn lost_within(&self) -> Duration {
        LOST_WITHIN
    }

    async fn live(&self) -> Result<Vec<LiveInstance>> {
        live_instances(&self.pool, &self.schema).await
    }
}

/// Releases every lease of `owners`, claimable at `release_at` at the earliest.
async fn release(
    conn: &mut PgConnection,
    owners: &[&str],
    release_at: Timestamp,
) -> Result<Vec<TakenOver>> {
    let rows: Vec<(String, i64)> = sqlx::query_as(RELEASE)
        .bind(owners)
        .bind(release_at.as_millis())
        .fetch_all(conn)
        .await
        .map_err(|e| db_err("releasing dead leases", e))?;
    Ok(rows
        .into_iter()
        .map(|(owner, leases)| TakenOver {
            owner,
            leases: u64::try_from(leases).unwrap_or(0),
        })
        .collect())
}
