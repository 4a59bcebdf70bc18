//! What the two sqlx stores (`sqlite`, `postgres`) share. Both keep timers in one `timers` table
//! with the same columns (`migrations/`), so decoding a row, mapping errors, and the statements
//! that are the same SQL in both dialects live here once; each store's [`Dialect`] says how it
//! differs. Shared statements number their parameters `$1`, `$2`, …, which SQLite takes too.

use std::marker::PhantomData;

use sqlx::{ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Pool, Row, Type};
use timer_core::control::transition;
use timer_core::policy::{Policy, Work};
use timer_core::store::Step;
use timer_core::{
    Action, Change, ClaimedTimer, ControlOutcome, Error, ErrorKind, HistoryEntry, Lease, PageAfter,
    Recurrence, Result, TenantSummary, Timer, TimerFilter, TimerKey, TimerState, Timestamp,
};

/// How a sqlx store differs where the code is otherwise shared.
pub(crate) trait Dialect {
    type Db: Database;
    /// The Rust type the `state` column decodes as.
    type State: Into<i64> + for<'r> Decode<'r, Self::Db> + Type<Self::Db>;
    /// The Rust type the counters (`attempts`, `occurrences`) decode as.
    type Count: Into<i64> + for<'r> Decode<'r, Self::Db> + Type<Self::Db>;
    /// `sqlite`, `postgres`: how messages name the store.
    const NAME: &'static str;
    /// `claim_due` in one atomic statement: leases the claimable rows, earliest `available_at`
    /// first, and returns them with the columns of [`TimerRow::claimed`]. Parameters: 1 the
    /// lease owner, 2 the lease end (also their `available_at`), 3 now, 4 the limit.
    const CLAIM: &'static str;
    /// What ends the `SELECT` of a row a control action is about to change: a row lock where
    /// the database needs one to order the action and a concurrent claim (PostgreSQL: ` FOR
    /// UPDATE`; SQLite's write transaction already excludes every other writer).
    const LOCK_ROW: &'static str;
    /// `purge`: deletes finished rows and their history; a row for each timer deleted.
    /// Parameters: 1 finished before, 2 the limit.
    const PURGE: &'static str;
    /// The first statement of a transaction that reads and then writes, if the database needs
    /// one to take its write lock up front. SQLite: a write that changes nothing, so the
    /// transaction waits `store.busy_timeout` for another process's write lock; a transaction
    /// whose first statement reads fails at once when it then tries to write. (Not `BEGIN
    /// IMMEDIATE`: sqlx refuses a custom BEGIN while it still counts a transaction open, as it
    /// does after a failed commit, e.g. on a full disk.)
    const LOCK_FOR_WRITE: Option<&'static str>;

    /// Whether an error that is not a decoding error may pass when tried again.
    fn retryable(e: &sqlx::Error) -> bool;
}

/// The columns of `timers` that make a [`Timer`] (the revision too, which a claim reads with the
/// same columns).
pub(crate) const TIMER_COLUMNS: &str = "tenant_id, service_call_id, due_at, state, \
    registered_at, reached_at, correlation_id, payload, attempts, last_error, lease_owner, \
    available_at, recurrence, occurrences, revision, policy, work";

/// A failed database operation `op`, with the sqlx error as its source. Decoding errors are a
/// bug or a foreign schema and will not pass when retried; the dialect judges the others.
pub(crate) fn db_err<D: Dialect>(op: &str, e: sqlx::Error) -> Error {
    let decoding = matches!(
        e,
        sqlx::Error::ColumnDecode { .. } | sqlx::Error::ColumnNotFound(_) | sqlx::Error::Decode(_)
    );
    let kind = if !decoding && D::retryable(&e) {
        ErrorKind::Unavailable
    } else {
        ErrorKind::Internal
    };
    Error::new(kind, format!("{} store: {op} failed", D::NAME)).with_source(e)
}

/// A counter as stored, clamped into `u32` (a negative one reads as 0).
fn count(n: i64) -> u32 {
    u32::try_from(n.max(0)).unwrap_or(u32::MAX)
}

/// One row of `timers`, decoded with the dialect's column types.
pub(crate) struct TimerRow<'r, D: Dialect> {
    row: &'r <D::Db as Database>::Row,
    dialect: PhantomData<D>,
}

impl<'r, D> TimerRow<'r, D>
where
    D: Dialect,
    &'static str: ColumnIndex<<D::Db as Database>::Row>,
    i64: Decode<'r, D::Db> + Type<D::Db>,
    String: Decode<'r, D::Db> + Type<D::Db>,
{
    pub(crate) fn of(row: &'r <D::Db as Database>::Row) -> Self {
        TimerRow {
            row,
            dialect: PhantomData,
        }
    }

    fn get<T: Decode<'r, D::Db> + Type<D::Db>>(&self, column: &'static str) -> Result<T> {
        self.row
            .try_get(column)
            .map_err(|e| db_err::<D>("reading a timer", e))
    }

    fn time(&self, column: &'static str) -> Result<Timestamp> {
        self.get(column).map(Timestamp::from_millis)
    }

    fn count(&self, column: &'static str) -> Result<u32> {
        Ok(count(self.get::<D::Count>(column)?.into()))
    }

    pub(crate) fn key(&self) -> Result<TimerKey> {
        Ok(TimerKey {
            tenant_id: self.get("tenant_id")?,
            service_call_id: self.get("service_call_id")?,
        })
    }

    fn recurrence(&self) -> Result<Option<Recurrence>> {
        self.get::<Option<String>>("recurrence")?
            .as_deref()
            .map(Recurrence::from_json)
            .transpose()
    }

    fn policy(&self) -> Result<Option<Policy>> {
        self.get::<Option<String>>("policy")?
            .as_deref()
            .map(Policy::from_json)
            .transpose()
    }

    fn work(&self) -> Result<Option<Work>> {
        self.get::<Option<String>>("work")?
            .as_deref()
            .map(Work::from_json)
            .transpose()
    }

    /// The `state` column.
    fn state(&self) -> Result<TimerState> {
        let code: i64 = self.get::<D::State>("state")?.into();
        TimerState::from_code(code)
            .ok_or_else(|| Error::internal(format!("{} store: unknown state code {code}", D::NAME)))
    }

    /// A row a claim returned.
    pub(crate) fn claimed(&self) -> Result<ClaimedTimer> {
        Ok(ClaimedTimer {
            key: self.key()?,
            due_at: self.time("due_at")?,
            registered_at: self.time("registered_at")?,
            correlation_id: self.get("correlation_id")?,
            payload: self.get("payload")?,
            attempts: self.count("attempts")?,
            revision: self.get("revision")?,
            recurrence: self.recurrence()?,
            occurrences: self.count("occurrences")?,
            policy: self.policy()?,
            work: self.work()?,
        })
    }

    /// A row of [`TIMER_COLUMNS`]: what a claim returns, with the state, the last fire and the
    /// lease besides.
    pub(crate) fn timer(&self) -> Result<Timer> {
        let ClaimedTimer {
            key,
            due_at,
            registered_at,
            correlation_id,
            payload,
            attempts,
            revision: _,
            recurrence,
            occurrences,
            policy,
            work,
        } = self.claimed()?;
        Ok(Timer {
            key,
            due_at,
            state: self.state()?,
            registered_at,
            reached_at: self
                .get::<Option<i64>>("reached_at")?
                .map(Timestamp::from_millis),
            correlation_id,
            payload,
            attempts,
            last_error: self.get("last_error")?,
            lease_owner: self.get("lease_owner")?,
            available_at: self.time("available_at")?,
            recurrence,
            occurrences,
            policy,
            work,
        })
    }
}

/// A transaction that will write, holding the write lock from its start where the dialect needs
/// that ([`Dialect::LOCK_FOR_WRITE`]).
pub(crate) async fn begin_write<D>(
    pool: &Pool<D::Db>,
) -> std::result::Result<sqlx::Transaction<'static, D::Db>, sqlx::Error>
where
    D: Dialect,
    for<'c> &'c mut <D::Db as Database>::Connection: Executor<'c, Database = D::Db>,
    for<'q> <D::Db as Database>::Arguments<'q>: IntoArguments<'q, D::Db>,
{
    let mut tx = pool.begin().await?;
    if let Some(lock) = D::LOCK_FOR_WRITE {
        sqlx::query(lock).execute(&mut *tx).await?;
    }
    Ok(tx)
}

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

/// Rows per multi-row statement; a history row has 5 parameters, a new timer on SQLite 9:
/// both stay far below SQLite's 32,766.
pub(crate) const ROWS_PER_STATEMENT: usize = 1_000;

/// A history entry a write transaction makes: number `seq` of timer `key`.
pub(crate) struct Entry<'a> {
    pub key: &'a TimerKey,
    pub seq: i64,
    pub change: Change,
}

/// Writes `changes` as the history entries of `key` numbered up to `last` (the row's
/// `history_seq` after the change), then drops its entries beyond the newest `limit`. Nothing
/// when `limit` is 0.
pub(crate) async fn record<D>(
    conn: &mut <D::Db as Database>::Connection,
    key: &TimerKey,
    last: i64,
    at: Timestamp,
    changes: &[Change],
    limit: usize,
) -> std::result::Result<(), sqlx::Error>
where
    D: Dialect,
    for<'c> &'c mut <D::Db as Database>::Connection: Executor<'c, Database = D::Db>,
    for<'q> <D::Db as Database>::Arguments<'q>: IntoArguments<'q, D::Db>,
    for<'q> &'q str: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> String: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> i64: Encode<'q, D::Db> + Type<D::Db>,
{
    record_all::<D>(conn, &numbered(key, last, changes), at, limit).await
}

/// `changes` as the history entries of `key` numbered up to `last` (the row's `history_seq`
/// after the change).
pub(crate) fn numbered<'a>(key: &'a TimerKey, last: i64, changes: &[Change]) -> Vec<Entry<'a>> {
    let first = last - i64::try_from(changes.len()).unwrap_or(0) + 1;
    (first..)
        .zip(changes)
        .map(|(seq, change)| Entry {
            key,
            seq,
            change: change.clone(),
        })
        .collect()
}

/// Writes the history `entries`, all at `at`, with one statement per [`ROWS_PER_STATEMENT`],
/// then drops each timer's entries beyond the newest `limit`. Nothing when `limit` is 0.
pub(crate) async fn record_all<D>(
    conn: &mut <D::Db as Database>::Connection,
    entries: &[Entry<'_>],
    at: Timestamp,
    limit: usize,
) -> std::result::Result<(), sqlx::Error>
where
    D: Dialect,
    for<'c> &'c mut <D::Db as Database>::Connection: Executor<'c, Database = D::Db>,
    for<'q> <D::Db as Database>::Arguments<'q>: IntoArguments<'q, D::Db>,
    for<'q> &'q str: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> String: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> i64: Encode<'q, D::Db> + Type<D::Db>,
{
    if limit == 0 || entries.is_empty() {
        return Ok(());
    }
    for chunk in entries.chunks(ROWS_PER_STATEMENT) {
        // `($1, $2, $3, $4, $5), ($6, …)`: the same placeholders in both dialects.
        let rows: Vec<String> = (0..chunk.len())
            .map(|i| {
                let p = |k: usize| format!("${}", 5 * i + k);
                format!("({}, {}, {}, {}, {})", p(1), p(2), p(3), p(4), p(5))
            })
            .collect();
        let sql = format!(
            "INSERT INTO timer_history (tenant_id, service_call_id, seq, at, change) VALUES {}",
            rows.join(", ")
        );
        let mut insert = sqlx::query(&sql);
        for e in chunk {
            insert = insert
                .bind(e.key.tenant_id.as_str())
                .bind(e.key.service_call_id.as_str())
                .bind(e.seq)
                .bind(at.as_millis())
                .bind(e.change.to_json());
        }
        insert.execute(&mut *conn).await?;
    }
    for e in entries {
        trim::<D>(conn, e.key, e.seq, limit).await?;
    }
    Ok(())
}

/// Drops the history entries of `key` beyond the newest `limit`, `last` being its newest.
pub(crate) async fn trim<D>(
    conn: &mut <D::Db as Database>::Connection,
    key: &TimerKey,
    last: i64,
    limit: usize,
) -> std::result::Result<(), sqlx::Error>
where
    D: Dialect,
    for<'c> &'c mut <D::Db as Database>::Connection: Executor<'c, Database = D::Db>,
    for<'q> <D::Db as Database>::Arguments<'q>: IntoArguments<'q, D::Db>,
    for<'q> &'q str: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> i64: Encode<'q, D::Db> + Type<D::Db>,
{
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    if last > limit {
        sqlx::query(
            "DELETE FROM timer_history WHERE tenant_id = $1 AND service_call_id = $2 AND seq <= $3",
        )
        .bind(key.tenant_id.as_str())
        .bind(key.service_call_id.as_str())
        .bind(last - limit)
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

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

/// The statements that are the same SQL in both dialects, run on one pool.
pub(crate) struct Statements<'p, D: Dialect> {
    pool: &'p Pool<D::Db>,
}

pub(crate) fn on<D: Dialect>(pool: &Pool<D::Db>) -> Statements<'_, D> {
    Statements { pool }
}

impl<D> Statements<'_, D>
where
    D: Dialect,
    for<'c> &'c mut <D::Db as Database>::Connection: Executor<'c, Database = D::Db>,
    for<'q> <D::Db as Database>::Arguments<'q>: IntoArguments<'q, D::Db>,
    for<'q> &'q str: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> i64: Encode<'q, D::Db> + Decode<'q, D::Db> + Type<D::Db>,
    for<'q> Option<i64>: Encode<'q, D::Db>,
    for<'q> String: Encode<'q, D::Db>,
    for<'q> Option<String>: Encode<'q, D::Db>,
    for<'r> String: Decode<'r, D::Db> + Type<D::Db>,
    for<'r> bool: Decode<'r, D::Db> + Type<D::Db>,
    &'static str: ColumnIndex<<D::Db as Database>::Row>,
    usize: ColumnIndex<<D::Db as Database>::Row>,
{
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

    pub(crate) async fn claim(
        &self,
        now: Timestamp,
        limit: usize,
        lease: &Lease,
    ) -> Result<Vec<ClaimedTimer>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(D::CLAIM)
            .bind(lease.owner.as_str())
            .bind(lease.until.as_millis())
            .bind(now.as_millis())
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(self.pool)
            .await
            .map_err(|e| db_err::<D>("claiming due timers", e))?;
        let mut claimed = rows
            .iter()
            .map(|row| TimerRow::<D>::of(row).claimed())
            .collect::<Result<Vec<_>>>()?;
        claimed.sort_by(|a, b| a.due_at.cmp(&b.due_at).then_with(|| a.key.cmp(&b.key)));
        Ok(claimed)
    }

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
        let mut outcomes = Vec::with_capacity(keys.len());
        for key in keys {
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
                   due_at = $4, available_at = $4, finished_at = $5, \
                   reached_at = CASE WHEN $3 = 1 THEN $5 ELSE reached_at END, \
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
            record::<D>(&mut *tx, key, seq, now, &write.changes, history)
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
        record::<D>(
            &mut *tx,
            key,
            seq,
            at,
            std::slice::from_ref(change),
            history,
        )
        .await
        .map_err(err)?;
        tx.commit().await.map_err(err)?;
        Ok(true)
    }

    pub(crate) async fn purge(&self, older_than: Timestamp, limit: usize) -> Result<u64> {
        let gone = sqlx::query(D::PURGE)
            .bind(older_than.as_millis())
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(self.pool)
            .await
            .map_err(|e| db_err::<D>("purging finished timers", e))?;
        Ok(gone.len() as u64)
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

    /// [`TimerQueries::list`](timer_core::TimerQueries::list): one statement on the index
    /// `(tenant_id, due_at, service_call_id)`, starting after the last row of the page before.
    pub(crate) async fn list(
        &self,
        tenant: &str,
        filter: &TimerFilter,
        after: Option<&PageAfter>,
        limit: usize,
    ) -> Result<Vec<Timer>> {
        enum Arg {
            Text(String),
            Int(i64),
        }
        let mut args = vec![Arg::Text(tenant.to_owned())];
        let mut sql = format!("SELECT {TIMER_COLUMNS} FROM timers WHERE tenant_id = $1");
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
        let rows = query
            .fetch_all(self.pool)
            .await
            .map_err(|e| db_err::<D>("listing timers", e))?;
        rows.iter()
            .map(|row| TimerRow::<D>::of(row).timer())
            .collect()
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
