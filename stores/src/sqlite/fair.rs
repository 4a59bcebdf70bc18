//! The steps of a fair claim ([`timer_core::fair`]) on SQLite: the earliest rows and the tenant
//! visit are the shared statements; a share of each tenant is one statement per tenant, all in
//! one write transaction.

use timer_core::{ClaimedTimer, Due, Lease, Result};

use super::{db_err, SqliteStore};
use crate::sql::{self, TimerRow};

/// Leases up to `?4` rows of tenant `?5` that the window takes, its earliest first (through
/// `timers_tenant_claimable`). Parameters 1 to 3 as [`Dialect::CLAIM`](crate::sql::Dialect), 6
/// the end of the window ahead.
const CLAIM_OF_TENANT: &str =
    "UPDATE timers SET lease_owner = ?1, available_at = ?2, lease_until = ?2 \
     WHERE rowid IN (SELECT rowid FROM timers WHERE state = 0 AND available_at IS NOT NULL \
                     AND tenant_id = ?5 AND available_at <= ?6 \
                     AND (available_at <= ?3 OR available_at = due_at) \
                     ORDER BY available_at LIMIT ?4) \
     RETURNING tenant_id, service_call_id, due_at, registered_at, correlation_id, payload, \
               attempts, revision, recurrence, occurrences, policy, work, target, message, \
               message_meta, traceparent, tracestate";

crate::sql::sql_fair_steps!(SqliteStore);

impl SqliteStore {
    /// [`FairSteps::claim_of_tenants`](timer_core::fair::FairSteps::claim_of_tenants).
    pub(crate) async fn claim_shares(
        &self,
        due: Due,
        shares: &[(String, usize)],
        lease: &Lease,
    ) -> Result<Vec<ClaimedTimer>> {
        let op = "claiming due timers of each tenant";
        let mut tx = sql::begin_write::<Self>(&self.write)
            .await
            .map_err(|e| db_err(op, e))?;
        let mut claimed = Vec::new();
        for (tenant, share) in shares {
            let rows = sqlx::query(CLAIM_OF_TENANT)
                .bind(lease.owner.as_str())
                .bind(lease.until.as_millis())
                .bind(due.now.as_millis())
                .bind(i64::try_from(*share).unwrap_or(i64::MAX))
                .bind(tenant.as_str())
                .bind(due.ahead.as_millis())
                .fetch_all(&mut *tx)
                .await
                .map_err(|e| db_err(op, e))?;
            claimed.extend(
                rows.iter()
                    .filter_map(|row| TimerRow::<Self>::of(row).claimed_readable()),
            );
        }
        tx.commit().await.map_err(|e| db_err(op, e))?;
        Ok(claimed)
    }
}
