//! Timers in a store beside the service: made, written, drained, held by leases, checked.

use std::time::Duration;

use timer_core::{NewTimer, Store, TimerKey, TimerState, Timestamp};

use super::{now_ms, signal};
use crate::wait_for;

/// `n` timers `<prefix>00000`, ... of tenants `tenant-0` to `tenant-<tenants - 1>` in turn, due
/// evenly over `spread_ms` from `due_from` (epoch ms).
pub fn new_timers(
    prefix: &str,
    n: usize,
    tenants: usize,
    due_from: i64,
    spread_ms: i64,
) -> Vec<NewTimer> {
    (0..n)
        .map(|i| {
            let key = TimerKey::new(format!("tenant-{}", i % tenants), format!("{prefix}{i:05}"));
            NewTimer::new(
                key,
                Timestamp::from_millis(due_from + (i as i64 * spread_ms) / n as i64),
            )
        })
        .collect()
}

/// Stores `timers` directly (as an instance sharing the store would).
pub async fn store_timers(store: &dyn Store, timers: &[NewTimer]) {
    store
        .schedule(timers, Timestamp::from_millis(now_ms()))
        .await
        .expect("schedule");
}

/// Waits until `store` has no pending timer; false at the deadline.
pub async fn drained(store: &dyn Store, deadline: Duration) -> bool {
    wait_for(deadline, || async {
        (store.scheduled_count().await.ok()? == 0).then_some(())
    })
    .await
    .is_some()
}

/// Freezes process `pid` (SIGSTOP) at a moment `leased` finds it holding leases, and returns
/// what it held then; it stays frozen (kill it, or SIGCONT it). Panics after `deadline`.
pub async fn freeze_holding_leases(
    pid: u32,
    deadline: Duration,
    leased: impl AsyncFnMut() -> Vec<TimerKey>,
) -> Vec<TimerKey> {
    catch_holding_leases(
        &format!("process {pid}"),
        deadline,
        leased,
        async || signal(pid, "-STOP").await,
        async || signal(pid, "-CONT").await,
    )
    .await
}

/// Catches an instance holding leases: at a moment `leased` finds some, runs `stop` (freezes
/// the instance, cuts it off) and returns what it held then, once two looks 200 ms apart agree
/// (a mark sent before the stop may still land; at most 20 looks). When it held nothing after
/// all, runs `resume` and waits for the next moment. Panics after `deadline`, naming `who`.
pub async fn catch_holding_leases(
    who: &str,
    deadline: Duration,
    mut leased: impl AsyncFnMut() -> Vec<TimerKey>,
    mut stop: impl AsyncFnMut(),
    mut resume: impl AsyncFnMut(),
) -> Vec<TimerKey> {
    let end = tokio::time::Instant::now() + deadline;
    while tokio::time::Instant::now() < end {
        if leased().await.is_empty() {
            tokio::time::sleep(Duration::from_millis(2)).await;
            continue;
        }
        stop().await;
        let mut held = leased().await;
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let again = leased().await;
            if again == held {
                break;
            }
            held = again;
        }
        if !held.is_empty() {
            return held;
        }
        resume().await;
    }
    panic!("never caught {who} holding leases within {deadline:?}");
}

/// Waits until every timer of `keys` is Reached, then returns how long after `since_ms`
/// (epoch ms) the last of them was: the time their fires took to recover.
pub async fn recovered_after(
    store: &dyn Store,
    keys: &[TimerKey],
    since_ms: i64,
    deadline: Duration,
) -> i64 {
    let last = wait_for(deadline, || async {
        let mut last = i64::MIN;
        for key in keys {
            let t = store.get(key).await.ok()??;
            if t.state != TimerState::Reached {
                return None;
            }
            last = last.max(t.reached_at?.as_millis());
        }
        Some(last)
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "the {} timers in flight did not all fire within {deadline:?}",
            keys.len()
        )
    });
    last - since_ms
}

/// The timers of `keys` not stored as Reached once `deadline` passed (waiting until all are: a
/// settle may still be on its way when its event is read), each with what the store says.
pub async fn not_reached_within(
    store: &dyn Store,
    keys: &[TimerKey],
    deadline: Duration,
) -> Vec<String> {
    let not_reached_now = || async {
        let mut not_reached = Vec::new();
        for key in keys {
            match store.get(key).await {
                Ok(Some(t)) if t.state == TimerState::Reached => {}
                other => {
                    not_reached.push(format!("{key}: {:?}", other.map(|t| t.map(|t| t.state))))
                }
            }
        }
        not_reached
    };
    let all = wait_for(deadline, || async {
        not_reached_now().await.is_empty().then_some(())
    })
    .await;
    match all {
        Some(()) => Vec::new(),
        None => not_reached_now().await,
    }
}

/// Asserts that every timer of `keys` is stored as Reached, and did not fire before it was due
/// (Reached means the broker confirmed the publish first: publish, then mark).
pub async fn assert_reached<'a>(store: &dyn Store, keys: impl IntoIterator<Item = &'a TimerKey>) {
    for key in keys {
        let t = store.get(key).await.expect("get").expect("row exists");
        assert_eq!(t.state, TimerState::Reached, "{key}");
        assert!(
            t.reached_at.expect("reached_at") >= t.due_at,
            "{key} not fired early"
        );
    }
}
