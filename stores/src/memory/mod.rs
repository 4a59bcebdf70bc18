//! `memory`: timers in process memory. Lost at exit; for tests and trying things out.
//!
//! The rest is the plugin's page of the book (`README.md` beside this file).
#![doc = include_str!("README.md")]

mod abilities;
mod plugin;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use async_trait::async_trait;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use timer_core::control::DEFAULT_HISTORY;
use timer_core::fair::{FairShare, FairSteps, Visited};
use timer_core::{CancelOutcome, Change, ClaimedTimer, Due, Error, HistoryEntry, Lease, NewTimer, Result, ScheduleOutcome, Settlement, Store, Timer, TimerControl, TimerKey, TimerState, Timestamp};

pub use plugin::PLUGIN;

/// The memory store: timers in process memory, lost at exit and not shared with other
/// processes. For tests and trying things out.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryConfig {
    /// Always `memory`; checked by the binary.
    pub kind: String,
}

#[derive(Debug)]
pub struct MemoryStore {
    state: Mutex<State>,
    /// History entries kept per timer ([`TimerHistory::set_limit`]).
    history_limit: AtomicUsize,
    /// Claims shared between tenants ([`timer_core::fair`]).
    fair: FairShare,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore {
            state: Mutex::default(),
            history_limit: AtomicUsize::new(DEFAULT_HISTORY),
            fair: FairShare::new(),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    rows: HashMap<TimerKey, Row>,
    ready: Ready,
}

/// The Scheduled rows by `available_at`, all of them and each tenant's: what `claim_due` and
/// `next_due_at` read.
#[derive(Debug, Default)]
struct Ready {
    all: BTreeSet<(Timestamp, TimerKey)>,
    /// Each tenant's, by `available_at` and then id; a tenant without any is not here.
    by_tenant: BTreeMap<String, BTreeSet<(Timestamp, String)>>,
}

impl Ready {
    fn insert(&mut self, (at, key): (Timestamp, TimerKey)) {
        self.by_tenant
            .entry(key.tenant_id.clone())
            .or_default()
            .insert((at, key.service_call_id.clone()));
        self.all.insert((at, key));
    }

    fn remove(&mut self, entry: &(Timestamp, TimerKey)) {
        if !self.all.remove(entry) {
            return;
        }
        let (at, key) = entry;
        if let Some(rows) = self.by_tenant.get_mut(&key.tenant_id) {
            rows.remove(&(*at, key.service_call_id.clone()));
            if rows.is_empty() {
                self.by_tenant.remove(&key.tenant_id);
            }
        }
    }

    fn first(&self) -> Option<&(Timestamp, TimerKey)> {
        self.all.first()
    }

    fn len(&self) -> usize {
        self.all.len()
    }

    /// The keys of up to `limit` rows `due` takes, earliest first: of `tenant`, or of all.
    /// `due_at` gives a row's due time (a row ahead of `due.now` is taken at its first due).
    fn due(
        &self,
        due: Due,
        tenant: Option<&str>,
        limit: usize,
        due_at: impl Fn(&TimerKey) -> Option<Timestamp>,
    ) -> Vec<TimerKey> {
        let takes = |at: Timestamp, key: &TimerKey| {
            at <= due.now || due_at(key).is_some_and(|d| due.takes(at, d))
        };
        match tenant {
            None => self
                .all
                .iter()
                .take_while(|(at, _)| *at <= due.ahead)
                .filter(|(at, key)| takes(*at, key))
                .take(limit)
                .map(|(_, key)| key.clone())
                .collect(),
            Some(tenant) => self
                .by_tenant
                .get(tenant)
                .into_iter()
                .flatten()
                .take_while(|(at, _)| *at <= due.ahead)
                .map(|(at, id)| (*at, TimerKey::new(tenant, id.as_str())))
                .filter(|(at, key)| takes(*at, key))
                .take(limit)
                .map(|(_, key)| key)
                .collect(),
        }
    }
}

#[derive(Debug, Clone)]
struct Row {
    timer: Timer,
    revision: i64,
    finished_at: Option<Timestamp>,
    /// When the live lease ends; `None` when none was taken or it was given back.
    lease_until: Option<Timestamp>,
    /// The newest entries of its history, oldest first.
    history: VecDeque<HistoryEntry>,
    /// The number of its last history entry.
    history_seq: u64,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn limit(&self) -> usize {
        self.history_limit.load(Ordering::Relaxed)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| Error::internal("memory store: a thread panicked while holding its lock"))
    }
}

impl MemoryStore {
    /// Leases up to its share of due rows of each tenant of `shares` (`None`: of anyone).
    fn claim_of(
        &self,
        due: Due,
        shares: &[(Option<&str>, usize)],
        lease: &Lease,
    ) -> Result<Vec<ClaimedTimer>> {
        let mut state = self.lock()?;
        let State { rows, ready } = &mut *state;
        let mut claimed = Vec::new();
        for (tenant, share) in shares {
            let keys = ready.due(due, *tenant, *share, |key| {
                rows.get(key).map(|row| row.timer.due_at)
            });
            for key in keys {
                if let Some(row) = rows.get_mut(&key) {
                    claimed.push(row.claim(ready, lease));
                }
            }
        }
        Ok(claimed)
    }
}

#[async_trait]
impl FairSteps for MemoryStore {
    async fn claim_earliest(
        &self,
        due: Due,
        limit: usize,
        lease: &Lease,
    ) -> Result<Vec<ClaimedTimer>> {
        self.claim_of(due, &[(None, limit)], lease)
    }

    async fn visit_tenants(
        &self,
        now: Timestamp,
        after: &str,
        visits: usize,
    ) -> Result<Vec<Visited>> {
        let state = self.lock()?;
        let after = std::ops::Bound::Excluded(after.to_owned());
        Ok(state
            .ready
            .by_tenant
            .range((after, std::ops::Bound::Unbounded))
            .take(visits)
            .map(|(tenant, rows)| Visited {
                tenant: tenant.clone(),
                due: rows.first().is_some_and(|(at, _)| *at <= now),
            })
            .collect())
    }

    async fn more_due_than(&self, due: Due, limit: usize) -> Result<bool> {
        let state = self.lock()?;
        let State { rows, ready } = &*state;
        let counted = ready.due(due, None, limit.saturating_add(1), |key| {
            rows.get(key).map(|row| row.timer.due_at)
        });
        Ok(counted.len() > limit)
    }

    async fn claim_of_tenants(
        &self,
        due: Due,
        shares: &[(String, usize)],
        lease: &Lease,
    ) -> Result<Vec<ClaimedTimer>> {
        let shares: Vec<(Option<&str>, usize)> =
            shares.iter().map(|(t, n)| (Some(t.as_str()), *n)).collect();
        self.claim_of(due, &shares, lease)
    }
}

impl Row {
    /// Moves this Scheduled row to a new `available_at`, keeping the ready index in step.
    fn set_available(&mut self, ready: &mut Ready, at: Timestamp) {
        ready.remove(&(self.timer.available_at, self.timer.key.clone()));
        self.timer.available_at = at;
        ready.insert((at, self.timer.key.clone()));
    }

    fn finish(&mut self, ready: &mut Ready, state: TimerState, at: Timestamp) {
        ready.remove(&(self.timer.available_at, self.timer.key.clone()));
        self.timer.state = state;
        // Its lease ends; `lease_owner` stays, naming the instance that settled it.
        self.lease_until = None;
        self.finished_at = Some(at);
    }

    /// Moves its due time; a changed one bumps the revision, so that a claim taken before it
    /// no longer settles the row.
    fn move_due(&mut self, due_at: Timestamp) {
        if due_at != self.timer.due_at {
            self.revision += 1;
            self.timer.due_at = due_at;
        }
    }

    /// Its publish attempts start again from 0, the last error cleared.
    fn reset_attempts(&mut self) {
        self.timer.attempts = 0;
        self.timer.last_error = None;
    }

    /// Appends `change` to its history, keeping the newest `limit` entries.
    fn record(&mut self, at: Timestamp, change: Change, limit: usize) {
        if limit == 0 {
            return;
        }
        self.history_seq += 1;
        self.history.push_back(HistoryEntry {
            seq: self.history_seq,
            at,
            change,
        });
        while self.history.len() > limit {
            self.history.pop_front();
        }
    }

    /// Gives its lease back: no owner, no lease end.
    fn release(&mut self) {
        self.timer.lease_owner = None;
        self.lease_until = None;
    }

    fn leased_by(&self, owner: &str) -> bool {
        self.timer.state == TimerState::Scheduled
            && self.timer.lease_owner.as_deref() == Some(owner)
    }

    /// Leases this row to `lease.owner`: it is claimable again once the lease ends.
    fn claim(&mut self, ready: &mut Ready, lease: &Lease) -> ClaimedTimer {
        self.set_available(ready, lease.until);
        self.timer.lease_owner = Some(lease.owner.clone());
        self.lease_until = Some(lease.until);
        let t = &self.timer;
        ClaimedTimer {
            key: t.key.clone(),
            due_at: t.due_at,
            registered_at: t.registered_at,
            correlation_id: t.correlation_id.clone(),
            payload: t.payload.clone(),
            attempts: t.attempts,
            revision: self.revision,
            recurrence: t.recurrence.clone(),
            occurrences: t.occurrences,
            policy: t.policy.clone(),
            work: t.work.clone(),
            target: t.target.clone(),
            message: t.message.clone(),
            trace: t.trace.clone(),
        }
    }
}

#[async_trait]
impl Store for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn schedule(&self, timers: &[NewTimer], now: Timestamp) -> Result<Vec<ScheduleOutcome>> {
        let limit = self.limit();
        let mut state = self.lock()?;
        let State { rows, ready } = &mut *state;
        let mut outcomes = Vec::with_capacity(timers.len());
        for new in timers {
            let Some(row) = rows.get_mut(&new.key) else {
                let timer = Timer::registered(new.clone(), now);
                ready.insert((new.due_at, new.key.clone()));
                let mut row = Row {
                    timer,
                    revision: 0,
                    finished_at: None,
                    lease_until: None,
                    history: VecDeque::new(),
                    history_seq: 0,
                };
                row.record(now, Change::Created { due_at: new.due_at }, limit);
                rows.insert(new.key.clone(), row);
                outcomes.push(ScheduleOutcome::Created);
                continue;
            };
            match row.timer.state {
                TimerState::Reached => outcomes.push(ScheduleOutcome::AlreadyReached),
                TimerState::Cancelled => outcomes.push(ScheduleOutcome::AlreadyCancelled),
                TimerState::Failed => outcomes.push(ScheduleOutcome::AlreadyFailed),
                TimerState::Scheduled | TimerState::Paused => {
                    row.record(now, Change::Rescheduled { due_at: new.due_at }, limit);
                    // What a fire sends, changed: a fire in flight with the old content does
                    // not settle it (the revision below), it fires again with the new.
                    let t = &row.timer;
                    let content_changed = t.correlation_id != new.correlation_id
                        || t.payload != new.payload
                        || t.policy != new.policy
                        || t.target != new.target
                        || t.message != new.message;
                    row.timer.correlation_id = new.correlation_id.clone();
                    row.timer.payload = new.payload.clone();
                    row.timer.policy = new.policy.clone();
                    row.timer.target = new.target.clone();
                    row.timer.message = new.message.clone();
                    row.timer.trace = new.trace.clone();
                    // A repeat of the same recurring series keeps its place (and its work).
                    if new.recurrence.is_some() && row.timer.recurrence == new.recurrence {
                        outcomes.push(ScheduleOutcome::Updated);
                        continue;
                    }
                    if row.timer.due_at != new.due_at || row.timer.recurrence != new.recurrence {
                        row.revision += 1;
                        row.timer.attempts = 0;
                        row.timer.work = new.work.clone();
                    } else if content_changed {
                        row.revision += 1;
                    }
                    let available = match row.lease_until {
                        Some(until) if until > now => until.max(new.due_at),
                        _ => new.due_at,
                    };
                    row.timer.due_at = new.due_at;
                    if row.timer.recurrence != new.recurrence {
                        row.timer.recurrence = new.recurrence.clone();
                        row.timer.occurrences = 0;
                    }
                    if row.timer.state == TimerState::Paused {
                        row.timer.available_at = available; // not claimable: not in `ready`
                    } else {
                        row.set_available(ready, available);
                    }
                    outcomes.push(ScheduleOutcome::Updated);
                }
            }
        }
        Ok(outcomes)
    }

    async fn claim_due(
        &self,
        due: Due,
        limit: usize,
        lease: &Lease,
    ) -> Result<Vec<ClaimedTimer>> {
        self.fair.claim(self, due, limit, lease).await
    }

    async fn settle(
        &self,
        claims: &[(ClaimedTimer, Settlement)],
        owner: &str,
        at: Timestamp,
    ) -> Result<u64> {
        let limit = self.limit();
        let mut state = self.lock()?;
        let State { rows, ready } = &mut *state;
        let mut changed = 0;
        for (claim, settlement) in claims {
            let Some(row) = rows.get_mut(&claim.key).filter(|row| row.leased_by(owner)) else {
                continue;
            };
            let retry = matches!(settlement, Settlement::Retry { .. });
            if row.revision != claim.revision {
                if retry {
                    // Rescheduled while it fired: the lease goes back, nothing else of the old
                    // fire touches what is now another timer.
                    changed += 1;
                    row.release();
                    let due = row.timer.due_at;
                    row.set_available(ready, due);
                }
                continue;
            }
            changed += 1;
            if let Some(change) = Change::of_settlement(claim, settlement, owner, at) {
                row.record(at, change, limit);
            }
            match settlement {
                Settlement::Reached => {
                    if row.timer.recurrence.is_some() {
                        row.timer.occurrences = row.timer.occurrences.saturating_add(1);
                    }
                    row.timer.reached_at = Some(at);
                    row.finish(ready, TimerState::Reached, at);
                }
                Settlement::Next(next) => {
                    row.revision += 1;
                    row.timer.due_at = *next;
                    row.reset_attempts();
                    row.release();
                    row.timer.reached_at = Some(at);
                    row.timer.occurrences = row.timer.occurrences.saturating_add(1);
                    row.set_available(ready, *next);
                }
                Settlement::Failed(error) => {
                    row.timer.attempts = row.timer.attempts.saturating_add(1);
                    row.timer.last_error = Some(error.clone());
                    row.finish(ready, TimerState::Failed, at);
                }
                Settlement::Retry {
                    at: retry_at,
                    error,
                } => {
                    row.release();
                    if let Some(error) = error {
                        row.timer.attempts = row.timer.attempts.saturating_add(1);
                        row.timer.last_error = Some(error.clone());
                    }
                    let available = (*retry_at).max(row.timer.due_at);
                    row.set_available(ready, available);
                }
                Settlement::Step(step) => {
                    for change in &step.changes {
                        row.record(at, change.clone(), limit);
                    }
                    row.move_due(step.due_at);
                    if step.fired {
                        row.reset_attempts();
                        row.timer.reached_at = Some(at);
                        if row.timer.recurrence.is_some() {
                            row.timer.occurrences = row.timer.occurrences.saturating_add(1);
                        }
                    }
                    row.timer.work = step.work.clone();
                    row.release();
                    if step.state.is_finished() {
                        row.finish(ready, step.state, at);
                    } else {
                        row.set_available(ready, step.available_at.max(step.due_at));
                    }
                }
            }
        }
        Ok(changed)
    }

    async fn renew(&self, keys: &[TimerKey], owner: &str, until: Timestamp) -> Result<u64> {
        let mut state = self.lock()?;
        let State { rows, ready } = &mut *state;
        let mut renewed = 0;
        for key in keys {
            if let Some(row) = rows.get_mut(key) {
                if row.leased_by(owner) && row.lease_until.is_some() {
                    row.set_available(ready, until.max(row.timer.due_at));
                    row.lease_until = Some(until);
                    renewed += 1;
                }
            }
        }
        Ok(renewed)
    }

    async fn next_due_at(&self) -> Result<Option<Timestamp>> {
        Ok(self.lock()?.ready.first().map(|(at, _)| *at))
    }

    async fn get(&self, key: &TimerKey) -> Result<Option<Timer>> {
        Ok(self.lock()?.rows.get(key).map(|row| row.timer.clone()))
    }

    async fn cancel(&self, key: &TimerKey, now: Timestamp) -> Result<CancelOutcome> {
        self.cancel_one(key, now).await
    }

    async fn purge(&self, older_than: Timestamp, limit: usize) -> Result<u64> {
        let mut state = self.lock()?;
        let old: Vec<TimerKey> = state
            .rows
            .iter()
            .filter(|(_, row)| row.finished_at.is_some_and(|at| at < older_than))
            .map(|(key, _)| key.clone())
            .take(limit)
            .collect();
        for key in &old {
            state.rows.remove(key);
        }
        Ok(old.len() as u64)
    }

    async fn scheduled_count(&self) -> Result<u64> {
        Ok(self.lock()?.ready.len() as u64)
    }

    async fn health(&self) -> Result<()> {
        self.lock().map(|_| ())
    }

    timer_core::own_abilities!();
}
