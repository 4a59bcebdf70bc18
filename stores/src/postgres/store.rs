//! The [`Store`] of PostgreSQL and its optional abilities (control, history, queries, tenant
//! counts); the lease owners are in owners.rs, the settle statements in settle.rs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use sqlx::Row;
use timer_core::policy::{Policy, Work};
use timer_core::{
    CancelOutcome, Change, ClaimedTimer, Due, Error, Lease, NewTimer, Recurrence, Result,
    ScheduleOutcome, Settlement, Store, Target, TenantCounts, Timer, TimerControl, TimerKey,
    TimerState, Timestamp, TraceContext,
};
use tokio::sync::broadcast;

use super::settle::{
    recorded, settled, Columns, SETTLE_FAILED, SETTLE_FAILED_SQL, SETTLE_NEXT, SETTLE_NEXT_SQL,
    SETTLE_REACHED, SETTLE_REACHED_SQL, SETTLE_RETRY, settle_retry,
};
use super::{db_err, PostgresStore};
use crate::sql::{self, SqlAbilities, Statements, TimerRow};

impl PostgresStore {
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
        let targets: Vec<Option<String>> = rows
            .iter()
            .map(|t| t.target.as_ref().map(Target::to_json))
            .collect();
        let messages: Vec<Option<&[u8]>> = rows
            .iter()
            .map(|t| t.message.as_ref().map(|m| m.body.as_slice()))
            .collect();
        let metas: Vec<Option<String>> = rows
            .iter()
            .map(|t| t.message.as_ref().map(|m| m.meta.to_json()))
            .collect();
        let traceparents: Vec<Option<&str>> = rows
            .iter()
            .map(|t| t.trace.as_ref().map(TraceContext::traceparent))
            .collect();
        let tracestates: Vec<Option<&str>> = rows
            .iter()
            .map(|t| t.trace.as_ref().and_then(TraceContext::tracestate))
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
        // What a fire sends, changed at the same due time: a new revision too, so a fire in
        // flight with the old content does not settle the timer (it fires again with the new).
        let content_changed = "t.correlation_id IS DISTINCT FROM EXCLUDED.correlation_id \
            OR t.payload IS DISTINCT FROM EXCLUDED.payload \
            OR t.policy IS DISTINCT FROM EXCLUDED.policy \
            OR t.target IS DISTINCT FROM EXCLUDED.target \
            OR t.message IS DISTINCT FROM EXCLUDED.message \
            OR t.message_meta IS DISTINCT FROM EXCLUDED.message_meta";
        let upsert = format!(
            "INSERT INTO timers AS t (tenant_id, service_call_id, due_at, registered_at, \
                                      correlation_id, payload, available_at, recurrence, \
                                      history_seq, policy, work, target, message, message_meta, \
                                      traceparent, tracestate) \
             SELECT i.tenant_id, i.service_call_id, i.due_at, $6, i.correlation_id, i.payload, \
                    i.due_at, i.recurrence, 1, i.policy, i.work, i.target, i.message, \
                    i.message_meta, i.traceparent, i.tracestate \
             FROM UNNEST($1::text[], $2::text[], $3::bigint[], $4::text[], $5::text[], $7::text[], \
                         $11::text[], $12::text[], $13::text[], $14::bytea[], $15::text[], \
                         $16::text[], $17::text[]) \
                  AS i(tenant_id, service_call_id, due_at, correlation_id, payload, recurrence, \
                       policy, work, target, message, message_meta, traceparent, tracestate) \
             ON CONFLICT (tenant_id, service_call_id) DO UPDATE SET \
                work = CASE WHEN {same_series} THEN t.work \
                    WHEN t.due_at <> EXCLUDED.due_at \
                    OR t.recurrence IS DISTINCT FROM EXCLUDED.recurrence THEN EXCLUDED.work \
                    ELSE t.work END, \
                policy = EXCLUDED.policy, \
                revision = t.revision + CASE WHEN {same_series} THEN 0 \
                    WHEN t.due_at <> EXCLUDED.due_at \
                    OR t.recurrence IS DISTINCT FROM EXCLUDED.recurrence \
                    OR ({content_changed}) THEN 1 ELSE 0 END, \
                attempts = CASE WHEN {same_series} THEN t.attempts \
                    WHEN t.due_at <> EXCLUDED.due_at \
                    OR t.recurrence IS DISTINCT FROM EXCLUDED.recurrence THEN 0 ELSE t.attempts END, \
                available_at = CASE WHEN {same_series} THEN t.available_at \
                               WHEN t.lease_until > $6 \
                               THEN GREATEST(t.lease_until, EXCLUDED.due_at) ELSE EXCLUDED.due_at END, \
                due_at = CASE WHEN {same_series} THEN t.due_at ELSE EXCLUDED.due_at END, \
                correlation_id = EXCLUDED.correlation_id, \
                payload = EXCLUDED.payload, \
                target = EXCLUDED.target, \
                message = EXCLUDED.message, \
                message_meta = EXCLUDED.message_meta, \
                traceparent = EXCLUDED.traceparent, \
                tracestate = EXCLUDED.tracestate, \
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
            .bind(&targets)
            .bind(&messages)
            .bind(&metas)
            .bind(&traceparents)
            .bind(&tracestates)
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
        due: Due,
        limit: usize,
        lease: &Lease,
    ) -> Result<Vec<ClaimedTimer>> {
        self.fair.claim(self, due, limit, lease).await
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
                reached
                    .bind(sql, owner, at)
                    .bind(&reached_changes)
                    .bind(history),
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
            let sql = SETTLE_RETRY.get_or_init(settle_retry);
            let retry = sqlx::query(sql)
                .bind(&retry_claims.tenants)
                .bind(&retry_claims.ids)
                .bind(&retry_at)
                .bind(&retry_errors)
                .bind(owner)
                .bind(&retry_changes)
                .bind(at.as_millis())
                .bind(history)
                .bind(&retry_claims.revisions);
            queries.push((true, retry));
        }
        let settled_rows = |row: &sqlx::postgres::PgRow| -> Result<u64> {
            let n: i64 = row.try_get(0).map_err(|e| db_err(op, e))?;
            Ok(u64::try_from(n).unwrap_or(0))
        };
        if queries.len() == 1 && steps.is_empty() {
            if let Some((_, query)) = queries.pop() {
                // One statement commits by itself: no transaction round trips on the hot path.
                let row = query
                    .fetch_one(&self.pool)
                    .await
                    .map_err(|e| db_err(op, e))?;
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
                let entries = sql::numbered(&t.key, seq, &step.changes);
                sql::record_all::<Self>(&mut tx, &entries, at, limit)
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

    timer_core::own_abilities!();

    fn lease_owners(&self) -> Option<&dyn timer_core::LeaseOwners> {
        Some(self)
    }

    fn shared_allowances(&self) -> Option<&dyn timer_core::SharedAllowances> {
        Some(self)
    }
}

impl SqlAbilities for PostgresStore {
    fn reads(&self) -> Statements<'_, Self> {
        self.statements()
    }

    fn writes(&self) -> Statements<'_, Self> {
        self.statements()
    }

    fn history_kept(&self) -> &AtomicUsize {
        &self.history
    }
}

crate::sql::sql_abilities!(PostgresStore);

#[async_trait]
impl TenantCounts for PostgresStore {
    async fn live_by_tenant(&self, tenants: &[String]) -> Result<HashMap<String, u64>> {
        // Each state from its partial index (`state IN (0, 4)` matches neither, and read every
        // row of the tenant, the finished ones of its retention too, on each schedule batch).
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT tenant_id, COUNT(*) FROM (SELECT tenant_id FROM timers \
             WHERE state = 0 AND available_at IS NOT NULL AND tenant_id = ANY($1) \
             UNION ALL SELECT tenant_id FROM timers WHERE state = 4 AND tenant_id = ANY($1)) \
             live GROUP BY tenant_id",
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

/// $1 tenants, $2 ids, $3 the lease owner, $4 the new end of the lease.
const RENEW_SQL: &str =
    "UPDATE timers t SET available_at = GREATEST($4, t.due_at), lease_until = $4 \
    FROM UNNEST($1::text[], $2::text[]) AS k(tenant_id, service_call_id) \
    WHERE t.tenant_id = k.tenant_id AND t.service_call_id = k.service_call_id \
      AND t.state = 0 AND t.lease_owner = $3 AND t.lease_until IS NOT NULL";
