//! Time as the engine sees it. Engine logic never reads the system clock directly, so tests drive
//! it with [`ManualClock`] (tokio's paused time does not move `SystemTime`).

use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;

use crate::model::Timestamp;

#[async_trait]
pub trait Clock: Send + Sync + 'static {
    fn now(&self) -> Timestamp;
    /// Returns once `now() >= at`.
    async fn sleep_until(&self, at: Timestamp);
}

/// The longest [`SystemClock::sleep_until`] sleeps without reading the wall clock again.
pub const WALL_CLOCK_CHECK: Duration = Duration::from_millis(250);

/// Wall-clock time; sleeps on tokio's timer, which runs on the monotonic clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

#[async_trait]
impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_millis(chrono::Utc::now().timestamp_millis())
    }

    /// Due times are on the wall clock, sleeps on the monotonic one: the sleep is cut into
    /// pieces of at most [`WALL_CLOCK_CHECK`], and the wall clock read after each. So when the
    /// wall clock jumps forward (NTP stepping it, a VM resumed), what became due is noticed
    /// within that; when it jumps back, nothing wakes early, since `now() >= at` decides.
    async fn sleep_until(&self, at: Timestamp) {
        loop {
            let now = self.now();
            if now >= at {
                return;
            }
            tokio::time::sleep(at.duration_since(now).min(WALL_CLOCK_CHECK)).await;
        }
    }
}

/// A clock that moves only when told to. Sleepers wake as soon as it passes their time; a test
/// sees who sleeps until when ([`sleepers`](Self::sleepers)), so it can wait for a task to be
/// asleep instead of guessing.
#[derive(Debug)]
pub struct ManualClock {
    now: watch::Sender<Timestamp>,
    /// The times the sleepers now in `sleep_until` wait for (one entry each).
    sleeping: std::sync::Mutex<Vec<Timestamp>>,
}

impl ManualClock {
    pub fn new(start: Timestamp) -> Self {
        ManualClock {
            now: watch::Sender::new(start),
            sleeping: std::sync::Mutex::default(),
        }
    }

    /// The times the tasks asleep on this clock wait for, earliest first.
    pub fn sleepers(&self) -> Vec<Timestamp> {
        let mut at = self.sleeping().clone();
        at.sort();
        at
    }

    fn sleeping(&self) -> std::sync::MutexGuard<'_, Vec<Timestamp>> {
        // A push or a removal is whole: a poisoned lock still holds a usable list.
        self.sleeping.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn set(&self, at: Timestamp) {
        self.now.send_replace(at);
    }

    pub fn advance(&self, by: Duration) {
        self.now.send_modify(|t| *t = t.saturating_add(by));
    }
}

#[async_trait]
impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        *self.now.borrow()
    }

    async fn sleep_until(&self, at: Timestamp) {
        let mut rx = self.now.subscribe();
        self.sleeping().push(at);
        // Off the list when the sleep ends, also when the sleeper stops waiting (a select).
        let _awake = Awake(self, at);
        // The sender lives as long as `self`, which outlives this borrow.
        let _ = rx.wait_for(|now| *now >= at).await;
    }
}

/// Takes one sleeper's entry off [`ManualClock`]'s list when dropped.
struct Awake<'a>(&'a ManualClock, Timestamp);

impl Drop for Awake<'_> {
    fn drop(&mut self) {
        let mut sleeping = self.0.sleeping();
        if let Some(i) = sleeping.iter().position(|at| *at == self.1) {
            sleeping.swap_remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn manual_clock_wakes_sleepers_when_advanced() {
        let clock = Arc::new(ManualClock::new(Timestamp::from_millis(1_000)));
        let sleeper = {
            let clock = clock.clone();
            tokio::spawn(async move { clock.sleep_until(Timestamp::from_millis(1_050)).await })
        };
        while clock.sleepers().is_empty() {
            tokio::task::yield_now().await;
        }
        assert_eq!(clock.sleepers(), [Timestamp::from_millis(1_050)]);
        clock.advance(Duration::from_millis(49));
        tokio::task::yield_now().await;
        assert!(!sleeper.is_finished());
        clock.advance(Duration::from_millis(1));
        tokio::time::timeout(Duration::from_secs(5), sleeper)
            .await
            .expect("sleeper woke")
            .expect("no panic");
        assert_eq!(clock.now().as_millis(), 1_050);
        assert_eq!(clock.sleepers(), [], "awake");
    }

    #[tokio::test]
    async fn system_clock_sleeps_until_the_time() {
        let clock = SystemClock;
        let at = clock.now().saturating_add(Duration::from_millis(20));
        clock.sleep_until(at).await;
        assert!(clock.now() >= at);
    }
}
