//! What the two sqlx stores (`sqlite`, `postgres`) share. Both keep timers in one `timers` table
//! with the same columns (`migrations/`), so decoding a row, mapping errors, and the statements
//! that are the same SQL in both dialects live here once; each store's [`Dialect`] says how it
//! differs. Shared statements number their parameters `$1`, `$2`, …, which SQLite takes too (but
//! in a many-row insert: [`Dialect::placeholder`]).
//!
//! Here: the [`Dialect`], error mapping, write transactions and the history a write records;
//! `row.rs` decodes a row, `reads.rs`, `writes.rs` and `control.rs` hold the [`Statements`], and
//! `abilities.rs` the stores' control, history and query abilities built on them.

/// `impl Statements { … }` for every dialect whose database binds and reads what the
/// statements do: the bounds written once for the files that add statements (`reads`, `writes`,
/// `control`).
macro_rules! statements {
    ($($body:tt)*) => {
        impl<D> $crate::sql::Statements<'_, D>
        where
            D: $crate::sql::Dialect,
            for<'c> &'c mut <D::Db as sqlx::Database>::Connection:
                sqlx::Executor<'c, Database = D::Db>,
            for<'q> <D::Db as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, D::Db>,
            for<'q> &'q str: sqlx::Encode<'q, D::Db> + sqlx::Type<D::Db>,
            for<'q> i64: sqlx::Encode<'q, D::Db> + sqlx::Decode<'q, D::Db> + sqlx::Type<D::Db>,
            for<'q> Option<i64>: sqlx::Encode<'q, D::Db>,
            for<'q> String: sqlx::Encode<'q, D::Db>,
            for<'q> Option<String>: sqlx::Encode<'q, D::Db>,
            for<'r> String: sqlx::Decode<'r, D::Db> + sqlx::Type<D::Db>,
            for<'r> Vec<u8>: sqlx::Decode<'r, D::Db> + sqlx::Type<D::Db>,
            for<'r> bool: sqlx::Decode<'r, D::Db> + sqlx::Type<D::Db>,
            &'static str: sqlx::ColumnIndex<<D::Db as sqlx::Database>::Row>,
            usize: sqlx::ColumnIndex<<D::Db as sqlx::Database>::Row>,
        {
            $($body)*
        }
    };
}

mod abilities;
mod control;
pub(crate) mod migrations;
mod reads;
mod row;
mod writes;

use sqlx::{Database, Decode, Encode, Executor, IntoArguments, Pool, Type};
use timer_core::{Change, Error, ErrorKind, TimerKey, Timestamp};

pub(crate) use abilities::{sql_abilities, sql_fair_steps, SqlAbilities};
pub(crate) use row::TimerRow;
pub(crate) use writes::settle_step;

/// How a sqlx store differs where the code is otherwise shared.
pub(crate) trait Dialect {
    type Db: Database + sqlx::database::HasStatementCache;
    /// The Rust type the `state` column decodes as.
    type State: Into<i64> + for<'r> Decode<'r, Self::Db> + Type<Self::Db>;
    /// The Rust type the counters (`attempts`, `occurrences`) decode as.
    type Count: Into<i64> + for<'r> Decode<'r, Self::Db> + Type<Self::Db>;
    /// `sqlite`, `postgres`: how messages name the store.
    const NAME: &'static str;
    /// `claim_due` in one atomic statement: leases the rows a [`Due`](timer_core::Due) takes,
    /// earliest `available_at` first, and returns them with the columns of
    /// [`TimerRow::claimed`]. Parameters: 1 the lease owner, 2 the lease end (also their
    /// `available_at`), 3 now, 4 the limit, 5 the end of the window ahead.
    const CLAIM: &'static str;
    /// What ends the `SELECT` of a row a control action is about to change: a row lock where
    /// the database needs one to order the action and a concurrent claim (PostgreSQL: ` FOR
    /// UPDATE`; SQLite's write transaction already excludes every other writer).
    const LOCK_ROW: &'static str;
    /// Where rows are locked ([`Self::LOCK_ROW`]): a subquery of the keys of parameter 1,
    /// `[{"t": tenant, "i": id}, ...]`, as `(tenant_id, service_call_id)` rows, with which a
    /// control action reads its rows first without a lock. A row the action leaves as it is
    /// (one being fired, one already paused) is then answered without its lock: locking it held
    /// up its settle, which every tenant's fires write together, until the action's page
    /// committed. `None`: the action's transaction excludes every other writer anyway.
    const KEYS_OF_JSON: Option<&'static str>;
    /// `purge`: deletes finished rows (and their history, unless [`Self::PURGE_HISTORY`]
    /// does); a row for each timer deleted, with its `tenant_id` and `service_call_id` when
    /// `PURGE_HISTORY` needs them. Parameters: 1 finished before, 2 the limit.
    const PURGE: &'static str;
    /// The history of what `PURGE` deleted, in a statement of its own in the same transaction
    /// (its snapshot then sees the history a transaction that committed while `PURGE` ran
    /// wrote); parameter 1 the deleted keys as JSON, `[{"t": tenant, "i": id}, ...]`. `None`:
    /// `PURGE` deletes it (SQLite: a foreign key cascades).
    const PURGE_HISTORY: Option<&'static str>;
    /// The first statement of a transaction that reads and then writes, if the database needs
    /// one to take its write lock up front. SQLite: a write that changes nothing, so the
    /// transaction waits `store.busy_timeout` for another process's write lock; a transaction
    /// whose first statement reads fails at once when it then tries to write. (Not `BEGIN
    /// IMMEDIATE`: sqlx refuses a custom BEGIN while it still counts a transaction open, as it
    /// does after a failed commit, e.g. on a full disk.)
    const LOCK_FOR_WRITE: Option<&'static str>;

    /// Whether an error that is not a decoding error may pass when tried again.
    fn retryable(e: &sqlx::Error) -> bool;

    /// The placeholder of parameter `n` (from 1) in a statement that binds each parameter once,
    /// in order (a multi-row `VALUES`): `$n` on PostgreSQL, `?` on SQLite. SQLite finds a
    /// numbered parameter's name by a scan of all the numbered ones, so binding thousands of them
    /// takes time quadratic in their number (it was a quarter of a SQLite herd's CPU).
    fn placeholder(n: usize) -> String;
}

/// The columns of `timers` that make a [`Timer`](timer_core::Timer) (the revision too, which a
/// claim reads with the same columns).
pub(crate) const TIMER_COLUMNS: &str = "tenant_id, service_call_id, due_at, state, \
    registered_at, reached_at, correlation_id, payload, attempts, last_error, lease_owner, \
    available_at, recurrence, occurrences, revision, policy, work, target, message, message_meta, \
    traceparent, tracestate";

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

/// Rows per multi-row statement; a history row has 5 parameters, a new timer on SQLite 9:
/// both stay far below SQLite's 32,766.
pub(crate) const ROWS_PER_STATEMENT: usize = 1_000;

/// A history entry a write transaction makes: number `seq` of timer `key`.
pub(crate) struct Entry<'a> {
    pub key: &'a TimerKey,
    pub seq: i64,
    pub change: Change,
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
        let rows: Vec<String> = (0..chunk.len())
            .map(|i| {
                let p = |k: usize| D::placeholder(5 * i + k);
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

/// The statements that are the same SQL in both dialects, run on one pool.
pub(crate) struct Statements<'p, D: Dialect> {
    pool: &'p Pool<D::Db>,
}

pub(crate) fn on<D: Dialect>(pool: &Pool<D::Db>) -> Statements<'_, D> {
    Statements { pool }
}
