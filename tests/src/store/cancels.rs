//! Cancelling: its outcomes, and a cancel while a fire holds the lease.

use std::sync::Arc;

use timer_core::{CancelOutcome, Store, TimerState};

use super::{
    at, cancel, claim, ids, mark_reached, put, release, schedule_and_claim, scheduled_count,
    state_of, timer, T0, T0_MS,
};

pub async fn cancel_outcomes(store: Arc<dyn Store>) {
    let s = store.as_ref();
    assert_eq!(cancel(s, "t", "a", T0).await, CancelOutcome::NotFound);
    put(s, &[timer("t", "a", T0_MS)], T0).await;
    assert_eq!(cancel(s, "t", "a", T0).await, CancelOutcome::Cancelled);
    assert_eq!(
        cancel(s, "t", "a", T0).await,
        CancelOutcome::AlreadyCancelled
    );
    assert_eq!(state_of(s, "t", "a").await, TimerState::Cancelled);
    let later = at(T0_MS + 1_000_000);
    assert!(
        claim(s, later, 10, "i1", later.as_millis())
            .await
            .is_empty(),
        "a cancelled timer never fires"
    );
    let claimed = schedule_and_claim(s, timer("t", "b", T0_MS), "i1", T0_MS + 1_000).await;
    mark_reached(s, &claimed, "i1", T0).await;
    assert_eq!(cancel(s, "t", "b", T0).await, CancelOutcome::AlreadyReached);
    assert_eq!(scheduled_count(s).await, 0);
}

pub async fn cancel_while_leased_is_refused(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let claimed = schedule_and_claim(s, timer("t", "a", T0_MS), "i1", T0_MS + 1_000).await;
    assert_eq!(claimed.len(), 1);
    // While the lease is live the event may be on its way: the cancel changes nothing.
    assert_eq!(
        cancel(s, "t", "a", at(T0_MS + 10)).await,
        CancelOutcome::Firing
    );
    assert_eq!(state_of(s, "t", "a").await, TimerState::Scheduled);
    // The publish failed: released for a retry, the timer can be cancelled and never fires.
    release(s, &claimed, "i1", at(T0_MS + 500), Some("broker down")).await;
    assert_eq!(
        cancel(s, "t", "a", at(T0_MS + 20)).await,
        CancelOutcome::Cancelled
    );
    assert_eq!(
        mark_reached(s, &claimed, "i1", at(T0_MS + 30)).await,
        0,
        "a late mark does not revive it"
    );
    let later = at(T0_MS + 10_000);
    assert!(claim(s, later, 10, "i2", later.as_millis() + 1_000)
        .await
        .is_empty());
    // Rescheduled far ahead while leased: "firing" only until the lease ends, not until the new
    // due time.
    let far = schedule_and_claim(s, timer("t", "far", T0_MS), "i1", T0_MS + 1_000).await;
    assert_eq!(ids(&far), ["far"]);
    put(s, &[timer("t", "far", T0_MS + 7 * 86_400_000)], T0).await;
    assert_eq!(
        cancel(s, "t", "far", at(T0_MS + 500)).await,
        CancelOutcome::Firing
    );
    assert_eq!(
        cancel(s, "t", "far", at(T0_MS + 1_001)).await,
        CancelOutcome::Cancelled
    );
    // A lease that expired (its holder crashed) no longer blocks a cancel.
    schedule_and_claim(s, timer("t", "b", T0_MS), "i1", T0_MS + 1_000).await;
    assert_eq!(
        cancel(s, "t", "b", at(T0_MS + 1_001)).await,
        CancelOutcome::Cancelled
    );
}
