//! The one way in for commands, from the broker and from HTTP alike: decode with the limits,
//! count, refuse what breaks a rule, schedule in one transaction, wake the firing task.

use std::borrow::Cow;

use opentelemetry::trace::Span as _;
use opentelemetry::KeyValue;

use super::{metrics as metric, spans, Engine};
use crate::error::{Error, Result};
use crate::model::{CancelOutcome, NewTimer, ScheduleOutcome, TimerKey, TimerState};
use crate::outbound::Target;
use crate::trace::{TraceContext, TraceHeaders};
use crate::wire::{decode_command, decode_schedule, Command, Reason, Rejection};

/// What the engine did with one timer given to [`Engine::schedule`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scheduled {
    /// The store took it (or found it finished), as the outcome says.
    Stored(ScheduleOutcome),
    /// Refused before the store: a limit (the reason says which); nothing was stored.
    Refused(Rejection),
}

impl Engine {
    /// Decodes one command as received from a broker (`ScheduleTimer` or `CancelTimer`),
    /// counting it and, when refused, its reason. A schedule is traced as `headers` say when
    /// the command gives no trace context of its own (else in a fresh trace: `crate::trace`).
    pub fn admit(&self, body: &[u8], headers: &TraceHeaders) -> Result<Command, Rejection> {
        let decoded = decode_command(body, &self.inner.limits, self.inner.clock.now());
        self.counted(decoded.and_then(|command| match command {
            Command::Schedule(timer) => {
                let timer = self.traced(timer, headers, "broker");
                self.carried(&timer).map(|()| Command::Schedule(timer))
            }
            command => Ok(command),
        }))
    }

    /// Decodes one `ScheduleTimer` as received over HTTP (a `CancelTimer` is refused with
    /// [`Reason::NotAcceptedHere`]), counting and tracing it like [`admit`](Self::admit).
    pub fn admit_schedule(
        &self,
        body: &[u8],
        headers: &TraceHeaders,
    ) -> Result<NewTimer, Rejection> {
        let decoded = decode_schedule(body, &self.inner.limits, self.inner.clock.now());
        self.counted(decoded.and_then(|timer| {
            let timer = self.traced(timer, headers, "http");
            self.carried(&timer).map(|()| timer)
        }))
    }

    /// Whether the broker can carry this timer's events ([`Broker::check_key`]) and its own
    /// message ([`Broker::check_message`]) to its target ([`Broker::check_target`]), or the
    /// caller to an HTTP target, and `targets` lets its tenant send there: a timer it could
    /// never publish is refused here rather than stored to fail at its due time.
    ///
    /// [`Broker::check_key`]: crate::broker::Broker::check_key
    /// [`Broker::check_message`]: crate::broker::Broker::check_message
    /// [`Broker::check_target`]: crate::broker::Broker::check_target
    fn carried(&self, timer: &NewTimer) -> Result<(), Rejection> {
        let broker = &self.inner.broker;
        let key = &timer.key;
        broker.check_key(key).map_err(|limit| {
            Rejection::new(
                Reason::InvalidId,
                Some(limit.field),
                format!(
                    "{} (a limit of the {} broker)",
                    limit.message,
                    broker.name()
                ),
            )
        })?;
        let caller = self.caller_of(timer.target.as_ref());
        if let Some(message) = &timer.message {
            match caller {
                Some(caller) => caller.check_message(&message.meta),
                None => broker.check_message(&message.meta),
            }
            .map_err(|why| Rejection::new(Reason::InvalidTarget, Some("message"), why))?;
        }
        let Some(target) = &timer.target else {
            return Ok(());
        };
        let name = self
            .target_name(target)
            .map_err(|why| Rejection::new(Reason::InvalidTarget, Some("target"), why))?;
        self.allowed(&key.tenant_id, &name)
    }

    /// Whether `targets` lets a stored timer of `key` send to `target` still: asked again at
    /// each fire, as the patterns may have been narrowed since the timer was taken. (A target
    /// the broker, or the caller, cannot name at all is refused by its publish, alone.)
    pub(super) fn still_allowed(
        &self,
        key: &TimerKey,
        target: Option<&Target>,
    ) -> Result<(), Rejection> {
        match target.map(|target| self.target_name(target)) {
            Some(Ok(name)) => self.allowed(&key.tenant_id, &name),
            None | Some(Err(_)) => Ok(()),
        }
    }

    /// The name `target` has for whoever sends there (the caller of HTTP targets, else the
    /// broker), or why it has none.
    fn target_name(&self, target: &Target) -> Result<String, String> {
        match self.caller_of(Some(target)) {
            Some(caller) => caller.check_target(target),
            None => self.inner.broker.check_target(target),
        }
    }

    /// Whether a pattern of `targets` lets `tenant` send to `name`.
    fn allowed(&self, tenant: &str, name: &str) -> Result<(), Rejection> {
        if self.inner.limits.targets.allows(tenant, name) {
            return Ok(());
        }
        Err(Rejection::new(
            Reason::InvalidTarget,
            Some("target"),
            format!(
                "tenant {tenant:?} may not send to {name:?}: no pattern of targets.allow or \
                 targets.tenants.<tenant>.allow matches it (by default a tenant sends only to \
                 names that start with its id and a dot)"
            ),
        ))
    }

    /// Takes the schedules of `timers` from their tenants' allowances (`limits.rate`), for the
    /// HTTP API: `Err` when a tenant is over its rate (or asks for more than its burst at
    /// once), counted in `timer.commands.throttled` with `path="http"`. The broker path holds
    /// such commands back instead.
    pub async fn within_rate(&self, timers: &[NewTimer]) -> Result<(), super::Throttled> {
        let taken = self
            .inner
            .throttle
            .take_all(timers.iter().map(|t| t.key.tenant_id.as_str()))
            .await;
        throttled_http(taken, timers.len())
    }

    /// Takes one from `tenant`'s allowance of schedules for an action that fires as a schedule
    /// would (a manual trigger, a retry of a Failed timer), for the HTTP API; `Err` (counted as
    /// [`within_rate`](Self::within_rate) counts) when the tenant is over its rate.
    pub async fn within_rate_of(&self, tenant: &str) -> Result<(), super::Throttled> {
        throttled_http(self.inner.throttle.take(tenant, 1).await, 1)
    }

    /// `timer` with the context its command came in: its own, else the one its transport's
    /// `headers` carried, else (when the engine makes no spans, which would start one) a fresh
    /// one.
    fn traced(
        &self,
        mut timer: NewTimer,
        headers: &TraceHeaders,
        source: &'static str,
    ) -> NewTimer {
        if timer.trace.is_none() {
            timer.trace = TraceContext::carried(headers, source);
        }
        if timer.trace.is_none() && self.spans().is_none() {
            timer.trace = Some(TraceContext::fresh());
        }
        timer
    }

    fn counted<T>(&self, decoded: Result<T, Rejection>) -> Result<T, Rejection> {
        ::metrics::counter!(metric::COMMANDS_RECEIVED).increment(1);
        if let Err(r) = &decoded {
            rejected(r.reason);
        }
        decoded
    }

    /// Stores a batch (one transaction) and wakes the firing task if a timer is due sooner than
    /// it planned to look. Timers a limit refuses are not stored (and counted as rejected).
    pub async fn schedule(&self, timers: &[NewTimer]) -> Result<Vec<Scheduled>> {
        if timers.is_empty() {
            return Ok(Vec::new());
        }
        let inner = &self.inner;
        let refused = self.over_tenant_limit(timers).await?;
        // Copies only when a limit refused some, or to keep each timer's `schedule` span (with
        // spans on): the usual batch goes to the store as it is.
        let mut allowed: Cow<[NewTimer]> = if refused.iter().all(Option::is_none) {
            Cow::Borrowed(timers)
        } else {
            let allowed = timers.iter().zip(&refused).filter(|(_, r)| r.is_none());
            Cow::Owned(allowed.map(|(t, _)| t.clone()).collect())
        };
        // Each timer keeps its `schedule` span's context, when the engine makes spans.
        let mut spans = Vec::new();
        if let Some(maker) = self.spans() {
            for timer in allowed.to_mut() {
                let span = maker.schedule(&timer.key, timer.trace.as_ref());
                if let Some(context) = spans::context_of(&span) {
                    timer.trace = Some(context);
                }
                timer.trace.get_or_insert_with(TraceContext::fresh);
                spans.push(span);
            }
        }
        let stored = if allowed.is_empty() {
            Ok(Vec::new())
        } else {
            inner.store.schedule(&allowed, inner.clock.now()).await
        };
        let stored = match stored {
            Ok(stored) => stored,
            Err(e) => {
                let error = e.chain();
                spans
                    .into_iter()
                    .for_each(|span| spans::failed(span, &error));
                return Err(e);
            }
        };
        for (mut span, outcome) in spans.into_iter().zip(&stored) {
            span.set_attribute(KeyValue::new("timer.outcome", format!("{outcome:?}")));
            span.end();
        }
        let mut stored = stored.into_iter();
        let mut results = Vec::with_capacity(timers.len());
        let mut soonest = i64::MAX;
        let mut changed = 0u64;
        for (timer, refusal) in timers.iter().zip(refused) {
            if let Some(rejection) = refusal {
                rejected(rejection.reason);
                results.push(Scheduled::Refused(rejection));
                continue;
            }
            let outcome = stored
                .next()
                .ok_or_else(|| Error::internal("the store returned fewer outcomes than timers"))?;
            if matches!(outcome, ScheduleOutcome::Created | ScheduleOutcome::Updated) {
                changed += 1;
                soonest = soonest.min(timer.due_at.as_millis());
            }
            results.push(Scheduled::Stored(outcome));
        }
        ::metrics::counter!(metric::SCHEDULES_PROCESSED).increment(changed);
        self.history_written(changed);
        self.wake_for(soonest);
        Ok(results)
    }

    /// Which timers `limits.max_pending_per_tenant` refuses: new timers of a tenant that has
    /// that many Scheduled or Paused ones (counting this batch). A timer that already exists as
    /// Scheduled or Paused is a reschedule and always allowed. Instances check independently, so
    /// several of them together may overshoot by up to one batch each.
    async fn over_tenant_limit(&self, timers: &[NewTimer]) -> Result<Vec<Option<Rejection>>> {
        let inner = &self.inner;
        let limit = inner.limits.max_pending_per_tenant;
        if limit == 0 {
            return Ok(vec![None; timers.len()]);
        }
        let counter = inner.store.tenant_counts();
        let mut tenants: Vec<String> = timers.iter().map(|t| t.key.tenant_id.clone()).collect();
        tenants.sort_unstable();
        tenants.dedup();
        let mut counts = counter.live_by_tenant(&tenants).await?;
        let mut refused = Vec::with_capacity(timers.len());
        for timer in timers {
            let count = counts.entry(timer.key.tenant_id.clone()).or_insert(0);
            if *count < limit {
                *count += 1; // as if new; a reschedule counted twice only refuses early
                refused.push(None);
                continue;
            }
            let existing = inner.store.get(&timer.key).await?;
            let reschedule = existing
                .is_some_and(|t| matches!(t.state, TimerState::Scheduled | TimerState::Paused));
            refused.push((!reschedule).then(|| {
                Rejection::new(
                    Reason::TenantLimit,
                    None,
                    format!(
                        "tenant {:?} has {limit} Scheduled or Paused timers already \
                         (limits.max_pending_per_tenant); nothing was stored",
                        timer.key.tenant_id
                    ),
                )
            }));
        }
        Ok(refused)
    }

    /// Cancels a timer (the HTTP API's DELETE and the broker's `CancelTimer`).
    pub async fn cancel(&self, key: &TimerKey) -> Result<CancelOutcome> {
        let span = self
            .spans()
            .map(|s| s.control("cancel", std::slice::from_ref(key)));
        let cancelled = self.inner.store.cancel(key, self.inner.clock.now()).await;
        let outcome = match (cancelled, span) {
            (Ok(outcome), Some(mut span)) => {
                span.set_attribute(KeyValue::new("timer.outcome", format!("{outcome:?}")));
                span.end();
                outcome
            }
            (Err(e), Some(span)) => {
                spans::failed(span, e.chain());
                return Err(e);
            }
            (cancelled, None) => cancelled?,
        };
        let label = match outcome {
            CancelOutcome::Cancelled => "cancelled",
            CancelOutcome::Firing => "firing",
            CancelOutcome::NotFound => "not_found",
            _ => "already_finished",
        };
        ::metrics::counter!(metric::CANCELS_PROCESSED, "outcome" => label).increment(1);
        Ok(outcome)
    }
}

/// `taken`, counting its `n` schedules in `timer.commands.throttled` (`path="http"`) when
/// they were over the rate.
fn throttled_http(taken: Result<(), super::Throttled>, n: usize) -> Result<(), super::Throttled> {
    if taken.is_err() {
        ::metrics::counter!(metric::COMMANDS_THROTTLED, "path" => "http").increment(n as u64);
    }
    taken
}

pub(super) fn rejected(reason: Reason) {
    ::metrics::counter!(metric::COMMANDS_REJECTED, "reason" => reason.as_str()).increment(1);
}
