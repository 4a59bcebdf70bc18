//! The settle statements: each kind of settlement over all of its claims in one statement, the
//! claims passed as one JSON array read by `json_each`. A batch is then a few statements, not
//! one per claim: each statement is a round trip to the connection's thread, which cost a fired
//! batch of 500 more time than the updates themselves. Steps (`Settlement::Step`) are spelled
//! out by the engine and run one by one ([`sql::settle_step`]).

use std::collections::HashMap;

use serde_json::{json, Value};
use sqlx::sqlite::SqliteConnection;
use timer_core::{Change, ClaimedTimer, Settlement, TimerKey, Timestamp};

use crate::sql::{self, Entry};

/// A settlement of the claims in ?1, a JSON array of `[tenant, service call id, claimed
/// revision, arg, arg2]` (`arg` and `arg2` as the kind needs them); ?2 the settle time, ?3 the
/// lease owner. Only rows still Scheduled and leased by the owner change, at the claimed
/// revision (or, with a guard of its own, [`RETURN_LEASE`] at another); each answers its key
/// and the number of the history entry it makes. The claims' columns are named apart from the table's, so that an unqualified
/// name in `SET` is always the table's old value.
macro_rules! settle_sql {
    ($set:literal) => {
        settle_sql!($set, " AND timers.revision = c.claimed_revision")
    };
    ($set:literal, $guard:literal) => {
        concat!(
            "UPDATE timers SET ",
            $set,
            " FROM (SELECT value ->> 0 AS key_tenant, value ->> 1 AS key_call, \
                           value ->> 2 AS claimed_revision, value ->> 3 AS arg, \
                           value ->> 4 AS arg2 \
                    FROM json_each(?1)) AS c \
             WHERE timers.tenant_id = c.key_tenant AND timers.service_call_id = c.key_call \
               AND timers.state = 0 AND timers.lease_owner = ?3",
            $guard,
            " RETURNING tenant_id, service_call_id, history_seq"
        )
    };
}

/// Reached and Failed end the lease (a completion must not meet a `firing` timer after its
/// fire settled); `lease_owner` stays, naming the instance that settled it.
const REACHED: &str = settle_sql!(
    "state = 1, reached_at = ?2, finished_at = ?2, lease_until = NULL, \
     occurrences = occurrences + (recurrence IS NOT NULL), history_seq = history_seq + 1"
);

/// `arg` the next occurrence.
const NEXT: &str = settle_sql!(
    "due_at = c.arg, available_at = c.arg, revision = revision + 1, attempts = 0, \
     last_error = NULL, lease_owner = NULL, lease_until = NULL, reached_at = ?2, \
     occurrences = occurrences + 1, history_seq = history_seq + 1"
);

/// `arg` the error.
const FAILED: &str = settle_sql!(
    "state = 3, finished_at = ?2, attempts = attempts + 1, last_error = c.arg, \
     lease_until = NULL, history_seq = history_seq + 1"
);

/// `arg` when it becomes claimable, `arg2` the error or null (a failed publish, recorded in
/// the history).
const RETRY: &str = settle_sql!(
    "lease_owner = NULL, lease_until = NULL, available_at = MAX(c.arg, due_at), \
     attempts = attempts + (c.arg2 IS NOT NULL), last_error = COALESCE(c.arg2, last_error), \
     history_seq = history_seq + (c.arg2 IS NOT NULL)"
);

/// A retry's claims at another revision (rescheduled while they fired): the lease goes back,
/// and nothing of the old fire (its backoff, error, attempt) touches the new timer.
const RETURN_LEASE: &str = settle_sql!(
    "lease_owner = NULL, lease_until = NULL, available_at = due_at",
    " AND timers.revision <> c.claimed_revision"
);

/// Settles `claims` in the open write transaction `tx`: the steps one by one, then each kind
/// of settlement in one statement. Returns how many rows changed and adds the history entries
/// of the changes to `entries`.
pub(super) async fn settle<'c>(
    tx: &mut SqliteConnection,
    claims: &'c [(ClaimedTimer, Settlement)],
    owner: &str,
    at: Timestamp,
    entries: &mut Vec<Entry<'c>>,
) -> std::result::Result<u64, sqlx::Error> {
    let mut changed = 0;
    // The rows of each statement, and which claims they are (a retry's go to two: the rows at
    // the claimed revision, and the others).
    let mut kinds: [(&str, Vec<Value>, Vec<usize>); 5] = [
        (REACHED, Vec::new(), Vec::new()),
        (NEXT, Vec::new(), Vec::new()),
        (FAILED, Vec::new(), Vec::new()),
        (RETRY, Vec::new(), Vec::new()),
        (RETURN_LEASE, Vec::new(), Vec::new()),
    ];
    for (i, (t, settlement)) in claims.iter().enumerate() {
        let (tenant, call, revision) = (&t.key.tenant_id, &t.key.service_call_id, t.revision);
        let (kind, row) = match settlement {
            Settlement::Step(step) => {
                if let Some(seq) = sql::settle_step::<super::SqliteStore>(tx, t, step, owner, at)
                    .await?
                {
                    changed += 1;
                    entries.extend(sql::numbered(&t.key, seq, &step.changes));
                }
                continue;
            }
            Settlement::Reached => (0, json!([tenant, call, revision])),
            Settlement::Next(next) => (1, json!([tenant, call, revision, next.as_millis()])),
            Settlement::Failed(error) => (2, json!([tenant, call, revision, error])),
            Settlement::Retry { at, error } => {
                (3, json!([tenant, call, revision, at.as_millis(), error]))
            }
        };
        if kind == 3 {
            kinds[4].1.push(row.clone());
            kinds[4].2.push(i);
        }
        kinds[kind].1.push(row);
        kinds[kind].2.push(i);
    }
    for (sql, rows, of) in kinds {
        if rows.is_empty() {
            continue;
        }
        let settled: Vec<(String, String, i64)> = sqlx::query_as(sql)
            .bind(Value::Array(rows).to_string())
            .bind(at.as_millis())
            .bind(owner)
            .fetch_all(&mut *tx)
            .await?;
        changed += settled.len() as u64;
        if sql == RETURN_LEASE {
            continue; // nothing recorded: the history is the new timer's
        }
        // A key given twice changes once, by one of its rows (SQLite does not say which); its
        // history entry is the first's.
        let claimed: HashMap<&TimerKey, usize> =
            of.iter().rev().map(|&i| (&claims[i].0.key, i)).collect();
        for (tenant_id, service_call_id, seq) in settled {
            let key = TimerKey::new(tenant_id, service_call_id);
            let Some(&i) = claimed.get(&key) else {
                continue; // not one of these claims: cannot be, the join is on the key
            };
            let (t, settlement) = &claims[i];
            if let Some(change) = Change::of_settlement(t, settlement, owner, at) {
                entries.push(Entry {
                    key: &t.key,
                    seq,
                    change,
                });
            }
        }
    }
    Ok(changed)
}
