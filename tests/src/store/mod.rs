//! The Store conformance suite: every store plugin must pass each check against a fresh, isolated
//! instance. A check panics (with a message) on the first broken promise.

mod actions;
mod allowances;
mod cancels;
mod claims;
mod fairness;
mod history;
mod leases;
mod queries;
mod retention;
mod schedule;
mod series;

use std::collections::HashMap;
use std::sync::Arc;

use timer_core::plugin::StoreConfig;
use timer_core::{
    Action, CancelOutcome, ClaimedTimer, ControlOutcome, HistoryEntry, Lease, NewTimer, Recurrence,
    ScheduleOutcome, Settlement, Store, Timer, TimerControl, TimerHistory, TimerKey, TimerState,
    Timestamp,
};

use crate::Check;

pub use actions::{
    a_claim_taken_before_a_resume_moved_the_series_does_not_settle_it,
    a_fired_timer_holds_no_lease, a_paused_timer_never_fires_and_resumes_on_its_due_time,
    a_resumed_series_skips_what_fell_into_the_pause, pause_resume_and_cancel_outcomes,
    pausing_a_firing_timer_is_refused, rescheduling_a_paused_timer_keeps_it_paused,
    retry_schedules_a_failed_timer_again,
};
pub use allowances::shared_allowances_are_one_budget_for_every_instance;
pub use cancels::{cancel_outcomes, cancel_while_leased_is_refused};
pub use claims::{
    a_claim_ahead_takes_first_due_times_only,
    a_failed_fire_of_a_rescheduled_timer_leaves_the_new_one_alone,
    claim_is_exclusive_under_concurrency, claim_takes_oldest_first_up_to_limit,
    expired_lease_makes_row_claimable, fail_marks_failed_for_the_lease_holder_only,
    next_due_at_tracks_claimable_rows, no_refire_after_reached,
    one_settle_applies_each_claims_own_settlement, release_keeps_attempts_and_last_error,
    release_without_error_keeps_attempts, reschedule_while_firing_keeps_timer_scheduled,
};
pub use fairness::{
    a_claim_in_a_backlog_shares_the_batch_between_tenants,
    fair_claims_are_exclusive_under_concurrency,
    tenants_beyond_one_claims_visits_are_served_in_turn,
    two_instances_share_a_backlog_and_never_claim_a_row_twice,
};
pub use history::{
    history_keeps_the_newest_entries_and_goes_with_the_timer, history_records_each_change_in_order,
};
pub use leases::{
    a_restart_releases_every_lease_of_a_store_one_service_owns,
    a_store_keeps_what_it_committed_across_a_restart,
    concurrent_take_overs_take_each_dead_owner_once, dead_owners_are_taken_over_at_once,
    leased_counts_the_live_leases, renew_extends_only_the_owners_leases,
};
pub use queries::{
    backlog_counts_claimable_rows_by_tenant_longest_waiting_first, count_counts_each_state,
    list_compares_ids_byte_by_byte, list_filters_combine,
    list_orders_by_due_time_then_id_within_the_tenant,
    list_pages_are_stable_under_concurrent_writes,
    live_by_tenant_counts_scheduled_and_paused_timers,
    summaries_count_states_next_due_and_recent_failures,
};
pub use retention::{
    failed_timers_stay_failed_and_are_purged, purge_removes_only_old_finished_rows,
};
pub use schedule::{
    batch_of_10k, duplicate_key_in_one_batch, millisecond_precision_across_offsets,
    payload_correlation_and_trace_round_trip, reschedule_moves_due_time,
    target_and_message_round_trip, upsert_outcomes,
};
pub use series::{
    a_series_that_ends_without_a_fire_keeps_its_last_reached_at,
    advance_needs_the_lease_and_revision, recurrence_round_trips_and_advance_moves_to_next,
    rescheduling_a_recurring_timer_resets_its_count,
};

/// A fixed "now" far from the epoch, so offsets and arithmetic are realistic.
pub const T0: Timestamp = Timestamp::from_millis(1_800_000_000_000);
const T0_MS: i64 = T0.as_millis();

pub fn timer(tenant: &str, id: &str, due_ms: i64) -> NewTimer {
    NewTimer::new(TimerKey::new(tenant, id), Timestamp::from_millis(due_ms))
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
        a_claim_ahead_takes_first_due_times_only,
        claim_is_exclusive_under_concurrency,
        expired_lease_makes_row_claimable,
        release_keeps_attempts_and_last_error,
        release_without_error_keeps_attempts,
        a_failed_fire_of_a_rescheduled_timer_leaves_the_new_one_alone,
        reschedule_while_firing_keeps_timer_scheduled,
        next_due_at_tracks_claimable_rows,
        cancel_outcomes,
        purge_removes_only_old_finished_rows,
        millisecond_precision_across_offsets,
        payload_correlation_and_trace_round_trip,
        target_and_message_round_trip,
        batch_of_10k,
        cancel_while_leased_is_refused,
        fail_marks_failed_for_the_lease_holder_only,
        one_settle_applies_each_claims_own_settlement,
        failed_timers_stay_failed_and_are_purged,
        recurrence_round_trips_and_advance_moves_to_next,
        advance_needs_the_lease_and_revision,
        rescheduling_a_recurring_timer_resets_its_count,
        a_series_that_ends_without_a_fire_keeps_its_last_reached_at,
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
        a_fired_timer_holds_no_lease,
        a_resumed_series_skips_what_fell_into_the_pause,
        a_claim_taken_before_a_resume_moved_the_series_does_not_settle_it,
        rescheduling_a_paused_timer_keeps_it_paused,
        history_records_each_change_in_order,
        history_keeps_the_newest_entries_and_goes_with_the_timer,
        count_counts_each_state,
        backlog_counts_claimable_rows_by_tenant_longest_waiting_first,
        renew_extends_only_the_owners_leases,
        leased_counts_the_live_leases,
        a_claim_in_a_backlog_shares_the_batch_between_tenants,
        tenants_beyond_one_claims_visits_are_served_in_turn,
        fair_claims_are_exclusive_under_concurrency,
    ]
}

/// A store and its config, for checks that open the same resource again.
pub type FreshStore = crate::fixtures::Fresh<Arc<dyn Store>, dyn StoreConfig>;

/// The checks about restarts and dead instances, by name: each opens the store again (a
/// restart, or a second instance).
pub fn restart_checks() -> Vec<Check<FreshStore>> {
    crate::checks![
        a_store_keeps_what_it_committed_across_a_restart,
        a_restart_releases_every_lease_of_a_store_one_service_owns,
        dead_owners_are_taken_over_at_once,
        concurrent_take_overs_take_each_dead_owner_once,
        two_instances_share_a_backlog_and_never_claim_a_row_twice,
        shared_allowances_are_one_budget_for_every_instance,
    ]
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
    s.claim_due(now.into(), limit, &lease)
        .await
        .unwrap_or_else(|e| panic!("claiming at {now:?} for {owner} failed: {e}"))
}

/// `workers` claimers of `limit` at a time, each its own lease owner, until nothing is due at
/// `now`; asserts that no timer was claimed twice, and returns how many were claimed.
async fn claim_all_concurrently(
    store: &Arc<dyn Store>,
    workers: usize,
    limit: usize,
    now: Timestamp,
) -> usize {
    let mut tasks = Vec::new();
    for worker in 0..workers {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let owner = format!("w{worker}");
            let mut mine = Vec::new();
            loop {
                let got = claim(store.as_ref(), now, limit, &owner, now.as_millis() + 60_000).await;
                if got.is_empty() {
                    return mine;
                }
                mine.extend(got.into_iter().map(|c| c.key));
            }
        }));
    }
    let mut seen = std::collections::HashSet::new();
    for task in tasks {
        for key in task.await.expect("claimer task") {
            assert!(seen.insert(key.clone()), "{key} was claimed twice");
        }
    }
    seen.len()
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
    s.control()
}

fn history_of(s: &dyn Store) -> &dyn TimerHistory {
    s.history()
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
