//! The `Store` contract (DESIGN §3). Every store plugin implements it and passes the Store
//! conformance suite in `timer-conformance`.

use std::collections::HashMap;

use async_trait::async_trait;
use tokio::sync::broadcast;

use crate::error::Result;
use crate::model::{
    CancelOutcome, ClaimedTimer, Lease, NewTimer, ScheduleOutcome, Timer, TimerKey, Timestamp,
};

/// Durable timer storage.
///
/// A row is claimable when it is `Scheduled` and its `available_at` (the due time, or the end
/// of a lease or retry backoff) is at or before `now`. Claiming sets a lease; an expired lease
/// makes the row claimable again, which is how a crashed instance's timers are recovered.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// The plugin's name: `memory`, `sqlite`, `postgres`.
    fn name(&self) -> &'static str;

    /// Upserts a batch in one transaction, all or nothing. New key → `Created`; existing
    /// Scheduled → due time, correlation id and payload replaced (`Updated`; a changed due time
    /// bumps the revision and resets attempts); Reached or Cancelled → unchanged. One outcome per
    /// input, in order. A key given twice in a batch is applied in order.
    async fn schedule(&self, timers: &[NewTimer], now: Timestamp) -> Result<Vec<ScheduleOutcome>>;

    /// Atomically leases up to `limit` claimable rows to `lease.owner` until `lease.until`,
    /// earliest `available_at` first. Two callers never hold the same row at once.
    async fn claim_due(
        &self,
        now: Timestamp,
        limit: usize,
        lease: &Lease,
    ) -> Result<Vec<ClaimedTimer>>;

    /// Marks fired timers Reached. Only rows still leased by `owner` at the claimed revision
    /// change (a timer rescheduled while it fired stays Scheduled). Returns how many changed.
    async fn mark_reached(
        &self,
        timers: &[ClaimedTimer],
        owner: &str,
        at: Timestamp,
    ) -> Result<u64>;

    /// Moves fired occurrences of recurring timers to their next occurrence: `due_at` and
    /// `available_at` become `next`, the revision is bumped, `occurrences` incremented,
    /// `reached_at` set to `at`, attempts and last error cleared, the lease released. Same
    /// guard as `mark_reached` (leased by `owner` at the claimed revision). Returns how many
    /// changed.
    async fn advance(
        &self,
        timers: &[(ClaimedTimer, Timestamp)],
        owner: &str,
        at: Timestamp,
    ) -> Result<u64>;

    /// Scheduled → Failed after the last allowed publish attempt: attempts incremented,
    /// `last_error` set, finished at `at`. Same guard as `mark_reached`. Returns how many changed.
    async fn fail(
        &self,
        timers: &[ClaimedTimer],
        owner: &str,
        at: Timestamp,
        error: &str,
    ) -> Result<u64>;

    /// Gives claims back: the rows stay Scheduled and become claimable at `retry_at`. With an
    /// `error`, `attempts` is incremented and `last_error` set (a failed publish); without
    /// (shutdown), attempts are unchanged.
    async fn release(
        &self,
        timers: &[ClaimedTimer],
        owner: &str,
        retry_at: Timestamp,
        error: Option<&str>,
    ) -> Result<()>;

    /// The earliest `available_at` of any Scheduled row: when the next claim can succeed.
    async fn next_due_at(&self) -> Result<Option<Timestamp>>;

    async fn get(&self, key: &TimerKey) -> Result<Option<Timer>>;

    /// Scheduled → Cancelled, unless an instance holds a live lease on it (the lease end a claim
    /// recorded lies after `now`; `release` and `advance` clear it): then
    /// [`CancelOutcome::Firing`] and nothing changes, so a cancel that succeeded can never be
    /// followed by the timer's event.
    async fn cancel(&self, key: &TimerKey, now: Timestamp) -> Result<CancelOutcome>;

    /// Deletes up to `limit` Reached, Cancelled or Failed rows finished before `older_than`.
    async fn purge(&self, older_than: Timestamp, limit: usize) -> Result<u64>;

    /// How many timers are Scheduled.
    async fn pending(&self) -> Result<u64>;

    /// How many timers of each of `tenants` are Scheduled; tenants without any are absent.
    /// Used for `limits.max_pending_per_tenant` (a count over the tenant's rows, so only asked
    /// when that limit is set).
    async fn pending_by_tenant(&self, tenants: &[String]) -> Result<HashMap<String, u64>>;

    /// Ok when the store answers a trivial query.
    async fn health(&self) -> Result<()>;

    /// Due times of timers scheduled by *any* instance, as the store learns of them (PostgreSQL:
    /// LISTEN/NOTIFY), so every instance's firing task can wake early. `None` when the store has
    /// no such channel; polling then finds other instances' timers.
    fn wakeups(&self) -> Option<broadcast::Receiver<Timestamp>> {
        None
    }
}
