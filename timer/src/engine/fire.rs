//! The firing task: sleep until `engine.claim_ahead` before the next due time (or a wake-up),
//! claim what is due by then and hold it until its due time ([`super::ready`]), publish the
//! events of what is due within `engine.publish_timeout` while renewing their leases, then
//! settle the claims.

use std::future::Future;
use std::sync::atomic::Ordering;
use tokio::time::Instant;

use opentelemetry::global::BoxedSpan;
use tokio::sync::{broadcast, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::call::{Calls, OneCall};
use super::publish::Batch;
use super::ready::Ready;
use super::settle::GivingUp;
use super::{metrics as metric, spans, Engine};
use crate::broker::OutboundEvent;
use crate::error::{Error, Result};
use crate::model::{ClaimedTimer, Due, Lease, TimerKey, Timestamp};
use crate::outbound::{Message, Target};
use crate::policy::{self, Fire, Plan};
use crate::store::Settlement;
use crate::trace::TraceContext;
use crate::wire::DueTimeReachedEnvelope;

impl Engine {
    pub(super) async fn fire_loop(self, shutdown: CancellationToken) {
        let inner = &self.inner;
        let ahead = inner.config.claim_ahead;
        let batch = inner.config.batch_size;
        let mut wakeups = inner.store.wakeups();
        let mut calls = Calls::default();
        let mut ready = Ready::default();
        // A claim running on a task of its own, so what is held fires meanwhile.
        let mut claiming: Option<oneshot::Receiver<Option<Claimed>>> = None;
        // The last batch fired when the next claim became due, and when: the claim waits until
        // that one and those before it are settled ([`super::publish`]), for a broker's
        // confirm at most `confirm_wait`.
        let mut claim_after: Option<(u64, Instant)> = None;
        let confirm_wait = ahead / 5;
        while !shutdown.is_cancelled() {
            if let Err(panic) = calls.reap() {
                std::panic::resume_unwind(panic);
            }
            inner.planned.store(i64::MAX, Ordering::SeqCst);
            inner.wake_before.store(i64::MAX, Ordering::SeqCst);
            // Claim only as a live member of the store's instances.
            let Some(fence) = self.member(&shutdown).await else {
                break;
            };
            if ready.fence().is_some_and(|f| f.is_cancelled()) {
                self.abandon(
                    ready.take_all(),
                    "the membership they were claimed under ended",
                );
            }
            // From the claim until its batch is done: joining again waits (`owners`).
            let firing = inner.firing.lock().await;
            let claims = claiming.is_none() && ready.claims(inner.clock.now(), ahead, batch);
            // Claim once the batches fired before are settled (waiting for their confirms only
            // so long: [`super::publish`]).
            let settles_behind = if claims {
                let (before, since) =
                    *claim_after.get_or_insert_with(|| (self.last_fired(), Instant::now()));
                let confirms = since.elapsed() < confirm_wait;
                (!self.settled_through(before, confirms)).then_some((before, since, confirms))
            } else {
                claim_after = None;
                None
            };
            if claims && settles_behind.is_none() {
                claim_after = None;
                claiming = Some(self.start_claim(&mut calls, &fence, &shutdown));
            }
            // Each fire publishes on a task of its own ([`super::publish`]), at most a batch of
            // timers being published at once.
            let room = self.room_to_publish(batch);
            if room > 0 {
                if let Some(now) = ready.take_due(inner.clock.now(), room) {
                    self.fire(now.timers, now.held_until, &fence, &shutdown, &mut calls)
                        .await;
                    continue;
                }
            } else if ready.first_due().is_some_and(|at| at <= inner.clock.now()) {
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => break,
                    panic = calls.publish_panicked() => std::panic::resume_unwind(panic),
                    _ = self.room_made(batch) => {}
                };
                continue;
            }
            if let Some(claim) = claiming.as_mut() {
                // Until the claim is back, or the first held timer is due.
                let first = ready.first_due();
                let claimed = tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => break,
                    panic = calls.publish_panicked() => std::panic::resume_unwind(panic),
                    claimed = claim => claimed,
                    _ = sleep_until(inner.clock.as_ref(), first) => continue,
                };
                claiming = None;
                match claimed {
                    Ok(Some(claimed)) => self.hold(&mut ready, claimed, batch),
                    Ok(None) => break, // shutdown while claiming
                    Err(_) => {}       // its task ended without an answer (aborted)
                }
                continue;
            }
            if let Some((before, since, confirms)) = settles_behind {
                // Until they are, or the first held timer is due.
                let first = ready.first_due();
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => break,
                    panic = calls.publish_panicked() => std::panic::resume_unwind(panic),
                    _ = self.settled(before, confirms) => {}
                    _ = tokio::time::sleep_until(since + confirm_wait), if confirms => {}
                    _ = sleep_until(inner.clock.as_ref(), first) => {}
                };
                continue;
            }
            let now = inner.clock.now();
            let held = ready.next_look(now, ahead, batch);
            if held.is_none() {
                drop(firing);
            } // else held until their due time, the firing lock too: a join waits that long
            let next = match self.bounded(inner.store.next_due_at()).await {
                Ok(next) => next.unwrap_or(Timestamp::MAX),
                Err(e) => {
                    warn!(error = %e.chain(), "reading the next due time failed; polling");
                    Timestamp::MAX
                }
            };
            // Claimed `claim_ahead` before it is due; but what the last claim's window held and
            // it did not take (a retry, a lease's end: not a first due time) once claimable.
            // (A full hold, `Ready::is_full`, claims no more until some fire.)
            let covered = ready.wake_before();
            let look = if ready.is_full(now, batch) {
                Timestamp::MAX
            } else if covered.is_some_and(|covered| next <= covered) {
                next
            } else {
                next.saturating_sub(ahead)
            };
            let wake_at = held
                .map_or(look, |held| held.min(look))
                .min(now.saturating_add(inner.config.poll_interval));
            // A timer due before the window of the next look, or inside the one claimed, is
            // not taken in time without a wake-up.
            let wake_before = wake_at
                .saturating_add(ahead)
                .as_millis()
                .max(covered.map_or(i64::MIN, |c| c.as_millis()));
            inner.wake_before.store(wake_before, Ordering::SeqCst);
            inner.planned.store(wake_at.as_millis(), Ordering::SeqCst);
            let fence = ready.fence().cloned();
            let fenced = async {
                match &fence {
                    Some(fence) => fence.cancelled().await,
                    None => std::future::pending().await,
                }
            };
            // Whether the next look claims: woken for a sooner timer, or for what the store
            // has (nothing held, or the store's next time came first), or a poll.
            let by_store = held.is_none() || look <= wake_at;
            let claims = tokio::select! {
                _ = shutdown.cancelled() => break,
                panic = calls.publish_panicked() => std::panic::resume_unwind(panic),
                _ = inner.clock.sleep_until(wake_at) => by_store,
                // On the monotonic clock too: a wall clock set back must not stretch the sleep.
                _ = tokio::time::sleep(inner.config.poll_interval) => true,
                _ = inner.wake.notified() => true,
                _ = sooner_elsewhere(&mut wakeups, Timestamp::from_millis(wake_before)) => true,
                _ = fenced => false,
            };
            if claims {
                ready.look_again();
            }
        }
        if let Some(claim) = claiming.take() {
            if let Ok(Some(claimed)) = claim.await {
                self.hold(&mut ready, claimed, batch);
            }
        }
        if !ready.is_empty() {
            // Claimable again at their due time (a give-back never makes a timer claimable
            // before it).
            let held = ready.take_all();
            info!(
                timers = held.len(),
                "shutdown; releasing timers claimed ahead of their due time"
            );
            self.give_back(&held, inner.clock.now(), "releasing timers claimed ahead")
                .await;
        }
        // Each call gives its claim back `engine.shutdown_grace` after shutdown at the latest.
        calls.finish().await;
        debug!("firing task stopped");
    }

    /// Starts a claim of what is due within `engine.claim_ahead` on a task of `calls` (so a
    /// join of the live instances waits for it, as for a call); the receiver gets its timers,
    /// or `None` at shutdown.
    fn start_claim(
        &self,
        calls: &mut Calls,
        fence: &CancellationToken,
        shutdown: &CancellationToken,
    ) -> oneshot::Receiver<Option<Claimed>> {
        let (tx, rx) = oneshot::channel();
        let engine = self.clone();
        let (fence, shutdown) = (fence.clone(), shutdown.clone());
        calls.spawn(self, async move {
            let inner = &engine.inner;
            let (ahead, batch) = (inner.config.claim_ahead, inner.config.batch_size);
            let retry = engine.store_retry(&shutdown, "claiming due timers");
            let began = inner.clock.now();
            let claimed = retry
                .until_ok(|| async {
                    let started = Instant::now();
                    let now = inner.clock.now();
                    let due = Due::ahead(now, ahead);
                    let lease = Lease {
                        owner: inner.owner.clone(),
                        until: now.saturating_add(inner.config.lease),
                    };
                    let claimed = inner.store.claim_due(due, batch, &lease).await;
                    ::metrics::histogram!(metric::POLLING_DURATION)
                        .record(started.elapsed().as_secs_f64());
                    // The lease runs out `engine.lease` after `now` was read, at the latest.
                    claimed.map(|timers| Claimed {
                        timers,
                        due,
                        held_until: started + inner.config.lease,
                        fence: fence.clone(),
                    })
                })
                .await;
            if let (Some(spans), Some(claimed)) = (engine.spans(), &claimed) {
                spans.claimed(began, &claimed.timers);
            }
            let _ = tx.send(claimed);
        });
        rx
    }

    /// Holds what a claim took until its due time, unless the membership it was claimed under
    /// ended meanwhile.
    fn hold(&self, ready: &mut Ready, claimed: Claimed, batch: usize) {
        if claimed.fence.is_cancelled() {
            self.abandon(
                claimed.timers,
                "the membership they were claimed under ended",
            );
            return;
        }
        ready.add(
            claimed.timers,
            claimed.due,
            batch,
            claimed.held_until,
            &claimed.fence,
        );
    }

    /// Drops held timers without firing or giving them back: their leases may be another
    /// instance's now, which fires them.
    fn abandon(&self, held: Vec<ClaimedTimer>, why: &str) {
        ::metrics::counter!(metric::CLAIMS_ABANDONED).increment(held.len() as u64);
        warn!(
            timers = held.len(),
            reason = why,
            "dropped timers claimed ahead of their due time; another instance fires them"
        );
    }

    /// Takes the timers over their tenant's fire rate out of `firing` (and their plans out of
    /// `fires`): each is handed back until its turn (`limits.fire_rate`, [`super::pace`]),
    /// with its attempts and due time kept.
    async fn pace(
        &self,
        firing: &mut Vec<ClaimedTimer>,
        fires: &mut Vec<Fire>,
        settled: &mut Vec<(ClaimedTimer, Settlement)>,
        now: Timestamp,
    ) {
        let keys: Vec<&crate::model::TimerKey> = firing.iter().map(|t| &t.key).collect();
        let turns = self.inner.pace.turns(&keys, now).await;
        let mut kept = Vec::with_capacity(firing.len());
        let claimed = std::mem::take(firing)
            .into_iter()
            .zip(std::mem::take(fires));
        for ((t, fire), turn) in claimed.zip(turns) {
            let Some(turn) = turn else {
                kept.push((t, fire));
                continue;
            };
            let labels = [("tenant", t.key.tenant_id.clone())];
            ::metrics::counter!(metric::FIRES_PACED, &labels).increment(1);
            ::metrics::histogram!(metric::FIRE_PACE_DELAY, &labels)
                .record((turn.as_millis() - now.as_millis()).max(0) as f64 / 1000.0);
            settled.push((
                t,
                Settlement::Retry {
                    at: turn,
                    error: None,
                },
            ));
        }
        (*firing, *fires) = kept.into_iter().unzip();
    }

    /// Plans a claimed batch ([`policy::plan`]): settles what does not fire, gives up what
    /// timed out too often, publishes the rest, then settles it; on failure releases it with
    /// backoff.
    async fn fire(
        &self,
        claimed: Vec<ClaimedTimer>,
        held_until: Instant,
        fence: &CancellationToken,
        shutdown: &CancellationToken,
        calls: &mut Calls,
    ) {
        let inner = &self.inner;
        let reached_at = inner.clock.now();
        let mut fires: Vec<Fire> = Vec::with_capacity(claimed.len());
        let mut firing: Vec<ClaimedTimer> = Vec::with_capacity(claimed.len());
        let mut settled: Vec<(ClaimedTimer, Settlement)> = Vec::new();
        let mut giving_up: Vec<GivingUp> = Vec::new();
        for t in claimed {
            match policy::plan(&t, reached_at, inner.config.max_attempts) {
                Plan::Fire(fire) => match self.still_allowed(&t.key, t.target.as_ref()) {
                    Ok(()) => {
                        fires.push(fire);
                        firing.push(t);
                    }
                    // Taken under `targets` patterns that refuse it now: no retry sends it.
                    Err(refused) => giving_up.push(GivingUp::refused(t, refused)),
                },
                Plan::Settle(step) => settled.push((t, Settlement::Step(step))),
                Plan::GiveUp { error } => giving_up.push(GivingUp {
                    timer: t,
                    error,
                    code: "completion_timeout",
                }),
            }
        }
        if !giving_up.is_empty() {
            self.give_up_claimed(giving_up, held_until, fence, shutdown)
                .await;
        }
        if !inner.pace.is_off() {
            self.pace(&mut firing, &mut fires, &mut settled, reached_at)
                .await;
        }
        if !settled.is_empty() {
            self.settle_all(settled, reached_at, shutdown).await;
        }
        // Each claim as its event describes it (due at the occurrence that fires). The
        // envelopes go out, or the timers' own messages with the envelopes' ids; the event
        // stream shows the envelopes either way.
        let n = firing.len();
        let mut batch = Batch {
            claimed: Vec::with_capacity(n),
            fires: Vec::with_capacity(n),
            as_fired: Vec::with_capacity(n),
            envelopes: Vec::with_capacity(n),
            events: Vec::with_capacity(n),
            spans: Vec::new(),
            reached_at,
            held_until,
            fence: fence.clone(),
            shutdown: shutdown.clone(),
        };
        for (claim, fire) in firing.into_iter().zip(fires) {
            let caller = self.called(&claim);
            let (fired, envelope, event, span) =
                self.outgoing(&claim, &fire, reached_at, caller.as_deref());
            if let Some(caller) = caller {
                let one = OneCall {
                    claim,
                    fire,
                    as_fired: fired,
                    envelope,
                    event,
                    reached_at,
                    held_until,
                    fence: fence.clone(),
                    shutdown: shutdown.clone(),
                    span,
                };
                self.start_call(calls, caller, one);
                continue;
            }
            batch.claimed.push(claim);
            batch.fires.push(fire);
            batch.as_fired.push(fired);
            batch.envelopes.push(envelope);
            batch.events.push(event);
            batch.spans.extend(span);
        }
        if !batch.claimed.is_empty() {
            self.start_publish(calls, batch);
        }
    }

    /// Counts and streams the fires the broker confirmed.
    pub(super) fn announce(
        &self,
        claimed: &[ClaimedTimer],
        envelopes: Vec<DueTimeReachedEnvelope>,
        at: Timestamp,
    ) {
        ::metrics::counter!(metric::TIMERS_FIRED).increment(claimed.len() as u64);
        for (timer, envelope) in claimed.iter().zip(envelopes) {
            // A timer scheduled when already past due is late only from when it arrived.
            let due = timer.due_at.max(timer.registered_at);
            let late = at.duration_since(due);
            ::metrics::histogram!(metric::FIRE_LATENESS).record(late.as_secs_f64());
            let late_ms = u64::try_from(late.as_millis()).unwrap_or(u64::MAX);
            self.inner.recent.record(at, &timer.key.tenant_id, late_ms);
            self.inner.fired.send(super::FiredEvent {
                tenant_id: timer.key.tenant_id.clone(),
                json: String::from_utf8(envelope.to_json()).unwrap_or_default(),
            });
        }
    }

    /// Runs a send to the broker, but never for longer than `engine.publish_timeout`: a stuck
    /// broker cannot hold the firing task (nor keep a timer "firing" for a cancel) for longer.
    pub(super) async fn within_publish_timeout<F, T>(&self, what: &str, send: F) -> Result<T>
    where
        F: Future<Output = Result<T>>,
    {
        let deadline = self.inner.config.publish_timeout;
        match tokio::time::timeout(deadline, send).await {
            Ok(result) => result,
            Err(_) => Err(Error::unavailable(format!(
                "{what} timed out after {} (engine.publish_timeout)",
                humantime::format_duration(deadline)
            ))),
        }
    }
}

impl Engine {
    /// A claim as its event describes it (due at the occurrence that fires), its envelope,
    /// what goes out for it (through the broker, or `caller`), and its `publish` span when the
    /// engine makes spans: the event carries the span's context.
    fn outgoing(
        &self,
        claim: &ClaimedTimer,
        fire: &Fire,
        reached_at: Timestamp,
        caller: Option<&dyn crate::call::Caller>,
    ) -> (
        ClaimedTimer,
        DueTimeReachedEnvelope,
        OutboundEvent,
        Option<BoxedSpan>,
    ) {
        let mut as_fired = fire.claim(claim);
        let span = self.spans().map(|spans| {
            let id = crate::wire::refired_event_id(&as_fired, fire.refire);
            let broker = &self.inner.broker;
            let (system, destination) = match (&as_fired.target, caller) {
                // The origin of an HTTP target: a URL's path and query may carry what a
                // tracing backend should not keep, and would name a span per timer.
                (Some(target), Some(caller)) => (
                    "http",
                    caller.check_target(target).ok().map(|name| {
                        url::Url::parse(&name)
                            .map_or(name, |url| url.origin().ascii_serialization())
                    }),
                ),
                (Some(target), None) => (broker.name(), broker.check_target(target).ok()),
                (None, _) => (broker.name(), broker.events_destination(&as_fired.key)),
            };
            spans.publish(&as_fired, system, destination, &id)
        });
        if let Some(context) = span.as_ref().and_then(spans::context_of) {
            as_fired.trace = Some(context);
        }
        outgoing(as_fired, fire, reached_at, span)
    }
}

/// [`Engine::outgoing`] once the span is made.
fn outgoing(
    mut as_fired: ClaimedTimer,
    fire: &Fire,
    reached_at: Timestamp,
    span: Option<BoxedSpan>,
) -> (
    ClaimedTimer,
    DueTimeReachedEnvelope,
    OutboundEvent,
    Option<BoxedSpan>,
) {
    // A timer stored before trace contexts were kept: each fire a trace of its own.
    as_fired.trace.get_or_insert_with(TraceContext::fresh);
    let envelope = DueTimeReachedEnvelope::for_fire(&as_fired, reached_at, fire.refire);
    let event = outbound_of(
        as_fired.key.clone(),
        envelope.id,
        envelope.to_json(),
        as_fired.target.clone(),
        as_fired.message.clone(),
        as_fired.trace.clone(),
    );
    (as_fired, envelope, event, span)
}

/// What goes to the broker for a fire with the event `id`: the `envelope` to the events
/// destination, unless the timer has a `target` (where it goes instead) or a `message` (what
/// goes instead of the envelope, with the same id); in the timer's `trace`.
pub(super) fn outbound_of(
    key: TimerKey,
    id: uuid::Uuid,
    envelope: Vec<u8>,
    target: Option<Target>,
    message: Option<Message>,
    trace: Option<TraceContext>,
) -> OutboundEvent {
    let (body, message) = match message {
        Some(Message { body, meta }) => (body, Some(meta)),
        None => (envelope, None),
    };
    OutboundEvent {
        id,
        key,
        body,
        target,
        message,
        trace,
    }
}

/// What a claim took: its timers, the window it claimed, until when their leases surely run,
/// and the fence of the membership it was made under.
struct Claimed {
    timers: Vec<ClaimedTimer>,
    due: Due,
    held_until: Instant,
    fence: CancellationToken,
}

/// Sleeps until `at` on `clock`; never returns without a time.
async fn sleep_until(clock: &dyn crate::clock::Clock, at: Option<Timestamp>) {
    match at {
        Some(at) => clock.sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Returns when the store reports a timer (scheduled by any instance) due before `wake_at`, or
/// when notices were lost (replan to be safe). Never returns without a wake-up channel.
async fn sooner_elsewhere(
    wakeups: &mut Option<broadcast::Receiver<Timestamp>>,
    wake_at: Timestamp,
) {
    loop {
        let Some(rx) = wakeups.as_mut() else {
            return std::future::pending().await;
        };
        match rx.recv().await {
            Ok(due) if due < wake_at => return,
            Ok(_) => {}
            Err(broadcast::error::RecvError::Lagged(_)) => return,
            Err(broadcast::error::RecvError::Closed) => *wakeups = None,
        }
    }
}
