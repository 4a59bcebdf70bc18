//! Shared rate allowances (`SharedAllowances`, `limits.rate.shared`): one budget per kind and
//! tenant that every handle on the store takes from atomically, so two instances never take the
//! same room twice.

use std::sync::Arc;

use timer_core::{SharedAllowances, Store, Take, Taken};

use super::FreshStore;

const SECOND: i64 = 1_000_000;
const NOW: i64 = 1_800_000_000 * SECOND;

/// `n` cells of a second each, at most three seconds ahead of `now` (a burst of 3), all or none
/// when `all`.
fn cells<'a>(kind: &'a str, tenant: &'a str, now_us: i64, n: u32, all: bool) -> Take<'a> {
    Take {
        kind,
        tenant,
        now_us,
        cell_us: SECOND,
        n,
        max_ahead_us: Some(3 * SECOND),
        all,
    }
}

async fn take(a: &dyn SharedAllowances, take: Take<'_>) -> (u32, i64, i64) {
    let Taken {
        taken,
        start_us,
        tat_us,
    } = a
        .take(&take)
        .await
        .unwrap_or_else(|e| panic!("taking {take:?}: {}", e.chain()));
    (taken, start_us - NOW, tat_us - NOW)
}

pub async fn shared_allowances_are_one_budget_for_every_instance(fresh: FreshStore) {
    let (store, config, _keep) = fresh.into_parts();
    if store.shared_allowances().is_none() {
        return; // a store one instance has to itself: its allowances are the instance's own
    }
    let second: Arc<dyn Store> = config
        .open()
        .await
        .unwrap_or_else(|e| panic!("opening a second instance: {}", e.chain()));
    let a = store.shared_allowances().expect("the first handle shares");
    let b = second
        .shared_allowances()
        .expect("the second handle shares");
    // Three fit, from either handle; then none, and a refusal changes nothing.
    assert_eq!(
        take(a, cells("rate", "acme", NOW, 1, true)).await,
        (1, 0, SECOND)
    );
    assert_eq!(
        take(b, cells("rate", "acme", NOW, 1, true)).await,
        (1, SECOND, 2 * SECOND)
    );
    assert_eq!(
        take(a, cells("rate", "acme", NOW, 1, true)).await,
        (1, 2 * SECOND, 3 * SECOND)
    );
    assert_eq!(
        take(b, cells("rate", "acme", NOW, 1, true)).await,
        (0, 3 * SECOND, 3 * SECOND)
    );
    // Other tenants and kinds have budgets of their own; all or none, or as many as fit.
    assert_eq!(
        take(b, cells("rate", "other", NOW, 4, true)).await,
        (0, 0, 0)
    );
    assert_eq!(
        take(b, cells("rate", "other", NOW, 4, false)).await,
        (3, 0, 3 * SECOND)
    );
    assert_eq!(
        take(a, cells("fire", "acme", NOW, 2, true)).await,
        (2, 0, 2 * SECOND)
    );
    // A second later one more fits; without a bound (reserved turns) all always do.
    let later = NOW + SECOND;
    assert_eq!(
        take(a, cells("rate", "acme", later, 2, false)).await,
        (1, 3 * SECOND, 4 * SECOND)
    );
    let turns = Take {
        max_ahead_us: None,
        ..cells("fire", "acme", later, 10, true)
    };
    assert_eq!(take(b, turns).await, (10, 2 * SECOND, 12 * SECOND));
    // Allowances whose time has passed are forgotten (full again: the same as none).
    let much_later = NOW + 60 * SECOND;
    assert_eq!(a.forget(much_later).await.expect("forget"), 3);
    assert_eq!(
        take(b, cells("rate", "acme", much_later, 3, true)).await,
        (3, 60 * SECOND, 63 * SECOND)
    );
}
