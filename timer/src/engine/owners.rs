//! Being a lease owner: membership in the store's live instances ([`LeaseOwners`]), taking
//! over the leases of dead ones, and holding the leases of a publish in flight.
//!
//! - The firing task claims only while this instance is a member: `member` hands it a fence
//!   (a cancellation token) that is cancelled the moment the membership is lost; a publish in
//!   flight then stops at once and its claims are left alone (another instance, or this one
//!   after joining again, releases them once `LeaseOwners::lost_within` has passed).
//! - A store without the ability (memory, SQLite) has one membership for the life of the
//!   engine, never lost.
//! - Joining again waits until the firing task is done with its batch: a batch whose publish
//!   the broker confirmed is settled (the settle waits for an unreachable store), so only
//!   what was abandoned is released by the join and fires again.
//! - While a publish runs, its leases are renewed every third of `engine.lease`; if renewals
//!   fail until less than a fifth of the lease is left, the publish is abandoned before the
//!   lease can run out, so no other instance claims a timer this one still publishes.

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::{metrics as metric, Engine};
use crate::model::{ClaimedTimer, TimerKey};
use crate::store::{LeaseOwners, Membership};

/// Why a publish stopped when the membership was lost.
const FENCED: &str = "this instance may no longer count as alive in the store";

/// Whether a membership state is a live one: joined, and its fence not cancelled.
fn live(member: &Option<CancellationToken>) -> bool {
    member.as_ref().is_some_and(|fence| !fence.is_cancelled())
}

/// How often an instance looks for dead instances to take over.
pub const TAKE_OVER_EVERY: Duration = Duration::from_millis(250);

impl Engine {
    /// Joins the store's live instances now, so that a name in use by another running instance
    /// stops the start with its error instead of being retried. The engine joins by itself
    /// when started without it.
    pub async fn join(&self) -> crate::Result<()> {
        let Some(owners) = self.inner.store.lease_owners() else {
            return Ok(());
        };
        let membership = self.join_now(owners).await?;
        if let Ok(mut joined) = self.inner.joined.lock() {
            *joined = Some(membership);
        }
        Ok(())
    }

    /// Joins as this instance's owner name; its leftover leases are claimable once a live
    /// instance that lost its membership has surely stopped firing them.
    async fn join_now(&self, owners: &dyn LeaseOwners) -> crate::Result<Box<dyn Membership>> {
        let release_at = self.inner.clock.now().saturating_add(owners.lost_within());
        let (release, started_at) = (self.release(), self.inner.started_at);
        owners
            .join(&self.inner.owner, release, started_at, release_at)
            .await
    }

    /// Whether this instance is a live member of the store's instances now (always, once
    /// started, for a store without [`LeaseOwners`]); it claims timers only while it is one.
    pub fn is_member(&self) -> bool {
        live(&self.inner.member.borrow())
    }

    /// Waits until this instance is a member of the store's live instances; the fence that is
    /// cancelled when it stops being one. `None` at shutdown.
    pub(super) async fn member(&self, shutdown: &CancellationToken) -> Option<CancellationToken> {
        let mut rx = self.inner.member.subscribe();
        tokio::select! {
            _ = shutdown.cancelled() => None,
            fence = rx.wait_for(live) => {
                fence.ok().and_then(|f| f.clone())
            }
        }
    }

    /// Keeps this instance a member: joins (unless [`Engine::join`] did), and when the
    /// membership is lost, fences the firing task and joins again.
    pub(super) async fn membership_loop(self, shutdown: CancellationToken) {
        let inner = &self.inner;
        let Some(owners) = inner.store.lease_owners() else {
            return;
        };
        let retry = self.store_retry(&shutdown, "joining the store's live instances");
        let mut joined = inner.joined.lock().ok().and_then(|mut j| j.take());
        loop {
            let mut membership = match joined.take() {
                Some(m) => m,
                None => {
                    // A batch this instance published settles first (its settle waits for the
                    // store like the join does); what it abandoned is released by the join.
                    let _idle = tokio::select! {
                        _ = shutdown.cancelled() => return,
                        idle = async {
                            let idle = inner.firing.lock().await;
                            // And the calls it started (each holds its lease meanwhile).
                            self.no_calls().await;
                            idle
                        } => idle,
                    };
                    let join = retry.until_ok(|| self.join_now(owners)).await;
                    let Some(m) = join else { return };
                    info!(instance = %inner.owner, "joined the store's live instances");
                    m
                }
            };
            let fence = CancellationToken::new();
            inner.member.send_replace(Some(fence.clone()));
            let lost = tokio::select! {
                _ = shutdown.cancelled() => {
                    // Left after the firing task gave its claims back (`Engine::start`).
                    if let Ok(mut j) = inner.joined.lock() {
                        *j = Some(membership);
                    }
                    return;
                }
                e = membership.lost() => e,
            };
            fence.cancel();
            inner.member.send_replace(None);
            ::metrics::counter!(metric::MEMBERSHIP_LOST).increment(1);
            warn!(error = %lost.chain(), "this instance may no longer count as alive in the store: stopped firing its claims; joining again");
        }
    }

    /// Every [`TAKE_OVER_EVERY`], releases the leases of instances that died.
    pub(super) async fn take_over_loop(self, shutdown: CancellationToken) {
        let inner = &self.inner;
        let Some(owners) = inner.store.lease_owners() else {
            return;
        };
        let mut tick = tokio::time::interval(TAKE_OVER_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            if !self.is_member() {
                continue;
            }
            let release_at = inner.clock.now().saturating_add(owners.lost_within());
            match owners.take_over(release_at).await {
                Ok(taken) => {
                    failing = false;
                    let mut released = 0;
                    for t in &taken {
                        released += t.leases;
                        info!(dead = %t.owner, leases = t.leases, "took over the leases of an instance that died; its timers fire now");
                    }
                    if released > 0 {
                        ::metrics::counter!(metric::LEASES_TAKEN_OVER).increment(released);
                        inner.wake.notify_one();
                    }
                }
                Err(e) if !failing => {
                    failing = true;
                    warn!(error = %e.chain(), "looking for dead instances failed; trying again");
                }
                Err(e) => debug!(error = %e.chain(), "looking for dead instances failed"),
            }
        }
    }

    /// Runs `work` (a publish, a call) on `claimed` while holding their leases
    /// ([`hold_leases`](Self::hold_leases)): stopped when the leases may be lost, and at
    /// shutdown once `engine.shutdown_grace` has passed. The leases come first: work claimed as
    /// the membership was lost is not done, nor work whose leases ran out (or nearly) while the
    /// claim waited (for room to publish, behind a slow broker) and could not be renewed before
    /// it starts: another instance may have claimed the timers by then, or a cancel taken them.
    pub(super) async fn while_leased<T>(
        &self,
        claimed: &[ClaimedTimer],
        mut held_until: Instant,
        fence: &CancellationToken,
        shutdown: &CancellationToken,
        work: impl std::future::Future<Output = T>,
    ) -> Leased<T> {
        if held_until.saturating_duration_since(Instant::now()) <= self.inner.config.lease / 5 {
            match self.renew_first(claimed, fence).await {
                Ok(until) => held_until = until,
                Err(why) => return Leased::Abandoned(why),
            }
        }
        let grace = self.inner.config.shutdown_grace;
        tokio::select! {
            biased;
            why = self.hold_leases(claimed, held_until, fence) => Leased::Abandoned(why),
            done = work => Leased::Done(done),
            _ = async { shutdown.cancelled().await; tokio::time::sleep(grace).await } => {
                Leased::Shutdown
            }
        }
    }

    /// Renews the leases of `claimed` before their work starts, when they ran out or nearly:
    /// `Ok` with when they run out now, once every one is this instance's again; `Err` says why
    /// not (then nothing is done with them: the timers this renewal took back are claimed again
    /// once their lease ends).
    async fn renew_first(
        &self,
        claimed: &[ClaimedTimer],
        fence: &CancellationToken,
    ) -> Result<Instant, String> {
        let inner = &self.inner;
        if fence.is_cancelled() {
            return Err(FENCED.to_owned());
        }
        let keys: Vec<TimerKey> = claimed.iter().map(|t| t.key.clone()).collect();
        let sent = Instant::now();
        let until = inner.clock.now().saturating_add(inner.config.lease);
        match self
            .bounded(inner.store.renew(&keys, &inner.owner, until))
            .await
        {
            Ok(n) if n as usize == keys.len() => Ok(sent + inner.config.lease),
            Ok(n) => Err(format!(
                "{} of {} leases ran out while the claim waited to be fired, and were taken \
                 over or their timers changed",
                keys.len() - n as usize,
                keys.len()
            )),
            Err(e) => Err(format!(
                "the leases ran out while the claim waited to be fired, and renewing them \
                 failed: {}",
                e.chain()
            )),
        }
    }

    /// Holds the leases of a publish in flight: renews them every third of `engine.lease`.
    /// Returns only when they may be lost, saying why: the membership was lost (`fence`), or
    /// renewals failed until less than a fifth of the lease was left. `held_until` is when the
    /// claim's lease runs out, on the monotonic clock.
    pub(super) async fn hold_leases(
        &self,
        claimed: &[ClaimedTimer],
        mut held_until: Instant,
        fence: &CancellationToken,
    ) -> String {
        let inner = &self.inner;
        let lease = inner.config.lease;
        let keys: Vec<TimerKey> = claimed.iter().map(|t| t.key.clone()).collect();
        let mut next = held_until.checked_sub(lease * 2 / 3).unwrap_or(held_until);
        loop {
            tokio::select! {
                biased;
                _ = fence.cancelled() => {
                    return FENCED.to_owned();
                }
                _ = tokio::time::sleep_until(next) => {}
            }
            let sent = Instant::now();
            let until = inner.clock.now().saturating_add(lease);
            let left = held_until.saturating_duration_since(sent);
            let renewed = tokio::select! {
                biased;
                _ = fence.cancelled() => {
                    return FENCED.to_owned();
                }
                r = tokio::time::timeout(left, inner.store.renew(&keys, &inner.owner, until)) => r,
            };
            match renewed {
                Ok(Ok(n)) if n as usize == keys.len() => {
                    held_until = sent + lease;
                    next = sent + lease / 3;
                    continue;
                }
                Ok(Ok(n)) => {
                    return format!(
                        "{} of {} leases were taken over while publishing",
                        keys.len() - n as usize,
                        keys.len()
                    );
                }
                Ok(Err(e)) => {
                    warn!(error = %e.chain(), timers = keys.len(), "renewing the leases of a publish in flight failed; trying again")
                }
                Err(_) => warn!(
                    timers = keys.len(),
                    "renewing the leases of a publish in flight took too long"
                ),
            }
            let now = Instant::now();
            if held_until.saturating_duration_since(now) <= lease / 5 {
                return "their leases could not be renewed and were about to run out".to_owned();
            }
            next = now + lease / 10;
        }
    }
}

/// How work done while holding leases ended ([`Engine::while_leased`]).
pub(super) enum Leased<T> {
    Done(T),
    /// Its leases could be lost (why): stopped, left alone.
    Abandoned(String),
    /// Shutdown, and the work did not end within the grace.
    Shutdown,
}
