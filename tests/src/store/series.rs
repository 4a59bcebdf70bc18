//! Recurring timers: the recurrence kept, a series moved on to its next occurrence, rescheduled.

use std::sync::Arc;

use timer_core::store::Step;
use timer_core::{Settlement, Store, TimerState};

use super::{
    advance, at, claim, mark_reached, next_due, put, recurring, release, row, schedule_and_claim,
    settle, timer, T0, T0_MS,
};

pub async fn recurrence_round_trips_and_advance_moves_to_next(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let new = recurring("t", "r", T0_MS, "*/10 * * * * *");
    put(s, std::slice::from_ref(&new), T0).await;
    let stored = row(s, "t", "r").await;
    assert_eq!(
        stored.recurrence, new.recurrence,
        "recurrence kept as given"
    );
    assert_eq!(stored.occurrences, 0);
    let claimed = claim(s, T0, 10, "i1", T0_MS + 1_000).await;
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].recurrence, new.recurrence);
    assert_eq!(claimed[0].occurrences, 0);
    let next = at(T0_MS + 10_000);
    let fired_at = at(T0_MS + 3);
    assert_eq!(advance(s, &claimed[0], next, "i1", fired_at).await, 1);
    let t = row(s, "t", "r").await;
    assert_eq!(t.state, TimerState::Scheduled);
    assert_eq!(t.due_at, next);
    assert_eq!(t.available_at, next);
    assert_eq!(t.occurrences, 1);
    assert_eq!(t.reached_at, Some(fired_at), "reachedAt is the last fire");
    assert_eq!(t.lease_owner, None);
    assert_eq!(next_due(s).await, Some(next));
    assert!(
        claim(
            s,
            at(next.as_millis() - 1),
            10,
            "i1",
            next.as_millis() + 1_000
        )
        .await
        .is_empty(),
        "not before the next occurrence"
    );
    let again = claim(s, next, 10, "i1", next.as_millis() + 1_000).await;
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].occurrences, 1);
    assert!(
        again[0].revision > claimed[0].revision,
        "each occurrence its own revision"
    );
    // The last occurrence: marked Reached like a one-shot timer, and counted.
    mark_reached(s, &again, "i1", next).await;
    let t = row(s, "t", "r").await;
    assert_eq!(t.state, TimerState::Reached);
    assert_eq!(t.occurrences, 2, "every fired occurrence counted");
}

pub async fn advance_needs_the_lease_and_revision(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let new = recurring("t", "r", T0_MS, "0 * * * * *");
    let claimed = schedule_and_claim(s, new, "i1", T0_MS + 1_000).await;
    let next = at(T0_MS + 60_000);
    assert_eq!(
        advance(s, &claimed[0], next, "i2", T0).await,
        0,
        "not the lease holder"
    );
    // Rescheduled (another pattern) while firing: the new series wins over the computed
    // occurrence of the old one.
    let moved = recurring("t", "r", T0_MS + 5_000, "5 * * * * *");
    put(s, &[moved], T0).await;
    assert_eq!(
        advance(s, &claimed[0], next, "i1", T0).await,
        0,
        "stale revision"
    );
    let t = row(s, "t", "r").await;
    assert_eq!(t.due_at, at(T0_MS + 5_000));
    assert_eq!(t.occurrences, 0);
}

pub async fn rescheduling_a_recurring_timer_resets_its_count(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let new = recurring("t", "r", T0_MS, "0 * * * * *");
    let claimed = schedule_and_claim(s, new, "i1", T0_MS + 1_000).await;
    advance(s, &claimed[0], at(T0_MS + 60_000), "i1", T0).await;
    // Same pattern again (a redelivered command, computed later): the series keeps its place,
    // its next occurrence and its count.
    put(
        s,
        &[recurring("t", "r", T0_MS + 120_000, "0 * * * * *")],
        T0,
    )
    .await;
    let t = row(s, "t", "r").await;
    assert_eq!(t.occurrences, 1);
    assert_eq!(t.due_at, at(T0_MS + 60_000), "not re-anchored");
    assert_eq!(t.available_at, at(T0_MS + 60_000));
    // Another pattern at the same due time: a new series, and a new revision, so a fire of
    // the old pattern in flight cannot move it on.
    let claimed = claim(s, at(T0_MS + 60_000), 10, "i1", T0_MS + 61_000).await;
    let same_due = recurring("t", "r", T0_MS + 60_000, "0 */5 * * * *");
    put(s, &[same_due], T0).await;
    assert_eq!(
        advance(s, &claimed[0], at(T0_MS + 61_000), "i1", T0).await,
        0,
        "the old pattern's fire does not move the new series"
    );
    release(s, &claimed, "i1", T0, None).await;
    let other = recurring("t", "r", T0_MS + 120_000, "0 */2 * * * *");
    put(s, std::slice::from_ref(&other), T0).await;
    let t = row(s, "t", "r").await;
    assert_eq!(t.occurrences, 0);
    assert_eq!(t.recurrence, other.recurrence);
    // A one-shot schedule of the same key turns it into a one-shot timer.
    put(s, &[timer("t", "r", T0_MS + 1_000)], T0).await;
    assert_eq!(row(s, "t", "r").await.recurrence, None);
}

/// A series that ends without a fire (its last occurrence skipped, a settle `Step` to Reached
/// with `fired` false) is finished at the settle time, but keeps the `reachedAt` of its last
/// fire: it did not fire then. A fired `Step` sets it.
pub async fn a_series_that_ends_without_a_fire_keeps_its_last_reached_at(store: Arc<dyn Store>) {
    let s = store.as_ref();
    put(s, &[recurring("t", "r", T0_MS, "*/10 * * * * *")], T0).await;
    let claimed = claim(s, T0, 10, "i1", T0_MS + 1_000).await;
    let fired_at = at(T0_MS + 3);
    let next = at(T0_MS + 10_000);
    let fired = Step {
        state: TimerState::Scheduled,
        due_at: next,
        available_at: next,
        fired: true,
        work: None,
        changes: Vec::new(),
    };
    assert_eq!(
        settle(s, &claimed, Settlement::Step(fired), "i1", fired_at).await,
        1
    );
    assert_eq!(row(s, "t", "r").await.reached_at, Some(fired_at));
    let again = claim(s, next, 10, "i1", next.as_millis() + 1_000).await;
    assert_eq!(again.len(), 1);
    let ended_at = at(next.as_millis() + 5);
    let ended = Step {
        state: TimerState::Reached,
        due_at: next,
        available_at: next,
        fired: false,
        work: None,
        changes: Vec::new(),
    };
    assert_eq!(
        settle(s, &again, Settlement::Step(ended), "i1", ended_at).await,
        1
    );
    let t = row(s, "t", "r").await;
    assert_eq!(t.state, TimerState::Reached);
    assert_eq!(t.reached_at, Some(fired_at), "not fired at the end: {t:?}");
    assert_eq!(t.occurrences, 1, "one occurrence fired");
}
