//! Claiming and settling: claim order and exclusivity, leases running out, releases for a retry,
//! failing, the next due time.

use std::sync::Arc;

use timer_core::{
    Change, ClaimedTimer, Due, Lease, NewTimer, ScheduleOutcome, Settlement, Store, TimerState,
};

use super::{
    at, cancel, claim, claim_all_concurrently, fail, history, ids, kinds, mark_reached, next_due,
    put, release, row, schedule_and_claim, scheduled_count, state_of, timer, T0, T0_MS,
};

pub async fn no_refire_after_reached(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let claimed = schedule_and_claim(s, timer("t", "a", T0_MS), "i1", T0_MS + 100).await;
    assert_eq!(mark_reached(s, &claimed, "i1", T0).await, 1);
    // Even long after every lease has run out, a Reached timer is never claimed again.
    let later = at(T0_MS + 86_400_000);
    let again = claim(s, later, 10, "i2", later.as_millis() + 100).await;
    assert!(
        again.is_empty(),
        "a Reached timer was claimed again: {again:?}"
    );
    assert_eq!(next_due(s).await, None);
    assert_eq!(scheduled_count(s).await, 0);
    // Marking twice does nothing more.
    assert_eq!(mark_reached(s, &claimed, "i1", T0).await, 0);
}

pub async fn claim_takes_oldest_first_up_to_limit(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let batch: Vec<NewTimer> = [5, 1, 4, 2, 3, 99]
        .iter()
        .map(|d| timer("t", &format!("d{d}"), T0_MS + d))
        .collect();
    put(s, &batch, T0).await;
    let now = at(T0_MS + 10);
    let first = claim(s, now, 2, "i1", now.as_millis() + 1_000).await;
    assert_eq!(ids(&first), ["d1", "d2"]);
    let rest = claim(s, now, 10, "i1", now.as_millis() + 1_000).await;
    assert_eq!(ids(&rest), ["d3", "d4", "d5"], "d99 is not due yet");
    assert!(claim(s, now, 10, "i1", 0).await.is_empty());
    assert!(
        claim(s, now, 0, "i1", 0).await.is_empty(),
        "limit 0 claims nothing"
    );
}

/// A claim ahead (`Due::ahead`) takes what is claimable now and what is first due within the
/// window, never a retry (or any row claimable later than its due time) before its time; in a
/// backlog too (the fair claim's shares and fill).
pub async fn a_claim_ahead_takes_first_due_times_only(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let batch = [
        timer("t1", "retried", T0_MS),
        timer("t1", "soon", T0_MS + 30),
        timer("t2", "sooner", T0_MS + 25),
        timer("t2", "far", T0_MS + 300),
        timer("t2", "beyond", T0_MS + 460),
    ];
    put(s, &batch, T0).await;
    // A full claim (the next one is a backlog's, shared between tenants), then a retry.
    let first = claim(s, T0, 1, "i1", T0_MS + 30_000).await;
    assert_eq!(ids(&first), ["retried"]);
    release(s, &first, "i1", at(T0_MS + 20), Some("broker said no")).await;
    let ahead = |now: i64| Due::ahead(at(now), std::time::Duration::from_millis(50));
    let lease = Lease {
        owner: "i2".into(),
        until: at(T0_MS + 30_000),
    };
    let claim_ahead = |now: i64| {
        let lease = lease.clone();
        async move {
            s.claim_due(ahead(now), 10, &lease)
                .await
                .unwrap_or_else(|e| panic!("claiming ahead at {now} failed: {e}"))
        }
    };
    // A backlog's shares look eight windows ahead (`timer_core::fair`): 400 ms.
    let shared = claim_ahead(T0_MS).await;
    assert_eq!(
        ids(&shared),
        ["sooner", "soon", "far"],
        "first due within 400 ms, not the retry due in 20 ms nor what is due in 460"
    );
    // Not full: the claims that follow look 50 ms ahead.
    assert!(claim_ahead(T0_MS + 19).await.is_empty());
    assert_eq!(
        ids(&claim_ahead(T0_MS + 20).await),
        ["retried"],
        "at its time"
    );
    assert!(claim_ahead(T0_MS + 409).await.is_empty());
    assert_eq!(ids(&claim_ahead(T0_MS + 410).await), ["beyond"]);
}

pub async fn claim_is_exclusive_under_concurrency(store: Arc<dyn Store>) {
    const N: usize = 2_000;
    let batch: Vec<NewTimer> = (0..N)
        .map(|i| timer("t", &format!("c{i:05}"), T0_MS + (i % 50) as i64))
        .collect();
    put(store.as_ref(), &batch, T0).await;
    let claimed = claim_all_concurrently(&store, 8, 37, at(T0_MS + 100)).await;
    assert_eq!(claimed, N, "every due timer claimed exactly once");
}

pub async fn expired_lease_makes_row_claimable(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let first = schedule_and_claim(s, timer("t", "a", T0_MS), "crashed", T0_MS + 1_000).await;
    assert_eq!(ids(&first), ["a"]);
    let during = at(T0_MS + 999);
    assert!(
        claim(s, during, 10, "other", during.as_millis() + 1_000)
            .await
            .is_empty(),
        "a live lease keeps the row from others"
    );
    let after = at(T0_MS + 1_000);
    let second = claim(s, after, 10, "other", after.as_millis() + 1_000).await;
    assert_eq!(
        ids(&second),
        ["a"],
        "an expired lease makes the row claimable"
    );
    // The old owner lost the lease: its mark does nothing; the new owner's does.
    assert_eq!(mark_reached(s, &first, "crashed", after).await, 0);
    assert_eq!(state_of(s, "t", "a").await, TimerState::Scheduled);
    assert_eq!(mark_reached(s, &second, "other", after).await, 1);
    assert_eq!(state_of(s, "t", "a").await, TimerState::Reached);
}

pub async fn release_keeps_attempts_and_last_error(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let claimed = schedule_and_claim(s, timer("t", "a", T0_MS), "i1", T0_MS + 30_000).await;
    let retry_at = at(T0_MS + 5_000);
    release(s, &claimed, "i1", retry_at, Some("broker said no")).await;
    let got = row(s, "t", "a").await;
    assert_eq!(got.state, TimerState::Scheduled);
    assert_eq!(got.attempts, 1);
    assert_eq!(got.last_error.as_deref(), Some("broker said no"));
    assert_eq!(got.due_at, T0, "release keeps the due time");
    assert_eq!(next_due(s).await, Some(retry_at));
    let early = at(retry_at.as_millis() - 1);
    assert!(claim(s, early, 10, "i1", early.as_millis() + 30_000)
        .await
        .is_empty());
    let again = claim(s, retry_at, 10, "i1", retry_at.as_millis() + 30_000).await;
    assert_eq!(ids(&again), ["a"]);
    assert_eq!(again[0].attempts, 1);
    release(s, &again, "i1", retry_at, Some("still no")).await;
    let got = row(s, "t", "a").await;
    assert_eq!(got.attempts, 2);
    assert_eq!(got.last_error.as_deref(), Some("still no"));
    // A release by someone who does not hold the lease changes nothing.
    release(s, &again, "stranger", retry_at, Some("x")).await;
    assert_eq!(row(s, "t", "a").await.attempts, 2);
}

/// A failed publish of a timer rescheduled while it fired gives the lease back, and nothing
/// more: the new due time is not pushed back by the old fire's backoff, and the old fire's
/// failure is not counted against (nor recorded in the history of) what is now another timer.
pub async fn a_failed_fire_of_a_rescheduled_timer_leaves_the_new_one_alone(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let claimed = schedule_and_claim(s, timer("t", "a", T0_MS), "i1", T0_MS + 30_000).await;
    let moved = T0_MS + 100;
    put(s, &[timer("t", "a", moved)], at(T0_MS + 1)).await;
    let backoff = at(T0_MS + 60_000);
    assert_eq!(
        release(s, &claimed, "i1", backoff, Some("broker down")).await,
        1
    );
    let got = row(s, "t", "a").await;
    assert_eq!((got.attempts, got.last_error), (0, None));
    assert_eq!(next_due(s).await, Some(at(moved)));
    let again = claim(s, at(moved), 10, "i2", moved + 30_000).await;
    assert_eq!(ids(&again), ["a"]);
    assert_eq!(again[0].attempts, 0);
    assert!(
        !kinds(&history(s, "a").await).contains(&"publish_failed".to_owned()),
        "{:?}",
        history(s, "a").await
    );
}

pub async fn release_without_error_keeps_attempts(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let claimed = schedule_and_claim(s, timer("t", "a", T0_MS), "i1", T0_MS + 30_000).await;
    release(s, &claimed, "i1", T0, None).await;
    let got = row(s, "t", "a").await;
    assert_eq!(got.attempts, 0);
    assert_eq!(got.last_error, None);
    let again = claim(s, T0, 10, "i2", T0_MS + 30_000).await;
    assert_eq!(ids(&again), ["a"], "a released claim is claimable at once");
}

pub async fn reschedule_while_firing_keeps_timer_scheduled(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let claimed = schedule_and_claim(s, timer("t", "a", T0_MS), "i1", T0_MS + 30_000).await;
    let later = T0_MS + 60_000;
    let out = put(s, &[timer("t", "a", later)], at(T0_MS + 1)).await;
    assert_eq!(out, vec![ScheduleOutcome::Updated]);
    // The fire of the old due time completes, but the timer now waits for its new due time.
    assert_eq!(mark_reached(s, &claimed, "i1", at(T0_MS + 2)).await, 0);
    let got = row(s, "t", "a").await;
    assert_eq!(got.state, TimerState::Scheduled);
    assert_eq!(got.due_at, at(later));
    let again = claim(s, at(later), 10, "i2", later + 30_000).await;
    assert_eq!(ids(&again), ["a"]);
    // A repeated command with the same due time (a broker redelivery) does not disturb a fire.
    put(s, &[timer("t", "a", later)], at(later)).await;
    assert_eq!(mark_reached(s, &again, "i2", at(later)).await, 1);
    // One with the same due time and other content: the fire of the old content does not
    // settle it, it is claimed again with the new.
    let b = schedule_and_claim(s, timer("t", "b", T0_MS), "i1", T0_MS + 30_000).await;
    let changed = NewTimer {
        payload: Some(r#"{"v":2}"#.into()),
        correlation_id: Some("c-2".into()),
        ..timer("t", "b", T0_MS)
    };
    assert_eq!(
        put(s, &[changed], at(T0_MS + 1)).await,
        [ScheduleOutcome::Updated]
    );
    assert_eq!(mark_reached(s, &b, "i1", at(T0_MS + 2)).await, 0);
    release(s, &b, "i1", at(T0_MS + 3), None).await;
    let b = claim(s, at(T0_MS + 3), 10, "i2", T0_MS + 30_000).await;
    assert_eq!(ids(&b), ["b"]);
    assert_eq!(b[0].payload.as_deref(), Some(r#"{"v":2}"#));
    assert_eq!(mark_reached(s, &b, "i2", at(T0_MS + 4)).await, 1);
}

pub async fn next_due_at_tracks_claimable_rows(store: Arc<dyn Store>) {
    let s = store.as_ref();
    assert_eq!(next_due(s).await, None, "empty store");
    let batch = [
        timer("t", "a", T0_MS + 300),
        timer("t", "b", T0_MS + 100),
        timer("t", "c", T0_MS + 200),
    ];
    put(s, &batch, T0).await;
    assert_eq!(next_due(s).await, Some(at(T0_MS + 100)));
    let now = at(T0_MS + 100);
    claim(s, now, 1, "i1", T0_MS + 10_000).await;
    assert_eq!(
        next_due(s).await,
        Some(at(T0_MS + 200)),
        "a leased row counts from its lease expiry"
    );
    cancel(s, "t", "c", now).await;
    assert_eq!(next_due(s).await, Some(at(T0_MS + 300)));
    cancel(s, "t", "a", now).await;
    assert_eq!(next_due(s).await, Some(at(T0_MS + 10_000)));
}

pub async fn fail_marks_failed_for_the_lease_holder_only(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let claimed = schedule_and_claim(s, timer("t", "a", T0_MS), "i1", T0_MS + 1_000).await;
    assert_eq!(
        fail(s, &claimed, "i2", T0, "not mine").await,
        0,
        "only the lease holder fails it"
    );
    assert_eq!(
        fail(s, &claimed, "i1", at(T0_MS + 5), "broker down").await,
        1
    );
    let t = row(s, "t", "a").await;
    assert_eq!(t.state, TimerState::Failed);
    assert_eq!(t.attempts, 1, "the last attempt counts");
    assert_eq!(t.last_error.as_deref(), Some("broker down"));
    assert_eq!(scheduled_count(s).await, 0);
    assert_eq!(next_due(s).await, None);
}

/// One settle of every kind at once (the engine settles a fired batch so): each row changes as
/// its own settlement says and records its own change; a row rescheduled since its claim does
/// not change, and is not counted.
pub async fn one_settle_applies_each_claims_own_settlement(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let batch: Vec<NewTimer> = ["reached", "next", "failed", "retry", "moved"]
        .iter()
        .map(|id| timer("t", id, T0_MS))
        .collect();
    put(s, &batch, T0).await;
    let claimed = claim(s, T0, 10, "i1", T0_MS + 30_000).await;
    assert_eq!(claimed.len(), 5);
    let moved_to = at(T0_MS + 60_000);
    put(
        s,
        &[timer("t", "moved", moved_to.as_millis())],
        at(T0_MS + 1),
    )
    .await;
    let (next, retry_at, settled_at) = (at(T0_MS + 1_000), at(T0_MS + 2_000), at(T0_MS + 20));
    let settled: Vec<(ClaimedTimer, Settlement)> = claimed
        .into_iter()
        .map(|c| {
            let settlement = match c.key.service_call_id.as_str() {
                "next" => Settlement::Next(next),
                "failed" => Settlement::Failed("gone".into()),
                "retry" => Settlement::Retry {
                    at: retry_at,
                    error: Some("busy".into()),
                },
                _ => Settlement::Reached,
            };
            (c, settlement)
        })
        .collect();
    let changed = s
        .settle(&settled, "i1", settled_at)
        .await
        .unwrap_or_else(|e| panic!("settling a batch of every kind failed: {e}"));
    assert_eq!(changed, 4, "every row but the rescheduled one");
    let fired = Change::Fired {
        due_at: T0,
        lateness_ms: 20,
        instance: "i1".into(),
        occurrence: None,
        caught_up: false,
        refire: None,
        answer: None,
    };
    let cases = [
        ("reached", TimerState::Reached, T0, 0, None, fired.clone()),
        ("next", TimerState::Scheduled, next, 0, None, fired),
        (
            "failed",
            TimerState::Failed,
            T0,
            1,
            Some("gone"),
            Change::GivenUp {
                attempts: 1,
                error: "gone".into(),
            },
        ),
        (
            "retry",
            TimerState::Scheduled,
            T0,
            1,
            Some("busy"),
            Change::PublishFailed {
                attempt: 1,
                error: "busy".into(),
            },
        ),
        (
            "moved",
            TimerState::Scheduled,
            moved_to,
            0,
            None,
            Change::Rescheduled { due_at: moved_to },
        ),
    ];
    for (id, state, due_at, attempts, error, change) in cases {
        let t = row(s, "t", id).await;
        assert_eq!(
            (t.state, t.due_at, t.attempts, t.last_error.as_deref()),
            (state, due_at, attempts, error),
            "t/{id}"
        );
        let entries = history(s, id).await;
        assert_eq!(
            entries.last().map(|e| &e.change),
            Some(&change),
            "the last change of t/{id}"
        );
    }
    assert_eq!(next_due(s).await, Some(next), "next, then retry and moved");
}
