//! The steps of a fair claim ([`timer_core::fair`]) on PostgreSQL: the earliest rows and the
//! tenant visit are the shared statements; the shares of all tenants are one statement.

use timer_core::{ClaimedTimer, Due, Lease, Result};

use super::{db_err, PostgresStore};
use crate::sql::TimerRow;

/// Leases up to its share (`$5`) of the rows the window takes of each tenant of `$4`, each
/// one's earliest first (a lateral probe of `timers_tenant_claimable` per tenant; SKIP LOCKED
/// as the plain claim). Parameters 1 to 3 as [`Dialect::CLAIM`](crate::sql::Dialect), 6 the end
/// of the window ahead.
///
/// "Due" is written as a row comparison on the index's columns, which only that index can take
/// as its bound: with `available_at <= $6` a plan made for a tenant in general (the tenant
/// comes from the array) may read `timers_claimable` in due order and filter by tenant, which
/// for a small tenant behind another's herd reads the whole herd.
const CLAIM_OF_TENANTS: &str =
    "UPDATE timers t SET lease_owner = $1, available_at = $2, lease_until = $2 \
     FROM (SELECT c.tenant_id, c.service_call_id FROM unnest($4::text[], $5::bigint[]) AS d(tenant_id, share) \
           CROSS JOIN LATERAL (SELECT tenant_id, service_call_id FROM timers \
               WHERE state = 0 AND available_at IS NOT NULL AND tenant_id = d.tenant_id \
               AND (tenant_id, available_at) <= (d.tenant_id, $6) \
               AND (available_at <= $3 OR available_at = due_at) \
               ORDER BY available_at LIMIT d.share FOR UPDATE SKIP LOCKED) c) c \
     WHERE t.tenant_id = c.tenant_id AND t.service_call_id = c.service_call_id \
     RETURNING t.tenant_id, t.service_call_id, t.due_at, t.registered_at, \
               t.correlation_id, t.payload, t.attempts, t.revision, t.recurrence, \
               t.occurrences, t.policy, t.work, t.target, t.message, t.message_meta, \
               t.traceparent, t.tracestate";

crate::sql::sql_fair_steps!(PostgresStore);

impl PostgresStore {
    /// [`FairSteps::claim_of_tenants`](timer_core::fair::FairSteps::claim_of_tenants).
    pub(crate) async fn claim_shares(
        &self,
        due: Due,
        shares: &[(String, usize)],
        lease: &Lease,
    ) -> Result<Vec<ClaimedTimer>> {
        let (tenants, counts): (Vec<&str>, Vec<i64>) = shares
            .iter()
            .map(|(t, n)| (t.as_str(), i64::try_from(*n).unwrap_or(i64::MAX)))
            .unzip();
        let rows = sqlx::query(CLAIM_OF_TENANTS)
            .bind(lease.owner.as_str())
            .bind(lease.until.as_millis())
            .bind(due.now.as_millis())
            .bind(&tenants)
            .bind(&counts)
            .bind(due.ahead.as_millis())
            .fetch_all(&self.pool)
            .await
            .map_err(|e| db_err("claiming due timers of each tenant", e))?;
        Ok(rows
            .iter()
            .filter_map(|row| TimerRow::<Self>::of(row).claimed_readable())
            .collect())
    }
}
