//! The Store conformance suite: every store plugin must pass each check against a fresh, isolated
//! instance. A check panics (with a message) on the first broken promise.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use timer_core::{
    decode_schedule, CancelOutcome, ClaimedTimer, Lease, Limits, NewTimer, Recurrence, Result,
    ScheduleOutcome, Settlement, Store, TimerKey, TimerState, Timestamp,
};

use crate::Check;

/// A fixed "now" far from the epoch, so offsets and arithmetic are realistic.
pub const T0: Timestamp = Timestamp::from_millis(1_800_000_000_000);

pub fn timer(tenant: &str, id: &str, due_ms: i64) -> NewTimer {
    NewTimer {
        key: TimerKey::new(tenant, id),
        due_at: Timestamp::from_millis(due_ms),
        correlation_id: None,
        payload: None,
        recurrence: None,
    }
}

fn lease(owner: &str, until_ms: i64) -> Lease {
    Lease {
        owner: owner.into(),
        until: Timestamp::from_millis(until_ms),
    }
}

fn at(ms: i64) -> Timestamp {
    Timestamp::from_millis(ms)
}

fn ids(claimed: &[ClaimedTimer]) -> Vec<String> {
    claimed
        .iter()
        .map(|c| c.key.service_call_id.clone())
        .collect()
}

async fn state_of(store: &dyn Store, tenant: &str, id: &str) -> TimerState {
    store
        .get(&TimerKey::new(tenant, id))
        .await
        .expect("get")
        .unwrap_or_else(|| panic!("timer {tenant}/{id} should exist"))
        .state
}

/// Every Store check, by name.
pub fn checks() -> Vec<Check<Arc<dyn Store>>> {
    crate::checks![
        upsert_outcomes,
        reschedule_moves_due_time,
        duplicate_key_in_one_batch,
        no_refire_after_reached,
        claim_takes_oldest_first_up_to_limit,
        claim_is_exclusive_under_concurrency,
        expired_lease_makes_row_claimable,
        release_keeps_attempts_and_last_error,
        release_without_error_keeps_attempts,
        reschedule_while_firing_keeps_timer_scheduled,
        next_due_at_tracks_claimable_rows,
        cancel_outcomes,
        purge_removes_only_old_finished_rows,
        millisecond_precision_across_offsets,
        payload_and_correlation_round_trip,
        batch_of_10k,
        cancel_while_leased_is_refused,
        fail_marks_failed_for_the_lease_holder_only,
        failed_timers_stay_failed_and_are_purged,
        recurrence_round_trips_and_advance_moves_to_next,
        advance_needs_the_lease_and_revision,
        rescheduling_a_recurring_timer_resets_its_count,
        scheduled_by_tenant_counts_scheduled_timers_only,
    ]
}

pub async fn upsert_outcomes(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let out = s
        .schedule(&[timer("t", "a", T0.as_millis() + 1_000)], T0)
        .await
        .expect("schedule");
    assert_eq!(out, vec![ScheduleOutcome::Created]);
    let got = s
        .get(&TimerKey::new("t", "a"))
        .await
        .expect("get")
        .expect("row");
    assert_eq!(got.state, TimerState::Scheduled);
    assert_eq!(got.registered_at, T0);
    assert_eq!(got.attempts, 0);
    assert_eq!(got.reached_at, None);

    let out = s
        .schedule(
            &[timer("t", "a", T0.as_millis() + 2_000)],
            at(T0.as_millis() + 10),
        )
        .await
        .expect("reschedule");
    assert_eq!(out, vec![ScheduleOutcome::Updated]);
    let got = s
        .get(&TimerKey::new("t", "a"))
        .await
        .expect("get")
        .expect("row");
    assert_eq!(got.registered_at, T0, "registered_at is kept on reschedule");

    // Fire it, then scheduling again changes nothing.
    let claimed = s
        .claim_due(
            at(T0.as_millis() + 2_000),
            10,
            &lease("i1", T0.as_millis() + 32_000),
        )
        .await
        .expect("claim");
    assert_eq!(ids(&claimed), ["a"]);
    let marked = s
        .mark_reached(&claimed, "i1", at(T0.as_millis() + 2_001))
        .await
        .expect("mark");
    assert_eq!(marked, 1);
    let out = s
        .schedule(&[timer("t", "a", T0.as_millis() + 9_000)], T0)
        .await
        .expect("schedule reached");
    assert_eq!(out, vec![ScheduleOutcome::AlreadyReached]);
    let got = s
        .get(&TimerKey::new("t", "a"))
        .await
        .expect("get")
        .expect("row");
    assert_eq!(got.state, TimerState::Reached);
    assert_eq!(
        got.due_at,
        at(T0.as_millis() + 2_000),
        "a reached timer keeps its due time"
    );
    assert_eq!(got.reached_at, Some(at(T0.as_millis() + 2_001)));

    s.schedule(&[timer("t", "b", T0.as_millis())], T0)
        .await
        .expect("schedule b");
    assert_eq!(
        s.cancel(&TimerKey::new("t", "b"), T0)
            .await
            .expect("cancel"),
        CancelOutcome::Cancelled
    );
    let out = s
        .schedule(&[timer("t", "b", T0.as_millis())], T0)
        .await
        .expect("schedule cancelled");
    assert_eq!(out, vec![ScheduleOutcome::AlreadyCancelled]);
    assert_eq!(state_of(s, "t", "b").await, TimerState::Cancelled);

    // The same service call id under another tenant is another timer.
    let out = s
        .schedule(&[timer("u", "a", T0.as_millis())], T0)
        .await
        .expect("other tenant");
    assert_eq!(out, vec![ScheduleOutcome::Created]);
    assert!(s
        .get(&TimerKey::new("v", "a"))
        .await
        .expect("get")
        .is_none());
}

pub async fn reschedule_moves_due_time(store: Arc<dyn Store>) {
    let s = store.as_ref();
    s.schedule(&[timer("t", "a", T0.as_millis() + 1_000)], T0)
        .await
        .expect("schedule");
    s.schedule(&[timer("t", "a", T0.as_millis() + 5_000)], T0)
        .await
        .expect("reschedule");
    let got = s
        .get(&TimerKey::new("t", "a"))
        .await
        .expect("get")
        .expect("row");
    assert_eq!(got.due_at, at(T0.as_millis() + 5_000));
    let early = s
        .claim_due(
            at(T0.as_millis() + 4_999),
            10,
            &lease("i1", T0.as_millis() + 60_000),
        )
        .await
        .expect("claim");
    assert!(
        early.is_empty(),
        "a moved timer is not due at its old time: {early:?}"
    );
    let due = s
        .claim_due(
            at(T0.as_millis() + 5_000),
            10,
            &lease("i1", T0.as_millis() + 60_000),
        )
        .await
        .expect("claim");
    assert_eq!(ids(&due), ["a"]);
    assert_eq!(due[0].due_at, at(T0.as_millis() + 5_000));

    // Moving it earlier works too.
    s.schedule(&[timer("t", "b", T0.as_millis() + 9_000)], T0)
        .await
        .expect("schedule b");
    s.schedule(&[timer("t", "b", T0.as_millis() + 100)], T0)
        .await
        .expect("move b earlier");
    let due = s
        .claim_due(
            at(T0.as_millis() + 100),
            10,
            &lease("i1", T0.as_millis() + 60_000),
        )
        .await
        .expect("claim");
    assert_eq!(ids(&due), ["b"]);
}

pub async fn duplicate_key_in_one_batch(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let out = s
        .schedule(
            &[
                timer("t", "a", T0.as_millis() + 1),
                timer("t", "a", T0.as_millis() + 2),
            ],
            T0,
        )
        .await
        .expect("schedule");
    assert_eq!(
        out,
        vec![ScheduleOutcome::Created, ScheduleOutcome::Updated]
    );
    let got = s
        .get(&TimerKey::new("t", "a"))
        .await
        .expect("get")
        .expect("row");
    assert_eq!(
        got.due_at,
        at(T0.as_millis() + 2),
        "the later entry of a batch wins"
    );
    assert_eq!(s.scheduled_count().await.expect("pending"), 1);
}

pub async fn no_refire_after_reached(store: Arc<dyn Store>) {
    let s = store.as_ref();
    s.schedule(&[timer("t", "a", T0.as_millis())], T0)
        .await
        .expect("schedule");
    let claimed = s
        .claim_due(T0, 10, &lease("i1", T0.as_millis() + 100))
        .await
        .expect("claim");
    assert_eq!(s.mark_reached(&claimed, "i1", T0).await.expect("mark"), 1);
    // Even long after every lease has run out, a Reached timer is never claimed again.
    let later = at(T0.as_millis() + 86_400_000);
    let again = s
        .claim_due(later, 10, &lease("i2", later.as_millis() + 100))
        .await
        .expect("claim");
    assert!(
        again.is_empty(),
        "a Reached timer was claimed again: {again:?}"
    );
    assert_eq!(s.next_due_at().await.expect("next"), None);
    assert_eq!(s.scheduled_count().await.expect("pending"), 0);
    // Marking twice does nothing more.
    assert_eq!(
        s.mark_reached(&claimed, "i1", T0)
            .await
            .expect("mark again"),
        0
    );
}

pub async fn claim_takes_oldest_first_up_to_limit(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let batch: Vec<NewTimer> = [5, 1, 4, 2, 3, 99]
        .iter()
        .map(|d| timer("t", &format!("d{d}"), T0.as_millis() + d))
        .collect();
    s.schedule(&batch, T0).await.expect("schedule");
    let now = at(T0.as_millis() + 10);
    let first = s
        .claim_due(now, 2, &lease("i1", now.as_millis() + 1_000))
        .await
        .expect("claim");
    assert_eq!(ids(&first), ["d1", "d2"]);
    let rest = s
        .claim_due(now, 10, &lease("i1", now.as_millis() + 1_000))
        .await
        .expect("claim");
    assert_eq!(ids(&rest), ["d3", "d4", "d5"], "d99 is not due yet");
    assert!(s
        .claim_due(now, 10, &lease("i1", 0))
        .await
        .expect("claim")
        .is_empty());
    assert!(
        s.claim_due(now, 0, &lease("i1", 0))
            .await
            .expect("claim")
            .is_empty(),
        "limit 0 claims nothing"
    );
}

pub async fn claim_is_exclusive_under_concurrency(store: Arc<dyn Store>) {
    const N: usize = 2_000;
    let batch: Vec<NewTimer> = (0..N)
        .map(|i| timer("t", &format!("c{i:05}"), T0.as_millis() + (i % 50) as i64))
        .collect();
    store.schedule(&batch, T0).await.expect("schedule");
    let now = at(T0.as_millis() + 100);
    let mut tasks = Vec::new();
    for worker in 0..8 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let owner = format!("w{worker}");
            let mut mine = Vec::new();
            loop {
                let got = store
                    .claim_due(now, 37, &lease(&owner, now.as_millis() + 60_000))
                    .await
                    .expect("claim");
                if got.is_empty() {
                    return mine;
                }
                mine.extend(got.into_iter().map(|c| c.key));
            }
        }));
    }
    let mut seen = HashSet::new();
    let mut total = 0;
    for task in tasks {
        for key in task.await.expect("claimer task") {
            total += 1;
            assert!(seen.insert(key.clone()), "{key} was claimed twice");
        }
    }
    assert_eq!(total, N, "every due timer claimed exactly once");
}

pub async fn expired_lease_makes_row_claimable(store: Arc<dyn Store>) {
    let s = store.as_ref();
    s.schedule(&[timer("t", "a", T0.as_millis())], T0)
        .await
        .expect("schedule");
    let first = s
        .claim_due(T0, 10, &lease("crashed", T0.as_millis() + 1_000))
        .await
        .expect("claim");
    assert_eq!(ids(&first), ["a"]);
    let during = at(T0.as_millis() + 999);
    assert!(
        s.claim_due(during, 10, &lease("other", during.as_millis() + 1_000))
            .await
            .expect("claim")
            .is_empty(),
        "a live lease keeps the row from others"
    );
    let after = at(T0.as_millis() + 1_000);
    let second = s
        .claim_due(after, 10, &lease("other", after.as_millis() + 1_000))
        .await
        .expect("claim");
    assert_eq!(
        ids(&second),
        ["a"],
        "an expired lease makes the row claimable"
    );
    // The old owner lost the lease: its mark does nothing; the new owner's does.
    assert_eq!(
        s.mark_reached(&first, "crashed", after)
            .await
            .expect("mark"),
        0
    );
    assert_eq!(state_of(s, "t", "a").await, TimerState::Scheduled);
    assert_eq!(
        s.mark_reached(&second, "other", after).await.expect("mark"),
        1
    );
    assert_eq!(state_of(s, "t", "a").await, TimerState::Reached);
}

pub async fn release_keeps_attempts_and_last_error(store: Arc<dyn Store>) {
    let s = store.as_ref();
    s.schedule(&[timer("t", "a", T0.as_millis())], T0)
        .await
        .expect("schedule");
    let claimed = s
        .claim_due(T0, 10, &lease("i1", T0.as_millis() + 30_000))
        .await
        .expect("claim");
    let retry_at = at(T0.as_millis() + 5_000);
    s.release(&claimed, "i1", retry_at, Some("broker said no"))
        .await
        .expect("release");
    let got = s
        .get(&TimerKey::new("t", "a"))
        .await
        .expect("get")
        .expect("row");
    assert_eq!(got.state, TimerState::Scheduled);
    assert_eq!(got.attempts, 1);
    assert_eq!(got.last_error.as_deref(), Some("broker said no"));
    assert_eq!(got.due_at, T0, "release keeps the due time");
    assert_eq!(s.next_due_at().await.expect("next"), Some(retry_at));
    let early = at(retry_at.as_millis() - 1);
    assert!(s
        .claim_due(early, 10, &lease("i1", early.as_millis() + 30_000))
        .await
        .expect("claim")
        .is_empty());
    let again = s
        .claim_due(retry_at, 10, &lease("i1", retry_at.as_millis() + 30_000))
        .await
        .expect("claim");
    assert_eq!(ids(&again), ["a"]);
    assert_eq!(again[0].attempts, 1);
    s.release(&again, "i1", retry_at, Some("still no"))
        .await
        .expect("release");
    let got = s
        .get(&TimerKey::new("t", "a"))
        .await
        .expect("get")
        .expect("row");
    assert_eq!(got.attempts, 2);
    assert_eq!(got.last_error.as_deref(), Some("still no"));
    // A release by someone who does not hold the lease changes nothing.
    s.release(&again, "stranger", retry_at, Some("x"))
        .await
        .expect("release");
    assert_eq!(
        s.get(&TimerKey::new("t", "a"))
            .await
            .expect("get")
            .expect("row")
            .attempts,
        2
    );
}

pub async fn release_without_error_keeps_attempts(store: Arc<dyn Store>) {
    let s = store.as_ref();
    s.schedule(&[timer("t", "a", T0.as_millis())], T0)
        .await
        .expect("schedule");
    let claimed = s
        .claim_due(T0, 10, &lease("i1", T0.as_millis() + 30_000))
        .await
        .expect("claim");
    s.release(&claimed, "i1", T0, None).await.expect("release");
    let got = s
        .get(&TimerKey::new("t", "a"))
        .await
        .expect("get")
        .expect("row");
    assert_eq!(got.attempts, 0);
    assert_eq!(got.last_error, None);
    let again = s
        .claim_due(T0, 10, &lease("i2", T0.as_millis() + 30_000))
        .await
        .expect("claim");
    assert_eq!(ids(&again), ["a"], "a released claim is claimable at once");
}

pub async fn reschedule_while_firing_keeps_timer_scheduled(store: Arc<dyn Store>) {
    let s = store.as_ref();
    s.schedule(&[timer("t", "a", T0.as_millis())], T0)
        .await
        .expect("schedule");
    let claimed = s
        .claim_due(T0, 10, &lease("i1", T0.as_millis() + 30_000))
        .await
        .expect("claim");
    let later = T0.as_millis() + 60_000;
    let out = s
        .schedule(&[timer("t", "a", later)], at(T0.as_millis() + 1))
        .await
        .expect("reschedule");
    assert_eq!(out, vec![ScheduleOutcome::Updated]);
    // The fire of the old due time completes, but the timer now waits for its new due time.
    assert_eq!(
        s.mark_reached(&claimed, "i1", at(T0.as_millis() + 2))
            .await
            .expect("mark"),
        0
    );
    let got = s
        .get(&TimerKey::new("t", "a"))
        .await
        .expect("get")
        .expect("row");
    assert_eq!(got.state, TimerState::Scheduled);
    assert_eq!(got.due_at, at(later));
    let again = s
        .claim_due(at(later), 10, &lease("i2", later + 30_000))
        .await
        .expect("claim");
    assert_eq!(ids(&again), ["a"]);
    // A repeated command with the same due time (a broker redelivery) does not disturb a fire.
    s.schedule(&[timer("t", "a", later)], at(later))
        .await
        .expect("same again");
    assert_eq!(
        s.mark_reached(&again, "i2", at(later)).await.expect("mark"),
        1
    );
}

pub async fn next_due_at_tracks_claimable_rows(store: Arc<dyn Store>) {
    let s = store.as_ref();
    assert_eq!(s.next_due_at().await.expect("next"), None, "empty store");
    s.schedule(
        &[
            timer("t", "a", T0.as_millis() + 300),
            timer("t", "b", T0.as_millis() + 100),
            timer("t", "c", T0.as_millis() + 200),
        ],
        T0,
    )
    .await
    .expect("schedule");
    assert_eq!(
        s.next_due_at().await.expect("next"),
        Some(at(T0.as_millis() + 100))
    );
    let now = at(T0.as_millis() + 100);
    s.claim_due(now, 1, &lease("i1", T0.as_millis() + 10_000))
        .await
        .expect("claim");
    assert_eq!(
        s.next_due_at().await.expect("next"),
        Some(at(T0.as_millis() + 200)),
        "a leased row counts from its lease expiry"
    );
    s.cancel(&TimerKey::new("t", "c"), now)
        .await
        .expect("cancel");
    assert_eq!(
        s.next_due_at().await.expect("next"),
        Some(at(T0.as_millis() + 300))
    );
    s.cancel(&TimerKey::new("t", "a"), now)
        .await
        .expect("cancel");
    assert_eq!(
        s.next_due_at().await.expect("next"),
        Some(at(T0.as_millis() + 10_000))
    );
}

pub async fn cancel_outcomes(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let key = TimerKey::new("t", "a");
    assert_eq!(
        s.cancel(&key, T0).await.expect("cancel"),
        CancelOutcome::NotFound
    );
    s.schedule(&[timer("t", "a", T0.as_millis())], T0)
        .await
        .expect("schedule");
    assert_eq!(
        s.cancel(&key, T0).await.expect("cancel"),
        CancelOutcome::Cancelled
    );
    assert_eq!(
        s.cancel(&key, T0).await.expect("cancel"),
        CancelOutcome::AlreadyCancelled
    );
    assert_eq!(state_of(s, "t", "a").await, TimerState::Cancelled);
    let later = at(T0.as_millis() + 1_000_000);
    assert!(
        s.claim_due(later, 10, &lease("i1", later.as_millis()))
            .await
            .expect("claim")
            .is_empty(),
        "a cancelled timer never fires"
    );
    s.schedule(&[timer("t", "b", T0.as_millis())], T0)
        .await
        .expect("schedule");
    let claimed = s
        .claim_due(T0, 10, &lease("i1", T0.as_millis() + 1_000))
        .await
        .expect("claim");
    s.mark_reached(&claimed, "i1", T0).await.expect("mark");
    assert_eq!(
        s.cancel(&TimerKey::new("t", "b"), T0)
            .await
            .expect("cancel"),
        CancelOutcome::AlreadyReached
    );
    assert_eq!(s.scheduled_count().await.expect("pending"), 0);
}

pub async fn purge_removes_only_old_finished_rows(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let batch: Vec<NewTimer> = (0..6)
        .map(|i| timer("t", &format!("p{i}"), T0.as_millis() + i))
        .collect();
    s.schedule(&batch, T0).await.expect("schedule");
    // p0..p2 reached at T0, p3 cancelled at T0, p4 reached much later, p5 stays scheduled.
    let claimed = s
        .claim_due(
            at(T0.as_millis() + 2),
            3,
            &lease("i1", T0.as_millis() + 1_000),
        )
        .await
        .expect("claim");
    assert_eq!(ids(&claimed), ["p0", "p1", "p2"]);
    s.mark_reached(&claimed, "i1", T0).await.expect("mark");
    s.cancel(&TimerKey::new("t", "p3"), T0)
        .await
        .expect("cancel");
    let late = at(T0.as_millis() + 100_000);
    let p4 = s
        .claim_due(late, 1, &lease("i1", late.as_millis() + 1_000))
        .await
        .expect("claim");
    assert_eq!(ids(&p4), ["p4"]);
    s.mark_reached(&p4, "i1", late).await.expect("mark");

    let cutoff = at(T0.as_millis() + 1);
    assert_eq!(
        s.purge(cutoff, 2).await.expect("purge"),
        2,
        "purge respects its limit"
    );
    assert_eq!(s.purge(cutoff, 100).await.expect("purge"), 2);
    assert_eq!(s.purge(cutoff, 100).await.expect("purge"), 0);
    for id in ["p0", "p1", "p2", "p3"] {
        assert!(
            s.get(&TimerKey::new("t", id)).await.expect("get").is_none(),
            "{id} purged"
        );
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

pub async fn millisecond_precision_across_offsets(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let limits = Limits::default();
    // The same instant written in three offsets, and its neighbours one millisecond apart.
    let commands = [
        (
            r#"{"tenantId":"t","serviceCallId":"utc","dueAt":"2027-03-01T12:00:00.500Z"}"#,
            0,
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"plus","dueAt":"2027-03-01T13:30:00.500+01:30"}"#,
            0,
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"minus","dueAt":"2027-03-01T07:00:00.500-05:00"}"#,
            0,
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"next","dueAt":"2027-03-01T12:00:00.501Z"}"#,
            1,
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"prev","dueAt":"2027-03-01T12:00:00.499Z"}"#,
            -1,
        ),
    ];
    let base = chrono::DateTime::parse_from_rfc3339("2027-03-01T12:00:00.500Z")
        .expect("valid")
        .timestamp_millis();
    let mut batch = Vec::new();
    for (json, delta) in commands {
        let t = decode_schedule(json.as_bytes(), &limits, T0).expect("valid command");
        assert_eq!(t.due_at.as_millis(), base + delta, "{json}");
        batch.push(t);
    }
    s.schedule(&batch, T0).await.expect("schedule");
    for (id, delta) in [
        ("utc", 0),
        ("plus", 0),
        ("minus", 0),
        ("next", 1),
        ("prev", -1),
    ] {
        let got = s
            .get(&TimerKey::new("t", id))
            .await
            .expect("get")
            .expect("row");
        assert_eq!(
            got.due_at.as_millis(),
            base + delta,
            "{id} stored to the millisecond"
        );
    }
    let l = lease("i1", base + 60_000);
    assert_eq!(
        ids(&s.claim_due(at(base - 2), 10, &l).await.expect("claim")),
        Vec::<String>::new()
    );
    assert_eq!(
        ids(&s.claim_due(at(base - 1), 10, &l).await.expect("claim")),
        ["prev"]
    );
    let mut same = ids(&s.claim_due(at(base), 10, &l).await.expect("claim"));
    same.sort();
    assert_eq!(
        same,
        ["minus", "plus", "utc"],
        "due exactly at now is due (inclusive)"
    );
    assert_eq!(
        ids(&s.claim_due(at(base + 1), 10, &l).await.expect("claim")),
        ["next"]
    );
}

pub async fn payload_and_correlation_round_trip(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let payload = r#"{"order":{"id":42,"items":["ä","\u0000"]},"n":1.5e3}"#;
    let t = NewTimer {
        key: TimerKey::new("tenant-ü", "call/1 with spaces"),
        due_at: T0,
        correlation_id: Some("corr-1".into()),
        payload: Some(payload.into()),
        recurrence: None,
    };
    s.schedule(std::slice::from_ref(&t), T0)
        .await
        .expect("schedule");
    let got = s.get(&t.key).await.expect("get").expect("row");
    assert_eq!(got.payload.as_deref(), Some(payload));
    assert_eq!(got.correlation_id.as_deref(), Some("corr-1"));
    let claimed = s
        .claim_due(T0, 1, &lease("i1", T0.as_millis() + 1_000))
        .await
        .expect("claim");
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].key, t.key);
    assert_eq!(claimed[0].payload.as_deref(), Some(payload));
    assert_eq!(claimed[0].correlation_id.as_deref(), Some("corr-1"));
    assert_eq!(claimed[0].registered_at, T0);
}

pub async fn batch_of_10k(store: Arc<dyn Store>) {
    const N: usize = 10_000;
    let s = store.as_ref();
    let batch: Vec<NewTimer> = (0..N)
        .map(|i| {
            timer(
                &format!("tenant{}", i % 7),
                &format!("b{i:05}"),
                T0.as_millis() + (i % 1000) as i64,
            )
        })
        .collect();
    let out = tokio::time::timeout(Duration::from_secs(120), s.schedule(&batch, T0))
        .await
        .expect("a 10k batch finishes")
        .expect("schedule");
    assert_eq!(out.len(), N);
    assert!(out.iter().all(|o| *o == ScheduleOutcome::Created));
    assert_eq!(s.scheduled_count().await.expect("pending"), N as u64);
    let now = at(T0.as_millis() + 1_000);
    let mut seen = HashSet::new();
    loop {
        let got = s
            .claim_due(now, 1_000, &lease("i1", now.as_millis() + 60_000))
            .await
            .expect("claim");
        if got.is_empty() {
            break;
        }
        assert_eq!(
            s.mark_reached(&got, "i1", now).await.expect("mark"),
            got.len() as u64
        );
        for c in got {
            assert!(seen.insert(c.key), "claimed twice");
        }
    }
    assert_eq!(seen.len(), N);
    assert_eq!(s.scheduled_count().await.expect("pending"), 0);
}

fn recurring(tenant: &str, id: &str, due_ms: i64, cron: &str) -> NewTimer {
    NewTimer {
        recurrence: Some(Recurrence {
            cron: cron.into(),
            time_zone: "Europe/Berlin".into(),
            end_at: Some(at(T0.as_millis() + 86_400_000)),
            max_occurrences: Some(7),
        }),
        ..timer(tenant, id, due_ms)
    }
}

pub async fn cancel_while_leased_is_refused(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let key = TimerKey::new("t", "a");
    s.schedule(&[timer("t", "a", T0.as_millis())], T0)
        .await
        .expect("schedule");
    let claimed = s
        .claim_due(T0, 10, &lease("i1", T0.as_millis() + 1_000))
        .await
        .expect("claim");
    assert_eq!(claimed.len(), 1);
    // While the lease is live the event may be on its way: the cancel changes nothing.
    assert_eq!(
        s.cancel(&key, at(T0.as_millis() + 10))
            .await
            .expect("cancel"),
        CancelOutcome::Firing
    );
    assert_eq!(state_of(s, "t", "a").await, TimerState::Scheduled);
    // The publish failed: released for a retry, the timer can be cancelled and never fires.
    s.release(
        &claimed,
        "i1",
        at(T0.as_millis() + 500),
        Some("broker down"),
    )
    .await
    .expect("release");
    assert_eq!(
        s.cancel(&key, at(T0.as_millis() + 20))
            .await
            .expect("cancel"),
        CancelOutcome::Cancelled
    );
    assert_eq!(
        s.mark_reached(&claimed, "i1", at(T0.as_millis() + 30))
            .await
            .expect("mark"),
        0,
        "a late mark does not revive it"
    );
    let later = at(T0.as_millis() + 10_000);
    assert!(s
        .claim_due(later, 10, &lease("i2", later.as_millis() + 1_000))
        .await
        .expect("claim")
        .is_empty());
    // Rescheduled far ahead while leased: "firing" only until the lease ends, not until the new
    // due time.
    s.schedule(&[timer("t", "far", T0.as_millis())], T0)
        .await
        .expect("schedule");
    let far = s
        .claim_due(T0, 10, &lease("i1", T0.as_millis() + 1_000))
        .await
        .expect("claim");
    assert_eq!(ids(&far), ["far"]);
    s.schedule(&[timer("t", "far", T0.as_millis() + 7 * 86_400_000)], T0)
        .await
        .expect("reschedule");
    assert_eq!(
        s.cancel(&TimerKey::new("t", "far"), at(T0.as_millis() + 500))
            .await
            .expect("cancel"),
        CancelOutcome::Firing
    );
    assert_eq!(
        s.cancel(&TimerKey::new("t", "far"), at(T0.as_millis() + 1_001))
            .await
            .expect("cancel"),
        CancelOutcome::Cancelled
    );
    // A lease that expired (its holder crashed) no longer blocks a cancel.
    s.schedule(&[timer("t", "b", T0.as_millis())], T0)
        .await
        .expect("schedule");
    s.claim_due(T0, 10, &lease("i1", T0.as_millis() + 1_000))
        .await
        .expect("claim");
    assert_eq!(
        s.cancel(&TimerKey::new("t", "b"), at(T0.as_millis() + 1_001))
            .await
            .expect("cancel"),
        CancelOutcome::Cancelled
    );
}

pub async fn fail_marks_failed_for_the_lease_holder_only(store: Arc<dyn Store>) {
    let s = store.as_ref();
    s.schedule(&[timer("t", "a", T0.as_millis())], T0)
        .await
        .expect("schedule");
    let claimed = s
        .claim_due(T0, 10, &lease("i1", T0.as_millis() + 1_000))
        .await
        .expect("claim");
    assert_eq!(
        s.fail(&claimed, "i2", T0, "not mine").await.expect("fail"),
        0,
        "only the lease holder fails it"
    );
    assert_eq!(
        s.fail(&claimed, "i1", at(T0.as_millis() + 5), "broker down")
            .await
            .expect("fail"),
        1
    );
    let t = s
        .get(&TimerKey::new("t", "a"))
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(t.state, TimerState::Failed);
    assert_eq!(t.attempts, 1, "the last attempt counts");
    assert_eq!(t.last_error.as_deref(), Some("broker down"));
    assert_eq!(s.scheduled_count().await.expect("pending"), 0);
    assert_eq!(s.next_due_at().await.expect("next"), None);
}

pub async fn failed_timers_stay_failed_and_are_purged(store: Arc<dyn Store>) {
    let s = store.as_ref();
    s.schedule(&[timer("t", "a", T0.as_millis())], T0)
        .await
        .expect("schedule");
    let claimed = s
        .claim_due(T0, 10, &lease("i1", T0.as_millis() + 1_000))
        .await
        .expect("claim");
    s.fail(&claimed, "i1", T0, "down").await.expect("fail");
    let out = s
        .schedule(&[timer("t", "a", T0.as_millis() + 5_000)], T0)
        .await
        .expect("schedule");
    assert_eq!(out, vec![ScheduleOutcome::AlreadyFailed]);
    assert_eq!(
        s.cancel(&TimerKey::new("t", "a"), T0)
            .await
            .expect("cancel"),
        CancelOutcome::AlreadyFailed
    );
    assert_eq!(s.purge(at(T0.as_millis() + 1), 10).await.expect("purge"), 1);
    assert!(s
        .get(&TimerKey::new("t", "a"))
        .await
        .expect("get")
        .is_none());
}

pub async fn recurrence_round_trips_and_advance_moves_to_next(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let new = recurring("t", "r", T0.as_millis(), "*/10 * * * * *");
    s.schedule(std::slice::from_ref(&new), T0)
        .await
        .expect("schedule");
    let stored = s.get(&new.key).await.expect("get").expect("exists");
    assert_eq!(
        stored.recurrence, new.recurrence,
        "recurrence kept as given"
    );
    assert_eq!(stored.occurrences, 0);
    let claimed = s
        .claim_due(T0, 10, &lease("i1", T0.as_millis() + 1_000))
        .await
        .expect("claim");
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].recurrence, new.recurrence);
    assert_eq!(claimed[0].occurrences, 0);
    let next = at(T0.as_millis() + 10_000);
    let fired_at = at(T0.as_millis() + 3);
    assert_eq!(
        s.advance(&[(claimed[0].clone(), next)], "i1", fired_at)
            .await
            .expect("advance"),
        1
    );
    let t = s.get(&new.key).await.expect("get").expect("exists");
    assert_eq!(t.state, TimerState::Scheduled);
    assert_eq!(t.due_at, next);
    assert_eq!(t.available_at, next);
    assert_eq!(t.occurrences, 1);
    assert_eq!(t.reached_at, Some(fired_at), "reachedAt is the last fire");
    assert_eq!(t.lease_owner, None);
    assert_eq!(s.next_due_at().await.expect("next"), Some(next));
    assert!(
        s.claim_due(
            at(next.as_millis() - 1),
            10,
            &lease("i1", next.as_millis() + 1_000)
        )
        .await
        .expect("claim")
        .is_empty(),
        "not before the next occurrence"
    );
    let again = s
        .claim_due(next, 10, &lease("i1", next.as_millis() + 1_000))
        .await
        .expect("claim");
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].occurrences, 1);
    assert!(
        again[0].revision > claimed[0].revision,
        "each occurrence its own revision"
    );
    // The last occurrence: marked Reached like a one-shot timer, and counted.
    s.mark_reached(&again, "i1", next).await.expect("mark");
    let t = s.get(&new.key).await.expect("get").expect("exists");
    assert_eq!(t.state, TimerState::Reached);
    assert_eq!(t.occurrences, 2, "every fired occurrence counted");
}

pub async fn advance_needs_the_lease_and_revision(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let new = recurring("t", "r", T0.as_millis(), "0 * * * * *");
    s.schedule(std::slice::from_ref(&new), T0)
        .await
        .expect("schedule");
    let claimed = s
        .claim_due(T0, 10, &lease("i1", T0.as_millis() + 1_000))
        .await
        .expect("claim");
    let next = at(T0.as_millis() + 60_000);
    assert_eq!(
        s.advance(&[(claimed[0].clone(), next)], "i2", T0)
            .await
            .expect("advance"),
        0,
        "not the lease holder"
    );
    // Rescheduled (another pattern) while firing: the new series wins over the computed
    // occurrence of the old one.
    let moved = recurring("t", "r", T0.as_millis() + 5_000, "5 * * * * *");
    s.schedule(&[moved], T0).await.expect("reschedule");
    assert_eq!(
        s.advance(&[(claimed[0].clone(), next)], "i1", T0)
            .await
            .expect("advance"),
        0,
        "stale revision"
    );
    let t = s.get(&new.key).await.expect("get").expect("exists");
    assert_eq!(t.due_at, at(T0.as_millis() + 5_000));
    assert_eq!(t.occurrences, 0);
}

pub async fn rescheduling_a_recurring_timer_resets_its_count(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let new = recurring("t", "r", T0.as_millis(), "0 * * * * *");
    s.schedule(std::slice::from_ref(&new), T0)
        .await
        .expect("schedule");
    let claimed = s
        .claim_due(T0, 10, &lease("i1", T0.as_millis() + 1_000))
        .await
        .expect("claim");
    s.advance(
        &[(claimed[0].clone(), at(T0.as_millis() + 60_000))],
        "i1",
        T0,
    )
    .await
    .expect("advance");
    // Same pattern again (a redelivered command, computed later): the series keeps its place,
    // its next occurrence and its count.
    s.schedule(
        &[recurring("t", "r", T0.as_millis() + 120_000, "0 * * * * *")],
        T0,
    )
    .await
    .expect("schedule");
    let t = s.get(&new.key).await.expect("get").expect("t");
    assert_eq!(t.occurrences, 1);
    assert_eq!(t.due_at, at(T0.as_millis() + 60_000), "not re-anchored");
    assert_eq!(t.available_at, at(T0.as_millis() + 60_000));
    // Another pattern at the same due time: a new series, and a new revision, so a fire of
    // the old pattern in flight cannot move it on.
    let claimed = s
        .claim_due(
            at(T0.as_millis() + 60_000),
            10,
            &lease("i1", T0.as_millis() + 61_000),
        )
        .await
        .expect("claim");
    let same_due = recurring("t", "r", T0.as_millis() + 60_000, "0 */5 * * * *");
    s.schedule(std::slice::from_ref(&same_due), T0)
        .await
        .expect("schedule");
    assert_eq!(
        s.advance(
            &[(claimed[0].clone(), at(T0.as_millis() + 61_000))],
            "i1",
            T0
        )
        .await
        .expect("advance"),
        0,
        "the old pattern's fire does not move the new series"
    );
    s.release(&claimed, "i1", T0, None).await.expect("release");
    let other = recurring("t", "r", T0.as_millis() + 120_000, "0 */2 * * * *");
    s.schedule(std::slice::from_ref(&other), T0)
        .await
        .expect("schedule");
    let t = s.get(&new.key).await.expect("get").expect("t");
    assert_eq!(t.occurrences, 0);
    assert_eq!(t.recurrence, other.recurrence);
    // A one-shot schedule of the same key turns it into a one-shot timer.
    s.schedule(&[timer("t", "r", T0.as_millis() + 1_000)], T0)
        .await
        .expect("schedule");
    let t = s.get(&new.key).await.expect("get").expect("t");
    assert_eq!(t.recurrence, None);
}

pub async fn scheduled_by_tenant_counts_scheduled_timers_only(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let mut batch: Vec<NewTimer> = (0..5)
        .map(|i| timer("a", &format!("a{i}"), T0.as_millis() + 1_000 + i))
        .collect();
    batch.push(timer("b", "b0", T0.as_millis() + 1_000));
    batch.push(timer("c", "due", T0.as_millis()));
    s.schedule(&batch, T0).await.expect("schedule");
    s.cancel(&TimerKey::new("a", "a0"), T0)
        .await
        .expect("cancel");
    let claimed = s
        .claim_due(T0, 10, &lease("i1", T0.as_millis() + 1_000))
        .await
        .expect("claim");
    s.mark_reached(&claimed, "i1", T0).await.expect("mark");
    let counts = s
        .tenant_counts()
        .expect("the store counts timers per tenant")
        .scheduled_by_tenant(&["a".into(), "b".into(), "c".into(), "nobody".into()])
        .await
        .expect("count");
    assert_eq!(
        counts.get("a"),
        Some(&4),
        "cancelled ones do not count: {counts:?}"
    );
    assert_eq!(counts.get("b"), Some(&1));
    assert_eq!(
        counts.get("c"),
        None,
        "reached ones do not count: {counts:?}"
    );
    assert_eq!(counts.get("nobody"), None);
    let only_b = s
        .tenant_counts()
        .expect("the store counts timers per tenant")
        .scheduled_by_tenant(&["b".into()])
        .await
        .expect("count");
    assert_eq!(only_b.len(), 1, "only the tenants asked for");
}

/// The four ways of settling a claim, as shorthands over [`Store::settle`], so each check
/// reads as the step it tests.
#[async_trait::async_trait]
trait SettleAs: Store {
    async fn mark_reached(
        &self,
        claims: &[ClaimedTimer],
        owner: &str,
        at: Timestamp,
    ) -> Result<u64> {
        self.settle(&each(claims, |_| Settlement::Reached), owner, at)
            .await
    }

    async fn advance(
        &self,
        claims: &[(ClaimedTimer, Timestamp)],
        owner: &str,
        at: Timestamp,
    ) -> Result<u64> {
        let settled: Vec<_> = claims
            .iter()
            .map(|(c, next)| (c.clone(), Settlement::Next(*next)))
            .collect();
        self.settle(&settled, owner, at).await
    }

    async fn fail(
        &self,
        claims: &[ClaimedTimer],
        owner: &str,
        at: Timestamp,
        error: &str,
    ) -> Result<u64> {
        let settled = each(claims, |_| Settlement::Failed(error.to_owned()));
        self.settle(&settled, owner, at).await
    }

    async fn release(
        &self,
        claims: &[ClaimedTimer],
        owner: &str,
        retry_at: Timestamp,
        error: Option<&str>,
    ) -> Result<u64> {
        let error = error.map(str::to_owned);
        let settled = each(claims, |_| Settlement::Retry {
            at: retry_at,
            error: error.clone(),
        });
        self.settle(&settled, owner, retry_at).await
    }
}

impl SettleAs for dyn Store {}

fn each(
    claims: &[ClaimedTimer],
    settlement: impl Fn(&ClaimedTimer) -> Settlement,
) -> Vec<(ClaimedTimer, Settlement)> {
    claims.iter().map(|c| (c.clone(), settlement(c))).collect()
}
