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

use crate::config::FireRateLimits;
use crate::model::{TimerKey, Timestamp};

/// Turns further back than this are forgotten when the map is swept (the timer was cancelled,
/// rescheduled, or claimed elsewhere).
const FORGET_AFTER_MS: i64 = 60_000;

pub(crate) struct Pace {
    limits: FireRateLimits,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Each paced tenant's theoretical arrival time: when its allowance is full again, in
    /// microseconds since the epoch.
    tat: HashMap<String, i64>,
    /// Timers handed back for a turn: the turn, in ms.
    turns: HashMap<TimerKey, i64>,
    /// When the maps were last swept, in ms.
    swept: i64,
}

impl Pace {
    pub(crate) fn new(limits: &FireRateLimits) -> Pace {
        Pace {
            limits: limits.clone(),
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

    /// When the timer `key` may fire, claimed at `now`: `None` for now, or its turn (which it
    /// keeps: the caller hands it back until then).
    pub(crate) fn turn(&self, key: &TimerKey, now: Timestamp) -> Option<Timestamp> {
        let (per_second, burst) = self.limits.of(&key.tenant_id)?;
        let now_ms = now.as_millis();
        let mut state = match self.state.lock() {
            Ok(state) => state,
            Err(poisoned) => poisoned.into_inner(),
        };
        state.sweep(now_ms);
        if let Some(turn) = state.turns.get(key).copied() {
            if turn <= now_ms {
                state.turns.remove(key);
                return None;
            }
            return Some(Timestamp::from_millis(turn));
        }
        let interval = 1_000_000 / i64::from(per_second).max(1);
        let tolerance = interval * (i64::from(burst) - 1);
        let now_us = now_ms.saturating_mul(1_000);
        let tat = state
            .tat
            .get(&key.tenant_id)
            .copied()
            .unwrap_or(now_us)
            .max(now_us);
        let at_us = (tat - tolerance).max(now_us);
        state.tat.insert(key.tenant_id.clone(), tat + interval);
        if at_us <= now_us {
            return None;
        }
        // Rounded up to the next ms: never before the turn.
        let turn = (at_us + 999) / 1_000;
        state.turns.insert(key.clone(), turn);
        Some(Timestamp::from_millis(turn))
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

    #[test]
    fn a_herd_fires_its_burst_then_one_turn_per_interval() {
        let pace = Pace::new(&limits(10, 3));
        let now = Timestamp::from_millis(1_000_000);
        let turns: Vec<Option<i64>> = (0..6)
            .map(|i| pace.turn(&key("herd", i), now).map(|t| t.as_millis()))
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
        assert_eq!(pace.turn(&key("other", 0), now), None);
    }

    #[test]
    fn a_timer_claimed_again_at_its_turn_goes_out_without_taking_another() {
        let pace = Pace::new(&limits(10, 1));
        let now = Timestamp::from_millis(1_000_000);
        assert_eq!(pace.turn(&key("herd", 0), now), None);
        let turn = pace.turn(&key("herd", 1), now).expect("over the rate");
        assert_eq!(turn.as_millis(), 1_000_100);
        // Claimed early (another claim before its turn): the same turn again.
        assert_eq!(pace.turn(&key("herd", 1), now), Some(turn));
        // At its turn it goes, and the next timer still gets the turn after it.
        assert_eq!(pace.turn(&key("herd", 1), turn), None);
        assert_eq!(
            pace.turn(&key("herd", 2), turn).map(|t| t.as_millis()),
            Some(1_000_200)
        );
    }

    #[test]
    fn after_a_quiet_spell_the_burst_is_full_again() {
        let pace = Pace::new(&limits(100, 2));
        let t0 = Timestamp::from_millis(5_000_000);
        assert_eq!(pace.turn(&key("herd", 0), t0), None);
        assert_eq!(pace.turn(&key("herd", 1), t0), None);
        assert!(pace.turn(&key("herd", 2), t0).is_some());
        let later = Timestamp::from_millis(5_010_000);
        assert_eq!(pace.turn(&key("herd", 3), later), None);
        assert_eq!(pace.turn(&key("herd", 4), later), None);
    }

    #[test]
    fn no_limit_is_off() {
        assert!(Pace::new(&FireRateLimits::default()).is_off());
        assert!(!Pace::new(&limits(1, 0)).is_off());
    }
}
