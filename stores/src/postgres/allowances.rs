//! Rate allowances kept in the schema (`timer_allowances` and the function
//! `timer_allowance_take`, migration 0012), so every instance takes from one budget per tenant
//! (`limits.rate.shared`): one call locks a tenant's allowance, takes what fits, and moves it.

use async_trait::async_trait;
use timer_core::{Result, SharedAllowances, Take, Taken};

use super::{db_err, PostgresStore};

#[async_trait]
impl SharedAllowances for PostgresStore {
    async fn take(&self, take: &Take<'_>) -> Result<Taken> {
        let (taken, start_us, tat_us): (i64, i64, i64) = sqlx::query_as(
            "SELECT taken, start_at, tat_after FROM timer_allowance_take($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(take.kind)
        .bind(take.tenant)
        .bind(take.now_us)
        .bind(take.cell_us.max(1))
        .bind(i64::from(take.n))
        .bind(take.max_ahead_us)
        .bind(take.all)
        .fetch_one(&self.pool)
        .await
        .map_err(|e| db_err("taking from a shared allowance", e))?;
        Ok(Taken {
            taken: u32::try_from(taken).unwrap_or(0),
            start_us,
            tat_us,
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
