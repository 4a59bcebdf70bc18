//! Per-tenant rate limits on schedules (`limits.rate`): one GCRA allowance per tenant from
//! `governor`, read on the engine's [`Clock`] (so `ManualClock` drives them in tests).
//!
//! [`Throttle`] only answers whether schedules fit now and, if not, how long until they do. HTTP
//! turns a refusal into 429 with `Retry-After`; the broker path
//! ([`Held`](super::held::Held)) keeps the tenant's commands, unacknowledged, until they fit.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::clock::Clock as _;
use governor::middleware::NoOpMiddleware;
use governor::state::keyed::HashMapStateStore;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};

use tracing::warn;

use crate::clock::Clock;
use crate::config::RateLimits;
use crate::store::{SharedAllowances, Store, Take, Taken};

/// The engine's clock as governor reads it: time since the epoch (never before it).
#[derive(Clone)]
struct EngineClock(Arc<dyn Clock>);

impl governor::clock::Clock for EngineClock {
    type Instant = Duration;

    fn now(&self) -> Duration {
        Duration::from_millis(u64::try_from(self.0.now().as_millis()).unwrap_or(0))
    }
}

type Keyed = RateLimiter<String, HashMapStateStore<String>, EngineClock, NoOpMiddleware<Duration>>;
type Direct = RateLimiter<NotKeyed, InMemoryState, EngineClock, NoOpMiddleware<Duration>>;

/// A rate: schedules per second and burst, both at least 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub per_second: NonZeroU32,
    pub burst: NonZeroU32,
}

impl Rate {
    /// None for 0 per second (no limit); a burst of 0 is one second's worth.
    fn of(per_second: u32, burst: u32) -> Option<Rate> {
        let per_second = NonZeroU32::new(per_second)?;
        Some(Rate {
            per_second,
            burst: NonZeroU32::new(burst).unwrap_or(per_second),
        })
    }

    fn quota(self) -> Quota {
        Quota::per_second(self.per_second).allow_burst(self.burst)
    }
}

/// Why schedules of a tenant do not fit now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Throttled {
    pub tenant: String,
    pub rate: Rate,
    /// How many schedules were asked for at once.
    pub asked: u32,
    /// When they fit; `None` when they never fit at once (more than the burst).
    pub retry_after: Option<Duration>,
}

impl fmt::Display for Throttled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Rate { per_second, burst } = self.rate;
        match self.retry_after {
            Some(after) => write!(
                f,
                "tenant {:?} is over its rate limit of {per_second} schedules per second \
                 (burst {burst}, limits.rate): retry after {} ms",
                self.tenant,
                after.as_millis().max(1)
            ),
            None => write!(
                f,
                "{} schedules of tenant {:?} at once are more than its burst of {burst} \
                 (limits.rate) allows: send at most {burst} at a time",
                self.asked, self.tenant
            ),
        }
    }
}

/// Every tenant's allowance: the default rate for all, a rate of their own for some.
pub(crate) struct Throttle {
    /// The clock the limiters read, for how long a refused schedule waits.
    clock: EngineClock,
    default: Option<(Rate, Keyed)>,
    /// Tenants of `limits.rate.tenants`; `None`: no limit for that tenant.
    own: HashMap<String, Option<(Rate, Direct)>>,
    /// The store's shared allowances, taken from instead of the limiters here
    /// (`limits.rate.shared`), if any.
    shared: Option<StoreAllowances>,
}

/// The store's shared allowances (`limits.rate.shared`), each take bounded by
/// `engine.store_timeout`: a store that does not answer costs a warning (the instance limits or
/// paces alone meanwhile), never a task held for as long as the connection takes to give up.
#[derive(Clone)]
pub(crate) struct StoreAllowances {
    store: Arc<dyn Store>,
    timeout: Duration,
}

impl StoreAllowances {
    /// `None` for a store that keeps no shared allowances.
    pub(crate) fn of(store: &Arc<dyn Store>, timeout: Duration) -> Option<Self> {
        store.shared_allowances().map(|_| StoreAllowances {
            store: store.clone(),
            timeout,
        })
    }

    fn allowances(&self) -> crate::Result<&dyn SharedAllowances> {
        self.store
            .shared_allowances()
            .ok_or_else(|| crate::Error::unsupported("the store keeps no shared allowances"))
    }

    pub(crate) async fn take(&self, take: &Take<'_>) -> crate::Result<Taken> {
        let call = self.allowances()?.take(take);
        super::retry::within_store_timeout(self.timeout, call).await
    }

    async fn forget(&self, now_us: i64) -> crate::Result<u64> {
        let call = self.allowances()?.forget(now_us);
        super::retry::within_store_timeout(self.timeout, call).await
    }
}

impl Throttle {
    pub(crate) fn new(
        config: &RateLimits,
        clock: Arc<dyn Clock>,
        shared: Option<StoreAllowances>,
    ) -> Throttle {
        let clock = EngineClock(clock);
        let default = Rate::of(config.schedules_per_second, config.burst).map(|rate| {
            let limiter =
                RateLimiter::new(rate.quota(), HashMapStateStore::default(), clock.clone());
            (rate, limiter)
        });
        let own = config
            .tenants
            .iter()
            .map(|(tenant, own)| {
                let limiter = Rate::of(own.schedules_per_second, own.burst).map(|rate| {
                    let limiter =
                        RateLimiter::new(rate.quota(), InMemoryState::default(), clock.clone());
                    (rate, limiter)
                });
                (tenant.clone(), limiter)
            })
            .collect();
        Throttle {
            clock,
            default,
            own,
            shared,
        }
    }

    /// `tenant`'s rate; `None`: no limit.
    fn rate_of(&self, tenant: &str) -> Option<Rate> {
        match (self.own.get(tenant), &self.default) {
            (Some(own), _) => own.as_ref().map(|(rate, _)| *rate),
            (None, default) => default.as_ref().map(|(rate, _)| *rate),
        }
    }

    /// Takes `n` schedules from `tenant`'s allowance, or nothing when they do not fit now: from
    /// the store's shared allowance with `limits.rate.shared`, else (and while the store cannot
    /// be reached: a warning) from this instance's own.
    pub(crate) async fn take(&self, tenant: &str, n: u32) -> Result<(), Throttled> {
        let Some(n) = NonZeroU32::new(n) else {
            return Ok(());
        };
        let Some(rate) = self.rate_of(tenant) else {
            return Ok(());
        };
        let throttled = |retry_after| Throttled {
            tenant: tenant.to_owned(),
            rate,
            asked: n.get(),
            retry_after,
        };
        // More than the burst never fits (as the limiters here say too).
        if n > rate.burst {
            return Err(throttled(None));
        }
        let Some(shared) = self.take_shared(tenant, n.get(), rate, true).await else {
            return self.take_here(tenant, n);
        };
        if shared.taken.taken >= n.get() {
            return Ok(());
        }
        // The cells fit once the allowance, with them, is no more than a burst ahead of now.
        let fits_at = shared.taken.start_us + shared.cell_us * i64::from(n.get())
            - shared.cell_us * i64::from(rate.burst.get());
        let wait = u64::try_from(fits_at - shared.now_us).unwrap_or(0).max(1);
        Err(throttled(Some(Duration::from_micros(wait))))
    }

    /// Takes as many of `n` schedules of `tenant` as fit now (the broker path, which holds the
    /// rest): one call of the store for them all when the allowances are shared.
    pub(crate) async fn take_up_to(&self, tenant: &str, n: u32) -> u32 {
        let Some(rate) = self.rate_of(tenant) else {
            return n;
        };
        if let Some(shared) = self.take_shared(tenant, n, rate, false).await {
            return shared.taken.taken;
        }
        let one = NonZeroU32::MIN;
        (0..n)
            .take_while(|_| self.take_here(tenant, one).is_ok())
            .count() as u32
    }

    /// Takes up to `n` cells of `tenant` at `rate` (all or none when `all`) from the store's
    /// shared allowance: a cell costs `1 / per_second`, and cells fit while the allowance is at
    /// most `burst` cells ahead of now. `None` when the allowances are not shared, or the store
    /// failed (a warning: this instance limits alone meanwhile).
    async fn take_shared(&self, tenant: &str, n: u32, rate: Rate, all: bool) -> Option<Shared> {
        let allowances = self.shared.as_ref()?;
        let cell_us = 1_000_000 / i64::from(rate.per_second.get());
        let now_us = micros(self.clock.now());
        let take = Take {
            kind: "rate",
            tenant,
            now_us,
            cell_us,
            n,
            max_ahead_us: Some(cell_us * i64::from(rate.burst.get())),
            all,
        };
        match allowances.take(&take).await {
            Ok(taken) => Some(Shared {
                taken,
                cell_us,
                now_us,
            }),
            Err(e) => {
                warn!(
                    tenant,
                    error = %e.chain(),
                    "taking from the shared allowance failed; this instance limits alone"
                );
                None
            }
        }
    }

    /// [`Throttle::take`] from this instance's own limiters.
    fn take_here(&self, tenant: &str, n: NonZeroU32) -> Result<(), Throttled> {
        let (rate, checked) = match (self.own.get(tenant), &self.default) {
            (Some(None), _) | (None, None) => return Ok(()),
            (Some(Some((rate, limiter))), _) => (*rate, limiter.check_n(n)),
            (None, Some((rate, limiter))) => (*rate, limiter.check_key_n(&tenant.to_owned(), n)),
        };
        let throttled = |retry_after| Throttled {
            tenant: tenant.to_owned(),
            rate,
            asked: n.get(),
            retry_after,
        };
        match checked {
            Ok(Ok(())) => Ok(()),
            Ok(Err(not)) => Err(throttled(Some(not.wait_time_from(self.clock.now())))),
            Err(_) => Err(throttled(None)),
        }
    }

    /// Takes the schedules of several tenants, tenant by tenant; stops at the first tenant that
    /// does not fit (what earlier tenants took stays taken).
    pub(crate) async fn take_all<'a>(
        &self,
        tenants: impl IntoIterator<Item = &'a str>,
    ) -> Result<(), Throttled> {
        let mut counts: BTreeMap<&str, u32> = BTreeMap::new();
        for tenant in tenants {
            *counts.entry(tenant).or_default() += 1;
        }
        for (tenant, n) in counts {
            self.take(tenant, n).await?;
        }
        Ok(())
    }

    /// Forgets the allowances of tenants that are full again (the state of a tenant not seen
    /// lately), so the map (and the store's table, when shared) does not grow with every
    /// tenant ever seen.
    pub(crate) async fn forget_idle(&self) {
        if let Some((_, limiter)) = &self.default {
            limiter.retain_recent();
        }
        if let Some(allowances) = &self.shared {
            if let Err(e) = allowances.forget(micros(self.clock.now())).await {
                warn!(error = %e.chain(), "forgetting full shared allowances failed");
            }
        }
    }
}

/// What the store's shared allowance gave ([`Throttle::take_shared`]), and on what terms.
struct Shared {
    taken: Taken,
    cell_us: i64,
    now_us: i64,
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::config::TenantRate;
    use crate::model::Timestamp;

    fn throttle(config: RateLimits) -> (Arc<ManualClock>, Throttle) {
        let clock = Arc::new(ManualClock::new(Timestamp::from_millis(1_700_000_000_000)));
        let throttle = Throttle::new(&config, clock.clone(), None);
        (clock, throttle)
    }

    fn limits(per_second: u32, burst: u32) -> RateLimits {
        RateLimits {
            schedules_per_second: per_second,
            burst,
            ..RateLimits::default()
        }
    }

    #[tokio::test]
    async fn no_limit_by_default() {
        let (_, throttle) = throttle(RateLimits::default());
        for _ in 0..10_000 {
            assert!(throttle.take("acme", 1).await.is_ok());
        }
    }

    #[tokio::test]
    async fn a_tenant_gets_its_burst_then_its_rate() {
        let (clock, throttle) = throttle(limits(10, 5));
        for _ in 0..5 {
            assert!(throttle.take("acme", 1).await.is_ok());
        }
        let over = throttle.take("acme", 1).await.unwrap_err();
        assert_eq!(over.retry_after, Some(Duration::from_millis(100)));
        assert!(
            over.to_string().contains("10 schedules per second"),
            "{over}"
        );
        // Another tenant has its own allowance.
        assert!(throttle.take("other", 5).await.is_ok());
        clock.advance(Duration::from_millis(100));
        assert!(throttle.take("acme", 1).await.is_ok());
        assert!(throttle.take("acme", 1).await.is_err());
    }

    #[tokio::test]
    async fn more_than_the_burst_at_once_never_fits() {
        let (_, throttle) = throttle(limits(10, 0));
        let never = throttle.take("acme", 11).await.unwrap_err();
        assert_eq!(never.retry_after, None);
        assert!(
            never.to_string().contains("at most 10 at a time"),
            "{never}"
        );
        // Nothing was taken.
        assert!(throttle.take("acme", 10).await.is_ok());
    }

    #[tokio::test]
    async fn tenants_of_their_own_override_the_default() {
        let mut config = limits(1, 1);
        config.tenants.insert(
            "big".into(),
            TenantRate {
                schedules_per_second: 100,
                burst: 100,
            },
        );
        config.tenants.insert("free".into(), TenantRate::default());
        let (_, throttle) = throttle(config);
        assert!(throttle.take("big", 100).await.is_ok());
        assert!(throttle.take("big", 1).await.is_err());
        assert!(throttle.take("free", 1_000_000).await.is_ok());
        assert!(throttle.take("small", 1).await.is_ok());
        assert!(throttle.take("small", 1).await.is_err());
    }

    #[tokio::test]
    async fn a_batch_counts_per_tenant() {
        let (_, throttle) = throttle(limits(2, 2));
        assert!(throttle.take_all(["a", "b", "a", "b"]).await.is_ok());
        let over = throttle.take_all(["b"]).await.unwrap_err();
        assert_eq!(over.tenant, "b");
    }
}
