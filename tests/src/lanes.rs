//! Which trials of one test binary may run at the same time. A trial that stops or restarts a
//! server runs beside trials of other servers but never beside another trial of its own, in
//! its server's lane; a trial that measures time (how late a fire is, how soon something
//! happens) runs alone, since every trial beside it takes the same two cores. A binary that
//! gives its trials lanes runs them on as many threads as it has trials: a thread whose trial
//! cannot start yet waits, taking no core, and the trial starts as soon as its lane is free.
//!
//! A trial waiting to run alone goes first: no trial enters a lane while one waits, so the
//! lanes drain and it starts (it is not held back for as long as there are trials to run).
//!
//! A trial that hung (ran past its limit, its thread left running) keeps its lane for good,
//! since it may still be using its server (stopped, perhaps): a later trial of that lane, or
//! one to run alone, fails at once naming it instead of running beside it (or waiting for it
//! for ever). A trial alone that hung fails every trial after it so.

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
    /// Trials that hung, with the lane each holds for good.
    hung: Vec<(Lane, String)>,
}

impl Running {
    /// Why a trial of `lane` cannot run: a hung trial holds what it needs.
    fn blocked(&self, lane: Lane) -> Option<String> {
        let (held, trial) = self.hung.iter().find(|(held, _)| match (lane, held) {
            (Lane::Of(_), Lane::Alone) | (Lane::Alone, _) => true,
            (Lane::Of(wanted), Lane::Of(held)) => wanted == *held,
        })?;
        Some(format!(
            "not run: {trial} hung and still holds {}",
            match held {
                Lane::Of(lane) => format!("the {lane} lane (its server may be down)"),
                Lane::Alone => "every lane (it was to run alone)".to_owned(),
            }
        ))
    }
}

/// The lanes of one process ([`LANES`]; a unit test makes its own).
struct Lanes {
    running: Mutex<Running>,
    changed: Condvar,
}

static LANES: Lanes = Lanes::new();

impl Lanes {
    const fn new() -> Self {
        Lanes {
            running: Mutex::new(Running {
                lanes: BTreeSet::new(),
                alone: false,
                alone_waiting: 0,
                hung: Vec::new(),
            }),
            changed: Condvar::new(),
        }
    }

    fn running(&self) -> MutexGuard<'_, Running> {
        // A panic never happens while the lock is held: what it guards stays whole.
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, Running>) -> MutexGuard<'a, Running> {
        self.changed
            .wait(guard)
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn enter(&'static self, lane: Lane) -> Result<Entered, String> {
        let mut now = self.running();
        match lane {
            Lane::Of(name) => {
                while now.alone || now.alone_waiting > 0 || now.lanes.contains(name) {
                    if let Some(why) = now.blocked(lane) {
                        return Err(why);
                    }
                    now = self.wait(now);
                }
                now.lanes.insert(name);
            }
            Lane::Alone => {
                now.alone_waiting += 1;
                while now.alone || !now.lanes.is_empty() {
                    if let Some(why) = now.blocked(lane) {
                        now.alone_waiting -= 1;
                        drop(now);
                        // The trials it held back may go on.
                        self.changed.notify_all();
                        return Err(why);
                    }
                    now = self.wait(now);
                }
                now.alone_waiting -= 1;
                now.alone = true;
            }
        }
        Ok(Entered { lanes: self, lane })
    }
}

impl Lane {
    /// Waits until a trial of this lane may run, and holds the lane until the answer drops;
    /// fails (saying why) when a trial that hung holds it.
    pub fn enter(self) -> Result<Entered, String> {
        LANES.enter(self)
    }
}

/// A lane held by a running trial ([`Lane::enter`]); dropping it lets the next one in.
#[must_use = "the lane is free again as soon as this is dropped"]
pub struct Entered {
    lanes: &'static Lanes,
    lane: Lane,
}

impl Entered {
    /// `trial` hung: its lane stays held, and the trials waiting for it are told so.
    pub fn hung(self, trial: &str) {
        let (lanes, lane) = (self.lanes, self.lane);
        std::mem::forget(self);
        lanes.running().hung.push((lane, trial.to_owned()));
        lanes.changed.notify_all();
    }
}

impl Drop for Entered {
    fn drop(&mut self) {
        let mut now = self.lanes.running();
        match self.lane {
            Lane::Of(lane) => {
                now.lanes.remove(lane);
            }
            Lane::Alone => now.alone = false,
        }
        drop(now);
        self.lanes.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{mpsc, Arc};
    use std::time::Duration;

    use super::*;

    fn own_lanes() -> &'static Lanes {
        Box::leak(Box::new(Lanes::new()))
    }

    /// Trials of two lanes run at once; trials of one lane never overlap, and a trial alone
    /// overlaps none (many threads entering and leaving, each checking who is inside).
    #[test]
    fn lanes_keep_apart_what_they_say_and_no_more() {
        let lanes = own_lanes();
        let a = lanes.enter(Lane::Of("a")).unwrap();
        let (entered, heard) = mpsc::channel();
        let b = std::thread::spawn(move || {
            let _b = lanes.enter(Lane::Of("b")).unwrap();
            let _ = entered.send(());
        });
        heard
            .recv_timeout(Duration::from_secs(10))
            .expect("lane b entered while lane a was held");
        drop(a);
        b.join().expect("lane b's thread");

        let inside = Arc::new(Mutex::new(Vec::<Lane>::new()));
        let kinds = [Lane::Of("a"), Lane::Of("b"), Lane::Alone];
        let threads: Vec<_> = (0..9)
            .map(|i| {
                let (inside, lane) = (inside.clone(), kinds[i % kinds.len()]);
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        let _entered = lanes.enter(lane).unwrap();
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

    /// A trial that hung keeps its lane: a later trial of that lane, or one to run alone,
    /// fails at once naming it, also one that was already waiting; other lanes go on.
    #[test]
    fn a_hung_trial_keeps_its_lane_and_fails_those_that_need_it() {
        let lanes = own_lanes();
        let stuck = lanes.enter(Lane::Of("a")).unwrap();
        let (waiting, started) = mpsc::channel();
        let alone = std::thread::spawn(move || {
            let _ = waiting.send(());
            lanes.enter(Lane::Alone).map(drop)
        });
        started.recv().unwrap();
        stuck.hung("the stuck trial");
        let refused = alone.join().unwrap().unwrap_err();
        assert!(refused.contains("the stuck trial hung"), "{refused}");
        let refused = lanes.enter(Lane::Of("a")).map(drop).unwrap_err();
        assert!(refused.contains("the a lane"), "{refused}");
        // Another lane runs; once a trial alone hangs, nothing does.
        drop(lanes.enter(Lane::Of("b")).unwrap());
        let lanes = own_lanes();
        lanes.enter(Lane::Alone).unwrap().hung("the lone trial");
        let refused = lanes.enter(Lane::Of("b")).map(drop).unwrap_err();
        assert!(refused.contains("every lane"), "{refused}");
    }
}
