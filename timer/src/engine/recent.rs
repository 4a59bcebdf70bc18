//! What this instance fired lately, for the status and the dashboard: counts per second and a
//! sample of lateness per second (the first [`SAMPLES_PER_SECOND`] fires of each second) for
//! the last minute, from which the status reads p50 and p99; and for the last hour, the same
//! three figures per minute, summarized from the seconds when a minute ends.

use std::sync::Mutex;

use crate::model::Timestamp;

/// Lateness values kept per second; the count goes on beyond it.
pub const SAMPLES_PER_SECOND: usize = 1_000;

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
    pub(super) fn record(&self, at: Timestamp, lateness_ms: u64) {
        let second = at.as_millis().div_euclid(1000);
        let minute = second.div_euclid(SECONDS as i64);
        let Ok(mut state) = self.state.lock() else {
            return;
        };
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
    let percentile =
        |p: usize| (!samples.is_empty()).then(|| samples[((samples.len() - 1) * p) / 100]);
    (fired, percentile(50), percentile(99))
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

    #[test]
    fn keeps_each_minute_of_the_last_hour() {
        let recent = RecentFires::default();
        // Minute 10 (seconds 600..660): lateness 1..=100; minute 11: 7 ms twice; minute 13: 3.
        for ms in 1..=100 {
            recent.record(Timestamp::from_millis(600_000 + ms as i64 * 500), ms);
        }
        recent.record(Timestamp::from_millis(660_000), 7);
        recent.record(Timestamp::from_millis(719_999), 7);
        // Confirmed after minute 12 began, for minute 11: counted there.
        recent.record(Timestamp::from_millis(720_500), 1);
        recent.record(Timestamp::from_millis(719_000), 9);
        recent.record(Timestamp::from_millis(780_000), 3);
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
