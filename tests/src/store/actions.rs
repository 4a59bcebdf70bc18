//! Control actions: pause, resume, cancel and retry, and what a pause does to a timer and a series.

use std::sync::Arc;

use timer_core::policy::Completion;
use timer_core::{
    Action, CancelOutcome, Change, ControlOutcome, NewTimer, Recurrence, ScheduleOutcome,
    Settlement, Store, TimerKey, TimerState,
};

use super::{
    act, at, cancel, claim, control, fail, history, ids, kinds, mark_reached, next_due, pause, put,
    release, row, schedule_and_claim, scheduled_count, settle, state_of, timer, T0, T0_MS,
};

pub async fn pause_resume_and_cancel_outcomes(store: Arc<dyn Store>) {
    use ControlOutcome as O;
    let s = store.as_ref();
    put(
        s,
        &[
            timer("t", "a", T0_MS + 1_000),
            timer("t", "b", T0_MS + 1_000),
        ],
        T0,
    )
    .await;
    assert_eq!(act(s, "a", &pause(), T0).await, O::Paused);
    assert_eq!(state_of(s, "t", "a").await, TimerState::Paused);
    assert_eq!(act(s, "a", &pause(), T0).await, O::AlreadyPaused);
    assert_eq!(act(s, "b", &Action::Resume, T0).await, O::NotPaused);
    assert_eq!(act(s, "missing", &pause(), T0).await, O::NotFound);
    // Several keys in one call: one outcome each, in order.
    let keys = [
        TimerKey::new("t", "b"),
        TimerKey::new("t", "a"),
        TimerKey::new("t", "zz"),
    ];
    let outcomes = control(s).apply(&keys, &pause(), T0).await.expect("apply");
    assert_eq!(outcomes, [O::Paused, O::AlreadyPaused, O::NotFound]);
    assert_eq!(act(s, "b", &Action::Resume, T0).await, O::Resumed);
    assert_eq!(state_of(s, "t", "b").await, TimerState::Scheduled);
    // A Paused timer can be cancelled, by the action and by `cancel`.
    assert_eq!(act(s, "a", &Action::Cancel, T0).await, O::Cancelled);
    assert_eq!(act(s, "a", &Action::Resume, T0).await, O::AlreadyCancelled);
    put(s, &[timer("t", "c", T0_MS)], T0).await;
    act(s, "c", &pause(), T0).await;
    assert_eq!(cancel(s, "t", "c", T0).await, CancelOutcome::Cancelled);
    let claimed = schedule_and_claim(s, timer("t", "d", T0_MS), "i1", T0_MS + 1_000).await;
    mark_reached(s, &claimed, "i1", T0).await;
    assert_eq!(act(s, "d", &pause(), T0).await, O::AlreadyReached);
}

pub async fn retry_schedules_a_failed_timer_again(store: Arc<dyn Store>) {
    use ControlOutcome as O;
    let s = store.as_ref();
    let claimed = schedule_and_claim(s, timer("t", "f", T0_MS), "i1", T0_MS + 1_000).await;
    fail(s, &claimed, "i1", at(T0_MS + 5), "broker down").await;
    put(s, &[timer("t", "s", T0_MS + 60_000)], T0).await;
    assert_eq!(act(s, "s", &Action::Retry, T0).await, O::NotFailed);
    act(s, "s", &pause(), T0).await;
    assert_eq!(act(s, "s", &Action::Retry, T0).await, O::NotFailed);
    assert_eq!(act(s, "missing", &Action::Retry, T0).await, O::NotFound);

    let retried_at = at(T0_MS + 10_000);
    assert_eq!(act(s, "f", &Action::Retry, retried_at).await, O::Retried);
    let t = row(s, "t", "f").await;
    assert_eq!(
        (t.state, t.due_at, t.attempts, t.last_error.as_deref()),
        (TimerState::Scheduled, T0, 0, None),
        "Scheduled again at its own due time, attempts from 0"
    );
    assert_eq!(next_due(s).await, Some(T0), "claimable at once");
    assert_eq!(scheduled_count(s).await, 1);
    assert_eq!(
        kinds(&history(s, "f").await).last().map(String::as_str),
        Some("retried")
    );
    // No longer finished: retention leaves it alone.
    assert_eq!(s.purge(at(T0_MS + 20_000), 10).await.expect("purge"), 0);
    let claimed = claim(s, retried_at, 10, "i2", T0_MS + 20_000).await;
    assert_eq!(ids(&claimed), ["f"]);
    assert_eq!(claimed[0].attempts, 0);
    mark_reached(s, &claimed, "i2", retried_at).await;
    assert_eq!(
        act(s, "f", &Action::Retry, retried_at).await,
        O::AlreadyReached
    );
    act(s, "s", &Action::Cancel, T0).await;
    assert_eq!(act(s, "s", &Action::Retry, T0).await, O::AlreadyCancelled);
}

pub async fn a_paused_timer_never_fires_and_resumes_on_its_due_time(store: Arc<dyn Store>) {
    let s = store.as_ref();
    put(s, &[timer("t", "a", T0_MS + 1_000)], T0).await;
    assert_eq!(scheduled_count(s).await, 1);
    act(s, "a", &pause(), T0).await;
    let later = at(T0_MS + 60_000);
    assert!(
        claim(s, later, 10, "i1", later.as_millis() + 1_000)
            .await
            .is_empty(),
        "a paused timer is not claimable"
    );
    assert_eq!(next_due(s).await, None, "nor is it the next due");
    assert_eq!(scheduled_count(s).await, 0, "nor pending");
    assert_eq!(
        s.purge(at(i64::MAX / 2), 100).await.expect("purge"),
        0,
        "never purged"
    );
    // Resumed after its due time passed: due at once, at its own due time.
    act(s, "a", &Action::Resume, later).await;
    let a = row(s, "t", "a").await;
    assert_eq!(
        (a.state, a.due_at),
        (TimerState::Scheduled, at(T0_MS + 1_000))
    );
    assert_eq!(next_due(s).await, Some(at(T0_MS + 1_000)));
    let claimed = claim(s, later, 10, "i1", later.as_millis() + 1_000).await;
    assert_eq!(ids(&claimed), ["a"]);
}

pub async fn pausing_a_firing_timer_is_refused(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let claimed = schedule_and_claim(s, timer("t", "a", T0_MS), "i1", T0_MS + 30_000).await;
    assert_eq!(act(s, "a", &pause(), T0).await, ControlOutcome::Firing);
    assert_eq!(
        act(s, "a", &Action::Cancel, T0).await,
        ControlOutcome::Firing
    );
    assert_eq!(state_of(s, "t", "a").await, TimerState::Scheduled);
    // Once the lease is given back, it can be paused.
    release(s, &claimed, "i1", at(T0_MS + 5_000), Some("broker down")).await;
    assert_eq!(act(s, "a", &pause(), T0).await, ControlOutcome::Paused);
    // A lease that ran out does not hold a pause back either.
    let b = schedule_and_claim(s, timer("t", "b", T0_MS), "i2", T0_MS + 1_000).await;
    assert_eq!(ids(&b), ["b"]);
    assert_eq!(
        act(s, "b", &pause(), at(T0_MS + 1_001)).await,
        ControlOutcome::Paused
    );
    assert_eq!(
        settle(s, &b, Settlement::Reached, "i2", at(T0_MS + 1_002)).await,
        0,
        "a paused timer is not settled by a stale claim"
    );
    assert_eq!(state_of(s, "t", "b").await, TimerState::Paused);
}

/// A timer that fired holds no lease: its completion is taken at once, not answered `firing`
/// until its claim's lease would have run out (on the broker path that held its tenant's later
/// commands back meanwhile).
pub async fn a_fired_timer_holds_no_lease(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let lease_end = T0_MS + 10_000;
    let reached = schedule_and_claim(s, timer("t", "a", T0_MS), "i1", lease_end).await;
    assert_eq!(mark_reached(s, &reached, "i1", at(T0_MS + 10)).await, 1);
    let done = Action::Complete(Completion {
        occurrence: None,
        outcome: None,
        message: None,
    });
    assert_eq!(
        act(s, "a", &done, at(T0_MS + 20)).await,
        ControlOutcome::Completed
    );
    // The completion kept it finished: when it was reached, and that it is purged in time.
    let got = row(s, "t", "a").await;
    assert_eq!(
        (got.state, got.reached_at),
        (TimerState::Reached, Some(at(T0_MS + 10)))
    );
    assert_eq!(
        act(s, "a", &done, at(T0_MS + 30)).await,
        ControlOutcome::AlreadyCompleted
    );
    assert_eq!(s.purge(at(T0_MS + 11), 10).await.expect("purge"), 1);
}

/// A series of tenant `t` due every minute from T0 (T0 is a whole minute).
fn every_minute(id: &str) -> NewTimer {
    NewTimer {
        recurrence: Some(Recurrence {
            cron: "* * * * *".into(),
            time_zone: "UTC".into(),
            end_at: None,
            max_occurrences: None,
        }),
        ..timer("t", id, T0_MS)
    }
}

pub async fn a_resumed_series_skips_what_fell_into_the_pause(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let series = every_minute("s");
    put(s, &[series], T0).await;
    act(s, "s", &pause(), T0).await;
    // Resumed 3.5 minutes later: T0, +1, +2, +3 skipped; +4 is next.
    let resumed_at = at(T0_MS + 210_000);
    assert_eq!(
        act(s, "s", &Action::Resume, resumed_at).await,
        ControlOutcome::Resumed
    );
    let row = row(s, "t", "s").await;
    assert_eq!(
        (row.state, row.due_at, row.occurrences),
        (TimerState::Scheduled, at(T0_MS + 240_000), 0)
    );
    let entries = history(s, "s").await;
    assert_eq!(kinds(&entries), ["created", "paused", "skipped", "resumed"]);
    assert_eq!(
        entries[2].change,
        Change::Skipped {
            count: 4,
            first: T0,
            last: at(T0_MS + 180_000),
            at_least: false,
            reason: Some(timer_core::policy::SkipReason::Pause),
        }
    );
    assert!(
        claim(s, resumed_at, 10, "i1", resumed_at.as_millis() + 1_000)
            .await
            .is_empty(),
        "nothing fires for the skipped ones"
    );
    let next = claim(s, at(T0_MS + 240_000), 10, "i1", T0_MS + 250_000).await;
    assert_eq!(ids(&next), ["s"]);
}

/// A control action that moves a timer's due time changes its revision, so a claim taken
/// before it no longer settles the timer, even for the owner whose lease it still names (a pause
/// after the lease ran out ends the lease, not the owner's name on the row).
pub async fn a_claim_taken_before_a_resume_moved_the_series_does_not_settle_it(
    store: Arc<dyn Store>,
) {
    let s = store.as_ref();
    let series = every_minute("s");
    put(s, &[series], T0).await;
    let stale = claim(s, T0, 10, "i1", T0_MS + 1_000).await;
    assert_eq!(ids(&stale), ["s"]);
    // The lease ran out: the timer is not firing, so it may be paused; resumed 3.5 minutes
    // later, its due time moves on to T0 + 4 minutes.
    assert_eq!(
        act(s, "s", &pause(), at(T0_MS + 2_000)).await,
        ControlOutcome::Paused
    );
    let resumed_at = at(T0_MS + 210_000);
    assert_eq!(
        act(s, "s", &Action::Resume, resumed_at).await,
        ControlOutcome::Resumed
    );
    assert_eq!(
        mark_reached(s, &stale, "i1", at(T0_MS + 210_001)).await,
        0,
        "a claim of the old due time settled the resumed series"
    );
    let row = row(s, "t", "s").await;
    assert_eq!(
        (row.state, row.due_at, row.occurrences),
        (TimerState::Scheduled, at(T0_MS + 240_000), 0)
    );
    let next = claim(s, at(T0_MS + 240_000), 10, "i2", T0_MS + 250_000).await;
    assert_eq!(ids(&next), ["s"], "the series fires at its new due time");
}

pub async fn rescheduling_a_paused_timer_keeps_it_paused(store: Arc<dyn Store>) {
    let s = store.as_ref();
    put(s, &[timer("t", "a", T0_MS + 1_000)], T0).await;
    act(s, "a", &pause(), T0).await;
    let outcome = put(s, &[timer("t", "a", T0_MS + 5_000)], T0).await;
    assert_eq!(outcome, [ScheduleOutcome::Updated]);
    let a = row(s, "t", "a").await;
    assert_eq!((a.state, a.due_at), (TimerState::Paused, at(T0_MS + 5_000)));
    assert!(claim(s, at(T0_MS + 10_000), 10, "i1", T0_MS + 20_000)
        .await
        .is_empty());
    act(s, "a", &Action::Resume, T0).await;
    assert_eq!(next_due(s).await, Some(at(T0_MS + 5_000)));
}
