//! Fair claims (`timer_core::fair`): in a backlog a claim is shared between the tenants with due
//! timers, each tenant's earliest first, and a tenant is served in turn however many others
//! have timers; several instances share it the same way and never claim a row twice.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use timer_core::{NewTimer, Store, TimerKey};

use super::{at, claim, claim_all_concurrently, ids, put, timer, FreshStore, T0, T0_MS};

/// `big` has `herd` timers due at T0 + 1 ms, + 2 ms, …; each of `small` one due after them all.
async fn a_herd_and_small_tenants(s: &dyn Store, herd: usize, small: &[&str]) {
    let mut batch: Vec<NewTimer> = (0..herd)
        .map(|i| timer("big", &format!("b{i:04}"), T0_MS + 1 + i as i64))
        .collect();
    for t in small {
        batch.push(timer(t, "s", T0_MS + 1 + herd as i64));
    }
    put(s, &batch, T0).await;
}

pub async fn a_claim_in_a_backlog_shares_the_batch_between_tenants(store: Arc<dyn Store>) {
    let s = store.as_ref();
    a_herd_and_small_tenants(s, 40, &["small"]).await;
    let now = at(T0_MS + 1_000);
    let until = now.as_millis() + 60_000;
    // 41 due, 4 taken: the first claim shares, so `small` does not wait for the other 37.
    let first = claim(s, now, 4, "i1", until).await;
    assert_eq!(ids(&first), ["b0000", "b0001", "b0002", "s"]);
    // The herd goes on in its due order, and all of it is claimed.
    let mut herd: Vec<String> = first
        .iter()
        .map(|c| c.key.service_call_id.clone())
        .collect();
    herd.retain(|id| id != "s");
    loop {
        let more = claim(s, now, 4, "i1", until).await;
        if more.is_empty() {
            break;
        }
        herd.extend(more.into_iter().map(|c| c.key.service_call_id));
    }
    let expected: Vec<String> = (0..40).map(|i| format!("b{i:04}")).collect();
    assert_eq!(
        herd, expected,
        "within a tenant, the earliest are claimed first"
    );
}

pub async fn tenants_beyond_one_claims_visits_are_served_in_turn(store: Arc<dyn Store>) {
    let s = store.as_ref();
    // Six tenants of three timers each; a claim of 2 visits two tenants.
    let tenants = ["t1", "t2", "t3", "t4", "t5", "t6"];
    let batch: Vec<NewTimer> = tenants
        .iter()
        .flat_map(|t| (0..3).map(move |i| timer(t, &format!("x{i}"), T0_MS + i)))
        .collect();
    put(s, &batch, T0).await;
    let now = at(T0_MS + 1_000);
    let mut first_served: HashMap<String, usize> = HashMap::new();
    for n in 0..4 {
        for c in claim(s, now, 2, "i1", now.as_millis() + 60_000).await {
            first_served.entry(c.key.tenant_id).or_insert(n);
        }
    }
    // 18 due, 2 taken: from the first, claims visit t1–t2, t3–t4, t5–t6.
    for t in tenants {
        let n = first_served.get(t);
        assert!(
            n.is_some_and(|n| *n <= 2),
            "{t} first served by claim {n:?} (of 0–2): {first_served:?}"
        );
    }
}

pub async fn fair_claims_are_exclusive_under_concurrency(store: Arc<dyn Store>) {
    const TENANTS: usize = 5;
    const EACH: usize = 300;
    let batch: Vec<NewTimer> = (0..TENANTS * EACH)
        .map(|i| {
            timer(
                &format!("t{}", i % TENANTS),
                &format!("c{i:05}"),
                T0_MS + (i % 50) as i64,
            )
        })
        .collect();
    put(store.as_ref(), &batch, T0).await;
    let claimed = claim_all_concurrently(&store, 6, 23, at(T0_MS + 100)).await;
    assert_eq!(
        claimed,
        TENANTS * EACH,
        "every due timer claimed exactly once"
    );
}

pub async fn two_instances_share_a_backlog_and_never_claim_a_row_twice(fresh: FreshStore) {
    let (store, config, _keep) = fresh.into_parts();
    if !config.shared() {
        return; // one instance at a time (a file, process memory): the checks above are its
    }
    let second = config
        .open()
        .await
        .unwrap_or_else(|e| panic!("opening a second instance: {}", e.chain()));
    let instances = [store.as_ref(), second.as_ref()];
    a_herd_and_small_tenants(instances[0], 60, &["small1", "small2"]).await;
    let now = at(T0_MS + 1_000);
    let mut seen: HashSet<TimerKey> = HashSet::new();
    let mut small_in_round = Vec::new();
    for round in 0.. {
        let mut any = false;
        for (i, s) in instances.iter().enumerate() {
            for c in claim(*s, now, 4, &format!("i{i}"), now.as_millis() + 60_000).await {
                any = true;
                if c.key.tenant_id != "big" {
                    small_in_round.push(round);
                }
                assert!(seen.insert(c.key.clone()), "{} was claimed twice", c.key);
            }
        }
        if !any {
            break;
        }
    }
    assert_eq!(seen.len(), 62, "every due timer claimed once");
    // 62 due, 4 a claim: the first claims share.
    assert_eq!(small_in_round.len(), 2);
    assert!(
        small_in_round.iter().all(|r| *r == 0),
        "the small tenants waited for the herd: served in rounds {small_in_round:?}"
    );
}
