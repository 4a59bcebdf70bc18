//! The control plane: pause, resume and cancel (a few timers, or page by page over a filter),
//! a manual trigger, and reading a timer's history.

use std::collections::BTreeMap;

use opentelemetry::trace::Span as _;
use opentelemetry::KeyValue;

use super::{metrics as metric, spans, Engine};
use crate::call::Called;
use crate::control::{Action, Change, HistoryEntry};
use crate::error::{Error, Result};
use crate::model::{ControlOutcome, TimerKey, TimerState, Timestamp};
use crate::store::{PageAfter, TimerFilter};
use crate::trace::TraceContext;
use crate::wire::{DueTimeReachedEnvelope, Rejection};

/// What a bulk action did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bulk {
    /// Timers the filter matched (each page as it was read).
    pub matched: u64,
    /// Timers the action changed.
    pub changed: u64,
    /// Pages applied, each in a transaction of its own.
    pub pages: u64,
    /// How many timers ended with each outcome.
    pub outcomes: BTreeMap<&'static str, u64>,
}

/// What a manual trigger did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Triggered {
    /// The broker confirmed the extra `DueTimeReached`; it has this id and time.
    Fired { event_id: uuid::Uuid, at: Timestamp },
    /// Nothing went out: the timer does not exist, or is finished (the outcome says how).
    Refused(ControlOutcome),
    /// Nothing went out: `targets` refuses the timer's target now (it was taken under other
    /// patterns); its due fire gives it up the same way.
    NotCarried(Rejection),
}

impl Engine {
    /// Applies `action` to `keys` in one store transaction; one outcome per key, in order.
    pub async fn control(&self, keys: &[TimerKey], action: &Action) -> Result<Vec<ControlOutcome>> {
        let inner = &self.inner;
        let span = self.spans().map(|s| s.control(action.as_str(), keys));
        let applied = inner
            .store
            .control()
            .apply(keys, action, inner.clock.now())
            .await;
        let outcomes = match (applied, span) {
            (Ok(outcomes), Some(mut span)) => {
                if let [outcome] = outcomes.as_slice() {
                    span.set_attribute(KeyValue::new("timer.outcome", outcome.as_str()));
                }
                span.end();
                outcomes
            }
            (Err(e), Some(span)) => {
                spans::failed(span, e.chain());
                return Err(e);
            }
            (applied, None) => applied?,
        };
        let mut changed = 0;
        for outcome in &outcomes {
            changed += u64::from(outcome.changed());
            ::metrics::counter!(metric::CONTROL_ACTIONS, "action" => action.as_str(), "outcome" => outcome.as_str())
                .increment(1);
        }
        self.history_written(changed);
        if matches!(action, Action::Resume | Action::Retry | Action::Complete(_)) && changed > 0 {
            // A resumed or retried timer, or an occurrence buffered behind a completed one, may
            // be due now: have the firing task look again.
            inner.wake.notify_one();
        }
        Ok(outcomes)
    }

    /// Applies `action` to every timer of `tenant` that `filter` matches, `page_size` at a
    /// time, each page in its own transaction, so no transaction holds many timers.
    pub async fn bulk(
        &self,
        tenant: &str,
        filter: &TimerFilter,
        action: &Action,
        page_size: usize,
    ) -> Result<Bulk> {
        let queries = self.inner.store.queries();
        let mut bulk = Bulk::default();
        let mut after: Option<PageAfter> = None;
        loop {
            let page = queries
                .list_keys(tenant, filter, after.as_ref(), page_size.max(1))
                .await?;
            let Some(last) = page.last() else { break };
            // Keyset order: timers the action moves (a resumed series) are at most seen again
            // and then answer not_paused; none is skipped.
            after = Some(last.clone());
            let keys: Vec<TimerKey> = page
                .iter()
                .map(|at| TimerKey::new(tenant, at.service_call_id.clone()))
                .collect();
            let outcomes = self.control(&keys, action).await?;
            bulk.pages += 1;
            bulk.matched += keys.len() as u64;
            for outcome in outcomes {
                bulk.changed += u64::from(outcome.changed());
                *bulk.outcomes.entry(outcome.as_str()).or_insert(0) += 1;
            }
            if page.len() < page_size {
                break;
            }
        }
        ::metrics::counter!(metric::BULK_ACTIONS, "action" => action.as_str()).increment(1);
        Ok(bulk)
    }

    /// Fires one extra `DueTimeReached` for a Scheduled or Paused timer now, with `"trigger":
    /// "manual"` and its own id, without moving its schedule; answers once the broker
    /// confirmed it, or the HTTP target of a timer that has one took the call (an error when
    /// not: nothing is recorded then, and a retry sends an event with a new id).
    pub async fn trigger(&self, key: &TimerKey) -> Result<Triggered> {
        let inner = &self.inner;
        let Some(timer) = inner.store.get(key).await? else {
            return Ok(Triggered::Refused(ControlOutcome::NotFound));
        };
        if let Some(finished) = ControlOutcome::finished(timer.state) {
            return Ok(Triggered::Refused(finished));
        }
        if let Err(refused) = self.still_allowed(key, timer.target.as_ref()) {
            return Ok(Triggered::NotCarried(refused));
        }
        let at = inner.clock.now();
        let span = self
            .spans()
            .map(|s| s.control("trigger", std::slice::from_ref(key)));
        let mut timer = timer;
        // A manual fire belongs to the request that asked for it, when there are spans.
        if let Some(context) = span.as_ref().and_then(spans::context_of) {
            timer.trace = Some(context);
        }
        timer.trace.get_or_insert_with(TraceContext::fresh);
        let envelope = DueTimeReachedEnvelope::manual(&timer, at);
        let body = envelope.to_json();
        let event = super::fire::outbound_of(
            key.clone(),
            envelope.id,
            body.clone(),
            timer.target.clone(),
            timer.message.clone(),
            timer.trace.clone(),
        );
        // An HTTP target's fire goes to the caller, as a due fire does.
        let published = match self.caller_of(timer.target.as_ref()) {
            Some(caller) => match caller.call(&event).await {
                Called::Delivered { .. } => Ok(()),
                Called::Retry { error, .. } | Called::Refused { error } => {
                    Err(Error::unavailable(format!(
                        "the {} target did not take the manually triggered event: {error}",
                        caller.name()
                    )))
                }
                Called::Busy { after } => Err(Error::unavailable(format!(
                    "the {} target has too many calls waiting; try again in {}",
                    caller.name(),
                    humantime::format_duration(after)
                ))),
            },
            None => self
                .within_publish_timeout(
                    "publishing a manually triggered event",
                    inner.broker.publish(std::slice::from_ref(&event)),
                )
                .await
                .and_then(|undelivered| match undelivered.into_iter().next() {
                    Some(refused) => Err(refused.error),
                    None => Ok(()),
                }),
        };
        match (published, span) {
            (Ok(()), Some(mut span)) => span.end(),
            (Ok(()), None) => {}
            (Err(e), span) => {
                if let Some(span) = span {
                    spans::failed(span, e.chain());
                }
                return Err(e);
            }
        }
        ::metrics::counter!(metric::TRIGGERS).increment(1);
        inner.fired.send(super::FiredEvent {
            tenant_id: key.tenant_id.clone(),
            json: String::from_utf8(body).unwrap_or_default(),
        });
        let change = Change::Triggered {
            event_id: envelope.id.to_string(),
        };
        // The event went out; a failed record only leaves it out of the history.
        match inner.store.history().record(key, at, &change).await {
            Ok(_) => self.history_written(1),
            Err(e) => {
                tracing::warn!(timer = %key, error = %e.chain(), "recording a manual trigger in the history failed")
            }
        }
        Ok(Triggered::Fired {
            event_id: envelope.id,
            at,
        })
    }

    /// Up to `limit` entries of `key`'s history after entry `after`, oldest first; `None` when
    /// there is no such timer.
    pub async fn history(
        &self,
        key: &TimerKey,
        after: u64,
        limit: usize,
    ) -> Result<Option<Vec<HistoryEntry>>> {
        let inner = &self.inner;
        if inner.store.get(key).await?.is_none() {
            return Ok(None);
        }
        inner
            .store
            .history()
            .read(key, after, limit)
            .await
            .map(Some)
    }

    /// How many timers are Paused (the `timer.paused` gauge).
    pub async fn paused_count(&self) -> Result<u64> {
        self.inner.store.queries().count(TimerState::Paused).await
    }

    /// Counts `n` history entries written, while history is on.
    pub(super) fn history_written(&self, n: u64) {
        if n > 0 && self.inner.config.history_per_timer > 0 {
            ::metrics::counter!(metric::HISTORY_WRITES).increment(n);
        }
    }
}
