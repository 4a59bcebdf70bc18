//! Rate allowances kept in the schema (`timer_allowances`, migration 0012), so every instance
//! takes from one budget per tenant (`limits.rate.shared`): one upsert moves an allowance's
//! time, or leaves it when the cost does not fit.

use async_trait::async_trait;
use timer_core::{Advanced, Result, SharedAllowances};

use super::{db_err, PostgresStore};

/// $1 kind, $2 tenant, $3 now, $4 cost, $5 most ahead of now (NULL: no bound). A new row takes
/// the cost from now (the caller checked that one cost alone fits); an existing one only when
/// the cost fits. Returns the time the cost started from.
const ADVANCE: &str = "INSERT INTO timer_allowances AS a (kind, tenant_id, tat) \
     VALUES ($1, $2, $3 + $4) \
     ON CONFLICT (kind, tenant_id) DO UPDATE SET tat = GREATEST(a.tat, $3) + $4 \
     WHERE $5::bigint IS NULL OR GREATEST(a.tat, $3) + $4 - $3 <= $5::bigint \
     RETURNING a.tat - $4 AS start";

#[async_trait]
impl SharedAllowances for PostgresStore {
    async fn advance(
        &self,
        kind: &str,
        tenant: &str,
        now_us: i64,
        cost_us: i64,
        max_ahead_us: Option<i64>,
    ) -> Result<Advanced> {
        let op = "taking from a shared allowance";
        let start: Option<i64> = sqlx::query_scalar(ADVANCE)
            .bind(kind)
            .bind(tenant)
            .bind(now_us)
            .bind(cost_us)
            .bind(max_ahead_us)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| db_err(op, e))?;
        if let Some(start_us) = start {
            return Ok(Advanced::Taken { start_us });
        }
        let tat: Option<i64> = sqlx::query_scalar(
            "SELECT tat FROM timer_allowances WHERE kind = $1 AND tenant_id = $2",
        )
        .bind(kind)
        .bind(tenant)
        .fetch_optional(&self.pool)
        .await
        .map_err(|e| db_err(op, e))?;
        Ok(Advanced::Denied {
            tat_us: tat.unwrap_or(now_us),
        })
    }

    async fn forget(&self, before_us: i64) -> Result<u64> {
        sqlx::query("DELETE FROM timer_allowances WHERE tat < $1")
            .bind(before_us)
            .execute(&self.pool)
            .await
            .map(|done| done.rows_affected())
            .map_err(|e| db_err("forgetting full allowances", e))
    }
}
