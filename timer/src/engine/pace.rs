//! Per-tenant fire rates (`limits.fire_rate`): when each claimed timer of a paced tenant may go
//! out. A generic cell rate algorithm whose cells are reserved: a timer over its tenant's rate
//! gets the next free turn in the future and is handed back until then, so a herd is spread at
//! the rate instead of being claimed and handed back again and again. (`governor`, which keeps
//! `limits.rate`, answers whether a cell fits now; it has no reservations.)
//!
//! A timer handed back for its turn is remembered by key until then: when it is claimed again
//! at its turn it goes out without taking another. What is forgotten (a restart, or another
//! instance claiming it) only costs a later turn.

use std::collections::HashMap;
use std::sync::Mutex;

use tracing::warn;

use super::throttle::StoreAllowances;
use crate::config::FireRateLimits;
use crate::model::{TimerKey, Timestamp};
use crate::store::Take;

/// Turns further back than this are forgotten when the map is swept (the timer was cancelled,
/// rescheduled, or claimed elsewhere).
const FORGET_AFTER_MS: i64 = 60_000;

pub(crate) struct Pace {
    limits: FireRateLimits,
    /// The store's shared allowances, which reserve the turns (`limits.rate.shared`), if any.
    shared: Option<StoreAllowances>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Each paced tenant's theoretical arrival time: when its allowance is full again, in
    /// microseconds since the epoch (kept here unless the allowances are shared).
    tat: HashMap<String, i64>,
    /// Timers handed back for a turn: the turn, in ms.
    turns: HashMap<TimerKey, i64>,
    /// When the maps were last swept, in ms.
    swept: i64,
}

impl Pace {
    pub(crate) fn new(limits: &FireRateLimits, shared: Option<StoreAllowances>) -> Pace {
        Pace {
            limits: limits.clone(),
            shared,
            state: Mutex::default(),
        }
    }

    /// Whether no tenant is paced.
    pub(crate) fn is_off(&self) -> bool {
        self.limits.fires_per_second == 0
            && self
                .limits
                .tenants
                .values()
                .all(|t| t.fires_per_second == 0)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(state) => state,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// When each of `keys` (claimed at `now`) may fire: `None` for now, or its turn, which it
    /// keeps (the caller hands it back until then).
    pub(crate) async fn turns(&self, keys: &[&TimerKey], now: Timestamp) -> Vec<Option<Timestamp>> {
        let now_ms = now.as_millis();
        let mut out: Vec<Option<Timestamp>> = vec![None; keys.len()];
        // Per paced tenant, the timers that need a new turn (by index into `keys`).
        let mut wanting: HashMap<&str, Vec<usize>> = HashMap::new();
        {
            let mut state = self.state();
            state.sweep(now_ms);
            for (i, key) in keys.iter().enumerate() {
                if self.limits.of(&key.tenant_id).is_none() {
                    continue;
                }
                match state.turns.get(*key).copied() {
                    // Claimed again at its turn: it goes, without taking another.
                    Some(turn) if turn <= now_ms => {
                        state.turns.remove(*key);
                    }
                    Some(turn) => out[i] = Some(Timestamp::from_millis(turn)),
                    None => wanting.entry(key.tenant_id.as_str()).or_default().push(i),
                }
            }
        }
        for (tenant, indexes) in wanting {
            let Some((per_second, burst)) = self.limits.of(tenant) else {
                continue;
            };
            let interval = 1_000_000 / i64::from(per_second).max(1);
            let now_us = now_ms.saturating_mul(1_000);
            let n = u32::try_from(indexes.len()).unwrap_or(u32::MAX);
            let start = self.reserve(tenant, n, interval, now_us).await;
            let mut state = self.state();
            for (k, i) in indexes.into_iter().enumerate() {
                // The k-th cell may go once the allowance is no more than a burst ahead.
                let at_us =
                    (start + (k as i64 + 1) * interval - i64::from(burst) * interval).max(now_us);
                if at_us <= now_us {
                    continue;
                }
                // Rounded up to the next ms: never before the turn.
                let turn = (at_us + 999) / 1_000;
                state.turns.insert(keys[i].clone(), turn);
                out[i] = Some(Timestamp::from_millis(turn));
            }
        }
        out
    }

    /// Reserves `n` cells of `cell_us` of `tenant`'s allowance; returns where the reservation
    /// starts. Kept in the store when shared; here when not, or when the store cannot be reached
    /// (a warning: the instance paces alone meanwhile).
    async fn reserve(&self, tenant: &str, n: u32, cell_us: i64, now_us: i64) -> i64 {
        if let Some(allowances) = &self.shared {
            let take = Take {
                kind: "fire",
                tenant,
                now_us,
                cell_us,
                n,
                max_ahead_us: None,
                all: true,
            };
            match allowances.take(&take).await {
                Ok(taken) => return taken.start_us,
                Err(e) => warn!(
                    tenant,
                    error = %e.chain(),
                    "reserving fire turns in the store failed; this instance paces alone"
                ),
            }
        }
        let mut state = self.state();
        let tat = state.tat.entry(tenant.to_owned()).or_insert(now_us);
        let start = (*tat).max(now_us);
        *tat = start + i64::from(n) * cell_us;
        start
    }
}

impl State {
    /// At most once a second: forgets turns long past and tenants whose allowance is full.
    fn sweep(&mut self, now_ms: i64) {
        if now_ms - self.swept < 1_000 {
            return;
        }
        self.swept = now_ms;
        self.turns
            .retain(|_, turn| *turn > now_ms - FORGET_AFTER_MS);
        let now_us = now_ms.saturating_mul(1_000);
        self.tat.retain(|_, tat| *tat > now_us);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TenantFireRate;

    fn limits(per_second: u32, burst: u32) -> FireRateLimits {
        FireRateLimits {
            fires_per_second: 0,
            burst: 0,
            tenants: [(
                "herd".to_owned(),
                TenantFireRate {
                    fires_per_second: per_second,
                    burst,
                },
            )]
            .into(),
        }
    }

    fn key(tenant: &str, i: usize) -> TimerKey {
        TimerKey::new(tenant, format!("t{i}"))
    }

    async fn turn(pace: &Pace, key: &TimerKey, now: Timestamp) -> Option<i64> {
        pace.turns(&[key], now).await[0].map(Timestamp::as_millis)
    }

    #[tokio::test]
    async fn a_herd_fires_its_burst_then_one_turn_per_interval() {
        let pace = Pace::new(&limits(10, 3), None);
        let now = Timestamp::from_millis(1_000_000);
        let keys: Vec<TimerKey> = (0..6).map(|i| key("herd", i)).collect();
        let refs: Vec<&TimerKey> = keys.iter().collect();
        let turns: Vec<Option<i64>> = pace
            .turns(&refs, now)
            .await
            .into_iter()
            .map(|t| t.map(Timestamp::as_millis))
            .collect();
        // A burst of 3 now, then every 100 ms.
        assert_eq!(
            turns,
            [
                None,
                None,
                None,
                Some(1_000_100),
                Some(1_000_200),
                Some(1_000_300)
            ]
        );
        // Other tenants are not paced.
        assert_eq!(turn(&pace, &key("other", 0), now).await, None);
    }

    #[tokio::test]
    async fn a_timer_claimed_again_at_its_turn_goes_out_without_taking_another() {
        let pace = Pace::new(&limits(10, 1), None);
        let now = Timestamp::from_millis(1_000_000);
        assert_eq!(turn(&pace, &key("herd", 0), now).await, None);
        let first = turn(&pace, &key("herd", 1), now).await;
        assert_eq!(first, Some(1_000_100));
        // Claimed early (another claim before its turn): the same turn again.
        assert_eq!(turn(&pace, &key("herd", 1), now).await, first);
        // At its turn it goes, and the next timer still gets the turn after it.
        let at = Timestamp::from_millis(1_000_100);
        assert_eq!(turn(&pace, &key("herd", 1), at).await, None);
        assert_eq!(turn(&pace, &key("herd", 2), at).await, Some(1_000_200));
    }

    #[tokio::test]
    async fn after_a_quiet_spell_the_burst_is_full_again() {
        let pace = Pace::new(&limits(100, 2), None);
        let t0 = Timestamp::from_millis(5_000_000);
        assert_eq!(turn(&pace, &key("herd", 0), t0).await, None);
        assert_eq!(turn(&pace, &key("herd", 1), t0).await, None);
        assert!(turn(&pace, &key("herd", 2), t0).await.is_some());
        let later = Timestamp::from_millis(5_010_000);
        assert_eq!(turn(&pace, &key("herd", 3), later).await, None);
        assert_eq!(turn(&pace, &key("herd", 4), later).await, None);
    }

    #[test]
    fn no_limit_is_off() {
        assert!(Pace::new(&FireRateLimits::default(), None).is_off());
        assert!(!Pace::new(&limits(1, 0), None).is_off());
    }
}
