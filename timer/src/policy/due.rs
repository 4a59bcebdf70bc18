//! The occurrences of a series due at some moment, found without a search for each one: the
//! first [`MAX_COUNTED_SKIPS`] one by one from the claimed one on, and, when more are due, the
//! latest ones searched back from the moment. A per-second series down for a day has 86,400
//! occurrences due; a plan of it makes about a hundred cron searches, not 86,400.

use std::ops::Range;

use crate::model::Timestamp;
use crate::recurrence::{Schedule, Skipped, MAX_COUNTED_SKIPS};

/// The occurrences of a series whose fire times are at or before some moment, from a first one
/// on (cron times, in order): all of them, or the first ones and the latest ones with at least
/// one left out between.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Due {
    /// Never empty: the first due one comes first.
    listed: Vec<Timestamp>,
    /// Where occurrences were left out: between `listed[gap - 1]` and `listed[gap]`.
    gap: Option<usize>,
    /// The first occurrence after them, whose fire time is after the moment; `None` when the
    /// series has no more (`endAt`).
    pub next: Option<Timestamp>,
}

impl Due {
    /// The occurrences from `first` on (which is due) whose fire times (`fire_time`) are at or
    /// before `now`: up to [`MAX_COUNTED_SKIPS`] of them listed one by one, then, when more are
    /// due, the `latest` latest (at least one), found from `now` back.
    pub fn of(
        schedule: &Schedule,
        first: Timestamp,
        now: Timestamp,
        fire_time: impl Fn(Timestamp) -> Timestamp,
        latest: usize,
    ) -> Due {
        let mut listed = vec![first];
        let mut candidate = schedule.after(first);
        let unlisted = loop {
            let Some(at) = candidate.filter(|at| fire_time(*at) <= now) else {
                return Due {
                    listed,
                    gap: None,
                    next: candidate,
                };
            };
            if listed.len() as u64 >= MAX_COUNTED_SKIPS {
                break at;
            }
            listed.push(at);
            candidate = schedule.after(at);
        };
        // More are due than listed: the latest of them, searched back from `now` (an earlier one
        // when a jitter puts a later one's fire time after `now`).
        let mut last = schedule
            .before(now, true)
            .map_or(unlisted, |l| l.max(unlisted));
        while last > unlisted && fire_time(last) > now {
            last = schedule
                .before(last, false)
                .map_or(unlisted, |l| l.max(unlisted));
        }
        let head = listed[listed.len() - 1];
        let mut tail = vec![last];
        let mut gap = true;
        while let Some(earlier) = schedule.before(tail[tail.len() - 1], false) {
            if earlier <= head {
                gap = false; // the latest ones reach the listed ones: nothing left out
                break;
            }
            if tail.len() >= latest.max(1) {
                break;
            }
            tail.push(earlier);
        }
        let gap = gap.then_some(listed.len());
        listed.extend(tail.into_iter().rev());
        Due {
            listed,
            gap,
            next: schedule.after(last),
        }
    }

    /// The listed occurrences, in order.
    #[cfg(test)]
    pub fn listed(&self) -> &[Timestamp] {
        &self.listed
    }

    /// How many are listed.
    pub fn len(&self) -> usize {
        self.listed.len()
    }

    /// The first due one.
    pub fn first(&self) -> Timestamp {
        self.listed[0]
    }

    /// The latest due one.
    pub fn last(&self) -> Timestamp {
        self.listed[self.listed.len() - 1]
    }

    /// More than one is due.
    pub fn many(&self) -> bool {
        self.listed.len() > 1
    }

    /// The occurrences from `listed[range.start]` to before `listed[range.end]` (to the last,
    /// when the range ends there), with those left out among them; `None` for an empty range.
    /// Its `count` says "at least" when some were left out.
    pub fn span(&self, schedule: &Schedule, range: Range<usize>) -> Option<Skipped> {
        let (start, end) = (range.start, range.end.min(self.listed.len()));
        if start >= end {
            return None;
        }
        // Left out occurrences belong to the span when they lie inside it, or right after its
        // last listed one and before the next listed one (which is not in it).
        let gap = self.gap.filter(|g| start < *g && *g <= end);
        let last = match (gap, self.listed.get(end)) {
            (Some(g), Some(kept)) if g == end => schedule
                .before(*kept, false)
                .unwrap_or(self.listed[end - 1]),
            _ => self.listed[end - 1],
        };
        let count = (end - start) as u64 + u64::from(gap.is_some());
        Some(Skipped {
            count,
            first: self.listed[start],
            last,
            at_least: gap.is_some(),
        })
    }

    /// These without the first `n` listed ones (and what was left out among those).
    pub fn from(self, n: usize) -> Due {
        let n = n.min(self.listed.len() - 1);
        Due {
            listed: self.listed[n..].to_vec(),
            gap: self.gap.filter(|g| *g > n).map(|g| g - n),
            next: self.next,
        }
    }

    /// The first one alone.
    pub fn first_only(self) -> Due {
        Due {
            listed: vec![self.listed[0]],
            gap: None,
            next: self.next,
        }
    }

    /// Every due one, as [`span`](Self::span).
    pub fn all(&self, schedule: &Schedule) -> Option<Skipped> {
        self.span(schedule, 0..self.listed.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recurrence::Recurrence;

    fn schedule(cron: &str) -> Schedule {
        Recurrence {
            cron: cron.into(),
            time_zone: "UTC".into(),
            end_at: None,
            max_occurrences: None,
        }
        .schedule()
        .expect("a schedule")
    }

    fn secs(s: i64) -> Timestamp {
        Timestamp::from_millis(1_800_000_000_000 + s * 1000)
    }

    /// Few due: each listed, the next one after them, nothing left out.
    #[test]
    fn few_due_are_listed_one_by_one() {
        let every = schedule("* * * * * *");
        let due = Due::of(&every, secs(0), secs(4), |n| n, 1);
        assert_eq!(due.listed(), [0, 1, 2, 3, 4].map(secs));
        assert_eq!(due.next, Some(secs(5)));
        let all = due.all(&every).expect("a span");
        assert_eq!(
            (all.count, all.first, all.last, all.at_least),
            (5, secs(0), secs(4), false)
        );
        let none = Due::of(&every, secs(0), secs(0), |n| n, 3);
        assert_eq!((none.listed(), none.next), (&[secs(0)][..], Some(secs(1))));
    }

    /// A day of a per-second series: the first hundred and the latest ones are listed, the
    /// rest left out; a span over them says "at least" with its true first and last.
    #[test]
    fn many_due_list_the_first_and_the_latest() {
        let every = schedule("* * * * * *");
        let now = secs(86_399);
        let due = Due::of(
            &every,
            secs(0),
            Timestamp::from_millis(now.as_millis() + 500),
            |n| n,
            3,
        );
        let listed = due.listed();
        assert_eq!(listed.len(), 103);
        assert_eq!(listed[99], secs(99));
        assert_eq!(&listed[100..], [86_397, 86_398, 86_399].map(secs));
        assert_eq!(
            (due.first(), due.last(), due.next),
            (secs(0), now, Some(secs(86_400)))
        );
        // The first 100 and what was left out after them: up to the first of the latest.
        let older = due.span(&every, 0..100).expect("a span");
        assert_eq!(
            (older.count, older.first, older.last, older.at_least),
            (101, secs(0), secs(86_396), true)
        );
        // All but the latest.
        let earlier = due.span(&every, 0..102).expect("a span");
        assert_eq!((earlier.last, earlier.at_least), (secs(86_398), true));
        // After the first: the rest, the left-out ones inside.
        let rest = due.span(&every, 1..103).expect("a span");
        assert_eq!((rest.first, rest.last, rest.at_least), (secs(1), now, true));
        assert_eq!(due.span(&every, 103..103), None);
    }

    /// The latest ones reach back to the listed ones: nothing is left out.
    #[test]
    fn latest_ones_meeting_the_listed_ones_leave_nothing_out() {
        let every = schedule("* * * * * *");
        let due = Due::of(&every, secs(0), secs(101), |n| n, 5);
        assert_eq!(due.listed(), (0..=101).map(secs).collect::<Vec<_>>());
        let all = due.all(&every).expect("a span");
        assert_eq!((all.count, all.at_least), (102, false));
    }

    /// With a jitter that puts the latest occurrence's fire time after now, the latest due is
    /// the one before it.
    #[test]
    fn a_jittered_occurrence_after_now_is_not_due() {
        let every = schedule("* * * * * *");
        let now = secs(500);
        // Every occurrence fires 1.5 s late.
        let late = |n: Timestamp| Timestamp::from_millis(n.as_millis() + 1_500);
        let due = Due::of(&every, secs(0), now, late, 1);
        assert_eq!(due.last(), secs(498));
        assert_eq!(due.next, Some(secs(499)));
    }

    /// A series that ends (`endAt`) before now: the latest due is its last.
    #[test]
    fn an_ended_series_has_no_next() {
        let ending = Recurrence {
            cron: "* * * * * *".into(),
            time_zone: "UTC".into(),
            end_at: Some(secs(300)),
            max_occurrences: None,
        }
        .schedule()
        .expect("a schedule");
        let due = Due::of(&ending, secs(0), secs(10_000), |n| n, 1);
        assert_eq!((due.last(), due.next), (secs(300), None));
    }
}
