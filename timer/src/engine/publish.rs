//! A fired batch's publish, on a task of its own. The firing task hands each batch it fires
//! through the broker to a task of [`Calls`] and goes on firing what comes due meanwhile: a
//! broker's confirm takes milliseconds (NATS, RabbitMQ, Kafka), and a timer due during it would
//! otherwise wait for it. The task holds the batch's leases while it publishes (renewed), then
//! announces and settles what the broker confirmed, and releases the rest for a retry, as the
//! firing task did before.
//!
//! Invariants:
//! - Publish before settle, per batch: a batch is settled only after its own confirm, so a
//!   crash anywhere repeats events, never loses one. Batches in flight together are
//!   independent (different timers, each leased); nothing orders their events among each other.
//! - Bounded: at most `engine.batch_size` timers are being published at once
//!   ([`InFlight::sending`]: a fire takes no more than the room left); so a herd's full batches
//!   still go one after another, and a steady stream of small fires overlaps its confirms.
//! - A claim waits until the batches fired before it was due to start are settled (published,
//!   and what became of them written; [`InFlight::unsettled`]), as when the firing task
//!   published each batch itself; batches fired while it waits do not hold it longer. On a
//!   store with one writer a claim waits behind every settle queued before it, so a deeper
//!   pipeline made a herd's claims (and the other tenants' timers due meanwhile) later: others'
//!   p50 during a 50,000 herd 9 ms with one batch unwritten, 150 ms with two, 135 ms with four
//!   (BENCHMARKS.md, "Claiming ahead"). Waiting for only a batch's worth of unwritten timers (a
//!   fair claim's due part is less) made others' p99 in `bench --workload fairness` 45 ms
//!   (median of nine) against 8.
//! - But a claim waits for a broker's confirm at most a fifth of `engine.claim_ahead` (10 ms);
//!   then only for the batches the broker answered ([`InFlight::answered`]). Waiting for every
//!   confirm held claims past `engine.claim_ahead` on a slow broker (delayed messages through
//!   tansu fired p99 190 ms late; 5 ms with a claim_ahead of 500 ms); never waiting for one let
//!   a claim start before the settle of the batch just fired was queued (the memory broker
//!   confirms at once), and the others' p99 in `fairness` went from 7 to 32 ms (medians of
//!   five).
//! - Counted as a call while it runs ([`Calls::spawn`]): joining the live instances again and
//!   leaving wait for it, and the firing task waits for it when it stops; aborted with it. A
//!   publish that panics panics the firing task (supervised: reported down, started again),
//!   as when the firing task published itself.
//! - The firing task is not reported asleep ([`Engine::asleep_until`]) while a publish runs or
//!   its outcome is not yet out ([`InFlight::landing`]: fires announced, refusals released).
//! - A batch's settle is queued before the timers the broker refused are released: a give-up
//!   (a dead letter each) may take long, and the delivered timers' leases are no longer renewed
//!   meanwhile.

use std::collections::BTreeSet;

use opentelemetry::global::BoxedSpan;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::call::Calls;
use super::owners::Leased;
use super::{metrics as metric, spans, Engine};
use crate::broker::{OutboundEvent, Undelivered};
use crate::error::Result;
use crate::model::{ClaimedTimer, TimerState, Timestamp};
use crate::policy::{self, Fire};
use crate::store::Settlement;
use crate::wire::DueTimeReachedEnvelope;

/// What the firing task's publishes hold now.
#[derive(Debug, Default)]
pub(super) struct InFlight {
    /// Timers being published: handed to the broker, not yet confirmed or failed.
    sending: usize,
    /// How many batches were fired through the broker so far (the number of the last one).
    fired: u64,
    /// The numbers of the fired batches not yet settled: being published, or answered and what
    /// became of them (settle or release) not yet written.
    unsettled: BTreeSet<u64>,
    /// Those of them the broker answered.
    answered: BTreeSet<u64>,
    /// Batches answered whose outcome is not yet out: announced (the event stream, the counts)
    /// and, for what the broker refused, released or given up.
    landing: usize,
}

impl InFlight {
    /// Whether no batch fired up to the one numbered `n` is unsettled; or, with `confirms`
    /// false, none the broker answered.
    fn settled_through(&self, n: u64, confirms: bool) -> bool {
        let set = if confirms {
            &self.unsettled
        } else {
            &self.answered
        };
        set.first().is_none_or(|&first| first > n)
    }
}

/// A batch's place in the engine's [`InFlight`]: counted as sending until
/// [`sent`](Self::sent), then answered and landing until [`landed`](Self::landed); unsettled
/// until dropped (so a task that ends by a panic or an abort leaves nothing counted).
struct Fired {
    engine: Engine,
    number: u64,
    /// Its timers while they count as being sent.
    sending: usize,
    /// Counted in [`InFlight::landing`].
    landing: bool,
}

impl Fired {
    fn new(engine: &Engine, timers: usize) -> Self {
        let mut number = 0;
        engine.inner.in_flight.send_modify(|f| {
            f.fired += 1;
            number = f.fired;
            f.sending += timers;
            f.unsettled.insert(number);
        });
        Fired {
            engine: engine.clone(),
            number,
            sending: timers,
            landing: false,
        }
    }

    /// The broker answered (or the publish ended otherwise): room for the next fire; the
    /// batch's outcome goes out next ([`landed`](Self::landed)), then it is written.
    fn sent(&mut self) {
        let timers = std::mem::take(&mut self.sending);
        if timers > 0 {
            let number = self.number;
            self.landing = true;
            self.engine.inner.in_flight.send_modify(|f| {
                f.sending -= timers;
                f.answered.insert(number);
                f.landing += 1;
            });
        }
    }

    /// The batch's outcome is out: its fires announced, what the broker refused released.
    fn landed(&mut self) {
        if std::mem::take(&mut self.landing) {
            self.engine.inner.in_flight.send_modify(|f| f.landing -= 1);
        }
    }
}

impl Drop for Fired {
    fn drop(&mut self) {
        let (number, timers, landing) = (self.number, self.sending, self.landing);
        self.engine.inner.in_flight.send_modify(|f| {
            f.sending -= timers;
            f.landing -= usize::from(landing);
            f.unsettled.remove(&number);
            f.answered.remove(&number);
        });
    }
}

/// A fired batch on its way to the broker: each claim with its plan, as its event describes it,
/// its envelope (what the event stream shows), what goes out, and the `publish` spans; when it
/// fired, until when the leases are surely held, and the firing task's fence and shutdown.
pub(super) struct Batch {
    pub claimed: Vec<ClaimedTimer>,
    pub fires: Vec<Fire>,
    pub as_fired: Vec<ClaimedTimer>,
    pub envelopes: Vec<DueTimeReachedEnvelope>,
    pub events: Vec<OutboundEvent>,
    pub spans: Vec<BoxedSpan>,
    pub reached_at: Timestamp,
    pub held_until: Instant,
    pub fence: CancellationToken,
    pub shutdown: CancellationToken,
}

impl Engine {
    /// How many timers a fire may start publishing now: `batch` less those being published.
    pub(super) fn room_to_publish(&self, batch: usize) -> usize {
        batch.saturating_sub(self.inner.in_flight.borrow().sending)
    }

    /// Returns when there is room to publish ([`room_to_publish`](Self::room_to_publish) above 0).
    pub(super) async fn room_made(&self, batch: usize) {
        let mut in_flight = self.inner.in_flight.subscribe();
        // The sender lives in `inner`, as long as `self`.
        let _ = in_flight.wait_for(|f| f.sending < batch).await;
    }

    /// The number of the last batch fired through the broker (0 before the first).
    pub(super) fn last_fired(&self) -> u64 {
        self.inner.in_flight.borrow().fired
    }

    /// Whether every batch fired up to the one numbered `n` is settled; or, with `confirms`
    /// false, every one of them the broker answered.
    pub(super) fn settled_through(&self, n: u64, confirms: bool) -> bool {
        self.inner.in_flight.borrow().settled_through(n, confirms)
    }

    /// Returns when [`settled_through`](Self::settled_through).
    pub(super) async fn settled(&self, n: u64, confirms: bool) {
        let mut in_flight = self.inner.in_flight.subscribe();
        let _ = in_flight.wait_for(|f| f.settled_through(n, confirms)).await;
    }

    /// Whether a publish runs now, or one whose outcome is not yet out.
    pub(super) fn publishing(&self) -> bool {
        let f = self.inner.in_flight.borrow();
        f.sending > 0 || f.landing > 0
    }

    /// Publishes `batch` on a task of `calls`, counted as being sent from now on.
    pub(super) fn start_publish(&self, calls: &mut Calls, batch: Batch) {
        let fired = Fired::new(self, batch.claimed.len());
        let engine = self.clone();
        calls.spawn_publish(self, async move { engine.publish(batch, fired).await });
    }

    /// Publishes a batch within `engine.publish_timeout` while holding its leases; announces and
    /// settles what the broker confirmed, releases what it refused with backoff, and gives the
    /// batch back at shutdown if the broker does not confirm within `engine.shutdown_grace`.
    async fn publish(&self, batch: Batch, mut fired: Fired) {
        let inner = &self.inner;
        let Batch {
            claimed,
            fires,
            as_fired,
            envelopes,
            events,
            spans,
            reached_at,
            held_until,
            fence,
            shutdown,
        } = batch;
        let publish = self.within_publish_timeout("publishing", inner.broker.publish(&events));
        let published = self
            .while_leased(&claimed, held_until, &fence, &shutdown, publish)
            .await;
        // Room for the next fire; the batch counts as unwritten until what became of it is.
        fired.sent();
        end_spans(&published, spans);
        match published {
            Leased::Abandoned(why) => {
                // Not settled, not given back: the leases may be another instance's by now
                // (or a new claim of this one's, after it joined again).
                ::metrics::counter!(metric::CLAIMS_ABANDONED).increment(claimed.len() as u64);
                warn!(timers = claimed.len(), reason = %why, "stopped publishing a batch whose leases could be lost; another instance fires it");
            }
            Leased::Done(Ok(undelivered)) => {
                let mut refused: Vec<Option<Undelivered>> = std::iter::repeat_with(|| None)
                    .take(claimed.len())
                    .collect();
                for undelivered in undelivered {
                    if let Some(slot) = refused.get_mut(undelivered.index) {
                        *slot = Some(undelivered);
                    }
                }
                let mut delivered = Delivered::default();
                let mut failed = Vec::new();
                let mut deferred = Vec::new();
                let batch = claimed.into_iter().zip(fires).zip(as_fired).zip(envelopes);
                for ((((claim, fire), as_fired), envelope), refusal) in batch.zip(refused) {
                    match refusal {
                        None => delivered.push(claim, fire, as_fired, envelope),
                        Some(u) if u.deferred => deferred.push((claim, u.error.chain())),
                        Some(u) => failed.push((claim, u.error.chain())),
                    }
                }
                self.announce(&delivered.as_fired, delivered.envelopes, reached_at);
                let settlements = delivered
                    .fired
                    .into_iter()
                    .map(|(t, fire)| {
                        let settlement = policy::fired(&t, &fire, reached_at, &inner.owner, None);
                        (t, settlement)
                    })
                    .collect();
                // Queued before the refused ones are released: their leases are no longer
                // renewed, and a give-up (a dead letter each) may take long.
                let written = self.settle_behind(settlements, &shutdown);
                if let Some((timer, error)) = failed.first() {
                    ::metrics::counter!(metric::PUBLISH_FAILURES).increment(failed.len() as u64);
                    warn!(broker = inner.broker.name(), timer = %timer.key, trace_id = timer.trace_id(), error = %error, timers = failed.len(), "the broker refused events of a batch (it confirmed the others); releasing them for a retry");
                    self.release_with_backoff(failed).await;
                    // Claimable after a backoff: the firing task plans again.
                    self.wake_by(inner.clock.now());
                }
                if let Some((timer, why)) = deferred.first() {
                    // Not tried: claimable again at once, no attempt counted (the broker takes
                    // up some more of what it left in each publish).
                    debug!(broker = inner.broker.name(), timer = %timer.key, why = %why, timers = deferred.len(), "the broker left events of a batch for a later publish; releasing them");
                    let now = inner.clock.now();
                    let (deferred, _): (Vec<ClaimedTimer>, Vec<String>) =
                        deferred.into_iter().unzip();
                    self.give_back(&deferred, now, "releasing timers the broker left for later")
                        .await;
                    self.wake_by(now);
                }
                fired.landed();
                written.await;
            }
            Leased::Done(Err(e)) => {
                ::metrics::counter!(metric::PUBLISH_FAILURES).increment(claimed.len() as u64);
                let message = e.chain();
                warn!(broker = inner.broker.name(), error = %message, timers = claimed.len(), "publishing events failed; releasing the timers for a retry");
                let failed = claimed.into_iter().map(|t| (t, message.clone())).collect();
                self.release_with_backoff(failed).await;
                self.wake_by(inner.clock.now());
            }
            Leased::Shutdown => {
                info!(
                    timers = claimed.len(),
                    "shutdown while publishing; releasing claims"
                );
                self.give_back(&claimed, inner.clock.now(), "releasing claims at shutdown")
                    .await;
            }
        }
    }

    /// Queues the settle of a published batch, written with whatever else waits in the settle
    /// queue (calls, other batches) in one transaction; what it returns ends once it is written.
    /// The batch counts as unwritten until then.
    fn settle_behind(
        &self,
        settled: Vec<(ClaimedTimer, Settlement)>,
        shutdown: &CancellationToken,
    ) -> impl std::future::Future<Output = ()> + '_ {
        let next = settled.iter().filter_map(|(_, s)| claimable_again(s)).min();
        // None: nothing to write, or the queue is poisoned (the leases expire and the timers
        // fire again).
        let written = if settled.is_empty() {
            None
        } else {
            self.queue_settles(settled, shutdown)
        };
        async move {
            let Some(written) = written else {
                return;
            };
            let _ = written.await;
            // A series' next occurrence: the firing task planned while the row was leased.
            if let Some(at) = next {
                self.wake_by(at);
            }
        }
    }
}

/// When a settled claim is claimable again, if it stays Scheduled (a series' next occurrence).
pub(super) fn claimable_again(settlement: &Settlement) -> Option<Timestamp> {
    match settlement {
        Settlement::Next(at) => Some(*at),
        Settlement::Step(step) if step.state == TimerState::Scheduled => Some(step.available_at),
        _ => None,
    }
}

/// The part of a published batch the broker confirmed: each claim with its fire, as its event
/// describes it, and the event.
#[derive(Default)]
struct Delivered {
    fired: Vec<(ClaimedTimer, Fire)>,
    as_fired: Vec<ClaimedTimer>,
    envelopes: Vec<DueTimeReachedEnvelope>,
}

impl Delivered {
    fn push(
        &mut self,
        claim: ClaimedTimer,
        fire: Fire,
        as_fired: ClaimedTimer,
        envelope: DueTimeReachedEnvelope,
    ) {
        self.fired.push((claim, fire));
        self.as_fired.push(as_fired);
        self.envelopes.push(envelope);
    }
}

/// Ends the `publish` spans of a batch (in its order) as its publish ended.
fn end_spans(published: &Leased<Result<Vec<Undelivered>>>, spans: Vec<BoxedSpan>) {
    use opentelemetry::trace::Span as _;
    if spans.is_empty() {
        return;
    }
    let all_failed = match published {
        Leased::Done(Ok(_)) => None,
        Leased::Done(Err(e)) => Some(e.chain()),
        Leased::Abandoned(why) => Some(format!("abandoned: {why}")),
        Leased::Shutdown => Some("shutdown before the broker confirmed".to_owned()),
    };
    let mut refused: Vec<Option<String>> = vec![all_failed; spans.len()];
    if let Leased::Done(Ok(undelivered)) = published {
        for Undelivered { index, error, .. } in undelivered {
            if let Some(slot) = refused.get_mut(*index) {
                *slot = Some(error.chain());
            }
        }
    }
    for (mut span, refusal) in spans.into_iter().zip(refused) {
        match refusal {
            None => span.end(),
            Some(error) => spans::failed(span, error),
        }
    }
}
