//! Counts that read every timer of a tenant, shared by every reader for a few seconds.
//!
//! The dashboard's overview asks for `/v1/status` and `/v1/summary` every 2 seconds. Counting
//! a tenant of 1,000,000 timers reads 1,000,000 rows (a third of a second on SQLite), so the
//! counts are kept in a [`Cached`]: a reader gets the last count until `http.counts_max_age`
//! after that count ended; once it is half that age, the first reader starts the next count in
//! the background (unless one is running) and still gets the last one. A reader polling more often than the maximum
//! age therefore never waits for a count. A reader finding no count young enough (the first,
//! or the first after a quiet while) starts one and waits for it, and readers arriving
//! meanwhile wait for and share that count instead of starting their own; the count goes on
//! when its reader gives up (a count longer than `http.request_timeout` is there for the next
//! reader). One count runs at a time, in the background or not. A maximum age of zero counts
//! for every reader.

use std::fmt::Display;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use timer_core::{Backlog, TenantSummary, Timestamp};

/// The store's timers by state (`GET /v1/status`).
pub struct Totals {
    pub counted_at: Timestamp,
    pub pending: u64,
    pub paused: u64,
    pub failed: u64,
    /// The timers due now that no instance has claimed yet, and the tenants waiting longest.
    pub backlog: Backlog,
}

/// The summaries of the first tenants, as many as the largest page of `GET /v1/summary`.
pub struct FirstTenants {
    pub counted_at: Timestamp,
    pub summaries: Vec<TenantSummary>,
    /// Whether there are tenants after these.
    pub more: bool,
}

/// The counts the API shares between requests.
#[derive(Clone)]
pub struct Counts {
    /// The store's timers by state, for `GET /v1/status`.
    pub totals: Arc<Cached<Totals>>,
    /// The first tenants' summaries, for `GET /v1/summary` without a cursor.
    pub first_tenants: Arc<Cached<FirstTenants>>,
    /// Single tenants' summaries, for the pages of `GET /v1/summary` that are not the shared
    /// first page: a key limited to some tenants, and pages after a cursor.
    pub tenants: Arc<PerTenant>,
}

impl Counts {
    pub fn new(max_age: Duration) -> Self {
        Counts {
            totals: Cached::new("timers by state", max_age),
            first_tenants: Cached::new("tenant summaries", max_age),
            tenants: Arc::new(PerTenant::new(max_age)),
        }
    }
}

/// Most tenants whose summaries [`PerTenant`] keeps; beyond it, the ones too old are dropped
/// (and if none is, all: the next requests count again).
const KEPT_TENANTS: usize = 10_000;

/// Tenants' summaries, each kept for `max_age` and shared by the requests that ask for it, so
/// that a client polling its tenants' summaries (a key limited to some tenants, with the
/// dashboard open) counts each tenant at most once per `http.counts_max_age`, however often it
/// asks.
pub struct PerTenant {
    max_age: Duration,
    kept: Mutex<std::collections::HashMap<String, (Instant, Timestamp, TenantSummary)>>,
}

impl PerTenant {
    fn new(max_age: Duration) -> Self {
        PerTenant {
            max_age,
            kept: Mutex::default(),
        }
    }

    /// The summaries of `tenants`, in order: the ones kept and young enough as they are, the
    /// others counted together by `count` (given the tenants it is to count, and the time to
    /// count at) and kept. Also when the oldest of them was counted.
    pub async fn get<F, Fut>(
        &self,
        tenants: &[String],
        now: Timestamp,
        count: F,
    ) -> timer_core::Result<(Vec<TenantSummary>, Timestamp)>
    where
        F: FnOnce(Vec<String>) -> Fut,
        Fut: Future<Output = timer_core::Result<Vec<TenantSummary>>>,
    {
        let mut found: Vec<Option<(Timestamp, TenantSummary)>> = {
            let kept = self.kept();
            tenants
                .iter()
                .map(|t| {
                    let (taken, at, summary) = kept.get(t)?;
                    (taken.elapsed() < self.max_age).then(|| (*at, summary.clone()))
                })
                .collect()
        };
        let missing: Vec<String> = tenants
            .iter()
            .zip(&found)
            .filter(|(_, f)| f.is_none())
            .map(|(t, _)| t.clone())
            .collect();
        if !missing.is_empty() {
            let started = Instant::now();
            let mut counted = count(missing).await?.into_iter();
            let mut kept = self.kept();
            if kept.len() + tenants.len() > KEPT_TENANTS {
                kept.retain(|_, (taken, _, _)| taken.elapsed() < self.max_age);
                if kept.len() + tenants.len() > KEPT_TENANTS {
                    kept.clear();
                }
            }
            for slot in found.iter_mut().filter(|f| f.is_none()) {
                let summary = counted.next().ok_or_else(|| {
                    timer_core::Error::internal("the store returned fewer summaries than tenants")
                })?;
                if !self.max_age.is_zero() {
                    let entry = (started, now, summary.clone());
                    kept.insert(summary.tenant_id.clone(), entry);
                }
                *slot = Some((now, summary));
            }
        }
        let oldest = found
            .iter()
            .flatten()
            .map(|(at, _)| *at)
            .min()
            .unwrap_or(now);
        Ok((
            found.into_iter().flatten().map(|(_, s)| s).collect(),
            oldest,
        ))
    }

    fn kept(
        &self,
    ) -> MutexGuard<'_, std::collections::HashMap<String, (Instant, Timestamp, TenantSummary)>>
    {
        // Entries are inserted whole: a poisoned lock still holds a usable map.
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The last count of one kind and when it was taken; see the module documentation.
pub struct Cached<T> {
    max_age: Duration,
    /// What the count is of, for the log line when a background count fails.
    what: &'static str,
    slot: Mutex<Slot<T>>,
    /// Held while a count runs, so that readers arriving meanwhile share its count.
    counting: Arc<tokio::sync::Mutex<()>>,
}

struct Slot<T> {
    last: Option<Kept<T>>,
    refreshing: bool,
}

/// A count, when it started and when it ended.
struct Kept<T> {
    started: Instant,
    ended: Instant,
    value: Arc<T>,
}

impl<T: Send + Sync + 'static> Cached<T> {
    pub fn new(what: &'static str, max_age: Duration) -> Arc<Self> {
        Arc::new(Cached {
            max_age,
            what,
            slot: Mutex::new(Slot {
                last: None,
                refreshing: false,
            }),
            counting: Arc::new(tokio::sync::Mutex::new(())),
        })
    }

    /// The last count if it is young enough, else a new one from `count` (called at most
    /// once, and only when a count is due). A failed count is not kept: the reader that
    /// counted gets the error, a failed background count leaves the last one in place.
    pub async fn get<F, Fut, E>(self: &Arc<Self>, count: F) -> Result<Arc<T>, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        E: Display + Send + 'static,
    {
        let refresh = {
            let mut slot = self.slot();
            match &slot.last {
                Some(kept) if kept.ended.elapsed() < self.max_age => {
                    let last = Arc::clone(&kept.value);
                    let due = kept.ended.elapsed() >= self.max_age / 2 && !slot.refreshing;
                    slot.refreshing |= due;
                    Some((last, due))
                }
                _ => None,
            }
        };
        if let Some((last, due)) = refresh {
            if due {
                self.refresh_in_background(count());
            }
            return Ok(last);
        }
        let turn = Arc::clone(&self.counting).lock_owned().await;
        // Another count may have ended while this reader waited for its turn: young, then.
        if let Some(last) = self.young() {
            return Ok(last);
        }
        // In a task of its own, which keeps the turn: a reader that gives up (its request
        // timed out, its client left) does not throw a long count away, and the readers after
        // it wait for that count instead of each starting again (each then timing out too).
        let cached = Arc::clone(self);
        let counting = count();
        let task = tokio::spawn(async move {
            let _turn = turn;
            let started = Instant::now();
            let value = Arc::new(counting.await?);
            cached.keep(started, &value);
            Ok(value)
        });
        match task.await {
            Ok(counted) => counted,
            Err(e) => match e.try_into_panic() {
                Ok(panic) => std::panic::resume_unwind(panic),
                // Cancelled: only when the runtime stops, and this request with it.
                Err(_) => std::future::pending().await,
            },
        }
    }

    /// Counts in the background, holding the turn, so that no reader starts a count of its
    /// own beside it; nothing when a count is running already.
    fn refresh_in_background<Fut, E>(self: &Arc<Self>, counting: Fut)
    where
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        E: Display + Send + 'static,
    {
        let Ok(turn) = Arc::clone(&self.counting).try_lock_owned() else {
            self.slot().refreshing = false;
            return;
        };
        let cached = Arc::clone(self);
        tokio::spawn(async move {
            let _turn = turn;
            let started = Instant::now();
            let result = counting.await;
            match result {
                Ok(value) => cached.keep(started, &Arc::new(value)),
                Err(e) => {
                    tracing::warn!(error = %e, what = cached.what, "counting failed; the last count stays until it is too old")
                }
            }
            cached.slot().refreshing = false;
        });
    }

    /// Keeps `value`, counted from `started`, unless a later count is kept already.
    fn keep(&self, started: Instant, value: &Arc<T>) {
        let mut slot = self.slot();
        if slot.last.as_ref().is_none_or(|kept| kept.started < started) {
            slot.last = Some(Kept {
                started,
                ended: Instant::now(),
                value: Arc::clone(value),
            });
        }
    }

    /// The last count while it ended less than `max_age` ago.
    fn young(&self) -> Option<Arc<T>> {
        let slot = self.slot();
        let kept = slot.last.as_ref()?;
        (kept.ended.elapsed() < self.max_age).then(|| Arc::clone(&kept.value))
    }

    fn slot(&self) -> MutexGuard<'_, Slot<T>> {
        // The slot is only read and replaced whole, so a panic elsewhere cannot leave it
        // half-written: take it back from a poisoned lock.
        self.slot
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests;
