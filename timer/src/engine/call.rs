//! The fires a [`Caller`] delivers (HTTP targets). The firing task hands each one to a task of
//! its own ([`Calls`]) and goes on with its batch: a call may take seconds (a slow endpoint, a
//! timeout), and the other fires of the batch, of other endpoints and tenants, must not wait for
//! it. Each call holds its timer's lease while it runs (renewed, as a publish does), then
//! settles its timer by itself:
//!
//! - delivered: as a confirmed publish (announced, then settled as fired, in one store
//!   transaction with the other calls that ended meanwhile);
//! - to retry: released after the engine's backoff, or the destination's `Retry-After` if later,
//!   and given up after `engine.max_attempts` as a failed publish is;
//! - refused for good: given up at once (`TimerFailed` with reason `target_refused`);
//! - busy (the caller holds too many calls for that destination): given back, no attempt
//!   counted;
//!
//! and wakes the firing task when that makes its timer claimable sooner than the task planned
//! to look (it sleeps until the call's lease would run out, not knowing the call ended).
//!
//! The calls belong to the firing task: when it ends, it waits for them (each gives its claim
//! back `engine.shutdown_grace` after shutdown); when it is aborted (a crash in tests), they are
//! aborted with it. Joining the live instances again waits until none runs, as it waits for the
//! firing task's batch.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use opentelemetry::global::BoxedSpan;
use opentelemetry::trace::Span as _;
use opentelemetry::KeyValue;
use tokio::sync::oneshot;
use tokio::task::{JoinError, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::owners::Leased;
use super::publish::claimable_again;
use super::{metrics as metric, spans, Engine, LoweredOnPanic};
use crate::broker::OutboundEvent;
use crate::call::{Called, Caller};
use crate::model::{ClaimedTimer, Timestamp};
use crate::outbound::Target;
use crate::policy::{self, Fire};
use crate::store::Settlement;
use crate::wire::DueTimeReachedEnvelope;

/// A claim and its settlement waiting to be written, and who waits for that (the last of a
/// group: the queue is written in order).
pub(super) type Settling = (ClaimedTimer, Settlement, Option<oneshot::Sender<()>>);

/// What a panic carried.
pub(super) type Panic = Box<dyn std::any::Any + Send>;

/// The tasks of the firing task that run now: calls, and publishes ([`super::publish`]).
#[derive(Default)]
pub(super) struct Calls {
    tasks: JoinSet<()>,
    /// The publishes among them: a publish that panics is the firing task's panic, as when it
    /// published itself (supervised: reported down, started again); a call's only logs.
    publishes: HashSet<tokio::task::Id>,
}

impl Calls {
    /// Forgets the tasks that ended; the panic of a publish, if one ended so.
    pub(super) fn reap(&mut self) -> Result<(), Panic> {
        while let Some(ended) = self.tasks.try_join_next_with_id() {
            self.ended(ended)?;
        }
        Ok(())
    }

    /// Returns the panic of a publish as soon as one ends so (never otherwise), forgetting the
    /// other tasks as they end. Cancel safe.
    pub(super) async fn publish_panicked(&mut self) -> Panic {
        loop {
            match self.tasks.join_next_with_id().await {
                Some(ended) => {
                    if let Err(panic) = self.ended(ended) {
                        return panic;
                    }
                }
                None => std::future::pending().await,
            }
        }
    }

    fn ended(&mut self, ended: Result<(tokio::task::Id, ()), JoinError>) -> Result<(), Panic> {
        match ended {
            Ok((id, ())) => {
                self.publishes.remove(&id);
            }
            Err(e) if self.publishes.remove(&e.id()) && e.is_panic() => {
                return Err(e.into_panic());
            }
            Err(e) => said(Err(e)),
        }
        Ok(())
    }

    /// Runs `work` on a task of the firing task's, counted as running while it lives (joining
    /// the live instances again waits for it).
    pub(super) fn spawn(
        &mut self,
        engine: &Engine,
        work: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> tokio::task::Id {
        let running = Running::new(engine);
        self.tasks
            .spawn(async move {
                work.await;
                drop(running);
            })
            .id()
    }

    /// As [`spawn`](Self::spawn), for a publish.
    pub(super) fn spawn_publish(
        &mut self,
        engine: &Engine,
        work: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let id = self.spawn(engine, work);
        self.publishes.insert(id);
    }

    /// Waits until every call ended and every batch was settled.
    pub(super) async fn finish(&mut self) {
        while let Some(ended) = self.tasks.join_next().await {
            said(ended);
        }
    }
}

/// Logs a call that panicked: its timer fires again once its lease runs out.
fn said(ended: Result<(), JoinError>) {
    if let Err(e) = ended {
        if e.is_panic() {
            error!(error = %e, "a call panicked; its timer fires again when its lease runs out");
        }
    }
}

/// One fire a caller delivers: the claim, its plan, the claim as its event describes it, the
/// envelope (what the event stream shows) and what goes out; when its batch was claimed, until
/// when the lease is surely held, and the firing task's fence and shutdown.
pub(super) struct OneCall {
    pub claim: ClaimedTimer,
    pub fire: Fire,
    pub as_fired: ClaimedTimer,
    pub envelope: DueTimeReachedEnvelope,
    pub event: OutboundEvent,
    pub reached_at: Timestamp,
    pub held_until: Instant,
    pub fence: CancellationToken,
    pub shutdown: CancellationToken,
    /// Its `publish` span, ended when the call ends.
    pub span: Option<BoxedSpan>,
}

/// Counts a call in [`Inner::calls`](super::Inner) while it lives.
struct Running(Engine);

impl Running {
    fn new(engine: &Engine) -> Self {
        engine.inner.calls.send_modify(|n| *n += 1);
        Running(engine.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.inner.calls.send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl Engine {
    /// The caller a timer with `target` goes to (an HTTP target), whatever the broker; `None`:
    /// the broker publishes it.
    pub(super) fn caller_of(&self, target: Option<&Target>) -> Option<&Arc<dyn Caller>> {
        let caller = self.inner.caller.get()?;
        caller.takes(target?).then_some(caller)
    }

    /// Whether `claim` goes to the caller rather than the broker.
    pub(super) fn called(&self, claim: &ClaimedTimer) -> Option<Arc<dyn Caller>> {
        self.caller_of(claim.target.as_ref()).cloned()
    }

    /// Starts delivering `one` through `caller` on a task of `calls`.
    pub(super) fn start_call(&self, calls: &mut Calls, caller: Arc<dyn Caller>, one: OneCall) {
        // Counted before the firing task lets its batch go, so a join never slips in between.
        let engine = self.clone();
        calls.spawn(self, async move { engine.call(caller, one).await });
    }

    async fn call(&self, caller: Arc<dyn Caller>, one: OneCall) {
        let inner = &self.inner;
        let OneCall {
            claim,
            fire,
            as_fired,
            envelope,
            event,
            reached_at,
            held_until,
            fence,
            shutdown,
            span,
        } = one;
        let (fence, shutdown) = (&fence, &shutdown);
        let claims = std::slice::from_ref(&claim);
        let called = self
            .while_leased(claims, held_until, fence, shutdown, caller.call(&event))
            .await;
        if let Some(mut span) = span {
            match &called {
                Leased::Done(Called::Delivered { answer }) => {
                    span.set_attribute(KeyValue::new("timer.answer", answer.clone()));
                    span.end();
                }
                Leased::Done(Called::Retry { error, .. } | Called::Refused { error }) => {
                    spans::failed(span, error.clone())
                }
                Leased::Done(Called::Busy { .. }) => {
                    spans::failed(span, "the destination was busy")
                }
                Leased::Abandoned(why) => spans::failed(span, format!("abandoned: {why}")),
                Leased::Shutdown => spans::failed(span, "shutdown before the destination answered"),
            }
        }
        match called {
            Leased::Abandoned(why) => {
                ::metrics::counter!(metric::CLAIMS_ABANDONED).increment(1);
                warn!(timer = %claim.key, trace_id = claim.trace_id(), reason = %why, "stopped a call whose lease could be lost; another instance fires it");
            }
            Leased::Shutdown => {
                info!(timer = %claim.key, trace_id = claim.trace_id(), "shutdown while calling; releasing the claim");
                self.give_back(claims, inner.clock.now(), "releasing a call at shutdown")
                    .await;
            }
            Leased::Done(Called::Delivered { answer }) => {
                debug!(timer = %claim.key, caller = caller.name(), %answer, "delivered");
                self.announce(std::slice::from_ref(&as_fired), vec![envelope], reached_at);
                let settlement =
                    policy::fired(&claim, &fire, reached_at, &inner.owner, Some(answer));
                let next = claimable_again(&settlement);
                self.settle_called(claim, settlement, shutdown).await;
                if let Some(at) = next {
                    self.wake_by(at);
                }
            }
            Leased::Done(Called::Retry { error, not_before }) => {
                ::metrics::counter!(metric::PUBLISH_FAILURES).increment(1);
                warn!(timer = %claim.key, trace_id = claim.trace_id(), caller = caller.name(), %error, "a call failed; retrying it after a backoff");
                self.release_after(vec![(claim, error)], not_before).await;
                // Its next attempt is after a backoff: the firing task plans again.
                self.wake_by(inner.clock.now());
            }
            Leased::Done(Called::Refused { error }) => {
                ::metrics::counter!(metric::PUBLISH_FAILURES).increment(1);
                warn!(timer = %claim.key, trace_id = claim.trace_id(), caller = caller.name(), %error, "the destination refused a call; the timer fails");
                let reason = format!("target_refused: {error}");
                if !self.give_up(&claim, &error, &reason).await {
                    // The dead letter did not go out: the next attempt meets the same answer
                    // and tries again to fail.
                    self.release_with_backoff(vec![(claim, error)]).await;
                }
            }
            Leased::Done(Called::Busy { after }) => {
                let at = inner.clock.now().saturating_add(after);
                self.give_back(
                    claims,
                    at,
                    "handing back a call its destination has no room for",
                )
                .await;
                self.wake_by(at);
            }
        }
    }

    /// Settles a delivered call together with the others that ended meanwhile (one store
    /// transaction for many, as the firing task settles a batch), and waits until it is written.
    async fn settle_called(
        &self,
        claim: ClaimedTimer,
        settlement: Settlement,
        shutdown: &CancellationToken,
    ) {
        if let Some(written) = self.queue_settles(vec![(claim, settlement)], shutdown) {
            let _ = written.await;
        } // else poisoned: the lease expires and the timer fires again
    }

    /// Puts settlements in the settle queue (starting its task if none runs); the receiver
    /// hears when they were written. `None` when the queue is poisoned.
    pub(super) fn queue_settles(
        &self,
        settled: Vec<(ClaimedTimer, Settlement)>,
        shutdown: &CancellationToken,
    ) -> Option<oneshot::Receiver<()>> {
        let inner = &self.inner;
        let (written, wait) = oneshot::channel();
        let mut queue = inner.settling.lock().ok()?;
        let last = settled.len().saturating_sub(1);
        let mut written = Some(written);
        for (i, (claim, settlement)) in settled.into_iter().enumerate() {
            let tell = if i == last { written.take() } else { None };
            queue.push((claim, settlement, tell));
        }
        drop(queue);
        if !inner.settling_now.swap(true, Ordering::SeqCst) {
            // A task of its own, so a call that is aborted cannot strand the queue.
            tokio::spawn(self.clone().settle_queue(shutdown.clone()));
        }
        Some(wait)
    }

    async fn settle_queue(self, shutdown: CancellationToken) {
        let inner = &self.inner;
        // A panic ends this task: the next call that ends starts another (a call waiting
        // for its settle gets no answer and goes on).
        let on_panic = LoweredOnPanic(&inner.settling_now);
        loop {
            let batch: Vec<Settling> = match inner.settling.lock() {
                Ok(mut queue) => {
                    let n = queue.len().min(inner.config.batch_size.max(1));
                    queue.drain(..n).collect()
                }
                Err(_) => Vec::new(),
            };
            if batch.is_empty() {
                inner.settling_now.store(false, Ordering::SeqCst);
                // Someone may have queued after the drain but before the flag dropped.
                let more = inner
                    .settling
                    .lock()
                    .map(|q| !q.is_empty())
                    .unwrap_or(false);
                if more && !inner.settling_now.swap(true, Ordering::SeqCst) {
                    continue;
                }
                // Not by a panic: the flag is another task's now, if raised.
                std::mem::forget(on_panic);
                return;
            }
            let (settled, written): (Vec<_>, Vec<_>) = batch
                .into_iter()
                .map(|(claim, settlement, written)| ((claim, settlement), written))
                .unzip();
            self.settle_all(settled, inner.clock.now(), &shutdown).await;
            for w in written.into_iter().flatten() {
                let _ = w.send(());
            }
        }
    }

    /// Has the firing task plan again if it sleeps past `at`, when a call or a settle behind
    /// it made its timer claimable then (the firing task, which planned while the timer was
    /// leased, would not know).
    pub(super) fn wake_by(&self, at: Timestamp) {
        self.wake_for(at.as_millis());
    }

    /// Waits until no call runs.
    pub(super) async fn no_calls(&self) {
        let mut calls = self.inner.calls.subscribe();
        // The sender lives in `inner`, as long as `self`.
        let _ = calls.wait_for(|n| *n == 0).await;
    }
}
