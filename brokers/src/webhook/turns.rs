//! Turns to call a host. At most `webhooks.per_host_concurrency` calls of one host run at once;
//! when one ends, its turn goes to the next tenant in line for that host (round robin between
//! the tenants waiting, first come first served within one), so a tenant with a backlog at a
//! slow host does not make the other tenants calling that host wait behind all of it.
//!
//! A host's line takes `per_host_concurrency + per_host_waiting` calls, running or waiting; when
//! it is full, a tenant with fewer than its even share of that (one at least) still gets in, up
//! to twice that in all, so one tenant's backlog keeps no other tenant out. All calls together
//! are at most `concurrency + max_waiting`. A call not let in is handed back by the caller, told
//! how long the tenant's line there will take to move, so that a big backlog is not claimed and
//! handed back again every second.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

/// The bounds, from the webhook config.
#[derive(Debug, Clone, Copy)]
pub(super) struct Bounds {
    /// Calls of one host at once.
    pub per_host: usize,
    /// Calls holding or waiting for a turn of one host, beyond which only a tenant below its
    /// even share of them gets in, up to twice this.
    pub line: usize,
    /// Calls holding or waiting, over all hosts and tenants.
    pub all: usize,
}

/// The shortest wait before a call that was not let in comes again.
pub(super) const AGAIN_SOONEST: Duration = Duration::from_secs(1);
/// The longest: a host that got fast again waits no longer than this for the calls handed back.
pub(super) const AGAIN_LATEST: Duration = Duration::from_secs(60);

/// The lines of every host with calls in them.
pub(super) struct Turns {
    bounds: Bounds,
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    hosts: HashMap<String, Host>,
    /// Calls holding or waiting, over all hosts.
    all: usize,
}

/// One host's line.
#[derive(Default)]
struct Host {
    /// Calls that hold a turn now.
    running: usize,
    /// Per tenant: its calls holding or waiting.
    entered: HashMap<String, usize>,
    /// Per tenant: its calls waiting, in order.
    waiting: HashMap<String, VecDeque<oneshot::Sender<()>>>,
    /// The tenants with calls waiting, the next to get a turn first.
    next: VecDeque<String>,
    /// How long its calls took lately (a moving average; none yet for a new line).
    turn_time: Option<Duration>,
}

impl Host {
    /// Hands a turn that ended to the next waiting call, round robin between tenants; false
    /// when no call waits (the turn is free).
    fn hand_on(&mut self) -> bool {
        while let Some(tenant) = self.next.pop_front() {
            let Some(line) = self.waiting.get_mut(&tenant) else {
                continue;
            };
            let granted = loop {
                let Some(waiter) = line.pop_front() else {
                    break false;
                };
                // A waiter that stopped waiting (timed out) is skipped.
                if waiter.send(()).is_ok() {
                    break true;
                }
            };
            if line.is_empty() {
                self.waiting.remove(&tenant);
            } else {
                self.next.push_back(tenant);
            }
            if granted {
                return true;
            }
        }
        false
    }
}

/// How long until a tenant with `entered` calls at a host whose turns take `turn_time` has room
/// there again: the rounds its calls need with its share of the `per_host` turns (shared round
/// robin with the other `tenants`), between [`AGAIN_SOONEST`] and [`AGAIN_LATEST`].
fn again_after(entered: usize, tenants: usize, per_host: usize, turn_time: Duration) -> Duration {
    let share = (per_host / tenants.max(1)).max(1);
    let rounds = u32::try_from(entered.div_ceil(share)).unwrap_or(u32::MAX);
    turn_time
        .saturating_mul(rounds)
        .clamp(AGAIN_SOONEST, AGAIN_LATEST)
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // The state is counts and queues that every update leaves whole: a panic elsewhere while
    // the lock was held leaves nothing half done.
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Turns {
    pub(super) fn new(bounds: Bounds) -> Self {
        Turns {
            bounds,
            state: Arc::new(Mutex::new(State::default())),
        }
    }

    /// A place in `host`'s line for a call of `tenant`; when the line is full and the tenant
    /// has its even share of it, or all calls together are as many as may be, how long to wait
    /// before it comes again.
    pub(super) fn enter(&self, host: &str, tenant: &str) -> Result<Entry, Duration> {
        let mut state = lock(&self.state);
        if state.all >= self.bounds.all {
            return Err(AGAIN_SOONEST);
        }
        let line = state.hosts.entry(host.to_owned()).or_default();
        let entered = line.entered.get(tenant).copied().unwrap_or(0);
        let tenants = line.entered.len() + usize::from(entered == 0);
        let share = (self.bounds.line / tenants).max(1);
        // At most twice the line's size in entries, so at most as many tenants: a short sum.
        let total: usize = line.entered.values().sum();
        let full = total >= self.bounds.line.saturating_mul(2)
            || (total >= self.bounds.line && entered >= share);
        if full {
            let turn_time = line.turn_time.unwrap_or(AGAIN_SOONEST);
            return Err(again_after(
                entered,
                tenants,
                self.bounds.per_host,
                turn_time,
            ));
        }
        *line.entered.entry(tenant.to_owned()).or_default() += 1;
        state.all += 1;
        Ok(Entry {
            state: self.state.clone(),
            per_host: self.bounds.per_host,
            host: host.to_owned(),
            tenant: tenant.to_owned(),
        })
    }
}

/// A call's place in its host's line, left when dropped.
pub(super) struct Entry {
    state: Arc<Mutex<State>>,
    per_host: usize,
    host: String,
    tenant: String,
}

impl Entry {
    /// Waits for a turn of the host: at once while fewer than `per_host` calls run, else when
    /// one ends and it is this tenant's turn. Dropping the future gives up waiting (a turn
    /// handed to it meanwhile goes on to the next).
    pub(super) async fn turn(&self) -> Turn<'_> {
        loop {
            let receiver = {
                let mut state = lock(&self.state);
                let line = state.hosts.entry(self.host.clone()).or_default();
                if line.running < self.per_host {
                    line.running += 1;
                    return Turn::of(self);
                }
                let (sender, receiver) = oneshot::channel();
                let waiting = line.waiting.entry(self.tenant.clone()).or_default();
                if waiting.is_empty() {
                    line.next.push_back(self.tenant.clone());
                }
                waiting.push_back(sender);
                receiver
            };
            let mut waiting = Waiting {
                entry: self,
                receiver,
                granted: false,
            };
            if (&mut waiting.receiver).await.is_ok() {
                waiting.granted = true;
                return Turn::of(self);
            }
            // Its place was dropped without a turn (not done here): line up again.
        }
    }

    /// The turn ended, after a call of this long (none: no call was made with it): the next
    /// waiting call gets it, or it is free.
    fn end_turn(&self, call: Option<Duration>) {
        let mut state = lock(&self.state);
        if let Some(line) = state.hosts.get_mut(&self.host) {
            if let Some(call) = call {
                line.turn_time = Some(match line.turn_time {
                    Some(average) => (average * 7 + call) / 8,
                    None => call,
                });
            }
            if !line.hand_on() {
                line.running = line.running.saturating_sub(1);
            }
        }
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        let mut state = lock(&self.state);
        state.all = state.all.saturating_sub(1);
        let Some(line) = state.hosts.get_mut(&self.host) else {
            return;
        };
        if let Some(entered) = line.entered.get_mut(&self.tenant) {
            *entered = entered.saturating_sub(1);
            if *entered == 0 {
                line.entered.remove(&self.tenant);
            }
        }
        // Waiters that gave up leave their places now, not when a turn skips them.
        if let Some(waiting) = line.waiting.get_mut(&self.tenant) {
            waiting.retain(|sender| !sender.is_closed());
            if waiting.is_empty() {
                line.waiting.remove(&self.tenant);
                line.next.retain(|tenant| *tenant != self.tenant);
            }
        }
        if line.entered.is_empty() {
            state.hosts.remove(&self.host);
        }
    }
}

/// A wait for a turn; a turn handed to it after it was given up goes on to the next.
struct Waiting<'a> {
    entry: &'a Entry,
    receiver: oneshot::Receiver<()>,
    granted: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.granted {
            return;
        }
        self.receiver.close();
        if self.receiver.try_recv().is_ok() {
            self.entry.end_turn(None);
        }
    }
}

/// A turn of the host, given on when dropped.
pub(super) struct Turn<'a> {
    entry: &'a Entry,
    /// When the call made with it started: its length is the host's pace.
    call_started: Option<Instant>,
}

impl<'a> Turn<'a> {
    fn of(entry: &'a Entry) -> Self {
        Turn {
            entry,
            call_started: None,
        }
    }

    /// The call starts now (it has every turn it needs).
    pub(super) fn call_starts(&mut self) {
        self.call_started = Some(Instant::now());
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.entry
            .end_turn(self.call_started.map(|started| started.elapsed()));
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::Poll;

    use super::*;

    /// Whether `wait` is still waiting, polled once.
    async fn waits<F: Future + Unpin>(wait: &mut F) -> bool {
        std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *wait).poll(cx).is_pending())).await
    }

    fn turns(per_host: usize, line: usize, all: usize) -> Turns {
        Turns::new(Bounds {
            per_host,
            line,
            all,
        })
    }

    /// `n` places of `tenant` in the line of host `h`.
    fn entries(turns: &Turns, tenant: &str, n: usize) -> Vec<Entry> {
        (0..n)
            .map(|_| turns.enter("h", tenant).expect("room"))
            .collect()
    }

    /// Whether `entry` gets a turn now (its wait polled once more after the others moved).
    async fn gets_turn(entry: &Entry) -> bool {
        tokio::time::timeout(Duration::from_millis(20), entry.turn())
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn a_turn_that_ends_goes_to_the_next_tenant_in_line() {
        let turns = turns(1, 10, 100);
        let a = entries(&turns, "a", 3);
        let b = turns.enter("h", "b").expect("room");
        let running = a[0].turn().await;
        // a[1] waits first, then b, then a[2].
        let mut a1 = Box::pin(a[1].turn());
        assert!(waits(&mut a1).await);
        let mut b_turn = Box::pin(b.turn());
        assert!(waits(&mut b_turn).await);
        let mut a2 = Box::pin(a[2].turn());
        assert!(waits(&mut a2).await);
        drop(running);
        let a1 = a1.await;
        assert!(waits(&mut b_turn).await, "one at a time");
        drop(a1);
        // a's next call waited before b's, yet b's tenant is next.
        let b_turn = b_turn.await;
        assert!(waits(&mut a2).await);
        drop(b_turn);
        drop(a2.await);
    }

    #[tokio::test]
    async fn a_full_line_still_lets_in_a_tenant_below_its_even_share() {
        let turns = turns(1, 2, 6);
        let a = entries(&turns, "a", 2);
        assert!(turns.enter("h", "a").is_err(), "the line is full");
        // Two tenants: a share of 1 each; three: still 1.
        let b = turns.enter("h", "b").expect("b is below its share");
        assert!(turns.enter("h", "b").is_err(), "b has its share");
        let _c = turns.enter("h", "c").expect("so is c");
        assert!(
            turns.enter("h", "a").is_err(),
            "a still has more than its share"
        );
        assert!(turns.enter("h", "d").is_err(), "twice the line in all");
        let _other = turns.enter("other", "a").expect("another host is apart");
        let _more = turns.enter("other", "a").expect("room");
        assert!(turns.enter("other", "d").is_err(), "6 in all");
        drop(a);
        assert!(gets_turn(&b).await, "the turns a held are free again");
    }

    #[tokio::test]
    async fn a_turn_handed_to_a_call_that_gave_up_goes_on() {
        let turns = turns(1, 10, 100);
        let a = turns.enter("h", "a").expect("room");
        let b = turns.enter("h", "b").expect("room");
        let c = turns.enter("h", "c").expect("room");
        let running = a.turn().await;
        let mut b_wait = Box::pin(b.turn());
        assert!(waits(&mut b_wait).await);
        let mut c_wait = Box::pin(c.turn());
        assert!(waits(&mut c_wait).await);
        // The turn goes to b, which gives up before it took it: c gets it.
        drop(running);
        drop(b_wait);
        drop(c_wait.await);
        // A waiter that gave up before any turn ended is skipped as well.
        let running = a.turn().await;
        let mut b_wait = Box::pin(b.turn());
        assert!(waits(&mut b_wait).await);
        drop(b_wait);
        drop(running);
        assert!(gets_turn(&c).await);
        drop((a, b, c));
        assert!(lock(&turns.state).hosts.is_empty(), "nothing left behind");
        assert_eq!(lock(&turns.state).all, 0);
    }

    #[test]
    fn a_call_not_let_in_comes_again_when_its_line_may_have_moved() {
        let five = Duration::from_secs(5);
        // 272 calls of one tenant, 16 turns at once, 5 s each: 17 rounds, 85 s; at most 60 s.
        assert_eq!(again_after(272, 1, 16, five), AGAIN_LATEST);
        assert_eq!(again_after(8, 1, 2, five), Duration::from_secs(20));
        // Shared with another tenant: half the turns, twice the rounds.
        assert_eq!(again_after(8, 2, 2, five), Duration::from_secs(40));
        // A fast host: a second at least.
        assert_eq!(
            again_after(272, 1, 16, Duration::from_millis(20)),
            AGAIN_SOONEST
        );
        // More tenants than turns: one turn a round still.
        assert_eq!(again_after(3, 40, 16, five), Duration::from_secs(15));
    }

    #[tokio::test]
    async fn a_tenant_over_its_share_is_told_how_long_its_line_takes() {
        let turns = turns(1, 2, 100);
        let a = entries(&turns, "a", 2);
        match turns.enter("h", "a") {
            Err(after) => assert_eq!(after, 2 * AGAIN_SOONEST, "no call timed yet: 1 s each"),
            Ok(_) => panic!("a holds its share"),
        }
        drop(a[0].turn().await);
        let pace = lock(&turns.state).hosts["h"].turn_time;
        assert_eq!(
            pace, None,
            "a turn no call was made with says nothing of the host"
        );
        let mut turn = a[0].turn().await;
        turn.call_starts();
        drop(turn);
        let pace = lock(&turns.state).hosts["h"].turn_time;
        assert!(pace.is_some_and(|t| t < Duration::from_secs(1)), "{pace:?}");
    }
}
