//! The Store conformance suite: every store plugin must pass each check against a fresh, isolated
//! instance. A check panics (with a message) on the first broken promise.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use timer_core::{
    decode_schedule, Action, CancelOutcome, Change, ClaimedTimer, ControlOutcome, HistoryEntry,
    Lease, Limits, NewTimer, PageAfter, Recurrence, ScheduleOutcome, Settlement, Store,
    TenantSummary, Timer, TimerControl, TimerFilter, TimerHistory, TimerKey, TimerQueries,
    TimerState, Timestamp,
};

use timer_core::plugin::StoreConfig;
use timer_core::{ErrorKind, TakenOver};

use crate::Check;

/// A fixed "now" far from the epoch, so offsets and arithmetic are realistic.
pub const T0: Timestamp = Timestamp::from_millis(1_800_000_000_000);
const T0_MS: i64 = T0.as_millis();

pub fn timer(tenant: &str, id: &str, due_ms: i64) -> NewTimer {
    NewTimer {
        key: TimerKey::new(tenant, id),
        due_at: Timestamp::from_millis(due_ms),
        correlation_id: None,
        payload: None,
        recurrence: None,
        policy: None,
        work: None,
    }
}

fn recurring(tenant: &str, id: &str, due_ms: i64, cron: &str) -> NewTimer {
    NewTimer {
        recurrence: Some(Recurrence {
            cron: cron.into(),
            time_zone: "Europe/Berlin".into(),
            end_at: Some(at(T0_MS + 86_400_000)),
            max_occurrences: Some(7),
        }),
        ..timer(tenant, id, due_ms)
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
        live_by_tenant_counts_scheduled_and_paused_timers,
        list_orders_by_due_time_then_id_within_the_tenant,
        list_filters_combine,
        list_compares_ids_byte_by_byte,
        list_pages_are_stable_under_concurrent_writes,
        summaries_count_states_next_due_and_recent_failures,
        pause_resume_and_cancel_outcomes,
        retry_schedules_a_failed_timer_again,
        a_paused_timer_never_fires_and_resumes_on_its_due_time,
        pausing_a_firing_timer_is_refused,
        a_resumed_series_skips_what_fell_into_the_pause,
        rescheduling_a_paused_timer_keeps_it_paused,
        history_records_each_change_in_order,
        history_keeps_the_newest_entries_and_goes_with_the_timer,
        count_counts_each_state,
        renew_extends_only_the_owners_leases,
    ]
}

/// A store and its config, for checks that open the same resource again.
pub type FreshStore = crate::fixtures::Fresh<Arc<dyn Store>, dyn StoreConfig>;

/// The checks about restarts and dead instances, by name: each opens the store again (a
/// restart, or a second instance).
pub fn restart_checks() -> Vec<Check<FreshStore>> {
    crate::checks![
        a_restart_releases_every_lease_of_a_store_one_service_owns,
        dead_owners_are_taken_over_at_once,
    ]
}

pub async fn upsert_outcomes(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let out = put(s, &[timer("t", "a", T0_MS + 1_000)], T0).await;
    assert_eq!(out, vec![ScheduleOutcome::Created]);
    let got = row(s, "t", "a").await;
    assert_eq!(got.state, TimerState::Scheduled);
    assert_eq!(got.registered_at, T0);
    assert_eq!(got.attempts, 0);
    assert_eq!(got.reached_at, None);

    let out = put(s, &[timer("t", "a", T0_MS + 2_000)], at(T0_MS + 10)).await;
    assert_eq!(out, vec![ScheduleOutcome::Updated]);
    let got = row(s, "t", "a").await;
    assert_eq!(got.registered_at, T0, "registered_at is kept on reschedule");

    // Fire it, then scheduling again changes nothing.
    let claimed = claim(s, at(T0_MS + 2_000), 10, "i1", T0_MS + 32_000).await;
    assert_eq!(ids(&claimed), ["a"]);
    assert_eq!(mark_reached(s, &claimed, "i1", at(T0_MS + 2_001)).await, 1);
    let out = put(s, &[timer("t", "a", T0_MS + 9_000)], T0).await;
    assert_eq!(out, vec![ScheduleOutcome::AlreadyReached]);
    let got = row(s, "t", "a").await;
    assert_eq!(got.state, TimerState::Reached);
    assert_eq!(
        got.due_at,
        at(T0_MS + 2_000),
        "a reached timer keeps its due time"
    );
    assert_eq!(got.reached_at, Some(at(T0_MS + 2_001)));

    put(s, &[timer("t", "b", T0_MS)], T0).await;
    assert_eq!(cancel(s, "t", "b", T0).await, CancelOutcome::Cancelled);
    let out = put(s, &[timer("t", "b", T0_MS)], T0).await;
    assert_eq!(out, vec![ScheduleOutcome::AlreadyCancelled]);
    assert_eq!(state_of(s, "t", "b").await, TimerState::Cancelled);

    // The same service call id under another tenant is another timer.
    let out = put(s, &[timer("u", "a", T0_MS)], T0).await;
    assert_eq!(out, vec![ScheduleOutcome::Created]);
    assert!(find(s, "v", "a").await.is_none());
}

pub async fn reschedule_moves_due_time(store: Arc<dyn Store>) {
    let s = store.as_ref();
    put(s, &[timer("t", "a", T0_MS + 1_000)], T0).await;
    put(s, &[timer("t", "a", T0_MS + 5_000)], T0).await;
    assert_eq!(row(s, "t", "a").await.due_at, at(T0_MS + 5_000));
    let early = claim(s, at(T0_MS + 4_999), 10, "i1", T0_MS + 60_000).await;
    assert!(
        early.is_empty(),
        "a moved timer is not due at its old time: {early:?}"
    );
    let due = claim(s, at(T0_MS + 5_000), 10, "i1", T0_MS + 60_000).await;
    assert_eq!(ids(&due), ["a"]);
    assert_eq!(due[0].due_at, at(T0_MS + 5_000));

    // Moving it earlier works too.
    put(s, &[timer("t", "b", T0_MS + 9_000)], T0).await;
    put(s, &[timer("t", "b", T0_MS + 100)], T0).await;
    let due = claim(s, at(T0_MS + 100), 10, "i1", T0_MS + 60_000).await;
    assert_eq!(ids(&due), ["b"]);
}

pub async fn duplicate_key_in_one_batch(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let batch = [timer("t", "a", T0_MS + 1), timer("t", "a", T0_MS + 2)];
    let out = put(s, &batch, T0).await;
    assert_eq!(
        out,
        vec![ScheduleOutcome::Created, ScheduleOutcome::Updated]
    );
    assert_eq!(
        row(s, "t", "a").await.due_at,
        at(T0_MS + 2),
        "the later entry of a batch wins"
    );
    assert_eq!(scheduled_count(s).await, 1);
    // A big batch (stores may write it in several statements) with a key early and late.
    let mut big: Vec<NewTimer> = (0..2_500)
        .map(|i| timer("big", &format!("k{i:04}"), T0_MS + 10))
        .collect();
    big[2_010] = timer("big", "k0010", T0_MS + 20);
    let out = put(s, &big, T0).await;
    assert_eq!(out[10], ScheduleOutcome::Created);
    assert_eq!(out[2_010], ScheduleOutcome::Updated, "the repeat updates");
    let created = out
        .iter()
        .filter(|o| **o == ScheduleOutcome::Created)
        .count();
    assert_eq!(created, 2_499);
    assert_eq!(row(s, "big", "k0010").await.due_at, at(T0_MS + 20));
    assert_eq!(scheduled_count(s).await, 2_500);
}

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

pub async fn claim_is_exclusive_under_concurrency(store: Arc<dyn Store>) {
    const N: usize = 2_000;
    let batch: Vec<NewTimer> = (0..N)
        .map(|i| timer("t", &format!("c{i:05}"), T0_MS + (i % 50) as i64))
        .collect();
    put(store.as_ref(), &batch, T0).await;
    let now = at(T0_MS + 100);
    let mut tasks = Vec::new();
    for worker in 0..8 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let owner = format!("w{worker}");
            let mut mine = Vec::new();
            loop {
                let got = claim(store.as_ref(), now, 37, &owner, now.as_millis() + 60_000).await;
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

pub async fn renew_extends_only_the_owners_leases(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let claimed = schedule_and_claim(s, timer("t", "a", T0_MS), "i1", T0_MS + 1_000).await;
    assert_eq!(ids(&claimed), ["a"]);
    let keys = [TimerKey::new("t", "a"), TimerKey::new("t", "missing")];
    let renew = |owner: &'static str, until_ms: i64| {
        let keys = keys.clone();
        async move {
            s.renew(&keys, owner, at(until_ms))
                .await
                .unwrap_or_else(|e| panic!("renewing for {owner} failed: {e}"))
        }
    };
    assert_eq!(renew("stranger", T0_MS + 9_000).await, 0, "not its lease");
    assert_eq!(renew("i1", T0_MS + 5_000).await, 1, "the holder renews");
    assert!(
        claim(s, at(T0_MS + 4_999), 10, "i2", T0_MS + 9_000)
            .await
            .is_empty(),
        "a renewed lease keeps the row from others until its new end"
    );
    assert_eq!(
        cancel(s, "t", "a", at(T0_MS + 4_999)).await,
        CancelOutcome::Firing,
        "a renewed lease is live for a cancel too"
    );
    assert_eq!(
        mark_reached(s, &claimed, "i1", at(T0_MS + 4_000)).await,
        1,
        "the holder settles after renewing"
    );
    assert_eq!(
        renew("i1", T0_MS + 9_000).await,
        0,
        "a settled claim has no lease"
    );

    // A lease that ran out and was claimed by another is that one's.
    let b = schedule_and_claim(s, timer("t", "b", T0_MS), "i1", T0_MS + 1_000).await;
    assert_eq!(ids(&b), ["b"]);
    let taken = claim(s, at(T0_MS + 1_000), 10, "i2", T0_MS + 2_000).await;
    assert_eq!(ids(&taken), ["b"]);
    assert_eq!(
        s.renew(&[TimerKey::new("t", "b")], "i1", at(T0_MS + 9_000))
            .await
            .expect("renew"),
        0,
        "the old holder renews nothing"
    );
    assert!(
        claim(s, at(T0_MS + 2_000), 10, "i3", T0_MS + 3_000)
            .await
            .iter()
            .any(|t| t.key.service_call_id == "b"),
        "the new holder's lease ends as it was set"
    );
}

/// A store that keeps its timers across a restart and cannot tell dead lease owners from live
/// ones is opened by one service at a time: a second open is refused while the first is open,
/// and an open releases every lease in it (they belong to a run that ended).
pub async fn a_restart_releases_every_lease_of_a_store_one_service_owns(fresh: FreshStore) {
    let (store, config, _keep) = fresh.into_parts();
    if store.lease_owners().is_some() {
        return; // dead_owners_are_taken_over_at_once
    }
    let s = store.as_ref();
    put(s, &[timer("t", "late", T0_MS + 60_000)], T0).await;
    let claimed = schedule_and_claim(s, timer("t", "a", T0_MS), "old", T0_MS + 3_600_000).await;
    assert_eq!(ids(&claimed), ["a"]);
    match config.open().await {
        Ok(other) => {
            let persists = other.get(&TimerKey::new("t", "a")).await.ok().flatten();
            assert!(
                persists.is_none(),
                "a second service opened a store with this one's timers while it ran, and \
                 cannot tell which leases are dead"
            );
            return; // a store in process memory: nothing survives a restart
        }
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::Config, "{}", e.chain());
            assert!(
                e.chain().contains("in use"),
                "names the conflict: {}",
                e.chain()
            );
        }
    }
    drop(store);
    let reopened = config
        .open()
        .await
        .unwrap_or_else(|e| panic!("opening again after the first closed: {}", e.chain()));
    let s = reopened.as_ref();
    let again = claim(s, T0, 10, "new", T0_MS + 1_000).await;
    assert_eq!(
        ids(&again),
        ["a"],
        "the lease of the run that ended is released at the restart"
    );
    assert_eq!(row(s, "t", "late").await.available_at, at(T0_MS + 60_000));
}

/// With lease owners, an owner's leases come back the moment it is found dead (claimable
/// `lost_within` later), never while it lives; two live owners never share a name.
pub async fn dead_owners_are_taken_over_at_once(fresh: FreshStore) {
    let (store, config, _keep) = fresh.into_parts();
    let Some(owners) = store.lease_owners() else {
        return; // a_restart_releases_every_lease_of_a_store_one_service_owns
    };
    let second = config
        .open()
        .await
        .unwrap_or_else(|e| panic!("a second instance on the store: {}", e.chain()));
    let others = second
        .lease_owners()
        .expect("the same plugin has the ability");
    let s = store.as_ref();
    let i1 = owners.join("i1", T0).await.expect("i1 joins");
    let refused = others
        .join("i1", T0)
        .await
        .err()
        .expect("a live name is refused");
    assert_eq!(refused.kind(), ErrorKind::Config, "{}", refused.chain());
    assert!(
        refused.chain().contains("\"i1\""),
        "names it: {}",
        refused.chain()
    );
    let i2 = others.join("i2", T0).await.expect("i2 joins");

    put(
        s,
        &[timer("t", "a", T0_MS), timer("t", "b", T0_MS + 10)],
        T0,
    )
    .await;
    let claimed = claim(s, at(T0_MS + 10), 10, "i1", T0_MS + 3_600_000).await;
    assert_eq!(ids(&claimed), ["a", "b"]);
    let release_at = at(T0_MS + 1_000);
    let taken = others.take_over(release_at).await.expect("take over");
    assert_eq!(taken, [], "nothing of a live owner");

    drop(i1); // the instance dies: its connection ends
    let taken = crate::wait_for(Duration::from_secs(10), || async {
        let taken = others.take_over(release_at).await.expect("take over");
        (!taken.is_empty()).then_some(taken)
    })
    .await
    .expect("a dead owner is found within seconds");
    assert_eq!(
        taken,
        [TakenOver {
            owner: "i1".into(),
            leases: 2
        }]
    );
    assert_eq!(others.take_over(release_at).await.expect("again"), []);
    assert!(
        claim(s, at(T0_MS + 999), 10, "i2", T0_MS + 3_600_000)
            .await
            .is_empty(),
        "released leases are claimable only from the time given"
    );
    let again = claim(s, release_at, 10, "i2", T0_MS + 3_600_000).await;
    assert_eq!(ids(&again), ["a", "b"]);
    assert_eq!(
        mark_reached(s, &claimed, "i1", release_at).await,
        0,
        "the dead owner settles nothing"
    );

    // i2 dies holding them and runs again before anyone took it over: joining releases them.
    drop(i2);
    let rejoined = crate::wait_for(Duration::from_secs(10), || async {
        others.join("i2", at(T0_MS + 2_000)).await.ok()
    })
    .await
    .expect("the name is free once its connection ended");
    assert_eq!(
        ids(&claim(s, at(T0_MS + 2_000), 10, "i3", T0_MS + 3_600_000).await),
        ["a", "b"]
    );
    rejoined.leave().await.expect("leave");
    assert_eq!(
        others.take_over(release_at).await.expect("after a leave"),
        [],
        "a left owner is not dead"
    );
    let i2 = others
        .join("i2", T0)
        .await
        .expect("a left name is free at once");
    drop(i2);
    let _ = second;
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
    put(s, &batch, T0).await;
    for (id, delta) in [
        ("utc", 0),
        ("plus", 0),
        ("minus", 0),
        ("next", 1),
        ("prev", -1),
    ] {
        assert_eq!(
            row(s, "t", id).await.due_at.as_millis(),
            base + delta,
            "{id} stored to the millisecond"
        );
    }
    let until = base + 60_000;
    assert_eq!(
        ids(&claim(s, at(base - 2), 10, "i1", until).await),
        Vec::<String>::new()
    );
    assert_eq!(
        ids(&claim(s, at(base - 1), 10, "i1", until).await),
        ["prev"]
    );
    let mut same = ids(&claim(s, at(base), 10, "i1", until).await);
    same.sort();
    assert_eq!(
        same,
        ["minus", "plus", "utc"],
        "due exactly at now is due (inclusive)"
    );
    assert_eq!(
        ids(&claim(s, at(base + 1), 10, "i1", until).await),
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
        policy: None,
        work: None,
    };
    put(s, std::slice::from_ref(&t), T0).await;
    let got = row(s, "tenant-ü", "call/1 with spaces").await;
    assert_eq!(got.payload.as_deref(), Some(payload));
    assert_eq!(got.correlation_id.as_deref(), Some("corr-1"));
    let claimed = claim(s, T0, 1, "i1", T0_MS + 1_000).await;
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
            let tenant = format!("tenant{}", i % 7);
            timer(&tenant, &format!("b{i:05}"), T0_MS + (i % 1000) as i64)
        })
        .collect();
    let out = tokio::time::timeout(Duration::from_secs(120), put(s, &batch, T0))
        .await
        .expect("a 10k batch finishes");
    assert_eq!(out.len(), N);
    assert!(out.iter().all(|o| *o == ScheduleOutcome::Created));
    assert_eq!(scheduled_count(s).await, N as u64);
    let now = at(T0_MS + 1_000);
    let mut seen = HashSet::new();
    loop {
        let got = claim(s, now, 1_000, "i1", now.as_millis() + 60_000).await;
        if got.is_empty() {
            break;
        }
        assert_eq!(mark_reached(s, &got, "i1", now).await, got.len() as u64);
        for c in got {
            assert!(seen.insert(c.key), "claimed twice");
        }
    }
    assert_eq!(seen.len(), N);
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

pub async fn live_by_tenant_counts_scheduled_and_paused_timers(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let mut batch: Vec<NewTimer> = (0..5)
        .map(|i| timer("a", &format!("a{i}"), T0_MS + 1_000 + i))
        .collect();
    batch.push(timer("b", "b0", T0_MS + 1_000));
    batch.push(timer("c", "due", T0_MS));
    put(s, &batch, T0).await;
    cancel(s, "a", "a0", T0).await;
    let pause = Action::Pause { note: None };
    let paused = control(s)
        .apply(&[TimerKey::new("a", "a1")], &pause, T0)
        .await
        .expect("pause a/a1");
    assert_eq!(paused, vec![ControlOutcome::Paused]);
    let claimed = claim(s, T0, 10, "i1", T0_MS + 1_000).await;
    mark_reached(s, &claimed, "i1", T0).await;
    let counts = live_by_tenant(s, &["a", "b", "c", "nobody"]).await;
    assert_eq!(
        counts.get("a"),
        Some(&4),
        "cancelled ones do not count, a paused one does: {counts:?}"
    );
    assert_eq!(counts.get("b"), Some(&1));
    assert_eq!(
        counts.get("c"),
        None,
        "reached ones do not count: {counts:?}"
    );
    assert_eq!(counts.get("nobody"), None);
    let only_b = live_by_tenant(s, &["b"]).await;
    assert_eq!(only_b.len(), 1, "only the tenants asked for");
}

/// The store's listing ability; every store plugin of this project has it.
fn queries(s: &dyn Store) -> &dyn TimerQueries {
    s.queries()
        .unwrap_or_else(|| panic!("the {} store offers no TimerQueries", s.name()))
}

/// Every page of `tenant`'s timers that pass `filter`, `limit` per page, as ids.
async fn all_pages(s: &dyn Store, tenant: &str, filter: &TimerFilter, limit: usize) -> Vec<String> {
    let mut ids = Vec::new();
    let mut after: Option<PageAfter> = None;
    for _ in 0..10_000 {
        let page = queries(s)
            .list(tenant, filter, after.as_ref(), limit)
            .await
            .unwrap_or_else(|e| panic!("listing {tenant} failed: {e}"));
        assert!(
            page.len() <= limit,
            "a page of {} for limit {limit}",
            page.len()
        );
        ids.extend(page.iter().map(|t| t.key.service_call_id.clone()));
        match page.last() {
            Some(last) if page.len() == limit => {
                after = Some(PageAfter {
                    due_at: last.due_at,
                    service_call_id: last.key.service_call_id.clone(),
                })
            }
            _ => return ids,
        }
    }
    panic!("listing {tenant} did not end")
}

pub async fn list_orders_by_due_time_then_id_within_the_tenant(store: Arc<dyn Store>) {
    let s = store.as_ref();
    put(
        s,
        &[
            timer("t", "c", T0_MS + 2_000),
            timer("t", "b", T0_MS + 1_000),
            timer("t", "a", T0_MS + 2_000),
            timer("t", "d", T0_MS + 500),
            timer("other", "x", T0_MS + 100),
        ],
        T0,
    )
    .await;
    let every = TimerFilter::default();
    assert_eq!(all_pages(s, "t", &every, 100).await, ["d", "b", "a", "c"]);
    for limit in [1, 2, 3] {
        assert_eq!(
            all_pages(s, "t", &every, limit).await,
            ["d", "b", "a", "c"],
            "pages of {limit}"
        );
    }
    assert_eq!(
        all_pages(s, "nobody", &every, 10).await,
        Vec::<String>::new()
    );
    let page = queries(s).list("t", &every, None, 1).await.expect("list");
    assert_eq!(
        page[0],
        row(s, "t", "d").await,
        "a listed timer is the stored timer"
    );
}

pub async fn list_filters_combine(store: Arc<dyn Store>) {
    let s = store.as_ref();
    put(
        s,
        &[
            timer("t", "order-1", T0_MS + 1_000),
            timer("t", "order-2", T0_MS + 2_000),
            timer("t", "ORDER-3", T0_MS + 3_000),
            timer("t", "invoice-1", T0_MS + 4_000),
            recurring("t", "order-r", T0_MS + 5_000, "0 * * * *"),
            timer("t", "order-due", T0_MS),
        ],
        T0,
    )
    .await;
    cancel(s, "t", "order-2", T0).await;
    let claimed = claim(s, T0, 10, "i1", T0_MS + 1_000).await;
    assert_eq!(ids(&claimed), ["order-due"]);
    mark_reached(s, &claimed, "i1", T0).await;
    let list = |filter: TimerFilter| async move { all_pages(s, "t", &filter, 2).await };
    let prefix = |p: &str| Some(p.to_owned());
    assert_eq!(
        list(TimerFilter {
            prefix: prefix("order-"),
            ..TimerFilter::default()
        })
        .await,
        ["order-due", "order-1", "order-2", "order-r"],
        "a prefix is case-sensitive"
    );
    assert_eq!(
        list(TimerFilter {
            states: vec![TimerState::Scheduled],
            prefix: prefix("order-"),
            ..TimerFilter::default()
        })
        .await,
        ["order-1", "order-r"]
    );
    assert_eq!(
        list(TimerFilter {
            states: vec![TimerState::Cancelled, TimerState::Reached],
            ..TimerFilter::default()
        })
        .await,
        ["order-due", "order-2"]
    );
    assert_eq!(
        list(TimerFilter {
            due_after: Some(at(T0_MS + 2_000)),
            due_before: Some(at(T0_MS + 4_000)),
            ..TimerFilter::default()
        })
        .await,
        ["order-2", "ORDER-3"],
        "dueAfter is inclusive, dueBefore exclusive"
    );
    assert_eq!(
        list(TimerFilter {
            recurring: Some(true),
            ..TimerFilter::default()
        })
        .await,
        ["order-r"]
    );
    assert_eq!(
        list(TimerFilter {
            recurring: Some(false),
            prefix: prefix("ORDER"),
            ..TimerFilter::default()
        })
        .await,
        ["ORDER-3"]
    );
    assert_eq!(
        list(TimerFilter {
            prefix: prefix("%"),
            ..TimerFilter::default()
        })
        .await,
        Vec::<String>::new(),
        "a prefix is text, not a pattern"
    );
    // A timer whose publish failed waits for its next attempt: it is "retrying".
    put(s, &[timer("t", "order-late", T0_MS + 500)], T0).await;
    let claimed = claim(s, at(T0_MS + 500), 10, "i1", T0_MS + 1_000).await;
    assert_eq!(ids(&claimed), ["order-late"]);
    release(s, &claimed, "i1", at(T0_MS + 60_000), Some("broker down")).await;
    assert_eq!(
        list(TimerFilter {
            retrying: Some(true),
            ..TimerFilter::default()
        })
        .await,
        ["order-late"]
    );
    assert_eq!(
        list(TimerFilter {
            states: vec![TimerState::Scheduled],
            retrying: Some(false),
            prefix: prefix("order-"),
            ..TimerFilter::default()
        })
        .await,
        ["order-1", "order-r"]
    );
}

/// Ids order and match by their bytes (code points), whatever the database's locale: a
/// collation that skips punctuation or folds accents would misplace these.
pub async fn list_compares_ids_byte_by_byte(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let ids = [
        "a",
        "a-b",
        "a.",
        "ab",
        "B",
        "e",
        "é1",
        "éa",
        "f",
        "\u{10FFFF}x",
        "\u{D7FF}",
        "\u{E000}",
    ];
    let batch: Vec<NewTimer> = ids.iter().map(|id| timer("t", id, T0_MS)).collect();
    put(s, &batch, T0).await;
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    assert_eq!(
        all_pages(s, "t", &TimerFilter::default(), 5).await,
        sorted,
        "equal due times: ids in byte order"
    );
    let with = |p: &str| TimerFilter {
        prefix: Some(p.to_owned()),
        ..TimerFilter::default()
    };
    for (prefix, expected) in [
        ("a-", &["a-b"][..]),
        ("a", &["a", "a-b", "a.", "ab"]),
        ("é", &["é1", "éa"]),
        ("e", &["e"]),
        ("\u{10FFFF}", &["\u{10FFFF}x"]),
        ("\u{D7FF}", &["\u{D7FF}"]),
        ("b", &[]),
    ] {
        assert_eq!(
            all_pages(s, "t", &with(prefix), 2).await,
            expected,
            "prefix {prefix:?}"
        );
    }
}

/// Timers written between two pages: a timer that was there all along is listed exactly once;
/// one added before the cursor is not listed, one added after it is.
pub async fn list_pages_are_stable_under_concurrent_writes(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let batch: Vec<NewTimer> = (0..50)
        .map(|i| timer("t", &format!("k{i:02}"), T0_MS + 1_000 * i))
        .collect();
    put(s, &batch, T0).await;
    let every = TimerFilter::default();
    let first = queries(s).list("t", &every, None, 20).await.expect("list");
    let last = first.last().expect("a full page");
    let after = PageAfter {
        due_at: last.due_at,
        service_call_id: last.key.service_call_id.clone(),
    };
    // Between the pages: one new timer before the cursor, one after, one moved from after to
    // before it, and one with the cursor's own due time (its id sorts after the cursor's).
    put(
        s,
        &[
            timer("t", "early", T0_MS + 500),
            timer("t", "late", T0_MS + 60_000),
            timer("t", "k40", T0_MS + 1),
            timer("t", "k19b", T0_MS + 19_000),
        ],
        T0,
    )
    .await;
    let mut seen: Vec<String> = first
        .iter()
        .map(|t| t.key.service_call_id.clone())
        .collect();
    let mut next = Some(after);
    while let Some(after) = next.take() {
        let page = queries(s)
            .list("t", &every, Some(&after), 20)
            .await
            .expect("list");
        if let Some(last) = page.last().filter(|_| page.len() == 20) {
            next = Some(PageAfter {
                due_at: last.due_at,
                service_call_id: last.key.service_call_id.clone(),
            });
        }
        seen.extend(page.iter().map(|t| t.key.service_call_id.clone()));
    }
    let unique: HashSet<&String> = seen.iter().collect();
    assert_eq!(unique.len(), seen.len(), "a timer listed twice: {seen:?}");
    for i in (0..50).filter(|i| *i != 40) {
        assert!(
            seen.contains(&format!("k{i:02}")),
            "k{i:02} missing: {seen:?}"
        );
    }
    assert!(
        seen.contains(&"late".to_owned()) && seen.contains(&"k19b".to_owned()),
        "{seen:?}"
    );
    assert!(!seen.contains(&"early".to_owned()), "{seen:?}");
}

pub async fn summaries_count_states_next_due_and_recent_failures(store: Arc<dyn Store>) {
    let s = store.as_ref();
    put(
        s,
        &[
            timer("a", "s1", T0_MS + 5_000),
            timer("a", "s2", T0_MS + 3_000),
            timer("a", "c", T0_MS + 1_000),
            timer("a", "f-old", T0_MS),
            timer("a", "f-new", T0_MS),
            timer("b", "r", T0_MS),
        ],
        T0,
    )
    .await;
    cancel(s, "a", "c", T0).await;
    let claimed = claim(s, T0, 10, "i1", T0_MS + 1_000).await;
    let (b, a): (Vec<ClaimedTimer>, Vec<ClaimedTimer>) =
        claimed.into_iter().partition(|c| c.key.tenant_id == "b");
    mark_reached(s, &b, "i1", T0).await;
    let old: Vec<ClaimedTimer> = a
        .iter()
        .filter(|c| c.key.service_call_id == "f-old")
        .cloned()
        .collect();
    let new: Vec<ClaimedTimer> = a
        .iter()
        .filter(|c| c.key.service_call_id == "f-new")
        .cloned()
        .collect();
    fail(s, &old, "i1", at(T0_MS + 10), "down").await;
    fail(s, &new, "i1", at(T0_MS + 1_000), "down").await;
    let tenants = queries(s).tenants(None, 10).await.expect("tenants");
    assert_eq!(tenants, ["a", "b"]);
    assert_eq!(
        queries(s).tenants(Some("a"), 10).await.expect("tenants"),
        ["b"]
    );
    assert_eq!(queries(s).tenants(None, 1).await.expect("tenants"), ["a"]);
    let wanted: Vec<String> = ["b", "a", "nobody"].map(String::from).to_vec();
    let summaries = queries(s)
        .summaries(&wanted, at(T0_MS + 500), T0)
        .await
        .expect("summaries");
    let names: Vec<&str> = summaries.iter().map(|x| x.tenant_id.as_str()).collect();
    assert_eq!(names, ["b", "a", "nobody"], "in the order asked for");
    let counts = |x: &TenantSummary| {
        let mut c: Vec<(TimerState, u64)> = x.counts.iter().map(|(s, n)| (*s, *n)).collect();
        c.sort_by_key(|(s, _)| s.code());
        c
    };
    assert_eq!(counts(&summaries[0]), [(TimerState::Reached, 1)]);
    assert_eq!(summaries[0].next_due_at, None);
    assert_eq!(
        counts(&summaries[1]),
        [
            (TimerState::Scheduled, 2),
            (TimerState::Cancelled, 1),
            (TimerState::Failed, 2)
        ]
    );
    assert_eq!(summaries[1].next_due_at, Some(at(T0_MS + 3_000)));
    assert_eq!(
        summaries[1].failed_since, 1,
        "only the failure at or after failed_since"
    );
    assert_eq!(
        (summaries[0].fired_since, summaries[1].fired_since),
        (1, 0),
        "b's timer fired at T0"
    );
    let later = queries(s)
        .summaries(&wanted, at(T0_MS + 500), at(T0_MS + 1))
        .await
        .expect("summaries");
    assert_eq!(later[0].fired_since, 0, "b's fire was before fired_since");
    assert_eq!(
        summaries[2],
        TenantSummary {
            tenant_id: "nobody".into(),
            ..TenantSummary::default()
        }
    );
}

// The steps the checks are made of: one call of the Store API each, which must succeed (a check
// asserts on what it returns).

/// Schedules `timers` at `now`.
async fn put(s: &dyn Store, timers: &[NewTimer], now: Timestamp) -> Vec<ScheduleOutcome> {
    s.schedule(timers, now)
        .await
        .unwrap_or_else(|e| panic!("scheduling {} timer(s) failed: {e}", timers.len()))
}

/// The stored timer `tenant/id`, if there is one.
async fn find(s: &dyn Store, tenant: &str, id: &str) -> Option<Timer> {
    s.get(&TimerKey::new(tenant, id))
        .await
        .unwrap_or_else(|e| panic!("reading timer {tenant}/{id} failed: {e}"))
}

/// The stored timer `tenant/id`, which must exist.
async fn row(s: &dyn Store, tenant: &str, id: &str) -> Timer {
    find(s, tenant, id)
        .await
        .unwrap_or_else(|| panic!("timer {tenant}/{id} should exist"))
}

async fn state_of(s: &dyn Store, tenant: &str, id: &str) -> TimerState {
    row(s, tenant, id).await.state
}

/// Claims up to `limit` timers due at `now` for `owner`, leased until `until_ms`.
async fn claim(
    s: &dyn Store,
    now: Timestamp,
    limit: usize,
    owner: &str,
    until_ms: i64,
) -> Vec<ClaimedTimer> {
    let lease = Lease {
        owner: owner.into(),
        until: at(until_ms),
    };
    s.claim_due(now, limit, &lease)
        .await
        .unwrap_or_else(|e| panic!("claiming at {now:?} for {owner} failed: {e}"))
}

/// A timer being fired: `new` scheduled at T0, then the timers due at T0 claimed for `owner`
/// until `until_ms`.
async fn schedule_and_claim(
    s: &dyn Store,
    new: NewTimer,
    owner: &str,
    until_ms: i64,
) -> Vec<ClaimedTimer> {
    put(s, &[new], T0).await;
    claim(s, T0, 10, owner, until_ms).await
}

async fn cancel(s: &dyn Store, tenant: &str, id: &str, now: Timestamp) -> CancelOutcome {
    s.cancel(&TimerKey::new(tenant, id), now)
        .await
        .unwrap_or_else(|e| panic!("cancelling {tenant}/{id} failed: {e}"))
}

async fn next_due(s: &dyn Store) -> Option<Timestamp> {
    s.next_due_at().await.expect("next_due_at")
}

async fn scheduled_count(s: &dyn Store) -> u64 {
    s.scheduled_count().await.expect("scheduled_count")
}

async fn live_by_tenant(s: &dyn Store, tenants: &[&str]) -> HashMap<String, u64> {
    let tenants: Vec<String> = tenants.iter().map(|t| t.to_string()).collect();
    s.tenant_counts()
        .expect("the store counts timers per tenant")
        .live_by_tenant(&tenants)
        .await
        .expect("counting per tenant")
}

/// Settles every one of `claims` the same way at `at`: how many rows changed.
async fn settle(
    s: &dyn Store,
    claims: &[ClaimedTimer],
    settlement: Settlement,
    owner: &str,
    at: Timestamp,
) -> u64 {
    let settled: Vec<_> = claims
        .iter()
        .map(|c| (c.clone(), settlement.clone()))
        .collect();
    s.settle(&settled, owner, at)
        .await
        .unwrap_or_else(|e| panic!("settling as {settlement:?} for {owner} failed: {e}"))
}

async fn mark_reached(s: &dyn Store, claims: &[ClaimedTimer], owner: &str, at: Timestamp) -> u64 {
    settle(s, claims, Settlement::Reached, owner, at).await
}

/// Moves a recurring timer on to its `next` occurrence.
async fn advance(
    s: &dyn Store,
    claim: &ClaimedTimer,
    next: Timestamp,
    owner: &str,
    at: Timestamp,
) -> u64 {
    settle(
        s,
        std::slice::from_ref(claim),
        Settlement::Next(next),
        owner,
        at,
    )
    .await
}

async fn fail(
    s: &dyn Store,
    claims: &[ClaimedTimer],
    owner: &str,
    at: Timestamp,
    error: &str,
) -> u64 {
    settle(s, claims, Settlement::Failed(error.into()), owner, at).await
}

/// Gives the lease back, claimable again at `retry_at`.
async fn release(
    s: &dyn Store,
    claims: &[ClaimedTimer],
    owner: &str,
    retry_at: Timestamp,
    error: Option<&str>,
) -> u64 {
    let error = error.map(str::to_owned);
    let retry = Settlement::Retry {
        at: retry_at,
        error,
    };
    settle(s, claims, retry, owner, retry_at).await
}

fn control(s: &dyn Store) -> &dyn TimerControl {
    s.control().expect("the store offers the control ability")
}

fn history_of(s: &dyn Store) -> &dyn TimerHistory {
    s.history().expect("the store keeps a history")
}

/// Applies `action` to `tenant/id` at `now`.
async fn act(s: &dyn Store, id: &str, action: &Action, now: Timestamp) -> ControlOutcome {
    let outcomes = control(s)
        .apply(&[TimerKey::new("t", id)], action, now)
        .await
        .unwrap_or_else(|e| panic!("{action:?} of t/{id} failed: {e}"));
    assert_eq!(outcomes.len(), 1, "one outcome per key");
    outcomes[0]
}

fn pause() -> Action {
    Action::Pause { note: None }
}

/// The whole history of `t/id`.
async fn history(s: &dyn Store, id: &str) -> Vec<HistoryEntry> {
    history_of(s)
        .read(&TimerKey::new("t", id), 0, 1_000)
        .await
        .unwrap_or_else(|e| panic!("reading the history of t/{id} failed: {e}"))
}

/// The `type` of each change in `entries`, in order.
fn kinds(entries: &[HistoryEntry]) -> Vec<String> {
    entries
        .iter()
        .map(|e| {
            let json: serde_json::Value =
                serde_json::from_str(&e.change.to_json()).expect("a change is JSON");
            json["type"].as_str().unwrap_or("?").to_owned()
        })
        .collect()
}

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

pub async fn a_resumed_series_skips_what_fell_into_the_pause(store: Arc<dyn Store>) {
    let s = store.as_ref();
    // Every minute from T0 (T0 is a whole minute).
    let series = NewTimer {
        recurrence: Some(Recurrence {
            cron: "* * * * *".into(),
            time_zone: "UTC".into(),
            end_at: None,
            max_occurrences: None,
        }),
        ..timer("t", "s", T0_MS)
    };
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

pub async fn history_records_each_change_in_order(store: Arc<dyn Store>) {
    let s = store.as_ref();
    put(s, &[timer("t", "a", T0_MS)], T0).await;
    put(s, &[timer("t", "a", T0_MS + 100)], T0).await;
    let claimed = claim(s, at(T0_MS + 100), 10, "i1", T0_MS + 10_000).await;
    release(s, &claimed, "i1", at(T0_MS + 200), Some("broker down")).await;
    let claimed = claim(s, at(T0_MS + 200), 10, "i2", T0_MS + 10_000).await;
    mark_reached(s, &claimed, "i2", at(T0_MS + 250)).await;
    let entries = history(s, "a").await;
    assert_eq!(
        kinds(&entries),
        ["created", "rescheduled", "publish_failed", "fired"]
    );
    assert_eq!(
        entries.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [1, 2, 3, 4]
    );
    assert_eq!(entries[0].at, T0);
    assert_eq!(entries[0].change, Change::Created { due_at: T0 });
    assert_eq!(
        entries[1].change,
        Change::Rescheduled {
            due_at: at(T0_MS + 100)
        }
    );
    assert_eq!(
        entries[2].change,
        Change::PublishFailed {
            attempt: 1,
            error: "broker down".into()
        }
    );
    assert_eq!(
        entries[3].change,
        Change::Fired {
            due_at: at(T0_MS + 100),
            lateness_ms: 150,
            instance: "i2".into(),
            occurrence: None,
            caught_up: false,
            refire: None,
        }
    );
    assert_eq!(entries[3].at, at(T0_MS + 250));
    // Pages: after an entry, up to a limit.
    let page = history_of(s)
        .read(&TimerKey::new("t", "a"), 1, 2)
        .await
        .expect("page");
    assert_eq!(page.iter().map(|e| e.seq).collect::<Vec<_>>(), [2, 3]);
    // A change made outside the store (a manual trigger), and a timer that does not exist.
    let triggered = Change::Triggered {
        event_id: "e-1".into(),
    };
    assert!(history_of(s)
        .record(&TimerKey::new("t", "a"), at(T0_MS + 300), &triggered)
        .await
        .expect("record"));
    assert!(!history_of(s)
        .record(&TimerKey::new("t", "none"), T0, &triggered)
        .await
        .expect("record"));
    assert!(history(s, "none").await.is_empty());
    assert_eq!(
        history(s, "a")
            .await
            .last()
            .map(|e| (e.seq, e.change.clone())),
        Some((5, triggered))
    );
    // Given up and cancelled.
    put(
        s,
        &[timer("t", "f", T0_MS), timer("t", "c", T0_MS + 60_000)],
        T0,
    )
    .await;
    let f = claim(s, T0, 1, "i1", T0_MS + 1_000).await;
    fail(s, &f, "i1", T0, "gone").await;
    assert_eq!(kinds(&history(s, "f").await), ["created", "given_up"]);
    act(s, "c", &pause(), T0).await;
    act(s, "c", &Action::Cancel, T0).await;
    assert_eq!(
        kinds(&history(s, "c").await),
        ["created", "paused", "cancelled"]
    );
}

pub async fn history_keeps_the_newest_entries_and_goes_with_the_timer(store: Arc<dyn Store>) {
    let s = store.as_ref();
    history_of(s).set_limit(3);
    put(s, &[timer("t", "a", T0_MS + 1_000)], T0).await;
    for _ in 0..3 {
        act(s, "a", &pause(), T0).await;
        act(s, "a", &Action::Resume, T0).await;
    }
    let entries = history(s, "a").await;
    assert_eq!(
        entries.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [5, 6, 7],
        "the newest 3 of 7"
    );
    assert_eq!(kinds(&entries), ["resumed", "paused", "resumed"]);
    // Off: nothing more is recorded.
    history_of(s).set_limit(0);
    act(s, "a", &pause(), T0).await;
    assert_eq!(history(s, "a").await.len(), 3);
    history_of(s).set_limit(100);
    // Purged with the timer: a new timer of the same key starts a new history.
    act(s, "a", &Action::Cancel, T0).await;
    assert_eq!(s.purge(at(T0_MS + 1), 10).await.expect("purge"), 1);
    assert!(history(s, "a").await.is_empty());
    put(s, &[timer("t", "a", T0_MS + 1_000)], T0).await;
    let fresh = history(s, "a").await;
    assert_eq!(fresh.iter().map(|e| e.seq).collect::<Vec<_>>(), [1]);
}

pub async fn count_counts_each_state(store: Arc<dyn Store>) {
    let s = store.as_ref();
    put(
        s,
        &[
            timer("t", "a", T0_MS),
            timer("t", "b", T0_MS + 10),
            timer("u", "c", T0_MS + 20),
        ],
        T0,
    )
    .await;
    act(s, "b", &pause(), T0).await;
    control(s)
        .apply(&[TimerKey::new("u", "c")], &Action::Cancel, T0)
        .await
        .expect("cancel");
    let q = queries(s);
    let count = |state| async move { q.count(state).await.expect("count") };
    assert_eq!(count(TimerState::Scheduled).await, 1);
    assert_eq!(count(TimerState::Paused).await, 1);
    assert_eq!(count(TimerState::Cancelled).await, 1);
    assert_eq!(count(TimerState::Reached).await, 0);
}
