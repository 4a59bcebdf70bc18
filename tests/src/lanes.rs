//! Which trials of one test binary may run at the same time. A trial that stops or restarts a
//! server runs beside trials of other servers but never beside another trial of its own, in
//! its server's lane; a trial that measures time (how late a fire is, how soon something
//! happens) runs alone, since every trial beside it takes the same two cores. A binary that
//! gives its trials lanes runs them on as many threads as it has trials: a thread whose trial
//! cannot start yet waits, taking no core, and the trial starts as soon as its lane is free.
//!
//! A trial waiting to run alone goes first: no trial enters a lane while one waits, so the
//! lanes drain and it starts (it is not held back for as long as there are trials to run).

use std::collections::BTreeSet;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

/// Where a trial runs (see the module's text).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    /// Beside the trials of other lanes, one at a time in this one (a server's kind).
    Of(&'static str),
    /// With no other trial of the binary running.
    Alone,
}

#[derive(Default)]
struct Running {
    lanes: BTreeSet<&'static str>,
    alone: bool,
    alone_waiting: usize,
}

static RUNNING: Mutex<Running> = Mutex::new(Running {
    lanes: BTreeSet::new(),
    alone: false,
    alone_waiting: 0,
});
static CHANGED: Condvar = Condvar::new();

fn running() -> MutexGuard<'static, Running> {
    // A panic never happens while the lock is held: what it guards stays whole.
    RUNNING.lock().unwrap_or_else(PoisonError::into_inner)
}

fn wait(guard: MutexGuard<'static, Running>) -> MutexGuard<'static, Running> {
    CHANGED.wait(guard).unwrap_or_else(PoisonError::into_inner)
}

impl Lane {
    /// Waits until a trial of this lane may run, and holds the lane until the answer drops.
    pub fn enter(self) -> Entered {
        let mut now = running();
        match self {
            Lane::Of(lane) => {
                while now.alone || now.alone_waiting > 0 || now.lanes.contains(lane) {
                    now = wait(now);
                }
                now.lanes.insert(lane);
            }
            Lane::Alone => {
                now.alone_waiting += 1;
                while now.alone || !now.lanes.is_empty() {
                    now = wait(now);
                }
                now.alone_waiting -= 1;
                now.alone = true;
            }
        }
        Entered(self)
    }
}

/// A lane held by a running trial ([`Lane::enter`]); dropping it lets the next one in.
#[must_use = "the lane is free again as soon as this is dropped"]
pub struct Entered(Lane);

impl Drop for Entered {
    fn drop(&mut self) {
        let mut now = running();
        match self.0 {
            Lane::Of(lane) => {
                now.lanes.remove(lane);
            }
            Lane::Alone => now.alone = false,
        }
        drop(now);
        CHANGED.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{mpsc, Arc};
    use std::time::Duration;

    use super::*;

    /// Trials of two lanes run at once; trials of one lane never overlap, and a trial alone
    /// overlaps none (many threads entering and leaving, each checking who is inside).
    #[test]
    fn lanes_keep_apart_what_they_say_and_no_more() {
        let a = Lane::Of("a").enter();
        let (entered, heard) = mpsc::channel();
        let b = std::thread::spawn(move || {
            let _b = Lane::Of("b").enter();
            let _ = entered.send(());
        });
        heard
            .recv_timeout(Duration::from_secs(10))
            .expect("lane b entered while lane a was held");
        drop(a);
        b.join().expect("lane b's thread");

        let inside = Arc::new(Mutex::new(Vec::<Lane>::new()));
        let lanes = [Lane::Of("a"), Lane::Of("b"), Lane::Alone];
        let threads: Vec<_> = (0..9)
            .map(|i| {
                let (inside, lane) = (inside.clone(), lanes[i % lanes.len()]);
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        let _entered = lane.enter();
                        {
                            let mut now = inside.lock().unwrap();
                            let alone = lane == Lane::Alone;
                            assert!(
                                !now.contains(&Lane::Alone) && !now.contains(&lane),
                                "{lane:?} entered beside {now:?}"
                            );
                            assert!(!alone || now.is_empty(), "alone beside {now:?}");
                            now.push(lane);
                        }
                        std::thread::yield_now();
                        let mut now = inside.lock().unwrap();
                        let at = now.iter().position(|&l| l == lane).unwrap();
                        now.remove(at);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("no trial entered beside one it must not");
        }
    }
}
