//! The PostgreSQL store against a server, where other transactions run beside it (the
//! conformance suite covers what every store does alone).

use sqlx::PgPool;
use timer_core::{Store, Timestamp};

use super::migrate::server_tests::{drop_schema, fresh, server};
use super::PostgresStore;

/// A purge leaves a finished timer that another transaction holds (a completion of a Reached
/// timer writing its history, a retry): it deleted the row once that committed, but not the
/// history the other transaction added (its snapshot was older), which outlived its timer.
/// Such rows are purged by a later purge, with all their history.
#[tokio::test]
async fn a_purge_leaves_a_timer_another_transaction_holds() {
    let Some(url) = server() else { return };
    let (config, pool) = fresh(url).await;
    let schema = config.schema.clone();
    let store = PostgresStore::open(&config).await.expect("opens");
    // A Reached timer finished long ago, beside many live ones known to the planner (the
    // purge finds its rows by a nested loop into a TID scan, as on a real table).
    sqlx::query(
        "INSERT INTO timers (tenant_id, service_call_id, due_at, available_at, state, \
         registered_at, finished_at, history_seq) VALUES ('t', 'held', 0, 0, 1, 0, 0, 1)",
    )
    .execute(&pool)
    .await
    .expect("a finished timer");
    sqlx::query(
        "INSERT INTO timers (tenant_id, service_call_id, due_at, available_at, state, \
         registered_at) SELECT 't', 'live-' || g, 0, 0, 0, 0 FROM generate_series(1, 20000) g",
    )
    .execute(&pool)
    .await
    .expect("live timers");
    sqlx::query("ANALYZE timers")
        .execute(&pool)
        .await
        .expect("analyze");
    // A completion, as the control plane writes it: the row held, a history entry added.
    let (mut completion, holder) = holding(&pool, "held").await;
    sqlx::query(
        "INSERT INTO timer_history (tenant_id, service_call_id, seq, at, change) \
         VALUES ('t', 'held', 2, 1, '{}')",
    )
    .execute(&mut *completion)
    .await
    .expect("history");
    let store = std::sync::Arc::new(store);
    let purging = store.clone();
    let purge = tokio::spawn(async move {
        purging
            .purge(Timestamp::from_millis(10_000), 100)
            .await
    });
    // Until the purge is done, or waits for the completion's lock.
    blocked_by(&pool, holder, || purge.is_finished()).await;
    completion.commit().await.expect("the completion commits");
    let purged = purge.await.expect("no panic").expect("purged");
    assert_eq!(purged, 0, "the held timer is left for a later purge");
    let orphans = || async {
        let (n,): (i64,) = sqlx::query_as(
            "SELECT count(*) FROM timer_history h WHERE NOT EXISTS (SELECT 1 FROM timers t \
             WHERE t.tenant_id = h.tenant_id AND t.service_call_id = h.service_call_id)",
        )
        .fetch_one(&pool)
        .await
        .expect("orphans");
        n
    };
    assert_eq!(orphans().await, 0, "no history outlives its timer");
    let purged = store
        .purge(Timestamp::from_millis(10_000), 100)
        .await
        .expect("purged");
    assert_eq!(purged, 1, "purged once nobody holds it");
    let (left,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM timer_history WHERE service_call_id = 'held'")
            .fetch_one(&pool)
            .await
            .expect("history");
    assert_eq!(left, 0, "its history with it");
    drop(store);
    drop_schema(&pool, &schema).await;
}

/// A control action reads its rows without a lock first: a row it leaves as it is (one being
/// fired) is not locked for the rest of its transaction, where its settle, which every
/// tenant's fires write together, would wait for it. Here a page's second row is held by
/// another transaction; while the page waits for it, its first row, being fired, can be locked.
#[tokio::test]
async fn a_control_action_locks_no_row_it_leaves_as_it_is() {
    let Some(url) = server() else { return };
    let (config, pool) = fresh(url).await;
    let schema = config.schema.clone();
    let store = std::sync::Arc::new(PostgresStore::open(&config).await.expect("opens"));
    sqlx::query(
        "INSERT INTO timers (tenant_id, service_call_id, due_at, available_at, state, \
         registered_at, lease_owner, lease_until) VALUES \
         ('t', 'firing', 0, 9000000000000, 0, 0, 'i1', 9000000000000), \
         ('t', 'held', 9000000000000, 9000000000000, 0, 0, NULL, NULL)",
    )
    .execute(&pool)
    .await
    .expect("a timer being fired, and one to pause");
    let (holder, held_by) = holding(&pool, "held").await;
    let acting = store.clone();
    let action = tokio::spawn(async move {
        let keys = [
            timer_core::TimerKey::new("t", "firing"),
            timer_core::TimerKey::new("t", "held"),
        ];
        let pause = timer_core::Action::Pause { note: None };
        acting
            .control()
            .apply(&keys, &pause, Timestamp::from_millis(1_000))
            .await
    });
    assert!(
        blocked_by(&pool, held_by, || action.is_finished()).await,
        "the action never waited for the held row"
    );
    let mut settle = pool.begin().await.expect("begin");
    let free = sqlx::query("SELECT 1 FROM timers WHERE service_call_id = 'firing' FOR UPDATE NOWAIT")
        .execute(&mut *settle)
        .await;
    assert!(free.is_ok(), "the row being fired is locked: {free:?}");
    settle.rollback().await.expect("rollback");
    holder.commit().await.expect("commit");
    let outcomes = action.await.expect("no panic").expect("applied");
    assert_eq!(
        outcomes,
        [
            timer_core::ControlOutcome::Firing,
            timer_core::ControlOutcome::Paused
        ]
    );
    drop(store);
    drop_schema(&pool, &schema).await;
}

/// A transaction of another client holding the row of timer `id` (as a control action or a
/// claim does), and the pid of its backend.
async fn holding(pool: &PgPool, id: &str) -> (sqlx::Transaction<'static, sqlx::Postgres>, i32) {
    let mut tx = pool.begin().await.expect("begin");
    let (pid,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .expect("pid");
    sqlx::query("SELECT 1 FROM timers WHERE service_call_id = $1 FOR UPDATE")
        .bind(id)
        .execute(&mut *tx)
        .await
        .expect("held");
    (tx, pid)
}

/// Waits until a statement waits for the transaction of backend `holder` (true), or `finished`
/// says the work that could wait ended first (false); fails after 20 s.
async fn blocked_by(pool: &PgPool, holder: i32, finished: impl Fn() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let (blocked,): (i64,) = sqlx::query_as(
            "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
        )
        .bind(holder)
        .fetch_one(pool)
        .await
        .expect("blocked");
        if blocked > 0 {
            return true;
        }
        if finished() {
            return false;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "nothing waited for backend {holder}, and the work did not end"
        );
        tokio::task::yield_now().await;
    }
}
