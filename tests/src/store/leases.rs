//! Leases across instances and restarts: renewing, a restart of a store one service owns, dead
//! lease owners taken over.

use std::sync::Arc;
use std::time::Duration;

use timer_core::{CancelOutcome, ErrorKind, Release, Store, TakenOver, TimerKey, TimerState};

use super::{
    at, cancel, claim, ids, mark_reached, put, row, schedule_and_claim, timer, FreshStore, T0,
    T0_MS,
};

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
    if !config.durable() {
        return; // nothing survives a restart: a_store_keeps_what_it_committed_across_a_restart
    }
    let s = store.as_ref();
    put(s, &[timer("t", "late", T0_MS + 60_000)], T0).await;
    let claimed = schedule_and_claim(s, timer("t", "a", T0_MS), "old", T0_MS + 3_600_000).await;
    assert_eq!(ids(&claimed), ["a"]);
    let e = config.open().await.err().unwrap_or_else(|| {
        panic!(
            "a second service opened a store with this one's timers while it ran, and cannot \
             tell which leases are dead"
        )
    });
    assert_eq!(e.kind(), ErrorKind::Config, "{}", e.chain());
    assert!(
        e.chain().contains("in use"),
        "names the conflict: {}",
        e.chain()
    );
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
    let build = Release {
        version: "0.2.0".into(),
        revision: "r1".into(),
    };
    let i1 = owners.join("i1", &build, T0, T0).await.expect("i1 joins");
    let refused = others
        .join("i1", &build, T0, T0)
        .await
        .err()
        .expect("a live name is refused");
    assert_eq!(refused.kind(), ErrorKind::Config, "{}", refused.chain());
    assert!(
        refused.chain().contains("\"i1\""),
        "names it: {}",
        refused.chain()
    );
    let i2 = others.join("i2", &build, T0, T0).await.expect("i2 joins");

    put(
        s,
        &[timer("t", "a", T0_MS), timer("t", "b", T0_MS + 10)],
        T0,
    )
    .await;
    let claimed = claim(s, at(T0_MS + 10), 10, "i1", T0_MS + 3_600_000).await;
    assert_eq!(ids(&claimed), ["a", "b"]);
    // The instance list: both, by id, with their builds and leases.
    let live = owners.live().await.expect("the live instances");
    let listed: Vec<(&str, Option<&Release>, u64)> = live
        .iter()
        .map(|i| (i.id.as_str(), i.release.as_ref(), i.leases))
        .collect();
    assert_eq!(
        listed,
        [("i1", Some(&build), 2), ("i2", Some(&build), 0)],
        "{live:?}"
    );
    assert!(live
        .iter()
        .all(|i| i.started_at == T0 && i.last_seen_at.is_some()));
    let release_at = at(T0_MS + 1_000);
    let taken = others.take_over(release_at).await.expect("take over");
    assert_eq!(taken, [], "nothing of a live owner");

    drop(i1); // the instance dies: its connection ends
    let live = crate::wait_for(Duration::from_secs(10), || async {
        let live = others.live().await.expect("the live instances");
        (live.len() == 1).then_some(live)
    })
    .await
    .expect("a dead instance leaves the list within seconds, before anyone takes it over");
    assert_eq!(live[0].id, "i2");
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
        others.join("i2", &build, T0, at(T0_MS + 2_000)).await.ok()
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
        .join("i2", &Release::core(), T0, T0)
        .await
        .expect("a left name is free at once");
    drop(i2);
    let _ = second;
}

/// What a store declares ([`StoreConfig::durable`](timer_core::plugin::StoreConfig::durable))
/// is what it does: a durable one opened again (after the first is gone, as after a restart)
/// holds every timer the first committed, in its state; one in process memory starts empty.
pub async fn a_store_keeps_what_it_committed_across_a_restart(fresh: FreshStore) {
    let (store, config, _keep) = fresh.into_parts();
    let s = store.as_ref();
    put(
        s,
        &[
            timer("t", "waiting", T0_MS + 60_000),
            timer("t", "cancelled", T0_MS + 60_000),
        ],
        T0,
    )
    .await;
    let fired = schedule_and_claim(s, timer("t", "fired", T0_MS), "i1", T0_MS + 1_000).await;
    assert_eq!(mark_reached(s, &fired, "i1", at(T0_MS + 10)).await, 1);
    assert_eq!(
        cancel(s, "t", "cancelled", at(T0_MS + 20)).await,
        CancelOutcome::Cancelled
    );
    drop(store);
    let reopened = crate::wait_for(Duration::from_secs(10), || async {
        config.open().await.ok()
    })
    .await
    .unwrap_or_else(|| panic!("opening the store again after the first was dropped"));
    let mut states: Vec<Option<TimerState>> = Vec::new();
    for id in ["waiting", "fired", "cancelled"] {
        let key = TimerKey::new("t", id);
        let found = reopened.get(&key).await;
        states.push(
            found
                .unwrap_or_else(|e| panic!("reading {key}: {}", e.chain()))
                .map(|t| t.state),
        );
    }
    if config.durable() {
        assert_eq!(
            states,
            [
                Some(TimerState::Scheduled),
                Some(TimerState::Reached),
                Some(TimerState::Cancelled)
            ],
            "a durable store holds what it committed, in its state"
        );
        assert_eq!(
            row(reopened.as_ref(), "t", "waiting").await.due_at,
            at(T0_MS + 60_000)
        );
    } else {
        assert_eq!(
            states,
            [None, None, None],
            "a store that says it is not durable starts empty: it says what it is"
        );
    }
}

/// Instances that look for dead owners at the same time take each over once: every dead
/// owner's leases are released by exactly one of them, and the sum is every lease it held.
pub async fn concurrent_take_overs_take_each_dead_owner_once(fresh: FreshStore) {
    let (store, config, _keep) = fresh.into_parts();
    let Some(owners) = store.lease_owners() else {
        return; // a_restart_releases_every_lease_of_a_store_one_service_owns
    };
    let s = store.as_ref();
    let dead = ["d1", "d2", "d3", "d4"];
    let mut members = Vec::new();
    for (i, owner) in dead.iter().enumerate() {
        members.push(
            owners
                .join(owner, &Release::core(), T0, T0)
                .await
                .expect("joins"),
        );
        let batch: Vec<_> = (0..=i)
            .map(|n| timer("t", &format!("{owner}-{n}"), T0_MS))
            .collect();
        put(s, &batch, T0).await;
        let claimed = claim(s, at(T0_MS + 10), 10, owner, T0_MS + 3_600_000).await;
        assert_eq!(claimed.len(), i + 1, "{owner} holds {} leases", i + 1);
    }
    let mut takers = Vec::new();
    for _ in 0..4 {
        takers.push(
            config
                .open()
                .await
                .unwrap_or_else(|e| panic!("another instance on the store: {}", e.chain())),
        );
    }
    drop(members); // the four die: their connections end
    let release_at = at(T0_MS + 1_000);
    // What every round took over, all rounds together (a round may come before the server
    // has noticed every death).
    let taken: std::sync::Mutex<Vec<TakenOver>> = Default::default();
    let all = crate::wait_for(Duration::from_secs(10), || async {
        let rounds = futures::future::join_all(takers.iter().map(|t| async move {
            let owners = t.lease_owners().expect("the same plugin has the ability");
            owners.take_over(release_at).await.expect("take over")
        }))
        .await;
        let mut taken = taken.lock().expect("not poisoned");
        taken.extend(rounds.into_iter().flatten());
        (taken.len() >= dead.len()).then(|| taken.clone())
    })
    .await
    .unwrap_or_else(|| panic!("every dead owner taken over within 10 s: {taken:?}"));
    let mut by_owner: Vec<(String, u64)> =
        all.iter().map(|t| (t.owner.clone(), t.leases)).collect();
    by_owner.sort();
    assert_eq!(
        by_owner,
        [
            ("d1".to_owned(), 1),
            ("d2".to_owned(), 2),
            ("d3".to_owned(), 3),
            ("d4".to_owned(), 4)
        ],
        "each dead owner taken over once, with all its leases"
    );
}

/// `leased` counts the rows claimed and not settled: the leases the instance list shows.
pub async fn leased_counts_the_live_leases(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let leased = || async {
        s.queries()
            .leased()
            .await
            .unwrap_or_else(|e| panic!("counting the leased timers failed: {e}"))
    };
    put(
        s,
        &[
            timer("t", "a", T0_MS),
            timer("t", "b", T0_MS),
            timer("u", "c", T0_MS + 60_000),
        ],
        T0,
    )
    .await;
    assert_eq!(leased().await, 0, "nothing claimed yet");
    let claimed = claim(s, T0, 10, "i1", T0_MS + 1_000).await;
    assert_eq!(ids(&claimed), ["a", "b"]);
    assert_eq!(leased().await, 2, "two claimed, none settled");
    assert_eq!(mark_reached(s, &claimed[..1], "i1", T0).await, 1);
    assert_eq!(leased().await, 1, "a settled row holds no lease");
}
