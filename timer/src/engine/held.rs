//! Commands the broker path holds aside, unacknowledged, in arrival order per tenant: a schedule
//! of a tenant over its rate (`limits.rate`) until its allowance fits it, and a `CancelTimer`,
//! `PauseTimer` or `TimerCompleted` that met a fire in progress until it is tried again. A tenant
//! with held commands gets every later command of its own in line behind them (a cancel must not
//! overtake the schedule it cancels); the other tenants' commands pass.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

use super::throttle::Throttle;

/// What a held command waits for, besides the commands before it in its tenant's line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Waits {
    /// Nothing more: it goes with the ones before it.
    Turn,
    /// One schedule of its tenant's allowance.
    Allowance,
    /// This time: a command that met a fire in progress is tried again then.
    Until(Instant),
}

/// A command the broker delivered and nobody acknowledged yet.
pub(crate) trait Unacknowledged {
    /// Its tag, for [`Broker::keep`](crate::Broker::keep).
    fn tag(&self) -> u64;
    /// When its ack wait last started: at its delivery, or when the broker was last told to
    /// keep it.
    fn kept(&mut self) -> &mut Instant;
}

/// The held commands, a line per tenant.
pub(crate) struct Held<T> {
    tenants: HashMap<String, VecDeque<(T, Waits)>>,
    len: usize,
}

impl<T> Default for Held<T> {
    fn default() -> Self {
        Held {
            tenants: HashMap::new(),
            len: 0,
        }
    }
}

impl<T: Unacknowledged> Held<T> {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `tenant` has commands held.
    pub(crate) fn holds(&self, tenant: &str) -> bool {
        self.tenants.contains_key(tenant)
    }

    /// How many commands `tenant` has held.
    pub(crate) fn of(&self, tenant: &str) -> usize {
        self.tenants.get(tenant).map_or(0, VecDeque::len)
    }

    /// Puts a command at the end of its tenant's line.
    pub(crate) fn push(&mut self, tenant: &str, item: T, waits: Waits) {
        let line = self.tenants.entry(tenant.to_owned()).or_default();
        line.push_back((item, waits));
        self.len += 1;
    }

    /// Puts commands that were released (or never held) and came before everything their
    /// tenants hold back in front of their lines, in the order given.
    pub(crate) fn put_back(&mut self, items: Vec<(String, T, Waits)>) {
        for (tenant, item, waits) in items.into_iter().rev() {
            self.tenants
                .entry(tenant)
                .or_default()
                .push_front((item, waits));
            self.len += 1;
        }
    }

    /// The commands at the front of each line that may go now, and how long until the next one
    /// may (None when nothing is held).
    pub(crate) async fn release(&mut self, throttle: &Throttle) -> (Vec<T>, Option<Duration>) {
        let mut ready = Vec::new();
        let mut next: Option<Duration> = None;
        let mut wait = |wait: Duration| {
            let wait = wait.max(Duration::from_millis(1));
            next = Some(next.map_or(wait, |n| n.min(wait)));
        };
        let now = Instant::now();
        let tenants: Vec<String> = self.tenants.keys().cloned().collect();
        for tenant in tenants {
            let Some(line) = self.tenants.get_mut(&tenant) else {
                continue;
            };
            while let Some((_, waits)) = line.front() {
                match *waits {
                    Waits::Turn => {}
                    Waits::Allowance => {
                        if let Err(throttled) = throttle.take(&tenant, 1).await {
                            // A limit of at least 1 always fits one schedule at some point.
                            wait(throttled.retry_after.unwrap_or(Duration::from_secs(1)));
                            break;
                        }
                    }
                    Waits::Until(at) if at > now => {
                        wait(at - now);
                        break;
                    }
                    Waits::Until(_) => {}
                }
                if let Some((item, _)) = line.pop_front() {
                    ready.push(item);
                }
            }
            if line.is_empty() {
                self.tenants.remove(&tenant);
            }
        }
        self.len -= ready.len();
        (ready, next)
    }

    /// The tags of held commands the broker was last told to keep more than `every` ago; marks
    /// them kept now.
    pub(crate) fn due_to_keep(&mut self, every: Duration) -> Vec<u64> {
        let now = Instant::now();
        let mut tags = Vec::new();
        for (item, _) in self.tenants.values_mut().flatten() {
            let kept = item.kept();
            if now.duration_since(*kept) >= every {
                *kept = now;
                tags.push(item.tag());
            }
        }
        tags
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::clock::ManualClock;
    use crate::config::RateLimits;
    use crate::model::Timestamp;

    #[derive(Debug, PartialEq)]
    struct Command(&'static str, u64, Instant);

    impl Unacknowledged for Command {
        fn tag(&self) -> u64 {
            self.1
        }

        fn kept(&mut self) -> &mut Instant {
            &mut self.2
        }
    }

    fn held(items: &[(&'static str, &'static str, Waits)]) -> Held<Command> {
        let mut held = Held::default();
        for (tag, (tenant, name, waits)) in items.iter().enumerate() {
            held.push(tenant, Command(name, tag as u64, Instant::now()), *waits);
        }
        held
    }

    fn names(commands: &[Command]) -> Vec<&'static str> {
        commands.iter().map(|c| c.0).collect()
    }

    /// One schedule a second, a burst of 1, on a manual clock.
    fn one_a_second() -> (Arc<ManualClock>, Throttle) {
        let clock = Arc::new(ManualClock::new(Timestamp::from_millis(1_700_000_000_000)));
        let limits = RateLimits {
            schedules_per_second: 1,
            burst: 1,
            ..RateLimits::default()
        };
        let throttle = Throttle::new(&limits, clock.clone(), None);
        (clock, throttle)
    }

    #[tokio::test]
    async fn held_commands_keep_their_order_per_tenant_and_others_pass() {
        let (clock, throttle) = one_a_second();
        let mut held = held(&[
            ("a", "a-schedule-2", Waits::Allowance),
            ("a", "a-cancel-2", Waits::Turn),
            ("a", "a-schedule-3", Waits::Allowance),
        ]);
        assert!(throttle.take("a", 1).await.is_ok());
        assert!(held.holds("a") && !held.holds("b"));
        assert_eq!(held.len(), 3);
        let (ready, next) = held.release(&throttle).await;
        assert!(ready.is_empty());
        assert_eq!(next, Some(Duration::from_secs(1)));
        clock.advance(Duration::from_secs(1));
        let (ready, next) = held.release(&throttle).await;
        assert_eq!(names(&ready), ["a-schedule-2", "a-cancel-2"]);
        assert_eq!(next, Some(Duration::from_secs(1)));
        clock.advance(Duration::from_secs(1));
        let (ready, next) = held.release(&throttle).await;
        assert_eq!(names(&ready), ["a-schedule-3"]);
        assert_eq!((next, held.len(), held.holds("a")), (None, 0, false));
    }

    #[tokio::test]
    async fn a_command_behind_a_fire_waits_for_its_time_and_goes_back_in_front() {
        let (_, throttle) = one_a_second();
        let later = Instant::now() + Duration::from_secs(3600);
        // `a` waits for its allowance with one command behind.
        let mut held = held(&[
            ("a", "a-schedule-2", Waits::Allowance),
            ("a", "a-pause-2", Waits::Turn),
        ]);
        assert!(throttle.take("a", 1).await.is_ok());
        // Released before, a cancel of `a` met a fire, and a schedule of `a` came after it.
        held.put_back(vec![
            (
                "a".into(),
                Command("a-cancel-1", 7, Instant::now()),
                Waits::Until(later),
            ),
            (
                "a".into(),
                Command("a-schedule-1", 8, Instant::now()),
                Waits::Turn,
            ),
            (
                "b".into(),
                Command("b-cancel-1", 9, Instant::now()),
                Waits::Until(Instant::now()),
            ),
        ]);
        assert_eq!((held.len(), held.of("a"), held.of("b")), (5, 4, 1));
        let (ready, next) = held.release(&throttle).await;
        assert_eq!(names(&ready), ["b-cancel-1"], "its time has come");
        let next = next.expect("a waits");
        assert!(
            next > Duration::from_secs(3590) && next <= Duration::from_secs(3600),
            "{next:?}"
        );
        let order: Vec<_> = held.tenants["a"].iter().map(|(c, _)| c.0).collect();
        assert_eq!(
            order,
            ["a-cancel-1", "a-schedule-1", "a-schedule-2", "a-pause-2"]
        );
    }

    #[tokio::test]
    async fn held_commands_are_kept_from_their_delivery_on() {
        let mut held = held(&[("a", "fresh", Waits::Turn)]);
        let long_ago = Instant::now()
            .checked_sub(Duration::from_secs(20))
            .expect("a machine up for 20 s");
        held.put_back(vec![("a".into(), Command("old", 5, long_ago), Waits::Turn)]);
        assert_eq!(held.due_to_keep(Duration::from_secs(10)), [5]);
        assert!(
            held.due_to_keep(Duration::from_secs(10)).is_empty(),
            "kept now"
        );
    }
}
