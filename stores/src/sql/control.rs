//! The shared statements of the control and history abilities: control actions
//! ([`TimerControl::apply`](timer_core::TimerControl::apply)), reading and recording a timer's
//! history.

use sqlx::Row;
use timer_core::control::transition;
use timer_core::policy::Work;
use timer_core::{Action, Change, ControlOutcome, HistoryEntry, Result, TimerKey, Timestamp};

use super::{begin_write, db_err, numbered, record_all, TimerRow, TIMER_COLUMNS};

statements! {
    /// [`TimerControl::apply`](timer_core::TimerControl::apply): each row read (and locked,
    /// [`Dialect::LOCK_ROW`]) and written in one transaction, its changes recorded.
    pub(crate) async fn apply(
        &self,
        keys: &[TimerKey],
        action: &Action,
        now: Timestamp,
        history: usize,
    ) -> Result<Vec<ControlOutcome>> {
        let op = match action {
            Action::Pause { .. } => "pausing timers",
            Action::Resume => "resuming timers",
            Action::Cancel => "cancelling timers",
            Action::Retry => "retrying timers",
            Action::Complete(_) => "completing timers",
        };
        let err = |e| db_err::<D>(op, e);
        let read = format!(
            "SELECT {TIMER_COLUMNS}, COALESCE(lease_until > $3, FALSE) AS firing FROM timers \
             WHERE tenant_id = $1 AND service_call_id = $2{}",
            D::LOCK_ROW
        );
        let mut tx = begin_write::<D>(self.pool).await.map_err(err)?;
        // Rows read without a lock first (where rows are locked): those the action leaves as
        // they are need none.
        let unlocked = match D::KEYS_OF_JSON {
            Some(keys_of) if !keys.is_empty() => {
                let json: Vec<serde_json::Value> = keys
                    .iter()
                    .map(|k| serde_json::json!({ "t": k.tenant_id, "i": k.service_call_id }))
                    .collect();
                let rows = sqlx::query(&format!(
                    "SELECT {TIMER_COLUMNS}, COALESCE(lease_until > $2, FALSE) AS firing \
                     FROM timers WHERE (tenant_id, service_call_id) IN ({keys_of})"
                ))
                .bind(serde_json::Value::Array(json).to_string())
                .bind(now.as_millis())
                .fetch_all(&mut *tx)
                .await
                .map_err(err)?;
                let mut unlocked = std::collections::HashMap::with_capacity(rows.len());
                for row in &rows {
                    let timer = TimerRow::<D>::of(row).timer()?;
                    let firing: bool = row.try_get("firing").map_err(err)?;
                    unlocked.insert(timer.key.clone(), (timer, firing));
                }
                Some(unlocked)
            }
            _ => None,
        };
        let mut outcomes = Vec::with_capacity(keys.len());
        for key in keys {
            if let Some(unlocked) = &unlocked {
                let Some((timer, firing)) = unlocked.get(key) else {
                    outcomes.push(ControlOutcome::NotFound);
                    continue;
                };
                let step = transition(timer, *firing, action, now);
                if step.write.is_none() {
                    outcomes.push(step.outcome);
                    continue;
                }
            }
            let row = sqlx::query(&read)
                .bind(key.tenant_id.as_str())
                .bind(key.service_call_id.as_str())
                .bind(now.as_millis())
                .fetch_optional(&mut *tx)
                .await
                .map_err(err)?;
            let Some(row) = row else {
                outcomes.push(ControlOutcome::NotFound);
                continue;
            };
            let timer = TimerRow::<D>::of(&row).timer()?;
            let firing: bool = row.try_get("firing").map_err(err)?;
            let step = transition(&timer, firing, action, now);
            outcomes.push(step.outcome);
            let Some(write) = step.write else {
                continue;
            };
            let seq: i64 = sqlx::query_scalar(
                "UPDATE timers SET state = CAST($3 AS SMALLINT), \
                   revision = revision + CASE WHEN due_at <> $4 THEN 1 ELSE 0 END, \
                   due_at = $4, available_at = $4, \
                   finished_at = CASE WHEN $3 = 0 THEN NULL ELSE COALESCE($5, finished_at) END, \
                   reached_at = CASE WHEN $3 = 1 AND $5 IS NOT NULL THEN $5 ELSE reached_at END, \
                   lease_until = NULL, history_seq = history_seq + $6, \
                   attempts = CASE WHEN $7 = 1 THEN 0 ELSE attempts END, \
                   last_error = CASE WHEN $7 = 1 THEN NULL ELSE last_error END, \
                   work = CASE WHEN $8 = 1 THEN $9 ELSE work END \
                 WHERE tenant_id = $1 AND service_call_id = $2 RETURNING history_seq",
            )
            .bind(key.tenant_id.as_str())
            .bind(key.service_call_id.as_str())
            .bind(write.state.code())
            .bind(write.due_at.as_millis())
            .bind(write.finished_at.map(Timestamp::as_millis))
            .bind(i64::try_from(write.changes.len()).unwrap_or(0))
            .bind(i64::from(write.reset_attempts))
            .bind(i64::from(write.work.is_some()))
            .bind(write.work.flatten().as_ref().map(Work::to_json))
            .fetch_one(&mut *tx)
            .await
            .map_err(err)?;
            record_all::<D>(&mut *tx, &numbered(key, seq, &write.changes), now, history)
                .await
                .map_err(err)?;
        }
        tx.commit().await.map_err(err)?;
        Ok(outcomes)
    }

    /// [`TimerHistory::read`](timer_core::TimerHistory::read).
    pub(crate) async fn history(
        &self,
        key: &TimerKey,
        after: u64,
        limit: usize,
    ) -> Result<Vec<HistoryEntry>> {
        let err = |e| db_err::<D>("reading a timer's history", e);
        let rows = sqlx::query(
            "SELECT seq, at, change FROM timer_history \
             WHERE tenant_id = $1 AND service_call_id = $2 AND seq > $3 ORDER BY seq LIMIT $4",
        )
        .bind(key.tenant_id.as_str())
        .bind(key.service_call_id.as_str())
        .bind(i64::try_from(after).unwrap_or(i64::MAX))
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(self.pool)
        .await
        .map_err(err)?;
        rows.iter()
            .map(|row| {
                let seq: i64 = row.try_get(0).map_err(err)?;
                let at: i64 = row.try_get(1).map_err(err)?;
                let change: String = row.try_get(2).map_err(err)?;
                Ok(HistoryEntry {
                    seq: u64::try_from(seq).unwrap_or(0),
                    at: Timestamp::from_millis(at),
                    change: Change::from_json(&change)?,
                })
            })
            .collect()
    }

    /// [`TimerHistory::record`](timer_core::TimerHistory::record).
    pub(crate) async fn record(
        &self,
        key: &TimerKey,
        at: Timestamp,
        change: &Change,
        history: usize,
    ) -> Result<bool> {
        let err = |e| db_err::<D>("recording a timer's history", e);
        let mut tx = begin_write::<D>(self.pool).await.map_err(err)?;
        let seq: Option<i64> = sqlx::query_scalar(
            "UPDATE timers SET history_seq = history_seq + 1 \
             WHERE tenant_id = $1 AND service_call_id = $2 RETURNING history_seq",
        )
        .bind(key.tenant_id.as_str())
        .bind(key.service_call_id.as_str())
        .fetch_optional(&mut *tx)
        .await
        .map_err(err)?;
        let Some(seq) = seq else {
            return Ok(false);
        };
        let entries = numbered(key, seq, std::slice::from_ref(change));
        record_all::<D>(&mut *tx, &entries, at, history)
        .await
        .map_err(err)?;
        tx.commit().await.map_err(err)?;
        Ok(true)
    }
}
