//! The `Store` contract. Every store plugin implements it and passes the Store conformance suite
//! in `timer-conformance`.
//!
//! The trait holds what the engine needs from every store. Abilities that only some features
//! need are separate traits a store may offer through an accessor that defaults to `None`
//! ([`Store::tenant_counts`], [`Store::queries`], [`Store::control`], [`Store::history`]), so a
//! new ability adds a trait and an accessor, not a required method on every plugin.

use std::collections::HashMap;

use async_trait::async_trait;
use tokio::sync::broadcast;

use crate::control::{Action, Change, HistoryEntry};
use crate::error::{Error, Result};
use crate::model::{
    CancelOutcome, ClaimedTimer, ControlOutcome, Due, Lease, NewTimer, ScheduleOutcome, Timer,
    TimerKey, TimerState, Timestamp, Work,
};

/// What becomes of a claimed timer when its fire ends: the one step that settles a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settlement {
    /// Its event went out and it was a one-shot timer: Scheduled → Reached at the settle time
    /// (a recurring timer whose series ended also counts the occurrence).
    Reached,
    /// Its event went out and it recurs: `due_at` and `available_at` become this next
    /// occurrence, the revision is bumped, `occurrences` incremented, `reached_at` set, attempts
    /// and last error cleared, the lease released.
    Next(Timestamp),
    /// Its last allowed publish failed: Scheduled → Failed, attempts incremented, `last_error`
    /// set, finished at the settle time.
    Failed(String),
    /// Its lease is given back: it stays Scheduled and becomes claimable at `at` (never before
    /// its due time). With an `error` (a failed publish) attempts are incremented and
    /// `last_error` set; without (shutdown, a reschedule during the fire) they are unchanged.
    /// Unlike the others it also applies at another revision (the timer was rescheduled while
    /// it fired), but only in part: the lease is returned and the timer is claimable at its
    /// new due time; the old fire's `at` and `error` do not touch it (nor its history).
    Retry {
        at: Timestamp,
        error: Option<String>,
    },
    /// What [`crate::policy`] decided for a timer with a policy or work: written as it says.
    Step(Step),
}

/// A settlement spelled out: the timer's new state and times, its work and its history. The
/// revision goes up when `due_at` differs from the claimed one; the lease is released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Scheduled, or Reached (finished at the settle time).
    pub state: TimerState,
    pub due_at: Timestamp,
    /// When it is claimable again; at or after `due_at`.
    pub available_at: Timestamp,
    /// Its event went out: `reached_at` is the settle time, a series counts the occurrence,
    /// attempts and the last error are cleared.
    pub fired: bool,
    /// Its work as it is now (`None`: nothing to keep).
    pub work: Option<Work>,
    /// Its history entries, in order.
    pub changes: Vec<Change>,
}

/// Durable timer storage.
///
/// A row is claimable when it is `Scheduled` and its `available_at` (the due time, or the end
/// of a lease or retry backoff) is at or before `now`; a claim may also take rows a little
/// ahead of their due time ([`Due`]). Claiming sets a lease; an expired lease
/// makes the row claimable again, which is how a crashed instance's timers are recovered.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// The plugin's kind: `memory`, `sqlite`, `postgres`.
    fn name(&self) -> &'static str;

    /// Upserts a batch in one transaction, all or nothing. New key → `Created`; existing
    /// Scheduled or Paused → due time, correlation id and payload replaced (`Updated`; a changed
    /// due time bumps the revision and resets attempts; a Paused timer stays Paused); Reached,
    /// Cancelled or Failed → unchanged. One outcome per input, in order. A key given twice in a
    /// batch is applied in order. A store with [`Store::history`] records `created` or
    /// `rescheduled` in the same transaction (as `settle` and `cancel` record theirs).
    async fn schedule(&self, timers: &[NewTimer], now: Timestamp) -> Result<Vec<ScheduleOutcome>>;

    /// Leases up to `limit` rows that `due` takes to `lease.owner` until `lease.until`,
    /// earliest `available_at` first; when the previous claim was full, shared between the
    /// tenants with claimable rows as [`crate::fair`] says (a store claims through
    /// [`FairShare::claim`](crate::fair::FairShare::claim)). Returned earliest due first. Two
    /// callers never hold the same row at once.
    async fn claim_due(&self, due: Due, limit: usize, lease: &Lease) -> Result<Vec<ClaimedTimer>>;

    /// Settles claims in one transaction, each as its [`Settlement`] says, at time `at`. Only
    /// rows still Scheduled and leased by `owner` change, and except for
    /// [`Settlement::Retry`] (which returns the lease) only at the claimed revision (a timer
    /// rescheduled while it fired stays Scheduled with its new due time). Returns how many rows
    /// changed.
    async fn settle(
        &self,
        claims: &[(ClaimedTimer, Settlement)],
        owner: &str,
        at: Timestamp,
    ) -> Result<u64>;

    /// Extends the leases `owner` holds on `keys` to `until`, so a publish that takes longer
    /// than `engine.lease` keeps its timers. Only Scheduled rows leased by `owner` change (at
    /// any revision: a timer rescheduled while it fires stays leased to the fire); returns how
    /// many did. Fewer than `keys` means leases were lost (taken over, or settled).
    async fn renew(&self, keys: &[TimerKey], owner: &str, until: Timestamp) -> Result<u64>;

    /// The earliest `available_at` of any Scheduled row: when the next claim can succeed.
    async fn next_due_at(&self) -> Result<Option<Timestamp>>;

    async fn get(&self, key: &TimerKey) -> Result<Option<Timer>>;

    /// Scheduled or Paused → Cancelled, unless an instance holds a live lease on it (the lease end a claim
    /// recorded lies after `now`; settling with `Next` or `Retry` clears it): then
    /// [`CancelOutcome::Firing`] and nothing changes, so a cancel that succeeded can never be
    /// followed by the timer's event.
    async fn cancel(&self, key: &TimerKey, now: Timestamp) -> Result<CancelOutcome>;

    /// Deletes up to `limit` Reached, Cancelled or Failed rows finished before `older_than`,
    /// with their history.
    async fn purge(&self, older_than: Timestamp, limit: usize) -> Result<u64>;

    /// How many timers are Scheduled (the `timer.pending` gauge).
    async fn scheduled_count(&self) -> Result<u64>;

    /// Ok when the store answers a trivial query.
    async fn health(&self) -> Result<()>;

    /// Due times of timers scheduled by *any* instance, as the store learns of them (PostgreSQL:
    /// LISTEN/NOTIFY), so every instance's firing task can wake early. `None` when the store has
    /// no such channel; polling then finds other instances' timers.
    fn wakeups(&self) -> Option<broadcast::Receiver<Timestamp>> {
        None
    }

    /// Counting Scheduled and Paused timers per tenant, for `limits.max_pending_per_tenant`.
    /// Every store has the abilities below (the control plane is part of the service); only
    /// [`lease_owners`](Store::lease_owners) is optional.
    fn tenant_counts(&self) -> &dyn TenantCounts;

    /// Listing, searching and counting a tenant's timers (the control plane).
    fn queries(&self) -> &dyn TimerQueries;

    /// Pausing, resuming and cancelling timers in batches (the control plane).
    fn control(&self) -> &dyn TimerControl;

    /// Each timer's history of changes.
    fn history(&self) -> &dyn TimerHistory;

    /// Knowing which lease owners are alive, so the leases of an instance that died come back
    /// at once; `None` when the store cannot tell (they come back when they run out, unless
    /// the store knows otherwise: SQLite releases every lease in its file when it opens it,
    /// since no other service may have it open).
    fn lease_owners(&self) -> Option<&dyn LeaseOwners> {
        None
    }

    /// Rate allowances kept in the store, so that every instance on it takes from one budget
    /// per tenant (`limits.rate.shared`); `None` when the store does not keep them (a store one
    /// instance has to itself: the instance's own allowances are the only ones).
    fn shared_allowances(&self) -> Option<&dyn SharedAllowances> {
        None
    }
}

/// Allowances of a generic cell rate algorithm kept in the store, one per kind (`rate`:
/// schedules, `fire`: fires) and tenant, each a theoretical arrival time (TAT) in microseconds
/// since the epoch. The engine decides what to ask (`engine/throttle.rs`, `engine/pace.rs`); the
/// store takes cells atomically, so instances never take the same room twice.
#[async_trait]
pub trait SharedAllowances: Send + Sync {
    /// Atomically: `start = max(tat, now)`; takes `k` cells, as many of `n` as keep
    /// `start + k × cell` at most `max_ahead` past now (all `n` without `max_ahead`: reserved
    /// turns), or none unless all fit when `all`; the TAT becomes `start + k × cell`. A missing
    /// allowance counts as `tat = now`.
    async fn take(&self, take: &Take<'_>) -> Result<Taken>;

    /// Deletes the allowances whose TAT is before `before_us` (full again, so the same as
    /// missing); returns how many.
    async fn forget(&self, before_us: i64) -> Result<u64>;
}

/// What [`SharedAllowances::take`] asks for.
#[derive(Debug, Clone, Copy)]
pub struct Take<'a> {
    pub kind: &'a str,
    pub tenant: &'a str,
    pub now_us: i64,
    /// The cost of one cell: `1 / rate`.
    pub cell_us: i64,
    pub n: u32,
    /// How far past now the TAT may go: `burst` cells. `None`: no bound.
    pub max_ahead_us: Option<i64>,
    /// All `n` or none.
    pub all: bool,
}

/// What [`SharedAllowances::take`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Taken {
    /// Cells taken.
    pub taken: u32,
    /// The TAT they started from (at least now).
    pub start_us: i64,
    /// The TAT after.
    pub tat_us: i64,
}

/// The four ability accessors of a store that implements the abilities itself, written in its
/// `impl Store` block: `timer_core::own_abilities!();` gives `tenant_counts`, `queries`,
/// `control` and `history`, each answering `self`.
#[macro_export]
macro_rules! own_abilities {
    () => {
        fn tenant_counts(&self) -> &dyn $crate::TenantCounts {
            self
        }

        fn queries(&self) -> &dyn $crate::TimerQueries {
            self
        }

        fn control(&self) -> &dyn $crate::TimerControl {
            self
        }

        fn history(&self) -> &dyn $crate::TimerHistory {
            self
        }
    };
}

/// An optional store ability: which lease owners are alive. An owner is *alive* while its
/// [`Membership`] holds something the store itself takes away when the owner's process or
/// connection ends (PostgreSQL: a session-level advisory lock). The leases of an owner that is
/// not alive are dead: [`take_over`](LeaseOwners::take_over) releases them.
///
/// The rule that keeps two instances from firing one claim at once: a store releases a dead
/// owner's leases claimable no sooner than [`lost_within`](LeaseOwners::lost_within) after it
/// found the owner dead, and a live instance whose [`Membership::lost`] resolved stops firing
/// its claims at once; a store guarantees `lost` resolves within `lost_within` of the moment
/// it stopped counting the owner as alive.
#[async_trait]
pub trait LeaseOwners: Send + Sync {
    /// Makes `owner` alive until the membership is dropped, leaves, or is lost. Leases `owner`
    /// still holds (an earlier run of the same instance, which is dead since the store let
    /// `owner` join) are released, claimable at `release_at`. An owner that is alive already
    /// (another running instance with the same `engine.instance_id`) is a
    /// [`Config`](crate::ErrorKind::Config) error naming it.
    /// `release` and `started_at` are what the instance list shows of it
    /// ([`LeaseOwners::live`]).
    async fn join(
        &self,
        owner: &str,
        release: &Release,
        started_at: Timestamp,
        release_at: Timestamp,
    ) -> Result<Box<dyn Membership>>;

    /// Releases the leases of every owner that joined and is not alive any more, claimable at
    /// `release_at` (never before their due time), and forgets those owners. Several instances
    /// may call it at once; each dead owner is taken over by one of them.
    async fn take_over(&self, release_at: Timestamp) -> Result<Vec<TakenOver>>;

    /// How long after the store stopped counting an owner as alive its `lost` resolves, at
    /// most: how much later than now `take_over` and `join` make released leases claimable.
    fn lost_within(&self) -> std::time::Duration;

    /// The instances alive now, ordered by id, each with the leases it holds.
    async fn live(&self) -> Result<Vec<LiveInstance>>;
}

/// Which build an instance runs: its release (the workspace version) and the git revision it
/// was built from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    pub version: String,
    pub revision: String,
}

impl Release {
    /// This timer-core's version, revision `unknown` (the binary says which it was built from).
    pub fn core() -> Self {
        Release {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            revision: "unknown".to_owned(),
        }
    }
}

/// One live instance, as [`LeaseOwners::live`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveInstance {
    /// Its lease owner name (`engine.instance_id`, or the name it made itself).
    pub id: String,
    /// `None` for an instance of a release that did not say (before 0.2.0).
    pub release: Option<Release>,
    pub started_at: Timestamp,
    /// When it last told the store it is alive (`None` before 0.2.0).
    pub last_seen_at: Option<Timestamp>,
    /// The timers it holds leases on now (claimed, not settled).
    pub leases: u64,
}

/// What [`LeaseOwners::take_over`] did for one dead owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakenOver {
    pub owner: String,
    /// Leases released.
    pub leases: u64,
}

/// One owner's being alive, held by the instance for as long as it runs.
#[async_trait]
pub trait Membership: Send + Sync {
    /// Resolves when the store may have stopped counting this owner as alive (the connection
    /// that holds it was lost, or did not answer in time). From then on another instance may
    /// take its leases over: the instance stops firing its claims at once, then joins again.
    async fn lost(&mut self) -> Error;

    /// Stops being alive on purpose (shutdown), after the instance gave its leases back.
    async fn leave(self: Box<Self>) -> Result<()>;
}

/// An optional store ability: control actions on timers.
#[async_trait]
pub trait TimerControl: Send + Sync {
    /// Applies `action` at `now` to each of `keys` in one transaction, as
    /// [`transition`](crate::control::transition) says for the row as it is then, recording
    /// its changes in the history. One outcome per key, in order.
    async fn apply(
        &self,
        keys: &[TimerKey],
        action: &Action,
        now: Timestamp,
    ) -> Result<Vec<ControlOutcome>>;

    /// [`Store::cancel`] for a store with this ability: the cancel action on one timer.
    async fn cancel_one(&self, key: &TimerKey, now: Timestamp) -> Result<CancelOutcome> {
        let outcomes = self
            .apply(std::slice::from_ref(key), &Action::Cancel, now)
            .await?;
        Ok(outcomes
            .first()
            .copied()
            .unwrap_or(ControlOutcome::NotFound)
            .into())
    }
}

/// An optional store ability: the history of each timer's changes, written by the store in the
/// transaction of the change, at most [`limit`](TimerHistory::set_limit) entries per timer (the
/// oldest dropped), deleted with the timer.
#[async_trait]
pub trait TimerHistory: Send + Sync {
    /// How many entries to keep per timer from now on; 0 records none. The engine sets it from
    /// `engine.history_per_timer` when it starts.
    fn set_limit(&self, per_timer: usize);

    /// Up to `limit` entries of `key`'s history, oldest first, after entry `after`.
    async fn read(&self, key: &TimerKey, after: u64, limit: usize) -> Result<Vec<HistoryEntry>>;

    /// Records `change` at `at` for `key`, a change made outside the store (a manual trigger).
    /// False when there is no such timer.
    async fn record(&self, key: &TimerKey, at: Timestamp, change: &Change) -> Result<bool>;
}

/// Which of a tenant's timers a list shows. Every condition given must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TimerFilter {
    /// Any of these states; empty: every state.
    pub states: Vec<TimerState>,
    /// The `serviceCallId` starts with this (compared as text, case-sensitive).
    pub prefix: Option<String>,
    /// Due at or after this instant.
    pub due_after: Option<Timestamp>,
    /// Due before this instant.
    pub due_before: Option<Timestamp>,
    /// Only recurring timers (`true`) or only one-shot timers (`false`).
    pub recurring: Option<bool>,
    /// Only (`true`) or all but (`false`) the Scheduled timers whose last publish failed and
    /// which wait for their next attempt ([`Timer::is_retrying`]).
    pub retrying: Option<bool>,
}

impl TimerFilter {
    /// Whether `timer` passes the filter (the memory store's list, and tests).
    pub fn matches(&self, timer: &Timer) -> bool {
        (self.states.is_empty() || self.states.contains(&timer.state))
            && self
                .prefix
                .as_deref()
                .is_none_or(|p| timer.key.service_call_id.starts_with(p))
            && self.due_after.is_none_or(|t| timer.due_at >= t)
            && self.due_before.is_none_or(|t| timer.due_at < t)
            && self
                .recurring
                .is_none_or(|r| r == timer.recurrence.is_some())
            && self.retrying.is_none_or(|r| r == timer.is_retrying())
    }
}

/// Where a page of a list starts: after the timer with this due time and id, in the list's order
/// (due time, then `serviceCallId`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct PageAfter {
    pub due_at: Timestamp,
    pub service_call_id: String,
}

/// One tenant's timers at a glance.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantSummary {
    pub tenant_id: String,
    /// How many timers are in each state; states without any are absent.
    pub counts: HashMap<TimerState, u64>,
    /// The earliest due time of a Scheduled timer.
    pub next_due_at: Option<Timestamp>,
    /// Timers that became Failed at or after the `failed_since` asked for.
    pub failed_since: u64,
    /// Timers that last fired at or after the `fired_since` asked for (a series counts once).
    pub fired_since: u64,
}

impl TenantSummary {
    /// A summary of each of `tenants`, in order, with nothing counted yet: where a store's
    /// `summaries` starts.
    pub fn nothing_counted(tenants: &[String]) -> Vec<TenantSummary> {
        tenants
            .iter()
            .map(|t| TenantSummary {
                tenant_id: t.clone(),
                ..TenantSummary::default()
            })
            .collect()
    }
}

/// The timers due now that no instance has claimed yet ([`TimerQueries::backlog`]): who waits.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Backlog {
    /// Claimable rows of all tenants.
    pub due: u64,
    /// Tenants with a claimable row.
    pub tenants: u64,
    /// The tenants waiting longest, earliest `available_at` first (then by id).
    pub by_tenant: Vec<TenantBacklog>,
}

/// One tenant's claimable rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantBacklog {
    pub tenant_id: String,
    /// How many rows are claimable.
    pub due: u64,
    /// The earliest `available_at` among them: the tenant waits since then.
    pub since: Timestamp,
}

/// An optional store ability: reading a tenant's timers as pages, and counting them.
#[async_trait]
pub trait TimerQueries: Send + Sync {
    /// Up to `limit` of `tenant`'s timers that pass `filter`, ordered by due time, then
    /// `serviceCallId`, starting after `after`. Keyset pagination: a page is read from an index,
    /// and timers written between pages never make a later page repeat or skip one that was
    /// there all along.
    async fn list(
        &self,
        tenant: &str,
        filter: &TimerFilter,
        after: Option<&PageAfter>,
        limit: usize,
    ) -> Result<Vec<Timer>>;

    /// The keys of [`list`](Self::list)'s page, each with its due time (where the next page
    /// starts): what a bulk action needs, without reading every timer whole (a page of timers
    /// with large messages and payloads is hundreds of megabytes).
    async fn list_keys(
        &self,
        tenant: &str,
        filter: &TimerFilter,
        after: Option<&PageAfter>,
        limit: usize,
    ) -> Result<Vec<PageAfter>> {
        let page = self.list(tenant, filter, after, limit).await?;
        Ok(page
            .into_iter()
            .map(|t| PageAfter {
                due_at: t.due_at,
                service_call_id: t.key.service_call_id,
            })
            .collect())
    }

    /// Up to `limit` tenants that have timers, in order, after `after`.
    async fn tenants(&self, after: Option<&str>, limit: usize) -> Result<Vec<String>>;

    /// A summary of each of `tenants` (in that order; one without timers has zero counts).
    async fn summaries(
        &self,
        tenants: &[String],
        failed_since: Timestamp,
        fired_since: Timestamp,
    ) -> Result<Vec<TenantSummary>>;

    /// How many timers of all tenants are in `state` (cheap for Scheduled and Paused, which
    /// are indexed; a scan for the others).
    async fn count(&self, state: TimerState) -> Result<u64>;

    /// The claimable rows at `now` (Scheduled, `available_at` at or before it: due, or a retry
    /// or an expired lease whose time came) of all tenants, with the `limit` tenants (at least
    /// one) that wait longest. Reads the claimable rows only, from an index: nothing when
    /// nothing waits, the whole backlog when a herd is due.
    async fn backlog(&self, now: Timestamp, limit: usize) -> Result<Backlog>;

    /// How many timers are leased now (claimed by an instance, not settled), from an index.
    async fn leased(&self) -> Result<u64>;
}

/// An optional store ability: live (Scheduled and Paused) timers counted per tenant.
#[async_trait]
pub trait TenantCounts: Send + Sync {
    /// How many timers of each of `tenants` are Scheduled or Paused (a paused timer holds its
    /// row as long as a scheduled one); tenants without any are absent.
    async fn live_by_tenant(&self, tenants: &[String]) -> Result<HashMap<String, u64>>;
}
