//! The shared statements of the firing path: claiming due timers (and visiting the tenants that
//! have some, for a fair claim), settling a claim the engine spelled out step by step
//! ([`settle_step`]), purging finished timers.

use sqlx::{ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Row, Type};
use timer_core::fair::Visited;
use timer_core::policy::Work;
use timer_core::store::Step;
use timer_core::{ClaimedTimer, Due, Lease, Result, Timestamp};

use super::{db_err, Dialect, TimerRow};

/// Up to `$2` tenants with Scheduled rows after `$1` in id order, each with its earliest
/// `available_at`: a recursive skip scan over `timers_tenant_claimable`, each step the first
/// entry after the last tenant (two probes of it: its tenant and its `available_at`). Every
/// subquery names the index's predicate (`available_at IS NOT NULL`, migration 0011/0007) and
/// orders by both its columns with no equality on the tenant, so no other index can give that
/// order: an `EXISTS (… tenant_id = …)` let PostgreSQL pick a sequential scan, and an
/// `ORDER BY available_at` with the tenant equal, `timers_claimable`.
const VISIT_TENANTS: &str = "WITH RECURSIVE visit(tenant_id, earliest, n) AS ( \
      SELECT (SELECT tenant_id FROM timers WHERE state = 0 AND available_at IS NOT NULL \
              AND tenant_id > $1 ORDER BY tenant_id, available_at LIMIT 1), \
             (SELECT available_at FROM timers WHERE state = 0 AND available_at IS NOT NULL \
              AND tenant_id > $1 ORDER BY tenant_id, available_at LIMIT 1), 1 \
      UNION ALL \
      SELECT (SELECT t.tenant_id FROM timers t WHERE t.state = 0 \
              AND t.available_at IS NOT NULL AND t.tenant_id > v.tenant_id \
              ORDER BY t.tenant_id, t.available_at LIMIT 1), \
             (SELECT t.available_at FROM timers t WHERE t.state = 0 \
              AND t.available_at IS NOT NULL AND t.tenant_id > v.tenant_id \
              ORDER BY t.tenant_id, t.available_at LIMIT 1), v.n + 1 \
      FROM visit v WHERE v.tenant_id IS NOT NULL AND v.n < $2) \
    SELECT tenant_id, earliest FROM visit WHERE tenant_id IS NOT NULL ORDER BY n";

/// Whether more than `$3 - 1` rows are in a claim's window (claimable at `$1`, or first due by
/// `$2`; the claim's condition): it counts no further than `$3`, and leases nothing. The order
/// binds it to `timers_claimable`, a range read that stops at the window's end: without it a
/// plan (a generic one above all, which guesses the share of due rows) may scan the table,
/// which with few rows due means the whole table.
const MORE_DUE: &str = "SELECT COUNT(*) FROM (SELECT 1 FROM timers WHERE state = 0 \
      AND available_at <= $2 AND (available_at <= $1 OR available_at = due_at) \
      ORDER BY available_at LIMIT $3) d";

/// Settles one claim as `step` says ([`Settlement::Step`](timer_core::Settlement::Step)) at
/// `at`, if `owner` still holds it at the claimed revision: `None` when not. Returns the row's
/// `history_seq` after the step's changes; the caller records them.
pub(crate) async fn settle_step<D>(
    conn: &mut <D::Db as Database>::Connection,
    claim: &ClaimedTimer,
    step: &Step,
    owner: &str,
    at: Timestamp,
) -> std::result::Result<Option<i64>, sqlx::Error>
where
    D: Dialect,
    for<'c> &'c mut <D::Db as Database>::Connection: Executor<'c, Database = D::Db>,
    for<'q> <D::Db as Database>::Arguments<'q>: IntoArguments<'q, D::Db>,
    for<'q> &'q str: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> i64: Encode<'q, D::Db> + Decode<'q, D::Db> + Type<D::Db>,
    for<'q> Option<i64>: Encode<'q, D::Db>,
    for<'q> String: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> Option<String>: Encode<'q, D::Db>,
    usize: ColumnIndex<<D::Db as Database>::Row>,
{
    let finished = step.state.is_finished().then_some(at.as_millis());
    sqlx::query_scalar(
        "UPDATE timers SET state = CAST($6 AS SMALLINT), \
           revision = revision + CASE WHEN due_at <> $7 THEN 1 ELSE 0 END, \
           due_at = $7, available_at = $8, finished_at = $9, \
           reached_at = CASE WHEN $10 = 1 THEN $3 ELSE reached_at END, \
           occurrences = occurrences \
             + CASE WHEN $10 = 1 AND recurrence IS NOT NULL THEN 1 ELSE 0 END, \
           attempts = CASE WHEN $10 = 1 THEN 0 ELSE attempts END, \
           last_error = CASE WHEN $10 = 1 THEN NULL ELSE last_error END, \
           work = $11, lease_owner = NULL, lease_until = NULL, \
           history_seq = history_seq + $12 \
         WHERE tenant_id = $1 AND service_call_id = $2 AND state = 0 AND lease_owner = $4 \
           AND revision = $5 RETURNING history_seq",
    )
    .bind(claim.key.tenant_id.as_str())
    .bind(claim.key.service_call_id.as_str())
    .bind(at.as_millis())
    .bind(owner)
    .bind(claim.revision)
    .bind(step.state.code())
    .bind(step.due_at.as_millis())
    .bind(step.available_at.max(step.due_at).as_millis())
    .bind(finished)
    .bind(i64::from(step.fired))
    .bind(step.work.as_ref().map(Work::to_json))
    .bind(i64::try_from(step.changes.len()).unwrap_or(0))
    .fetch_optional(&mut *conn)
    .await
}

statements! {
    /// [`FairSteps::claim_earliest`](timer_core::fair::FairSteps::claim_earliest): the rows in
    /// the order the database returns them (`FairShare::claim` orders the whole claim).
    pub(crate) async fn claim(
        &self,
        due: Due,
        limit: usize,
        lease: &Lease,
    ) -> Result<Vec<ClaimedTimer>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(D::CLAIM)
            .bind(lease.owner.as_str())
            .bind(lease.until.as_millis())
            .bind(due.now.as_millis())
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .bind(due.ahead.as_millis())
            .fetch_all(self.pool)
            .await
            .map_err(|e| db_err::<D>("claiming due timers", e))?;
        Ok(rows
            .iter()
            .filter_map(|row| TimerRow::<D>::of(row).claimed_readable())
            .collect())
    }

    /// [`FairSteps::more_due_than`](timer_core::fair::FairSteps::more_due_than) ([`MORE_DUE`]).
    pub(crate) async fn more_due_than(&self, due: Due, limit: usize) -> Result<bool> {
        let count: i64 = sqlx::query_scalar(MORE_DUE)
            .bind(due.now.as_millis())
            .bind(due.ahead.as_millis())
            .bind(i64::try_from(limit.saturating_add(1)).unwrap_or(i64::MAX))
            .fetch_one(self.pool)
            .await
            .map_err(|e| db_err::<D>("counting the due timers", e))?;
        Ok(usize::try_from(count).is_ok_and(|n| n > limit))
    }

    /// [`FairSteps::visit_tenants`](timer_core::fair::FairSteps::visit_tenants) ([`VISIT_TENANTS`]).
    pub(crate) async fn visit_tenants(
        &self,
        now: Timestamp,
        after: &str,
        visits: usize,
    ) -> Result<Vec<Visited>> {
        if visits == 0 {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(VISIT_TENANTS)
            .bind(after)
            .bind(i64::try_from(visits).unwrap_or(i64::MAX))
            .fetch_all(self.pool)
            .await
            .map_err(|e| db_err::<D>("visiting the tenants with due timers", e))?;
        rows.iter()
            .map(|row| {
                let earliest: Option<i64> = row.try_get("earliest")?;
                Ok(Visited {
                    tenant: row.try_get("tenant_id")?,
                    // None: its rows went meanwhile.
                    due: earliest.is_some_and(|at| at <= now.as_millis()),
                })
            })
            .collect::<std::result::Result<_, sqlx::Error>>()
            .map_err(|e| db_err::<D>("reading the tenants with due timers", e))
    }

    pub(crate) async fn purge(&self, older_than: Timestamp, limit: usize) -> Result<u64> {
        let err = |e| db_err::<D>("purging finished timers", e);
        let purge = sqlx::query(D::PURGE)
            .bind(older_than.as_millis())
            .bind(i64::try_from(limit).unwrap_or(i64::MAX));
        let Some(history) = D::PURGE_HISTORY else {
            return Ok(purge.fetch_all(self.pool).await.map_err(err)?.len() as u64);
        };
        let mut tx = self.pool.begin().await.map_err(err)?;
        let gone = purge.fetch_all(&mut *tx).await.map_err(err)?;
        let keys = gone
            .iter()
            .map(|row| {
                let (t, i): (String, String) =
                    (row.try_get("tenant_id")?, row.try_get("service_call_id")?);
                Ok(serde_json::json!({ "t": t, "i": i }))
            })
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()
            .map_err(err)?;
        if !keys.is_empty() {
            sqlx::query(history)
                .bind(serde_json::Value::Array(keys).to_string())
                .execute(&mut *tx)
                .await
                .map_err(err)?;
        }
        tx.commit().await.map_err(err)?;
        Ok(gone.len() as u64)
    }
}
