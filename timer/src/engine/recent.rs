//! What this instance fired in the last minute, for the status: counts per second and a sample
//! of lateness per second (the first [`SAMPLES_PER_SECOND`] fires of each second), from which
//! the status reads p50 and p99.

use std::sync::Mutex;

use crate::model::Timestamp;

/// Lateness values kept per second; the count goes on beyond it.
pub const SAMPLES_PER_SECOND: usize = 1_000;

const SECONDS: usize = 60;

#[derive(Debug, Default)]
pub(super) struct RecentFires {
    buckets: Mutex<Vec<Bucket>>,
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

impl RecentFires {
    pub(super) fn record(&self, at: Timestamp, lateness_ms: u64) {
        let second = at.as_millis().div_euclid(1000);
        let Ok(mut buckets) = self.buckets.lock() else {
            return;
        };
        if buckets.is_empty() {
            buckets.resize(SECONDS, Bucket::default());
        }
        let bucket = &mut buckets[second.rem_euclid(SECONDS as i64) as usize];
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
        let Ok(buckets) = self.buckets.lock() else {
            return LastMinute::default();
        };
        let live = buckets
            .iter()
            .filter(|b| b.second > now_second - SECONDS as i64 && b.second <= now_second);
        let mut fired = 0;
        let mut samples = Vec::new();
        for bucket in live {
            fired += bucket.fired;
            samples.extend_from_slice(&bucket.lateness_ms);
        }
        samples.sort_unstable();
        let percentile =
            |p: usize| (!samples.is_empty()).then(|| samples[((samples.len() - 1) * p) / 100]);
        LastMinute {
            fired,
            p50_ms: percentile(50),
            p99_ms: percentile(99),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_last_sixty_seconds_only() {
        let recent = RecentFires::default();
        let t = |s: i64| Timestamp::from_millis(s * 1000 + 500);
        recent.record(t(100), 900); // more than a minute before 200
        for ms in 1..=100 {
            recent.record(t(190), ms);
        }
        recent.record(t(200), 5_000);
        let minute = recent.last_minute(t(200));
        assert_eq!(minute.fired, 101);
        assert_eq!(minute.p50_ms, Some(51));
        assert_eq!(minute.p99_ms, Some(100));
        assert_eq!(recent.last_minute(t(400)), LastMinute::default());
    }
}
