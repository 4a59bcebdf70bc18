//! The engine's spans, through the OpenTelemetry API: the binary installs a tracer that exports
//! them ([`Engine::with_tracer`](super::Engine::with_tracer)); without one the engine makes
//! none, and a timer keeps the context it came with (or a fresh one: `crate::trace`).
//!
//! What is a child and what is a link (the tracing page of the book draws it):
//! - `schedule` (one per timer written): a child of the command's context (the HTTP request's
//!   span, or the `traceparent` of the command or of its broker message); a root when there is
//!   none. Its context is what the timer keeps.
//! - `publish <destination>` (kind producer, one per fire, one-shot and each occurrence of a
//!   series alike): a child of the kept context, so the whole life of a timer is one trace and
//!   the consumer's span (a child of the `traceparent` the message carries) joins it. Ends
//!   when the broker confirmed (or refused) the event, or the HTTP target answered.
//! - `claim` and `settle` (one per store call that took or wrote timers): a trace of their
//!   own (work for many timers at once), linked to the kept context of each timer, at most
//!   [`MAX_LINKS`].
//! - `control <action>` (pause, resume, cancel, retry, complete, trigger): a child of the
//!   current context (the HTTP request's span; for a broker command, its headers' context).

use std::time::SystemTime;

use opentelemetry::global::{BoxedSpan, BoxedTracer};
use opentelemetry::trace::{Link, Span as _, SpanKind, Status, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue};

use crate::model::{ClaimedTimer, TimerKey, Timestamp};
use crate::trace::TraceContext;

/// Links a `claim` or `settle` span keeps at most (the first timers of its batch).
pub const MAX_LINKS: usize = 128;

/// What makes the engine's spans.
pub(crate) struct Spans {
    tracer: BoxedTracer,
}

/// The context a span continues: `trace` as a remote parent, or none (a root).
fn parent(trace: Option<&TraceContext>) -> Context {
    match trace {
        Some(trace) => Context::new().with_remote_span_context(trace.span_context()),
        None => Context::new(),
    }
}

fn about(key: &TimerKey) -> [KeyValue; 2] {
    [
        KeyValue::new("timer.tenant_id", key.tenant_id.clone()),
        KeyValue::new("timer.service_call_id", key.service_call_id.clone()),
    ]
}

/// Links to the kept contexts of `timers`, at most [`MAX_LINKS`].
fn links<'a>(timers: impl IntoIterator<Item = &'a ClaimedTimer>) -> Vec<Link> {
    timers
        .into_iter()
        .filter_map(|t| t.trace.as_ref())
        .take(MAX_LINKS)
        .map(|trace| Link::with_context(trace.span_context()))
        .collect()
}

impl Spans {
    pub(crate) fn new(tracer: BoxedTracer) -> Self {
        Spans { tracer }
    }

    /// The `schedule` span of a timer whose command came in `trace` (its own, or its
    /// transport's).
    pub(crate) fn schedule(&self, key: &TimerKey, trace: Option<&TraceContext>) -> BoxedSpan {
        self.tracer
            .span_builder("schedule")
            .with_kind(SpanKind::Internal)
            .with_attributes(about(key))
            .start_with_context(&self.tracer, &parent(trace))
    }

    /// The `publish` span of one fire of `timer` (its kept context the parent), with the
    /// messaging attributes of the broker (`system`), the destination when the broker names
    /// one, and the event id.
    pub(crate) fn publish(
        &self,
        timer: &ClaimedTimer,
        system: &'static str,
        destination: Option<String>,
        event_id: &uuid::Uuid,
    ) -> BoxedSpan {
        let name = match &destination {
            Some(destination) => format!("publish {destination}"),
            None => "publish".to_owned(),
        };
        let mut attributes = Vec::with_capacity(8);
        attributes.extend(about(&timer.key));
        attributes.extend([
            KeyValue::new("messaging.system", system),
            KeyValue::new("messaging.operation.type", "send"),
            KeyValue::new("messaging.operation.name", "publish"),
            KeyValue::new("messaging.message.id", event_id.to_string()),
            KeyValue::new("timer.due_at", timer.due_at.to_rfc3339()),
        ]);
        if let Some(destination) = destination {
            attributes.push(KeyValue::new("messaging.destination.name", destination));
        }
        if timer.recurrence.is_some() {
            let occurrence = i64::from(timer.occurrences.saturating_add(1));
            attributes.push(KeyValue::new("timer.occurrence", occurrence));
        }
        self.tracer
            .span_builder(name)
            .with_kind(SpanKind::Producer)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &parent(timer.trace.as_ref()))
    }

    /// A `claim` that began at `started` (on the engine's clock) and took `timers` (a trace of
    /// its own, linked to theirs), ended now. Nothing for a claim that took none.
    pub(crate) fn claimed(&self, started: Timestamp, timers: &[ClaimedTimer]) {
        let started = SystemTime::UNIX_EPOCH
            + std::time::Duration::from_millis(u64::try_from(started.as_millis()).unwrap_or(0));
        if timers.is_empty() {
            return;
        }
        self.tracer
            .span_builder("claim")
            .with_kind(SpanKind::Internal)
            .with_start_time(started)
            .with_attributes([KeyValue::new("timer.count", timers.len() as i64)])
            .with_links(links(timers))
            .start_with_context(&self.tracer, &Context::new())
            .end();
    }

    /// A `settle` of `timers` (a trace of its own, linked to theirs), begun now.
    pub(crate) fn settle<'a>(
        &self,
        timers: impl IntoIterator<Item = &'a ClaimedTimer> + Clone,
    ) -> BoxedSpan {
        let count = timers.clone().into_iter().count();
        self.tracer
            .span_builder("settle")
            .with_kind(SpanKind::Internal)
            .with_attributes([KeyValue::new("timer.count", count as i64)])
            .with_links(links(timers))
            .start_with_context(&self.tracer, &Context::new())
    }

    /// A `control <action>` on `keys` (the timer's tenant and id when there is one), a child
    /// of the current context (the HTTP request's span, a broker command's context).
    pub(crate) fn control(&self, action: &str, keys: &[TimerKey]) -> BoxedSpan {
        let mut attributes = vec![KeyValue::new("timer.count", keys.len() as i64)];
        if let [key] = keys {
            attributes.extend(about(key));
        }
        self.tracer
            .span_builder(format!("control {action}"))
            .with_kind(SpanKind::Internal)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &Context::current())
    }
}

/// The context a span gives its children (and a timer keeps), when it is a real one.
pub(crate) fn context_of(span: &BoxedSpan) -> Option<TraceContext> {
    TraceContext::of_span(span.span_context())
}

/// Ends `span` as failed with `error`.
pub(crate) fn failed(mut span: BoxedSpan, error: impl Into<String>) {
    span.set_status(Status::error(error.into()));
    span.end();
}
