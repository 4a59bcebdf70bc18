//! The memory store's query abilities: control actions, history, lists, counts and the due
//! backlog, over the same state as the `Store` impl.

use std::collections::{BTreeSet, HashMap};

use async_trait::async_trait;
use timer_core::control::transition;
use timer_core::{
    Action, Backlog, Change, ControlOutcome, HistoryEntry, PageAfter, Result, TenantBacklog,
    TenantCounts, TenantSummary, Timer, TimerControl, TimerFilter, TimerHistory, TimerKey,
    TimerQueries, TimerState, Timestamp,
};

use std::sync::atomic::Ordering;

use super::{MemoryStore, Row, State};

#[async_trait]
impl TimerControl for MemoryStore {
    async fn apply(
        &self,
        keys: &[TimerKey],
        action: &Action,
        now: Timestamp,
    ) -> Result<Vec<ControlOutcome>> {
        let limit = self.limit();
        let mut state = self.lock()?;
        let State { rows, ready } = &mut *state;
        let mut outcomes = Vec::with_capacity(keys.len());
        for key in keys {
            let Some(row) = rows.get_mut(key) else {
                outcomes.push(ControlOutcome::NotFound);
                continue;
            };
            let firing = row.lease_until.is_some_and(|until| until > now);
            let step = transition(&row.timer, firing, action, now);
            outcomes.push(step.outcome);
            let Some(write) = step.write else {
                continue;
            };
            for change in write.changes {
                row.record(now, change, limit);
            }
            row.move_due(write.due_at);
            if write.reset_attempts {
                row.reset_attempts();
            }
            if let Some(work) = write.work {
                row.timer.work = work;
            }
            // Out of `ready` unless it becomes Scheduled again.
            ready.remove(&(row.timer.available_at, key.clone()));
            row.lease_until = None;
            row.timer.available_at = write.due_at;
            match (write.state, write.finished_at) {
                (TimerState::Scheduled, _) => {
                    row.timer.state = TimerState::Scheduled;
                    row.finished_at = None;
                    ready.insert((write.due_at, key.clone()));
                }
                (state, Some(at)) => {
                    // As the SQL stores: an action that finishes it Reached (a completion of
                    // its last occurrence) is when it was reached.
                    if state == TimerState::Reached {
                        row.timer.reached_at = Some(at);
                    }
                    row.finish(ready, state, at)
                }
                (state, None) => row.timer.state = state,
            }
        }
        Ok(outcomes)
    }
}

#[async_trait]
impl TimerHistory for MemoryStore {
    fn set_limit(&self, per_timer: usize) {
        self.history_limit.store(per_timer, Ordering::Relaxed);
    }

    async fn read(&self, key: &TimerKey, after: u64, limit: usize) -> Result<Vec<HistoryEntry>> {
        let state = self.lock()?;
        Ok(state.rows.get(key).map_or_else(Vec::new, |row| {
            row.history
                .iter()
                .filter(|e| e.seq > after)
                .take(limit)
                .cloned()
                .collect()
        }))
    }

    async fn record(&self, key: &TimerKey, at: Timestamp, change: &Change) -> Result<bool> {
        let limit = self.limit();
        let mut state = self.lock()?;
        Ok(match state.rows.get_mut(key) {
            Some(row) => {
                row.record(at, change.clone(), limit);
                true
            }
            None => false,
        })
    }
}

/// A scan of every row: the memory store is for tests and trials, not for large tenants.
#[async_trait]
impl TimerQueries for MemoryStore {
    async fn list(
        &self,
        tenant: &str,
        filter: &TimerFilter,
        after: Option<&PageAfter>,
        limit: usize,
    ) -> Result<Vec<Timer>> {
        let state = self.lock()?;
        let mut page: Vec<(PageAfter, &Timer)> = state
            .rows
            .values()
            .map(|row| &row.timer)
            .filter(|t| t.key.tenant_id == tenant && filter.matches(t))
            .map(|t| {
                let at = PageAfter {
                    due_at: t.due_at,
                    service_call_id: t.key.service_call_id.clone(),
                };
                (at, t)
            })
            .filter(|(at, _)| after.is_none_or(|after| at > after))
            .collect();
        page.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(page.into_iter().take(limit).map(|(_, t)| t.clone()).collect())
    }

    async fn tenants(&self, after: Option<&str>, limit: usize) -> Result<Vec<String>> {
        let state = self.lock()?;
        let tenants: BTreeSet<&str> = state
            .rows
            .keys()
            .map(|k| k.tenant_id.as_str())
            .filter(|t| after.is_none_or(|after| *t > after))
            .collect();
        Ok(tenants.into_iter().take(limit).map(str::to_owned).collect())
    }

    async fn summaries(
        &self,
        tenants: &[String],
        failed_since: Timestamp,
        fired_since: Timestamp,
    ) -> Result<Vec<TenantSummary>> {
        let state = self.lock()?;
        let mut summaries = TenantSummary::nothing_counted(tenants);
        for row in state.rows.values() {
            let t = &row.timer;
            let Some(summary) = summaries.iter_mut().find(|s| s.tenant_id == t.key.tenant_id)
            else {
                continue;
            };
            *summary.counts.entry(t.state).or_insert(0) += 1;
            if t.state == TimerState::Scheduled {
                summary.next_due_at = Some(summary.next_due_at.map_or(t.due_at, |n| n.min(t.due_at)));
            }
            if t.state == TimerState::Failed && row.finished_at.is_some_and(|f| f >= failed_since) {
                summary.failed_since += 1;
            }
            if t.reached_at.is_some_and(|r| r >= fired_since) {
                summary.fired_since += 1;
            }
        }
        Ok(summaries)
    }
    async fn count(&self, state: TimerState) -> Result<u64> {
        let rows = &self.lock()?.rows;
        Ok(rows.values().filter(|row| row.timer.state == state).count() as u64)
    }

    async fn leased(&self) -> Result<u64> {
        let rows = &self.lock()?.rows;
        let leased = |row: &&Row| {
            row.timer.state == TimerState::Scheduled && row.lease_until.is_some()
        };
        Ok(rows.values().filter(leased).count() as u64)
    }

    async fn backlog(&self, now: Timestamp, limit: usize) -> Result<Backlog> {
        let state = self.lock()?;
        let mut by_tenant: Vec<TenantBacklog> = state
            .ready
            .by_tenant
            .iter()
            .filter_map(|(tenant, rows)| {
                let (since, _) = rows.first().filter(|(at, _)| *at <= now)?;
                Some(TenantBacklog {
                    tenant_id: tenant.clone(),
                    due: rows.iter().take_while(|(at, _)| *at <= now).count() as u64,
                    since: *since,
                })
            })
            .collect();
        by_tenant.sort_by(|a, b| (a.since, &a.tenant_id).cmp(&(b.since, &b.tenant_id)));
        let due = by_tenant.iter().map(|t| t.due).sum();
        let tenants = by_tenant.len() as u64;
        by_tenant.truncate(limit.max(1));
        Ok(Backlog {
            due,
            tenants,
            by_tenant,
        })
    }
}

#[async_trait]
impl TenantCounts for MemoryStore {
    async fn live_by_tenant(&self, tenants: &[String]) -> Result<HashMap<String, u64>> {
        let state = self.lock()?;
        let mut counts = HashMap::new();
        let live = |s: TimerState| matches!(s, TimerState::Scheduled | TimerState::Paused);
        for (key, row) in &state.rows {
            if live(row.timer.state) && tenants.contains(&key.tenant_id) {
                *counts.entry(key.tenant_id.clone()).or_insert(0) += 1;
            }
        }
        Ok(counts)
    }
}
