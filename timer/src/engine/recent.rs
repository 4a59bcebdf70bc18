//! What this instance fired lately, for the status and the dashboard: counts per second and a
//! sample of lateness per second (the first [`SAMPLES_PER_SECOND`] fires of each second) for
//! the last minute, from which the status reads p50 and p99; for the last hour, the same
//! three figures per minute, summarized from the seconds when a minute ends; and the last
//! minute per tenant (who was late), with smaller samples ([`TENANT_SAMPLES_PER_SECOND`]) for
//! at most [`TENANTS`] tenants, so its memory is bounded by the fires, not by the tenants.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use crate::model::Timestamp;

/// Lateness values kept per second; the count goes on beyond it.
pub const SAMPLES_PER_SECOND: usize = 1_000;

/// Lateness values kept per tenant and second; the count and the maximum go on beyond it.
pub const TENANT_SAMPLES_PER_SECOND: usize = 100;

/// Most tenants whose last minute is kept: a tenant that first fires while this many fired in
/// the last minute is counted in the totals only, until one of them has been quiet a minute.
pub const TENANTS: usize = 10_000;

const SECONDS: usize = 60;
const MINUTES: usize = 60;

#[derive(Debug, Default)]
pub(super) struct RecentFires {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Ring of the last 60 seconds, by epoch second modulo 60.
    seconds: Vec<Bucket>,
    /// Ring of the last 60 finished minutes, by epoch minute modulo 60.
    minutes: Vec<Option<MinuteFires>>,
    /// The minute the seconds are counting; summarized into `minutes` when a fire of a later
    /// minute arrives (its seconds are all still in the ring then).
    open_minute: i64,
    /// Each tenant's seconds with fires in the last minute, oldest first.
    tenants: HashMap<String, VecDeque<TenantBucket>>,
    /// The latest second whose fires dropped the tenants quiet for a minute.
    pruned_second: i64,
}

#[derive(Debug)]
struct TenantBucket {
    second: i64,
    fired: u64,
    max_ms: u64,
    lateness_ms: Vec<u64>,
}

#[derive(Debug, Default, Clone)]
struct Bucket {
    /// The second (epoch seconds) this bucket counts; an older one is stale.
    second: i64,
    fired: u64,
    lateness_ms: Vec<u64>,
}

/// Fires of the last minute.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LastMinute {
    pub fired: u64,
    /// Lateness percentiles in milliseconds; `None` without fires.
    pub p50_ms: Option<u64>,
    pub p99_ms: Option<u64>,
}

/// One tenant's fires of the last minute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantMinute {
    pub tenant_id: String,
    pub fired: u64,
    /// Lateness percentiles in milliseconds, from the tenant's samples.
    pub p50_ms: Option<u64>,
    pub p99_ms: Option<u64>,
    /// The lateness of its most late fire, in milliseconds.
    pub max_ms: u64,
}

/// Fires of one minute of the last hour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MinuteFires {
    /// The minute's start, in epoch milliseconds.
    pub start: Timestamp,
    pub fired: u64,
    /// Lateness percentiles in milliseconds, from the minute's samples.
    pub p50_ms: Option<u64>,
    pub p99_ms: Option<u64>,
}

impl RecentFires {
    pub(super) fn record(&self, at: Timestamp, tenant: &str, lateness_ms: u64) {
        let second = at.as_millis().div_euclid(1000);
        let minute = second.div_euclid(SECONDS as i64);
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        state.record_tenant(second, tenant, lateness_ms);
        if state.seconds.is_empty() {
            state.seconds.resize(SECONDS, Bucket::default());
            state.minutes.resize(MINUTES, None);
            state.open_minute = minute;
        }
        if minute > state.open_minute {
            state.close_minute();
            state.open_minute = minute;
        } else if minute < state.open_minute {
            // A fire confirmed just after its minute was summarized: counted, not sampled.
            let slot = &mut state.minutes[minute.rem_euclid(MINUTES as i64) as usize];
            if let Some(closed) = slot
                .as_mut()
                .filter(|m| m.start.as_millis() == minute * 60_000)
            {
                closed.fired += 1;
            }
        }
        let bucket = &mut state.seconds[second.rem_euclid(SECONDS as i64) as usize];
        if bucket.second != second {
            *bucket = Bucket {
                second,
                ..Bucket::default()
            };
        }
        bucket.fired += 1;
        if bucket.lateness_ms.len() < SAMPLES_PER_SECOND {
            bucket.lateness_ms.push(lateness_ms);
        }
    }

    /// The fires of the 60 seconds up to `now`.
    pub(super) fn last_minute(&self, now: Timestamp) -> LastMinute {
        let now_second = now.as_millis().div_euclid(1000);
        let Ok(state) = self.state.lock() else {
            return LastMinute::default();
        };
        let (fired, p50_ms, p99_ms) = summarize(
            state
                .seconds
                .iter()
                .filter(|b| b.second > now_second - SECONDS as i64 && b.second <= now_second),
        );
        LastMinute {
            fired,
            p50_ms,
            p99_ms,
        }
    }

    /// The tenants that fired in the 60 seconds up to `now`, most late first (by p99, then by
    /// the most late fire, then by id): at most `limit` of them, and how many there were.
    pub(super) fn last_minute_by_tenant(
        &self,
        now: Timestamp,
        limit: usize,
    ) -> (Vec<TenantMinute>, usize) {
        let now_second = now.as_millis().div_euclid(1000);
        let in_minute =
            |b: &&TenantBucket| b.second > now_second - SECONDS as i64 && b.second <= now_second;
        let Ok(state) = self.state.lock() else {
            return (Vec::new(), 0);
        };
        let mut tenants: Vec<TenantMinute> = state
            .tenants
            .iter()
            .filter_map(|(tenant, buckets)| {
                let buckets: Vec<&TenantBucket> = buckets.iter().filter(in_minute).collect();
                let fired: u64 = buckets.iter().map(|b| b.fired).sum();
                let mut samples: Vec<u64> = buckets
                    .iter()
                    .flat_map(|b| b.lateness_ms.iter().copied())
                    .collect();
                samples.sort_unstable();
                (fired > 0).then(|| TenantMinute {
                    tenant_id: tenant.clone(),
                    fired,
                    p50_ms: percentile(&samples, 50),
                    p99_ms: percentile(&samples, 99),
                    max_ms: buckets.iter().map(|b| b.max_ms).max().unwrap_or(0),
                })
            })
            .collect();
        let count = tenants.len();
        tenants.sort_by(|a, b| {
            (b.p99_ms, b.max_ms)
                .cmp(&(a.p99_ms, a.max_ms))
                .then_with(|| a.tenant_id.cmp(&b.tenant_id))
        });
        tenants.truncate(limit);
        (tenants, count)
    }

    /// The minutes of the last hour up to `now` (the current one too, so far) that had fires,
    /// oldest first.
    pub(super) fn last_hour(&self, now: Timestamp) -> Vec<MinuteFires> {
        let now_minute = now.as_millis().div_euclid(60_000);
        let Ok(state) = self.state.lock() else {
            return Vec::new();
        };
        let in_hour = |start: Timestamp| {
            let minute = start.as_millis().div_euclid(60_000);
            minute > now_minute - MINUTES as i64 && minute <= now_minute
        };
        let mut minutes: Vec<MinuteFires> = state
            .minutes
            .iter()
            .flatten()
            .filter(|m| in_hour(m.start))
            .copied()
            .collect();
        if let Some(open) = state.open().filter(|m| in_hour(m.start)) {
            minutes.push(open);
        }
        minutes.sort_by_key(|m| m.start);
        minutes
    }
}

impl State {
    fn record_tenant(&mut self, second: i64, tenant: &str, lateness_ms: u64) {
        if second > self.pruned_second {
            // Once a second: the tenants quiet for a minute go, and so does their memory.
            let oldest = second - SECONDS as i64;
            self.tenants.retain(|_, buckets| {
                while buckets.front().is_some_and(|b| b.second <= oldest) {
                    buckets.pop_front();
                }
                !buckets.is_empty()
            });
            self.pruned_second = second;
        }
        // The id is copied for a tenant new to the last minute only, not for every fire.
        if !self.tenants.contains_key(tenant) {
            if self.tenants.len() >= TENANTS {
                return;
            }
            self.tenants.insert(tenant.to_owned(), VecDeque::new());
        }
        let Some(buckets) = self.tenants.get_mut(tenant) else {
            return;
        };
        // Fires arrive in time order but for a few confirmed late: those count in the latest
        // second.
        if buckets.back().is_none_or(|b| b.second < second) {
            buckets.push_back(TenantBucket {
                second,
                fired: 0,
                max_ms: 0,
                lateness_ms: Vec::new(),
            });
        }
        let Some(bucket) = buckets.back_mut() else {
            return;
        };
        bucket.fired += 1;
        bucket.max_ms = bucket.max_ms.max(lateness_ms);
        if bucket.lateness_ms.len() < TENANT_SAMPLES_PER_SECOND {
            bucket.lateness_ms.push(lateness_ms);
        }
    }

    /// The open minute as its seconds count it so far; `None` before any fire.
    fn open(&self) -> Option<MinuteFires> {
        let first = self.open_minute * SECONDS as i64;
        let (fired, p50_ms, p99_ms) = summarize(
            self.seconds
                .iter()
                .filter(|b| b.second >= first && b.second < first + SECONDS as i64),
        );
        (fired > 0).then_some(MinuteFires {
            start: Timestamp::from_millis(self.open_minute * 60_000),
            fired,
            p50_ms,
            p99_ms,
        })
    }

    fn close_minute(&mut self) {
        let open = self.open();
        if open.is_some() {
            self.minutes[self.open_minute.rem_euclid(MINUTES as i64) as usize] = open;
        }
    }
}

/// Fires and lateness p50 and p99 of some seconds' buckets.
fn summarize<'a>(buckets: impl Iterator<Item = &'a Bucket>) -> (u64, Option<u64>, Option<u64>) {
    let mut fired = 0;
    let mut samples = Vec::new();
    for bucket in buckets {
        fired += bucket.fired;
        samples.extend_from_slice(&bucket.lateness_ms);
    }
    samples.sort_unstable();
    (fired, percentile(&samples, 50), percentile(&samples, 99))
}

/// The `p`th percentile of `sorted` (nearest rank below); `None` when it is empty.
fn percentile(sorted: &[u64], p: usize) -> Option<u64> {
    (!sorted.is_empty()).then(|| sorted[((sorted.len() - 1) * p) / 100])
}

#[cfg(test)]
mod tests {
    use super::*;

    impl RecentFires {
        fn record_at(&self, at: Timestamp, lateness_ms: u64) {
            self.record(at, "t", lateness_ms);
        }
    }

    #[test]
    fn keeps_each_tenants_last_minute_most_late_first() {
        let recent = RecentFires::default();
        let t = |s: i64| Timestamp::from_millis(s * 1000 + 500);
        recent.record(t(100), "gone", 900); // more than a minute before 200
        for ms in 1..=100 {
            recent.record(t(190), "small", ms);
        }
        for _ in 0..(TENANT_SAMPLES_PER_SECOND + 50) {
            recent.record(t(195), "big", 2);
        }
        recent.record(t(196), "big", 4_000);
        recent.record(t(200), "small", 5);
        // Confirmed late, for a second before the tenant's latest: counted in the latest.
        recent.record(t(199), "small", 7);
        let (tenants, count) = recent.last_minute_by_tenant(t(200), 10);
        let minute = |tenant: &str, fired, p50, p99, max| TenantMinute {
            tenant_id: tenant.into(),
            fired,
            p50_ms: Some(p50),
            p99_ms: Some(p99),
            max_ms: max,
        };
        assert_eq!(count, 2, "{tenants:?}");
        assert_eq!(
            tenants,
            [
                // 1..=100, 5 and 7.
                minute("small", 102, 49, 98, 100),
                // 100 samples of 2 ms (the cap) and one of 4 s; 151 counted, and the maximum.
                minute("big", 151, 2, 2, 4_000),
            ]
        );
        let (first, count) = recent.last_minute_by_tenant(t(200), 1);
        assert_eq!(
            (first[0].tenant_id.as_str(), count),
            ("small", 2),
            "most late first"
        );
        // A minute later everyone is quiet; the next fire drops them all.
        assert_eq!(recent.last_minute_by_tenant(t(300), 10), (Vec::new(), 0));
        recent.record(t(300), "new", 1);
        let state = recent.state.lock().expect("not poisoned");
        assert_eq!(state.tenants.keys().collect::<Vec<_>>(), ["new"]);
    }

    #[test]
    fn tracks_at_most_the_tenant_limit() {
        let recent = RecentFires::default();
        let at = Timestamp::from_millis(1_000_500);
        for i in 0..=TENANTS {
            recent.record(at, &format!("t{i}"), 1);
        }
        let (_, count) = recent.last_minute_by_tenant(at, 1);
        assert_eq!(count, TENANTS, "the one past the limit is not kept");
        assert_eq!(
            recent.last_minute(at).fired,
            TENANTS as u64 + 1,
            "but counted"
        );
    }

    #[test]
    fn counts_the_last_sixty_seconds_only() {
        let recent = RecentFires::default();
        let t = |s: i64| Timestamp::from_millis(s * 1000 + 500);
        recent.record_at(t(100), 900); // more than a minute before 200
        for ms in 1..=100 {
            recent.record_at(t(190), ms);
        }
        recent.record_at(t(200), 5_000);
        let minute = recent.last_minute(t(200));
        assert_eq!(minute.fired, 101);
        assert_eq!(minute.p50_ms, Some(51));
        assert_eq!(minute.p99_ms, Some(100));
        assert_eq!(recent.last_minute(t(400)), LastMinute::default());
    }

    #[test]
    fn keeps_each_minute_of_the_last_hour() {
        let recent = RecentFires::default();
        // Minute 10 (seconds 600..660): lateness 1..=100; minute 11: 7 ms twice; minute 13: 3.
        for ms in 1..=100 {
            recent.record_at(Timestamp::from_millis(600_000 + ms as i64 * 500), ms);
        }
        recent.record_at(Timestamp::from_millis(660_000), 7);
        recent.record_at(Timestamp::from_millis(719_999), 7);
        // Confirmed after minute 12 began, for minute 11: counted there.
        recent.record_at(Timestamp::from_millis(720_500), 1);
        recent.record_at(Timestamp::from_millis(719_000), 9);
        recent.record_at(Timestamp::from_millis(780_000), 3);
        let minute = |m: i64, fired, p50, p99| MinuteFires {
            start: Timestamp::from_millis(m * 60_000),
            fired,
            p50_ms: Some(p50),
            p99_ms: Some(p99),
        };
        let now = Timestamp::from_millis(790_000);
        assert_eq!(
            recent.last_hour(now),
            [
                minute(10, 100, 50, 99),
                minute(11, 3, 7, 7),
                minute(12, 1, 1, 1),
                minute(13, 1, 3, 3),
            ]
        );
        // An hour later only the minutes after now - 60 min are left.
        let later = Timestamp::from_millis(790_000 + 58 * 60_000);
        assert_eq!(
            recent.last_hour(later),
            [minute(12, 1, 1, 1), minute(13, 1, 3, 3)]
        );
        assert_eq!(
            recent.last_hour(Timestamp::from_millis(790_000 + 61 * 60_000)),
            []
        );
    }
}
