//! Recurring timers: a cron pattern read in an IANA time zone.
//!
//! Patterns are parsed by [croner] (5 fields, or 6 with seconds first; OCPS syntax with `L`, `W`,
//! `#`), wall-clock times are resolved with [chrono_tz]. Occurrences follow croner's daylight
//! saving rules:
//! - **gap** (clocks jump forward): a fixed-time pattern (`0 30 2 * * *`) fires at the first
//!   valid time after the gap on the same day; occurrences of an interval pattern (`*/15 * * *
//!   * *`) inside the gap do not exist and are skipped.
//! - **overlap** (clocks fall back): a fixed-time pattern fires once, at the first pass; an
//!   interval pattern fires on both passes (real time keeps moving forward).
//!
//! The next occurrence is computed only after the current one was confirmed by the broker, from
//! the later of its due time and the moment it fired, so occurrences never overlap and the ones
//! missed while the service was down collapse into the single (late) fire of the first one.

use std::str::FromStr;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use croner::Cron;
use serde::{Deserialize, Serialize};

use crate::model::Timestamp;

/// How a recurring timer repeats, as given in `ScheduleTimer` and kept by the stores (as JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Recurrence {
    /// The cron pattern, e.g. `0 9 * * MON-FRI` or `*/10 * * * * *` (seconds first).
    pub cron: String,
    /// IANA time zone the pattern is read in, e.g. `Europe/Berlin`.
    pub time_zone: String,
    /// No occurrence after this instant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_at: Option<Timestamp>,
    /// At most this many occurrences fire.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_occurrences: Option<u32>,
}

/// How many occurrences that never fire (skipped by a resume or a policy) are counted one by
/// one; beyond, only the last is found (searching back from now) and the count says "at
/// least". Each is a cron search (a microsecond or more; with `jitter`, a hash too), made in
/// the firing task (a plan) or inside the store's write transaction (a resume): counting every
/// one of a per-second series down for a day, 86,400, took about 0.1 s a series, so 500 such
/// series held every tenant's fires for about a minute, and a bulk resume SQLite's write lock.
pub const MAX_COUNTED_SKIPS: u64 = 100;

/// What [`Schedule::resume`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resumed {
    /// The occurrence the series continues with; `None` when it ended during the pause.
    pub next: Option<Timestamp>,
    /// The occurrences that fell into the pause, if any.
    pub skipped: Option<Skipped>,
}

/// Occurrences of a series that were due while it was paused and never fire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Skipped {
    pub count: u64,
    pub first: Timestamp,
    pub last: Timestamp,
    /// Counting stopped at [`MAX_COUNTED_SKIPS`]: there were more (`first` and `last` are
    /// still the first and the last).
    pub at_least: bool,
}

/// A parsed [`Recurrence`], ready to compute occurrences.
#[derive(Debug, Clone)]
pub struct Schedule {
    cron: Cron,
    tz: Tz,
    end_at: Option<Timestamp>,
    max_occurrences: Option<u32>,
}

/// Why a recurrence is not usable: which field, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecurrenceError {
    pub field: &'static str,
    pub message: String,
}

impl Recurrence {
    /// The form stores keep: JSON text.
    pub fn to_json(&self) -> String {
        // Strings, an optional number and an optional timestamp cannot fail to serialize.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Reads what [`Recurrence::to_json`] wrote.
    pub fn from_json(text: &str) -> crate::Result<Self> {
        serde_json::from_str(text).map_err(|e| {
            crate::Error::internal(format!("stored recurrence {text:?} does not parse: {e}"))
        })
    }

    /// Parses the pattern and the time zone.
    pub fn schedule(&self) -> Result<Schedule, RecurrenceError> {
        let cron = Cron::from_str(&self.cron).map_err(|e| RecurrenceError {
            field: "cron",
            message: format!("{:?} is not a cron pattern: {e}", self.cron),
        })?;
        let tz = Tz::from_str(&self.time_zone).map_err(|_| RecurrenceError {
            field: "timeZone",
            message: format!(
                "{:?} is not an IANA time zone (e.g. Europe/Berlin, UTC)",
                self.time_zone
            ),
        })?;
        if self.max_occurrences == Some(0) {
            return Err(RecurrenceError {
                field: "maxOccurrences",
                message: "must be at least 1".into(),
            });
        }
        Ok(Schedule {
            cron,
            tz,
            end_at: self.end_at,
            max_occurrences: self.max_occurrences,
        })
    }
}

impl Schedule {
    /// The first occurrence at or after `now`; `None` when the series has none (it ends first).
    pub fn first(&self, now: Timestamp) -> Option<Timestamp> {
        self.find(now, true)
    }

    /// The occurrence after one that fired: strictly after `after`, unless `fired` occurrences
    /// (counting the one that just fired) already reached `maxOccurrences`.
    pub fn next(&self, after: Timestamp, fired: u32) -> Option<Timestamp> {
        if self.max_occurrences.is_some_and(|max| fired >= max) {
            return None;
        }
        self.find(after, false)
    }

    /// Up to `n` coming occurrences of a Scheduled series whose next occurrence is `due` and of
    /// which `fired` occurrences fired: `due` itself, then each one after it as the series will
    /// fire them from `now` on (after an overdue `due`, the next is the first after `now`).
    pub fn upcoming(&self, due: Timestamp, fired: u32, now: Timestamp, n: usize) -> Vec<Timestamp> {
        let mut out = Vec::with_capacity(n.min(100));
        let mut next = Some(due);
        while let Some(at) = next.filter(|_| out.len() < n) {
            out.push(at);
            let count = fired.saturating_add(u32::try_from(out.len()).unwrap_or(u32::MAX));
            next = self.next(at.max(now), count);
        }
        out
    }

    /// Where a paused series goes on when resumed at `now`, its next occurrence being `due`:
    /// the occurrences before `now` (from `due` on) are skipped, the series continues with the
    /// first one at or after `now` (the cadence is kept). Counting stops after
    /// [`MAX_COUNTED_SKIPS`]; then [`Skipped::at_least`] is set.
    pub fn resume(&self, due: Timestamp, now: Timestamp) -> Resumed {
        if due >= now {
            return Resumed {
                next: Some(due),
                skipped: None,
            };
        }
        let mut skipped = Skipped {
            count: 1,
            first: due,
            last: due,
            at_least: false,
        };
        let mut next = self.find(due, false);
        while let Some(at) = next.filter(|at| *at < now) {
            if skipped.count >= MAX_COUNTED_SKIPS {
                skipped.at_least = true;
                skipped.last = self.before(now, false).map_or(at, |last| last.max(at));
                next = self.first(now);
                break;
            }
            skipped.count += 1;
            skipped.last = at;
            next = self.find(at, false);
        }
        Resumed {
            next,
            skipped: Some(skipped),
        }
    }

    /// The occurrence strictly after `at`, whatever `maxOccurrences` says (`endAt` holds).
    pub fn after(&self, at: Timestamp) -> Option<Timestamp> {
        self.find(at, false)
    }

    /// The latest occurrence before `at` (with `inclusive`, at or before it), whatever
    /// `maxOccurrences` says and never after `endAt`; `None` when the pattern has none (croner
    /// searches back a bounded way).
    pub fn before(&self, at: Timestamp, inclusive: bool) -> Option<Timestamp> {
        let at = match self.end_at {
            Some(end) if end < at => return self.before(end, true),
            _ => at,
        };
        // Occurrences fall on whole seconds, and croner searches from whole seconds: from a
        // time with milliseconds, the second it falls in is before it.
        let second = Timestamp::from_millis(at.as_millis().div_euclid(1000) * 1000);
        let inclusive = inclusive || second < at;
        let local = second.to_datetime().with_timezone(&self.tz);
        let found = self.cron.find_previous_occurrence(&local, inclusive).ok()?;
        Some(Timestamp::from_datetime(&found))
    }

    /// `at` on the wall clock of the series' time zone, RFC 3339 with its offset and
    /// milliseconds (`2026-11-25T09:30:00.000+01:00`).
    pub fn local_rfc3339(&self, at: Timestamp) -> String {
        at.to_datetime()
            .with_timezone(&self.tz)
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
    }

    fn find(&self, from: Timestamp, inclusive: bool) -> Option<Timestamp> {
        let start: DateTime<Utc> = from.to_datetime();
        let local = start.with_timezone(&self.tz);
        let next = self.cron.find_next_occurrence(&local, inclusive).ok()?;
        let at = Timestamp::from_datetime(&next);
        // An inclusive search from a time with milliseconds may return that very second.
        let at = if at < from || (!inclusive && at == from) {
            self.cron
                .find_next_occurrence(&next, false)
                .ok()
                .map(|d| Timestamp::from_datetime(&d))?
        } else {
            at
        };
        match self.end_at {
            Some(end) if at > end => None,
            _ if at > Timestamp::MAX => None,
            _ => Some(at),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn upcoming_lists_the_next_occurrences_and_stops_at_the_maximum() {
        let series = Recurrence {
            max_occurrences: Some(4),
            ..recurrence("30 9 * * MON-FRI", "Europe/Berlin")
        };
        let schedule = series.schedule().unwrap();
        // Friday 2026-11-20 08:30Z is 09:30 in Berlin; one occurrence fired before it.
        let due = utc("2026-11-20T08:30:00Z");
        let now = utc("2026-11-19T12:00:00Z");
        let got = schedule.upcoming(due, 1, now, 5);
        let want = [
            "2026-11-20T08:30:00Z",
            "2026-11-23T08:30:00Z",
            "2026-11-24T08:30:00Z",
        ];
        assert_eq!(got, want.map(utc), "the fourth occurrence is the last");
        assert_eq!(
            schedule.local_rfc3339(got[0]),
            "2026-11-20T09:30:00.000+01:00"
        );
        // Overdue: the next one after it is the first after now, as the series will fire it.
        let late = schedule.upcoming(due, 0, utc("2026-11-24T10:00:00Z"), 2);
        assert_eq!(late, [due, utc("2026-11-25T08:30:00Z")]);
        assert!(schedule.upcoming(due, 0, now, 0).is_empty());
    }

    #[test]
    fn resume_skips_what_fell_into_the_pause_and_keeps_the_cadence() {
        let schedule = recurrence("0 * * * *", "UTC").schedule().unwrap();
        let due = utc("2026-11-24T10:00:00Z");
        // Resumed at 12:30: 10:00, 11:00 and 12:00 were missed; 13:00 is next.
        let resumed = schedule.resume(due, utc("2026-11-24T12:30:00Z"));
        assert_eq!(resumed.next, Some(utc("2026-11-24T13:00:00Z")));
        let skipped = resumed.skipped.unwrap();
        assert_eq!((skipped.count, skipped.at_least), (3, false));
        assert_eq!(
            (skipped.first, skipped.last),
            (due, utc("2026-11-24T12:00:00Z"))
        );
        // Resumed before the next occurrence: nothing skipped, nothing moved.
        let early = schedule.resume(due, utc("2026-11-24T09:59:00Z"));
        assert_eq!((early.next, early.skipped), (Some(due), None));
        // Exactly on an occurrence: that one fires.
        let on_time = schedule.resume(due, utc("2026-11-24T12:00:00Z"));
        assert_eq!(on_time.next, Some(utc("2026-11-24T12:00:00Z")));
        assert_eq!(on_time.skipped.unwrap().count, 2);
        // A series that ended during the pause has no next occurrence.
        let ending = Recurrence {
            end_at: Some(utc("2026-11-24T11:30:00Z")),
            ..recurrence("0 * * * *", "UTC")
        };
        let over = ending
            .schedule()
            .unwrap()
            .resume(due, utc("2026-11-24T12:30:00Z"));
        assert_eq!(over.next, None);
        assert_eq!(over.skipped.unwrap().count, 2);
    }

    #[test]
    fn resume_stops_counting_a_long_pause_of_a_fast_series() {
        let schedule = recurrence("* * * * * *", "UTC").schedule().unwrap();
        let due = utc("2026-11-24T00:00:00Z");
        let resumed = schedule.resume(due, utc("2026-11-26T00:00:00.500Z"));
        assert_eq!(resumed.next, Some(utc("2026-11-26T00:00:01Z")));
        let skipped = resumed.skipped.unwrap();
        // 172,800 skipped; a resume (inside the store's write transaction) counts 100.
        assert_eq!((skipped.count, skipped.at_least), (MAX_COUNTED_SKIPS, true));
        assert_eq!(skipped.first, due);
        assert_eq!(
            skipped.last,
            utc("2026-11-26T00:00:00Z"),
            "the last before now"
        );
    }

    fn at(tz: Tz, y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> Timestamp {
        Timestamp::from_datetime(&tz.with_ymd_and_hms(y, mo, d, h, mi, s).earliest().unwrap())
    }

    fn utc(text: &str) -> Timestamp {
        Timestamp::from_datetime(&DateTime::parse_from_rfc3339(text).unwrap())
    }

    fn recurrence(cron: &str, tz: &str) -> Recurrence {
        Recurrence {
            cron: cron.into(),
            time_zone: tz.into(),
            end_at: None,
            max_occurrences: None,
        }
    }

    fn schedule(cron: &str, tz: &str) -> Schedule {
        recurrence(cron, tz).schedule().unwrap()
    }

    #[test]
    fn every_second_with_seconds_field() {
        let s = schedule("*/1 * * * * *", "Europe/Berlin");
        let now = utc("2026-11-23T12:00:00.250Z");
        assert_eq!(s.first(now), Some(utc("2026-11-23T12:00:01Z")));
        let first = s.first(now).unwrap();
        assert_eq!(s.next(first, 1), Some(utc("2026-11-23T12:00:02Z")));
        // Fired late (at 12:00:05.3): the next one comes after the fire, not a backlog.
        assert_eq!(
            s.next(utc("2026-11-23T12:00:05.300Z"), 2),
            Some(utc("2026-11-23T12:00:06Z"))
        );
        // On a whole second, `first` includes it.
        assert_eq!(
            s.first(utc("2026-11-23T12:00:07Z")),
            Some(utc("2026-11-23T12:00:07Z"))
        );
    }

    #[test]
    fn five_fields_are_minutes_in_the_zone() {
        let s = schedule("30 9 * * *", "America/New_York");
        // 2026-11-23 is EST (UTC-5): 09:30 local = 14:30 UTC.
        assert_eq!(
            s.first(utc("2026-11-23T12:00:00Z")),
            Some(utc("2026-11-23T14:30:00Z"))
        );
    }

    #[test]
    fn dst_gap_fixed_time_fires_after_the_gap_and_intervals_skip_it() {
        // Europe/Berlin springs forward on 2026-03-29: 02:00 CET becomes 03:00 CEST.
        let berlin = chrono_tz::Europe::Berlin;
        let fixed = schedule("0 30 2 * * *", "Europe/Berlin");
        let before = at(berlin, 2026, 3, 28, 12, 0, 0);
        // 02:30 does not exist that day: it fires at the first valid time after the gap.
        assert_eq!(fixed.first(before), Some(at(berlin, 2026, 3, 29, 3, 0, 0)));
        let interval = schedule("0 */30 * * * *", "Europe/Berlin");
        let t = at(berlin, 2026, 3, 29, 1, 30, 0);
        // 01:30 CET → the next half hour is 03:00 CEST (02:00 and 02:30 do not exist).
        assert_eq!(interval.next(t, 1), Some(at(berlin, 2026, 3, 29, 3, 0, 0)));
        assert_eq!(
            at(berlin, 2026, 3, 29, 3, 0, 0).as_millis() - t.as_millis(),
            30 * 60 * 1000,
            "half an hour of real time"
        );
    }

    #[test]
    fn dst_overlap_fixed_time_fires_once_and_intervals_on_both_passes() {
        // Europe/Berlin falls back on 2026-10-25: 03:00 CEST becomes 02:00 CET.
        let fixed = schedule("0 30 2 * * *", "Europe/Berlin");
        let first = fixed.first(utc("2026-10-24T12:00:00Z")).unwrap();
        // 02:30 CEST = 00:30 UTC, the first pass.
        assert_eq!(first, utc("2026-10-25T00:30:00Z"));
        // Not again at 02:30 CET (01:30 UTC): the next is the following day.
        assert_eq!(fixed.next(first, 1), Some(utc("2026-10-26T01:30:00Z")));
        let hourly = schedule("0 0 * * * *", "Europe/Berlin");
        let two_cest = utc("2026-10-25T00:00:00Z"); // 02:00 CEST
        assert_eq!(hourly.next(two_cest, 1), Some(utc("2026-10-25T01:00:00Z")));
        // 02:00 CET
    }

    #[test]
    fn end_and_max_occurrences_end_the_series() {
        let mut r = Recurrence {
            cron: "0 * * * *".into(),
            time_zone: "UTC".into(),
            end_at: Some(utc("2026-11-23T13:30:00Z")),
            max_occurrences: None,
        };
        let s = r.schedule().unwrap();
        let first = s.first(utc("2026-11-23T12:10:00Z")).unwrap();
        assert_eq!(first, utc("2026-11-23T13:00:00Z"));
        assert_eq!(s.next(first, 1), None, "14:00 lies after endAt");
        r.end_at = None;
        r.max_occurrences = Some(2);
        let s = r.schedule().unwrap();
        assert_eq!(s.next(first, 1), Some(utc("2026-11-23T14:00:00Z")));
        assert_eq!(s.next(utc("2026-11-23T14:00:00Z"), 2), None);
    }

    #[test]
    fn bad_patterns_and_zones_name_the_field() {
        let bad = |cron: &str, tz: &str| recurrence(cron, tz).schedule().unwrap_err().field;
        assert_eq!(bad("61 * * * *", "UTC"), "cron");
        assert_eq!(bad("* * *", "UTC"), "cron");
        assert_eq!(bad("* * * * *", "Mars/Olympus"), "timeZone");
    }
}
