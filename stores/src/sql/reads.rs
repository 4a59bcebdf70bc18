//! The shared statements that only read: a timer, the next due time, counts, listings, tenant
//! summaries, the health check.

use sqlx::Row;
use timer_core::{
    Backlog, PageAfter, Result, TenantBacklog, TenantSummary, Timer, TimerFilter, TimerKey,
    TimerState, Timestamp,
};

use super::{db_err, TimerRow, TIMER_COLUMNS};

/// The first string after every string that starts with `prefix`, in byte order (which for
/// UTF-8 is code point order): the prefix with its last character replaced by the next one,
/// after dropping trailing characters that have no next one. `None` when no string is after
/// them all (an empty prefix, or one of only `char::MAX`).
fn prefix_end(prefix: &str) -> Option<String> {
    let mut chars: Vec<char> = prefix.chars().collect();
    while let Some(last) = chars.pop() {
        // The next scalar value, stepping over the surrogates (which no `char` can hold).
        let next = match u32::from(last) + 1 {
            0xD800 => Some('\u{E000}'),
            n => char::from_u32(n),
        };
        if let Some(next) = next {
            chars.push(next);
            return Some(chars.into_iter().collect());
        }
    }
    None
}

statements! {
    pub(crate) async fn get(&self, key: &TimerKey) -> Result<Option<Timer>> {
        let sql = format!(
            "SELECT {TIMER_COLUMNS} FROM timers WHERE tenant_id = $1 AND service_call_id = $2"
        );
        let row = sqlx::query(&sql)
            .bind(key.tenant_id.as_str())
            .bind(key.service_call_id.as_str())
            .fetch_optional(self.pool)
            .await
            .map_err(|e| db_err::<D>("reading a timer", e))?;
        row.as_ref()
            .map(|row| TimerRow::<D>::of(row).timer())
            .transpose()
    }

    pub(crate) async fn next_due_at(&self) -> Result<Option<Timestamp>> {
        let next: Option<i64> =
            sqlx::query_scalar("SELECT MIN(available_at) FROM timers WHERE state = 0")
                .fetch_one(self.pool)
                .await
                .map_err(|e| db_err::<D>("reading the next due time", e))?;
        Ok(next.map(Timestamp::from_millis))
    }

    pub(crate) async fn scheduled_count(&self) -> Result<u64> {
        self.count(TimerState::Scheduled).await
    }

    /// [`TimerQueries::count`](timer_core::TimerQueries::count).
    pub(crate) async fn count(&self, state: TimerState) -> Result<u64> {
        // The code is our own small integer, written into the statement so the partial
        // indexes (`WHERE state = 0`, `WHERE state = 4`) serve it.
        let sql = format!("SELECT COUNT(*) FROM timers WHERE state = {}", state.code());
        let n: i64 = sqlx::query_scalar(&sql)
            .fetch_one(self.pool)
            .await
            .map_err(|e| db_err::<D>(&format!("counting {} timers", state.as_str()), e))?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// [`TimerQueries::leased`](timer_core::TimerQueries::leased): from the index of live
    /// leases (`timers_leased`: PostgreSQL 0010, SQLite 0010).
    pub(crate) async fn leased(&self) -> Result<u64> {
        let n: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM timers WHERE state = 0 AND lease_until IS NOT NULL",
        )
        .fetch_one(self.pool)
        .await
        .map_err(|e| db_err::<D>("counting the leased timers", e))?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// [`TimerQueries::list`](timer_core::TimerQueries::list): one statement on the index
    /// `(tenant_id, due_at, service_call_id)`, starting after the last row of the page before.
    pub(crate) async fn list(
        &self,
        tenant: &str,
        filter: &TimerFilter,
        after: Option<&PageAfter>,
        limit: usize,
    ) -> Result<Vec<Timer>> {
        let rows = self
            .list_rows(TIMER_COLUMNS, tenant, filter, after, limit)
            .await?;
        rows.iter()
            .map(|row| TimerRow::<D>::of(row).timer())
            .collect()
    }

    /// [`TimerQueries::list_keys`](timer_core::TimerQueries::list_keys): `list`'s statement,
    /// reading the key and due time of each row only.
    pub(crate) async fn list_keys(
        &self,
        tenant: &str,
        filter: &TimerFilter,
        after: Option<&PageAfter>,
        limit: usize,
    ) -> Result<Vec<PageAfter>> {
        let rows = self
            .list_rows("service_call_id, due_at", tenant, filter, after, limit)
            .await?;
        rows.iter()
            .map(|row| {
                Ok(PageAfter {
                    due_at: Timestamp::from_millis(row.try_get("due_at")?),
                    service_call_id: row.try_get("service_call_id")?,
                })
            })
            .collect::<std::result::Result<_, sqlx::Error>>()
            .map_err(|e| db_err::<D>("listing timers", e))
    }

    /// The rows of a page of `list`, with `columns`.
    async fn list_rows(
        &self,
        columns: &str,
        tenant: &str,
        filter: &TimerFilter,
        after: Option<&PageAfter>,
        limit: usize,
    ) -> Result<Vec<<D::Db as sqlx::Database>::Row>> {
        enum Arg {
            Text(String),
            Int(i64),
        }
        let mut args = vec![Arg::Text(tenant.to_owned())];
        let mut sql = format!("SELECT {columns} FROM timers WHERE tenant_id = $1");
        // The next parameter's placeholder, once its value is pushed.
        let next = |args: &mut Vec<Arg>, arg| {
            args.push(arg);
            format!("${}", args.len())
        };
        if !filter.states.is_empty() {
            // Our own small integers, not input: written into the statement.
            let codes: Vec<String> = filter.states.iter().map(|s| s.code().to_string()).collect();
            sql += &format!(" AND state IN ({})", codes.join(", "));
        }
        if let Some(prefix) = filter.prefix.as_deref() {
            // A range on the primary key `(tenant_id, service_call_id)`, which both databases
            // can estimate and walk: ids compare byte by byte (SQLite's BINARY, PostgreSQL's
            // "C" from migration 0006), so the ids with the prefix are exactly those in it.
            let low = next(&mut args, Arg::Text(prefix.to_owned()));
            sql += &format!(" AND service_call_id >= {low}");
            if let Some(end) = prefix_end(prefix) {
                sql += &format!(" AND service_call_id < {}", next(&mut args, Arg::Text(end)));
            }
        }
        if let Some(t) = filter.due_after {
            sql += &format!(
                " AND due_at >= {}",
                next(&mut args, Arg::Int(t.as_millis()))
            );
        }
        if let Some(t) = filter.due_before {
            sql += &format!(" AND due_at < {}", next(&mut args, Arg::Int(t.as_millis())));
        }
        match filter.recurring {
            Some(true) => sql += " AND recurrence IS NOT NULL",
            Some(false) => sql += " AND recurrence IS NULL",
            None => {}
        }
        // As `Timer::is_retrying`.
        match filter.retrying {
            Some(true) => sql += " AND state = 0 AND attempts > 0",
            Some(false) => sql += " AND NOT (state = 0 AND attempts > 0)",
            None => {}
        }
        if let Some(after) = after {
            let due = next(&mut args, Arg::Int(after.due_at.as_millis()));
            let id = next(&mut args, Arg::Text(after.service_call_id.clone()));
            sql += &format!(" AND (due_at, service_call_id) > ({due}, {id})");
        }
        let limit = next(
            &mut args,
            Arg::Int(i64::try_from(limit).unwrap_or(i64::MAX)),
        );
        sql += &format!(" ORDER BY due_at, service_call_id LIMIT {limit}");
        let mut query = sqlx::query(&sql);
        for arg in &args {
            query = match arg {
                Arg::Text(text) => query.bind(text.as_str()),
                Arg::Int(n) => query.bind(*n),
            };
        }
        query
            .fetch_all(self.pool)
            .await
            .map_err(|e| db_err::<D>("listing timers", e))
    }

    pub(crate) async fn tenants(&self, after: Option<&str>, limit: usize) -> Result<Vec<String>> {
        // One index seek per tenant on the primary key (a loose index scan), where `SELECT
        // DISTINCT` would read every row of every tenant on the way: 2 ms instead of 75 ms
        // past a tenant of 1,000,000 timers on PostgreSQL. `n` stops the recursion after
        // `limit` tenants (SQLite would not stop it for the outer LIMIT alone).
        sqlx::query_scalar(
            "WITH RECURSIVE t(tenant_id, n) AS ( \
                 SELECT (SELECT tenant_id FROM timers WHERE tenant_id > $1 \
                         ORDER BY tenant_id LIMIT 1), 1 \
                 UNION ALL \
                 SELECT (SELECT x.tenant_id FROM timers x WHERE x.tenant_id > t.tenant_id \
                         ORDER BY x.tenant_id LIMIT 1), t.n + 1 \
                 FROM t WHERE t.tenant_id IS NOT NULL AND t.n < $2) \
             SELECT tenant_id FROM t WHERE tenant_id IS NOT NULL",
        )
        .bind(after.unwrap_or(""))
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(self.pool)
        .await
        .map_err(|e| db_err::<D>("listing tenants", e))
    }

    pub(crate) async fn summaries(
        &self,
        tenants: &[String],
        failed_since: Timestamp,
        fired_since: Timestamp,
    ) -> Result<Vec<TenantSummary>> {
        let mut summaries = TenantSummary::nothing_counted(tenants);
        // A page of tenants at a time keeps the parameters far below SQLite's limit.
        for chunk in tenants.chunks(500) {
            let list: Vec<String> = (0..chunk.len()).map(|i| format!("${}", i + 3)).collect();
            let sql = format!(
                "SELECT tenant_id, state, COUNT(*), MIN(due_at), \
                        SUM(CASE WHEN finished_at >= $1 THEN 1 ELSE 0 END), \
                        SUM(CASE WHEN reached_at >= $2 THEN 1 ELSE 0 END) \
                 FROM timers WHERE tenant_id IN ({}) GROUP BY tenant_id, state",
                list.join(", ")
            );
            let mut query = sqlx::query(&sql)
                .bind(failed_since.as_millis())
                .bind(fired_since.as_millis());
            for tenant in chunk {
                query = query.bind(tenant.as_str());
            }
            let err = |e| db_err::<D>("summarizing tenants", e);
            for row in query.fetch_all(self.pool).await.map_err(err)? {
                let tenant: String = row.try_get(0).map_err(err)?;
                let code: i64 = row.try_get::<D::State, usize>(1).map_err(err)?.into();
                let count: i64 = row.try_get(2).map_err(err)?;
                let first_due: Option<i64> = row.try_get(3).map_err(err)?;
                let finished_since: Option<i64> = row.try_get(4).map_err(err)?;
                let fired_since: Option<i64> = row.try_get(5).map_err(err)?;
                let (Some(state), Some(summary)) = (
                    TimerState::from_code(code),
                    summaries.iter_mut().find(|s| s.tenant_id == tenant),
                ) else {
                    continue;
                };
                summary
                    .counts
                    .insert(state, u64::try_from(count).unwrap_or(0));
                summary.fired_since += u64::try_from(fired_since.unwrap_or(0)).unwrap_or(0);
                match state {
                    TimerState::Scheduled => {
                        summary.next_due_at = first_due.map(Timestamp::from_millis)
                    }
                    TimerState::Failed => {
                        summary.failed_since =
                            u64::try_from(finished_since.unwrap_or(0)).unwrap_or(0)
                    }
                    _ => {}
                }
            }
        }
        Ok(summaries)
    }

    pub(crate) async fn backlog(&self, now: Timestamp, limit: usize) -> Result<Backlog> {
        // The claimable rows only (`timers_claimable` or `timers_tenant_claimable`), grouped by
        // tenant; the window functions count every group before the LIMIT keeps the first.
        let err = |e| db_err::<D>("counting the due backlog", e);
        let rows = sqlx::query(
            "SELECT tenant_id, COUNT(*), MIN(available_at), \
                    COUNT(*) OVER (), CAST(SUM(COUNT(*)) OVER () AS BIGINT) \
             FROM timers WHERE state = 0 AND available_at <= $1 \
             GROUP BY tenant_id ORDER BY MIN(available_at), tenant_id LIMIT $2",
        )
        .bind(now.as_millis())
        .bind(i64::try_from(limit.max(1)).unwrap_or(i64::MAX))
        // Planned for each `now`: PostgreSQL's generic plan guesses a third of the table due
        // and reads nothing in parallel workers (5 ms at 2M rows, 40-65 ms at 10M with JIT,
        // where the plan for the value reads the empty range in 0.03 ms).
        .persistent(false)
        .fetch_all(self.pool)
        .await
        .map_err(err)?;
        let mut backlog = Backlog::default();
        for row in rows {
            let due: i64 = row.try_get(1).map_err(err)?;
            let since: i64 = row.try_get(2).map_err(err)?;
            let tenants: i64 = row.try_get(3).map_err(err)?;
            let total: i64 = row.try_get(4).map_err(err)?;
            backlog.tenants = u64::try_from(tenants).unwrap_or(0);
            backlog.due = u64::try_from(total).unwrap_or(0);
            backlog.by_tenant.push(TenantBacklog {
                tenant_id: row.try_get(0).map_err(err)?,
                due: u64::try_from(due).unwrap_or(0),
                since: Timestamp::from_millis(since),
            });
        }
        Ok(backlog)
    }

    pub(crate) async fn health(&self) -> Result<()> {
        sqlx::query("SELECT 1")
            .execute(self.pool)
            .await
            .map(|_| ())
            .map_err(|e| db_err::<D>("health check", e))
    }
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn prefix_end_is_the_first_string_after_the_prefixed_ones() {
        assert_eq!(prefix_end("t0000").as_deref(), Some("t0001"));
        assert_eq!(prefix_end("a-").as_deref(), Some("a."));
        assert_eq!(prefix_end("zé").as_deref(), Some("zê"));
        assert_eq!(prefix_end("a\u{D7FF}").as_deref(), Some("a\u{E000}"));
        assert_eq!(prefix_end("a\u{10FFFF}").as_deref(), Some("b"));
        assert_eq!(prefix_end("\u{10FFFF}\u{10FFFF}"), None);
        assert_eq!(prefix_end(""), None);
    }
}
