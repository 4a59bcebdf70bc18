//! The settle statements: each kind of settlement over arrays of claims in one statement that
//! also records each row's history entry ([`settled`], [`recorded`]), and the [`Columns`] of
//! claims they bind.

use std::sync::OnceLock;

use sqlx::postgres::Postgres;
use timer_core::{ClaimedTimer, Timestamp};

type PgQuery<'q> = sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>;

/// A settlement over arrays of claims, all or none of them at once. Parameters: $1 tenants,
/// $2 service call ids, $3 claimed revisions, $4 the lease owner, $5 the settle time, then the
/// settlement's own arrays from $6 (`arrays`), named in `m` after the revision (`columns`).
/// Only rows still Scheduled, leased by the owner, at the claimed revision change.
macro_rules! settle_sql {
    ($set:literal, $arrays:literal, $columns:literal) => {
        concat!(
            "UPDATE timers t SET ",
            $set,
            ", history_seq = t.history_seq + 1",
            " FROM UNNEST($1::text[], $2::text[], $3::bigint[]",
            $arrays,
            ") AS m(tenant_id, service_call_id, revision",
            $columns,
            ") WHERE t.tenant_id = m.tenant_id AND t.service_call_id = m.service_call_id \
               AND t.state = 0 AND t.lease_owner = $4 AND t.revision = m.revision"
        )
    };
}

/// Reached and Failed end the lease (a completion must not meet a `firing` timer after its
/// fire settled); `lease_owner` stays, naming the instance that settled it.
pub(super) const SETTLE_REACHED_SQL: &str = settle_sql!(
    "state = 1, reached_at = $5, finished_at = $5, lease_until = NULL, \
     occurrences = t.occurrences + CASE WHEN t.recurrence IS NULL THEN 0 ELSE 1 END",
    "",
    ""
);

/// $6 the next occurrences.
pub(super) const SETTLE_NEXT_SQL: &str = settle_sql!(
    "due_at = m.next, available_at = m.next, revision = t.revision + 1, attempts = 0, \
     last_error = NULL, lease_owner = NULL, lease_until = NULL, reached_at = $5, \
     occurrences = t.occurrences + 1",
    ", $6::bigint[]",
    ", next"
);

/// $6 the errors.
pub(super) const SETTLE_FAILED_SQL: &str = settle_sql!(
    "state = 3, finished_at = $5, attempts = t.attempts + 1, last_error = m.error, \
     lease_until = NULL",
    ", $6::text[]",
    ", error"
);

/// $1 tenants, $2 service call ids, $3 when each becomes claimable, $4 the errors (NULL for
/// none; an error is a failed publish, recorded in the history), $5 the lease owner, $9 the
/// claimed revisions. At any revision the lease goes back; at another (rescheduled while it
/// fired) nothing else of the old fire (its backoff, error, attempt, history entry) touches
/// the new timer: each row answers `same`, whether it was at the claimed revision.
pub(super) const SETTLE_RETRY_SQL: &str =
    "UPDATE timers t SET lease_owner = NULL, lease_until = NULL, \
      available_at = CASE WHEN t.revision = m.revision \
                          THEN GREATEST(m.retry_at, t.due_at) ELSE t.due_at END, \
      attempts = t.attempts + CASE WHEN m.error IS NULL OR t.revision <> m.revision \
                                   THEN 0 ELSE 1 END, \
      last_error = CASE WHEN t.revision = m.revision \
                        THEN COALESCE(m.error, t.last_error) ELSE t.last_error END, \
      history_seq = t.history_seq + CASE WHEN m.error IS NULL OR t.revision <> m.revision \
                                         THEN 0 ELSE 1 END \
    FROM UNNEST($1::text[], $2::text[], $3::bigint[], $4::text[], $9::bigint[]) \
         AS m(tenant_id, service_call_id, retry_at, error, revision) \
    WHERE t.tenant_id = m.tenant_id AND t.service_call_id = m.service_call_id \
      AND t.state = 0 AND t.lease_owner = $5";

/// [`SETTLE_RETRY_SQL`] recording its changes ($6, JSON, in the order of the keys; at $7, the
/// history limit $8) for the rows at the claimed revision only.
pub(super) fn settle_retry() -> String {
    recorded(
        SETTLE_RETRY_SQL,
        ", (t.revision = m.revision) AS same",
        "UNNEST($1::text[], $2::text[], $6::text[]) AS c(tenant_id, service_call_id, change)",
        "CASE WHEN s.same THEN c.change END",
        (7, 8),
        "SELECT COUNT(*) FROM s",
    )
}

/// The settlements as they run: each recording its changes and counting its rows
/// ([`settled`]), made once.
pub(super) static SETTLE_REACHED: OnceLock<String> = OnceLock::new();
pub(super) static SETTLE_NEXT: OnceLock<String> = OnceLock::new();
pub(super) static SETTLE_FAILED: OnceLock<String> = OnceLock::new();
pub(super) static SETTLE_RETRY: OnceLock<String> = OnceLock::new();

/// A settlement statement (its first two parameters are the keys) as one statement that also
/// records each settled row's change and answers how many rows it settled. `(changes, at,
/// limit)` number the parameters of the changes (JSON, NULL for none; in the order of the
/// keys), the settle time and the history limit.
pub(super) fn settled(update: &str, (changes, at, limit): (usize, usize, usize)) -> String {
    recorded(
        update,
        "",
        &format!(
            "UNNEST($1::text[], $2::text[], ${changes}::text[]) \
             AS c(tenant_id, service_call_id, change)"
        ),
        "c.change",
        (at, limit),
        "SELECT COUNT(*) FROM s",
    )
}

/// `write` (an INSERT or UPDATE of `timers AS t`, without RETURNING) as one statement that
/// also records a history entry for each row it wrote and drops that row's entries beyond the
/// newest `$limit` (none are recorded, and none dropped, when it is 0). The written rows are `s` (key,
/// `history_seq`, and `returning`); `changes` is a relation `c` with the key columns, joined to
/// them, and `change` the SQL of each row's change (JSON text; NULL records none); `at` and
/// `limit` are the numbers of the parameters holding the time and the limit; `select` what the
/// whole statement answers (from `s`).
pub(super) fn recorded(
    write: &str,
    returning: &str,
    changes: &str,
    change: &str,
    (at, limit): (usize, usize),
    select: &str,
) -> String {
    format!(
        "WITH s AS ({write} RETURNING t.tenant_id, t.service_call_id, t.history_seq{returning}), \
         h AS (INSERT INTO timer_history (tenant_id, service_call_id, seq, at, change) \
               SELECT s.tenant_id, s.service_call_id, s.history_seq, ${at}, {change} \
               FROM s JOIN {changes} USING (tenant_id, service_call_id) \
               WHERE {change} IS NOT NULL AND ${limit} > 0), \
         d AS (DELETE FROM timer_history x USING s \
               WHERE ${limit} > 0 AND s.history_seq > ${limit} AND x.tenant_id = s.tenant_id \
                 AND x.service_call_id = s.service_call_id \
                 AND x.seq <= s.history_seq - ${limit}) \
         {select}"
    )
}

/// Keys and claimed revisions of some claims, as the arrays an `UNNEST` reads.
pub(super) struct Columns<'a> {
    pub(super) tenants: Vec<&'a str>,
    pub(super) ids: Vec<&'a str>,
    pub(super) revisions: Vec<i64>,
}

impl<'a> Columns<'a> {
    fn of(claims: impl Iterator<Item = &'a ClaimedTimer>) -> Self {
        let mut columns = Columns {
            tenants: Vec::new(),
            ids: Vec::new(),
            revisions: Vec::new(),
        };
        for t in claims {
            columns.tenants.push(t.key.tenant_id.as_str());
            columns.ids.push(t.key.service_call_id.as_str());
            columns.revisions.push(t.revision);
        }
        columns
    }

    /// The columns of the claims in `pairs`, and what goes with each, in the same order.
    pub(super) fn split<T>(pairs: Vec<(&'a ClaimedTimer, T)>) -> (Self, Vec<T>) {
        let (claims, rest): (Vec<&ClaimedTimer>, Vec<T>) = pairs.into_iter().unzip();
        (Columns::of(claims.into_iter()), rest)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.tenants.is_empty()
    }

    /// `sql` (of [`settle_sql!`]) with these claims, the lease owner and the settle time bound
    /// as its first parameters.
    pub(super) fn bind<'q>(&'q self, sql: &'q str, owner: &'q str, at: Timestamp) -> PgQuery<'q> {
        sqlx::query(sql)
            .bind(&self.tenants)
            .bind(&self.ids)
            .bind(&self.revisions)
            .bind(owner)
            .bind(at.as_millis())
    }
}
