//! Watchers of the events this instance fired (the HTTP event stream, `bench`). Each watcher has
//! a queue of its own, filtered by the tenants it may see before anything is queued, and bounded
//! in bytes: a reader slower than its events is dropped (its stream ends, and it learns that it
//! lagged) instead of making the service keep events for it, and it never learns of other
//! tenants' events, not even their number.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

use super::FiredEvent;

/// Which tenants' events a watcher sees.
pub type Shows = Box<dyn Fn(&str) -> bool + Send + Sync>;

struct Watcher {
    shows: Shows,
    tx: mpsc::UnboundedSender<Arc<FiredEvent>>,
    state: Arc<State>,
    budget: usize,
}

#[derive(Default)]
struct State {
    /// Bytes of events queued and not yet read.
    queued: AtomicUsize,
    /// Events it was shown and did not get (its queue was full).
    missed: AtomicU64,
    /// Dropped for reading too slowly.
    dropped: AtomicBool,
}

/// Every watcher of one engine.
#[derive(Default)]
pub(super) struct Watchers(Mutex<Vec<Watcher>>);

impl Watchers {
    pub(super) fn add(&self, budget: usize, shows: Shows) -> Subscription {
        let (tx, rx) = mpsc::unbounded_channel();
        let state = Arc::new(State::default());
        let watcher = Watcher {
            shows,
            tx,
            state: state.clone(),
            budget: budget.max(1),
        };
        let mut watchers = self.lock();
        // Those whose reader went away, gone too: streams opened and closed while nothing
        // fires would otherwise pile up until the next event.
        watchers.retain(|w| !w.tx.is_closed());
        watchers.push(watcher);
        Subscription { rx, state }
    }

    /// Queues `event` for each watcher that may see it; drops the watchers that went away or
    /// have a full queue.
    pub(super) fn send(&self, event: FiredEvent) {
        let mut watchers = self.lock();
        if watchers.is_empty() {
            return;
        }
        let event = Arc::new(event);
        let size = event.json.len();
        watchers.retain(|w| {
            if w.tx.is_closed() {
                return false;
            }
            if !(w.shows)(&event.tenant_id) {
                return true;
            }
            let queued = w.state.queued.load(Ordering::Acquire);
            // A reader with nothing queued takes the event, however large: it keeps up.
            if queued > 0 && queued.saturating_add(size) > w.budget {
                // Dropping the sender ends its stream once it read what is queued.
                w.state.missed.fetch_add(1, Ordering::Relaxed);
                w.state.dropped.store(true, Ordering::Release);
                return false;
            }
            w.state.queued.fetch_add(size, Ordering::AcqRel);
            w.tx.send(event.clone()).is_ok()
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Watcher>> {
        // A panic while it was held leaves a whole list: go on with it.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One watcher's events, as they fire (after the broker confirmed them).
pub struct Subscription {
    rx: mpsc::UnboundedReceiver<Arc<FiredEvent>>,
    state: Arc<State>,
}

impl Subscription {
    /// The next event; `None` once the engine dropped this watcher (see
    /// [`lagged`](Self::lagged)) or stopped.
    pub async fn recv(&mut self) -> Option<Arc<FiredEvent>> {
        let event = self.rx.recv().await?;
        self.state
            .queued
            .fetch_sub(event.json.len(), Ordering::AcqRel);
        Some(event)
    }

    /// When the stream ended because this watcher read too slowly: how many of its events it
    /// missed.
    pub fn lagged(&self) -> Option<u64> {
        self.state
            .dropped
            .load(Ordering::Acquire)
            .then(|| self.state.missed.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fired(tenant: &str, json: &str) -> FiredEvent {
        FiredEvent {
            tenant_id: tenant.into(),
            json: json.into(),
        }
    }

    #[tokio::test]
    async fn a_watcher_sees_only_its_tenants_and_is_dropped_when_its_queue_is_full() {
        let watchers = Watchers::default();
        let mut only_a = watchers.add(10, Box::new(|t| t == "a"));
        let mut all = watchers.add(1_000, Box::new(|_| true));
        watchers.send(fired("b", "bbbbbbbbbbbbbbbbbbbb")); // 20 bytes: not a's
        watchers.send(fired("a", "12345"));
        watchers.send(fired("a", "12345"));
        assert_eq!(
            all.recv().await.map(|e| e.tenant_id.clone()),
            Some("b".into())
        );
        assert_eq!(
            only_a.recv().await.map(|e| e.json.clone()),
            Some("12345".into())
        );
        // Read: room for one more, but not two.
        watchers.send(fired("a", "123"));
        watchers.send(fired("a", "123456789"));
        assert_eq!(
            only_a.recv().await.map(|e| e.json.clone()),
            Some("12345".into())
        );
        assert_eq!(
            only_a.recv().await.map(|e| e.json.clone()),
            Some("123".into())
        );
        assert!(only_a.recv().await.is_none(), "dropped: the stream ends");
        assert_eq!(only_a.lagged(), Some(1));
        assert_eq!(all.lagged(), None);
        assert_eq!(
            watchers.lock().len(),
            1,
            "only the one that keeps up is left"
        );
        // A reader that read everything takes an event larger than its budget.
        let mut small = watchers.add(10, Box::new(|_| true));
        watchers.send(fired("c", "a payload larger than 10 bytes"));
        assert!(small.recv().await.is_some());
        assert_eq!(small.lagged(), None);
        drop((all, small));
        watchers.send(fired("a", "x"));
        assert!(
            watchers.lock().is_empty(),
            "a watcher that went away is forgotten"
        );
        // Also while nothing fires: at the next watcher's arrival.
        for _ in 0..100 {
            drop(watchers.add(10, Box::new(|_| true)));
        }
        let _kept = watchers.add(10, Box::new(|_| true));
        assert_eq!(watchers.lock().len(), 1, "only the live watcher is kept");
    }
}
