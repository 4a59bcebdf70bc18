//! Shared rate allowances (`SharedAllowances`, `limits.rate.shared`): one budget per kind and
//! tenant that every handle on the store moves atomically, so two instances never take the same
//! room twice.

use std::sync::Arc;

use timer_core::{Advanced, Store};

use super::FreshStore;

const SECOND: i64 = 1_000_000;

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
    let now = 1_800_000_000 * SECOND;
    // A cost of one second with at most three seconds ahead: three fit, from either handle.
    assert_eq!(
        a.advance("rate", "acme", now, SECOND, Some(3 * SECOND))
            .await
            .expect("advance"),
        Advanced::Taken { start_us: now }
    );
    assert_eq!(
        b.advance("rate", "acme", now, SECOND, Some(3 * SECOND))
            .await
            .expect("advance"),
        Advanced::Taken {
            start_us: now + SECOND
        }
    );
    assert_eq!(
        a.advance("rate", "acme", now, SECOND, Some(3 * SECOND))
            .await
            .expect("advance"),
        Advanced::Taken {
            start_us: now + 2 * SECOND
        }
    );
    // The fourth does not fit, and changes nothing.
    assert_eq!(
        b.advance("rate", "acme", now, SECOND, Some(3 * SECOND))
            .await
            .expect("advance"),
        Advanced::Denied {
            tat_us: now + 3 * SECOND
        }
    );
    assert_eq!(
        a.advance("rate", "acme", now, SECOND, Some(3 * SECOND))
            .await
            .expect("advance"),
        Advanced::Denied {
            tat_us: now + 3 * SECOND
        }
    );
    // Other tenants and kinds have budgets of their own.
    assert_eq!(
        b.advance("rate", "other", now, SECOND, Some(3 * SECOND))
            .await
            .expect("advance"),
        Advanced::Taken { start_us: now }
    );
    assert_eq!(
        b.advance("fire", "acme", now, SECOND, Some(3 * SECOND))
            .await
            .expect("advance"),
        Advanced::Taken { start_us: now }
    );
    // A second later one more fits; without a bound (a reserved turn) it always does.
    let later = now + SECOND;
    assert_eq!(
        a.advance("rate", "acme", later, SECOND, Some(3 * SECOND))
            .await
            .expect("advance"),
        Advanced::Taken {
            start_us: now + 3 * SECOND
        }
    );
    assert_eq!(
        b.advance("fire", "acme", later, 10 * SECOND, None)
            .await
            .expect("advance"),
        Advanced::Taken {
            start_us: now + SECOND
        }
    );
    // Allowances whose time has passed are forgotten (full again: the same as none).
    let much_later = now + 60 * SECOND;
    assert_eq!(a.forget(much_later).await.expect("forget"), 3);
    assert_eq!(
        b.advance("rate", "acme", much_later, SECOND, Some(3 * SECOND))
            .await
            .expect("advance"),
        Advanced::Taken {
            start_us: much_later
        }
    );
}
