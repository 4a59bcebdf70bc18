//! Retention: purging finished timers.

use std::sync::Arc;

use timer_core::{CancelOutcome, NewTimer, ScheduleOutcome, Store, TimerState};

use super::{
    at, cancel, claim, fail, find, ids, mark_reached, put, schedule_and_claim, state_of, timer, T0,
    T0_MS,
};

pub async fn purge_removes_only_old_finished_rows(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let batch: Vec<NewTimer> = (0..6)
        .map(|i| timer("t", &format!("p{i}"), T0_MS + i))
        .collect();
    put(s, &batch, T0).await;
    // p0..p2 reached at T0, p3 cancelled at T0, p4 reached much later, p5 stays scheduled.
    let claimed = claim(s, at(T0_MS + 2), 3, "i1", T0_MS + 1_000).await;
    assert_eq!(ids(&claimed), ["p0", "p1", "p2"]);
    mark_reached(s, &claimed, "i1", T0).await;
    cancel(s, "t", "p3", T0).await;
    let late = at(T0_MS + 100_000);
    let p4 = claim(s, late, 1, "i1", late.as_millis() + 1_000).await;
    assert_eq!(ids(&p4), ["p4"]);
    mark_reached(s, &p4, "i1", late).await;

    let cutoff = at(T0_MS + 1);
    assert_eq!(
        s.purge(cutoff, 2).await.expect("purge"),
        2,
        "purge respects its limit"
    );
    assert_eq!(s.purge(cutoff, 100).await.expect("purge"), 2);
    assert_eq!(s.purge(cutoff, 100).await.expect("purge"), 0);
    for id in ["p0", "p1", "p2", "p3"] {
        assert!(find(s, "t", id).await.is_none(), "{id} purged");
    }
    assert_eq!(
        state_of(s, "t", "p4").await,
        TimerState::Reached,
        "recent rows stay"
    );
    assert_eq!(
        state_of(s, "t", "p5").await,
        TimerState::Scheduled,
        "scheduled rows stay"
    );
}

pub async fn failed_timers_stay_failed_and_are_purged(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let claimed = schedule_and_claim(s, timer("t", "a", T0_MS), "i1", T0_MS + 1_000).await;
    fail(s, &claimed, "i1", T0, "down").await;
    let out = put(s, &[timer("t", "a", T0_MS + 5_000)], T0).await;
    assert_eq!(out, vec![ScheduleOutcome::AlreadyFailed]);
    assert_eq!(cancel(s, "t", "a", T0).await, CancelOutcome::AlreadyFailed);
    assert_eq!(s.purge(at(T0_MS + 1), 10).await.expect("purge"), 1);
    assert!(find(s, "t", "a").await.is_none());
}
