//! Fair claims: when more timers are due than one claim takes, the claim is shared between the
//! tenants that have due timers, so one tenant's herd does not make another tenant's timers
//! wait behind it. Every store claims through [`FairShare::claim`]; a store supplies four
//! steps ([`FairSteps`]), each bounded by an index, so no claim scans the due set.
//!
//! # The claim
//! - **No backlog** (the previous claim took fewer rows than it could, and no more rows are due
//!   within the shares' window, below, than this one takes): the claim takes the earliest due
//!   rows, whoever they belong to, as a store without fairness would. Everything due fits, so
//!   no tenant waits behind another. Knowing that costs one read of at most `limit + 1` index
//!   entries ([`FairSteps::more_due_than`]). The previous claim alone cannot tell, since a herd
//!   comes due between two claims; and the read looks as far as the shares do, so a herd is
//!   seen coming: its first claims are shared while it is not yet in the claim's own window
//!   (cheap: the shares, and no herd in the fill), and the other tenants' timers due with it
//!   and just after are held before the herd's first full claim. That claim comes back late
//!   on a busy store (three instances on two cores: 60-100 ms after the herd's due time), and
//!   with a window of the claim's own every other timer due by then waited for it.
//! - **Backlog** (the previous claim was full, or more rows are due within the shares' window
//!   than this claim takes): the claim first visits tenants that have Scheduled rows, in tenant
//!   id order from a cursor, at most `limit` of them, and keeps those with a due row. It takes
//!   an equal share of `limit` (the shares add up to `limit`) of each one's earliest due rows,
//!   then fills what is left of the batch (the shares of tenants with fewer due rows) with the
//!   earliest due rows of anyone, so a herd alone still fills every batch. When the visit
//!   stopped at its bound, the next claim starts after the last tenant visited; otherwise it
//!   starts from the first tenant again.
//! - **The shares look further ahead in a backlog.** Claims then come one batch's firing apart
//!   (the firing task claims again only when what it holds is fired), which is longer than
//!   `engine.claim_ahead` under a herd: a timer first due just after one claim's window would wait
//!   for the next claim, late by up to that interval. So the shares' window is [`BACKLOG_WINDOWS`]
//!   times the claim's (400 ms for `engine.claim_ahead` 50 ms; nothing for 0: eight, as a herd's
//!   first claims showed that the next claim may come back two batches' firing later, 250-400 ms
//!   with three instances on two cores), or [`CLAIM_GAPS`] times the time since the previous claim
//!   of the backlog when that is longer (claims on a busy store come further apart, and the next
//!   one about as far), at most a fifth of the lease, for every tenant visited: the timers the
//!   next claims would share out are leased now and held until their due time (`engine/ready.rs`),
//!   whatever the herd's batches take. The fill keeps the claim's own window.
//!
//! # Invariants
//! - A claim never takes more than `limit` rows, and takes `limit` whenever that many are due
//!   (the fill), so fairness costs the herd no throughput.
//! - Within a tenant, rows are claimed earliest `available_at` first (both steps take a tenant's
//!   earliest; the fill takes anyone's earliest).
//! - In a backlog, a tenant with a due row is served by the next claim when at most `limit`
//!   tenants have Scheduled rows, and within ⌈tenants / limit⌉ claims otherwise, whatever other
//!   tenants have due; so it waits about one claim batch, the first of a backlog included.
//! - Nothing is starved: every claim's fill serves the earliest due rows of all.
//! - Nothing is claimed further ahead than the claim's window, or in a backlog eight times it or
//!   twice the time since the previous claim (and at most a fifth of the lease); what is claimed
//!   ahead is only ever a first due time ([`Due::takes`]), so it is held, not fired early.
//! - Each instance keeps its own cursor and backlog flag (memory, not shared): several
//!   instances each share their own claims the same way, and the store's row locks keep their
//!   claims apart as before.

use std::sync::Mutex;

use async_trait::async_trait;
use tracing::warn;

use crate::error::Result;
use crate::model::{ClaimedTimer, Due, Lease, Timestamp};

/// One tenant visited by [`FairSteps::visit_tenants`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Visited {
    pub tenant: String,
    /// It has a claimable row (Scheduled, `available_at` at or before now).
    pub due: bool,
}

/// The four steps of a fair claim, each in the store's terms.
#[async_trait]
pub trait FairSteps: Send + Sync {
    /// Leases up to `limit` rows `due` takes, earliest `available_at` first, whoever they
    /// belong to: the claim of a store without fairness.
    async fn claim_earliest(
        &self,
        due: Due,
        limit: usize,
        lease: &Lease,
    ) -> Result<Vec<ClaimedTimer>>;

    /// Up to `visits` tenants with Scheduled rows whose id sorts after `after` (byte order;
    /// `""`: from the first), in that order, each saying whether it has a claimable row. One
    /// index probe or two per tenant: the cost does not grow with the number of due rows.
    /// (`now` is the end of the claim's window: a tenant with a row due by then is due.)
    async fn visit_tenants(
        &self,
        now: Timestamp,
        after: &str,
        visits: usize,
    ) -> Result<Vec<Visited>>;

    /// Whether more than `limit` rows are in `due` (claimable now, or first due by its end),
    /// whoever they belong to: a read of at most `limit + 1` entries of the claim's index,
    /// leasing nothing. A claim not in a backlog asks it first, over its shares' window.
    async fn more_due_than(&self, due: Due, limit: usize) -> Result<bool>;

    /// Leases up to its share of the rows `due` takes of each tenant of `shares`, each
    /// tenant's earliest `available_at` first.
    async fn claim_of_tenants(
        &self,
        due: Due,
        shares: &[(String, usize)],
        lease: &Lease,
    ) -> Result<Vec<ClaimedTimer>>;
}

/// One instance's state of fair claiming: where the next visit starts and whether the last
/// claim was full. Each store holds one.
#[derive(Debug, Default)]
pub struct FairShare {
    state: Mutex<Cursor>,
}

#[derive(Debug, Default, Clone)]
struct Cursor {
    /// The previous claim took all it could: more may be due than one claim takes.
    backlog: bool,
    /// The next visit starts after this tenant (`""`: from the first).
    after: String,
    /// When the previous claim was made (its `due.now`), if it was in a backlog that goes on
    /// (it was shared, and full).
    shared_at: Option<Timestamp>,
}

impl FairShare {
    pub fn new() -> Self {
        Self::default()
    }

    /// Claims up to `limit` due rows as the module explains; the claims come back earliest
    /// due first (then by key).
    pub async fn claim(
        &self,
        steps: &(impl FairSteps + ?Sized),
        due: Due,
        limit: usize,
        lease: &Lease,
    ) -> Result<Vec<ClaimedTimer>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let cursor = self.current();
        // A failed probe fails the claim (nothing is leased yet): the engine retries it.
        let attempt = async {
            let window = backlog_window(due, lease, cursor.shared_at);
            let backlog = cursor.backlog || steps.more_due_than(window, limit).await?;
            let claimed = if backlog {
                self.shared(steps, due, window, limit, lease, &cursor.after)
                    .await?
            } else {
                steps.claim_earliest(due, limit, lease).await?
            };
            Ok::<_, crate::error::Error>((backlog, claimed))
        };
        let (backlog, mut claimed) = match attempt.await {
            Ok(done) => done,
            Err(e) => {
                // The next claim may come long after (the store's retries): no gap to measure.
                self.update(|c| c.shared_at = None);
                return Err(e);
            }
        };
        let full = claimed.len() >= limit;
        self.update(|c| {
            c.backlog = full;
            // A gap is measured between two claims of one backlog, never across an idle time.
            c.shared_at = (backlog && full).then_some(due.now);
        });
        claimed.sort_by(|a, b| a.due_at.cmp(&b.due_at).then_with(|| a.key.cmp(&b.key)));
        Ok(claimed)
    }

    /// The claim in a backlog: a share for each tenant with rows due within `window`, then the
    /// fill from `due`.
    async fn shared(
        &self,
        steps: &(impl FairSteps + ?Sized),
        due: Due,
        window: Due,
        limit: usize,
        lease: &Lease,
        after: &str,
    ) -> Result<Vec<ClaimedTimer>> {
        let visited = steps.visit_tenants(window.ahead, after, limit).await?;
        // Stopped at its bound: more tenants may have due timers, after the last one visited.
        let cut = visited.len() >= limit;
        let next = match visited.last() {
            Some(last) if cut => last.tenant.clone(),
            _ => String::new(),
        };
        self.update(|c| c.after = next);
        let tenants: Vec<String> = visited
            .into_iter()
            .filter(|v| v.due)
            .map(|v| v.tenant)
            .collect();
        let mut claimed = Vec::new();
        // One due tenant among all of them: the fill takes its earliest anyway, cheaper.
        if tenants.len() > 1 || (cut && !tenants.is_empty()) {
            claimed = steps
                .claim_of_tenants(window, &shares(tenants, limit), lease)
                .await?;
        }
        let rest = limit.saturating_sub(claimed.len());
        if rest > 0 {
            match steps.claim_earliest(due, rest, lease).await {
                Ok(more) => claimed.extend(more),
                // What the shares leased fires now rather than when its lease runs out; the
                // next claim fills again.
                Err(e) if !claimed.is_empty() => {
                    warn!(error = %e.chain(), "filling a shared claim failed; firing its shares");
                }
                Err(e) => return Err(e),
            }
        }
        Ok(claimed)
    }

    #[cfg(test)]
    fn cursor(&self) -> Cursor {
        self.current()
    }

    fn current(&self) -> Cursor {
        match self.state.lock() {
            Ok(c) => c.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn update(&self, change: impl FnOnce(&mut Cursor)) {
        match self.state.lock() {
            Ok(mut c) => change(&mut c),
            Err(poisoned) => change(&mut poisoned.into_inner()),
        }
    }
}

/// How many times the claim's own window a backlog's shares look ahead.
pub const BACKLOG_WINDOWS: i64 = 8;

/// How many times the time since the previous claim of a backlog its shares look ahead, when
/// that is longer than [`BACKLOG_WINDOWS`] of the claim's own window.
pub const CLAIM_GAPS: i64 = 2;

/// The window of a backlog's shares: [`BACKLOG_WINDOWS`] times `due`'s, or [`CLAIM_GAPS`] times
/// the time since the backlog's previous claim (`shared_at`) when longer, but no more than a
/// fifth of the lease ahead of `due.now` (never shorter than `due`'s own; nothing ahead when
/// `due` looks nowhere ahead).
fn backlog_window(due: Due, lease: &Lease, shared_at: Option<Timestamp>) -> Due {
    let (now, ahead) = (due.now.as_millis(), due.ahead.as_millis());
    let own = ahead.saturating_sub(now).max(0);
    let gap = shared_at.map_or(0, |at| now.saturating_sub(at.as_millis()).max(0));
    let look = if own == 0 {
        0
    } else {
        own.saturating_mul(BACKLOG_WINDOWS)
            .max(gap.saturating_mul(CLAIM_GAPS))
    };
    let lease_cap = lease.until.as_millis().saturating_sub(now).max(0) / 5;
    let end = now.saturating_add(look.min(lease_cap));
    Due {
        now: due.now,
        ahead: Timestamp::from_millis(end.max(ahead)),
    }
}

/// `limit` shared between `tenants` (at most `limit` of them): each gets `limit / tenants`, and
/// the first `limit % tenants` one more, so the shares add up to `limit`.
fn shares(tenants: Vec<String>, limit: usize) -> Vec<(String, usize)> {
    let n = tenants.len().max(1);
    let (base, extra) = (limit / n, limit % n);
    tenants
        .into_iter()
        .enumerate()
        .map(|(i, tenant)| (tenant, (base + usize::from(i < extra)).max(1)))
        .collect()
}

#[cfg(test)]
mod tests;
