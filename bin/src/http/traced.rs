//! Each API request in its trace: a server span (`<METHOD> <route>`, a child of the request's
//! `traceparent`, a root without one) whose context replaces the request's `traceparent` and
//! `tracestate` headers (so a timer scheduled by it continues it) and is the current context of
//! the handler (so a control action's span is its child); log lines of the request carry its
//! `trace_id`. Without a tracer provider (no `telemetry.otlp_endpoint`) no span records, and a
//! request's own `traceparent` still names the trace of its log lines.

use axum::extract::{MatchedPath, Request};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use opentelemetry::trace::{
    FutureExt as _, Span as _, SpanKind, Status, TraceContextExt as _, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use timer_core::trace::{TRACEPARENT, TRACESTATE};
use timer_core::TraceContext;
use tracing::Instrument as _;

use crate::http::state::trace_headers;

/// The middleware: see the module.
pub async fn traced(mut request: Request, next: Next) -> Response {
    let carried = trace_headers(request.headers());
    let parent = TraceContext::carried(&carried, "http");
    if parent.is_none() && carried.traceparent.is_some() {
        // Counted (and logged) once here: the handler sees no malformed context again.
        request.headers_mut().remove(TRACEPARENT);
        request.headers_mut().remove(TRACESTATE);
    }
    let method = request.method().as_str().to_owned();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned());
    let name = match &route {
        Some(route) => format!("{method} {route}"),
        None => method.clone(),
    };
    let mut attributes = vec![
        KeyValue::new("http.request.method", method),
        KeyValue::new("url.path", request.uri().path().to_owned()),
    ];
    attributes.extend(route.map(|route| KeyValue::new("http.route", route)));
    let tracer = opentelemetry::global::tracer("timer-service");
    let parent_cx = match &parent {
        Some(parent) => Context::new().with_remote_span_context(parent.span_context()),
        None => Context::new(),
    };
    let span = tracer
        .span_builder(name)
        .with_kind(SpanKind::Server)
        .with_attributes(attributes)
        .start_with_context(&tracer, &parent_cx);
    let recording = span.is_recording();
    let own = recording
        .then(|| TraceContext::of_span(span.span_context()))
        .flatten();
    if let Some(own) = &own {
        let headers = request.headers_mut();
        headers.remove(TRACESTATE);
        for (name, value) in own.headers() {
            if let Ok(value) = HeaderValue::from_str(value) {
                headers.insert(name, value);
            }
        }
    }
    let logged = match own.as_ref().or(parent.as_ref()) {
        Some(context) => tracing::info_span!("request", trace_id = %context.trace_id()),
        None => tracing::Span::none(),
    };
    let cx = Context::new().with_span(span);
    let response = next
        .run(request)
        .with_context(cx.clone())
        .instrument(logged)
        .await;
    if recording {
        let span = cx.span();
        let status = response.status();
        span.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status.as_u16()),
        ));
        if status.is_server_error() || status == StatusCode::REQUEST_TIMEOUT {
            span.set_status(Status::error(status.to_string()));
        }
        span.end();
    }
    response
}
