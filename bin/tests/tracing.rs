//! Tracing end to end (#41), with the real binary and a real OTLP receiver of the test's own:
//! OTLP/gRPC (a tonic server of the protocol's own service definition) for NATS, OTLP/HTTP
//! (protobuf decoded with the protocol's own messages, `opentelemetry-proto`) for the others.
//!
//! Per broker with a server (NATS, RabbitMQ, Kafka): a timer scheduled over HTTP with a
//! `traceparent` is fired; the consumer (the plugin's test client) reads a `traceparent` header
//! of the original trace whose parent is the exported `publish` span, a child of `schedule`, a
//! child of the HTTP request's server span, a child of the caller's span; the `claim` and
//! `settle` spans link to the timer's context. A timer scheduled without a context gets a fresh
//! trace (a root server span); a malformed `traceparent` is ignored (counted), never refused.
//! And an exporter whose endpoint is down never holds firing back: every timer fires on time
//! while `timer.telemetry.spans_dropped` counts the spans it could not send; one that never
//! answers does not hold the service's stop for a timeout per waiting batch.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use libtest_mimic::Arguments;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message as _;
use serde_json::{json, Value};
use timer_conformance::e2e::{metric, on_time, write_config, Service};
use timer_conformance::{server_trial, wait_for};
use timer_core::plugin::{BrokerPlugin, StorePlugin};
use timer_core::TraceContext;

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");
/// The caller's context: trace `4bf9…`, its span `00f0…`, sampled.
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";
const WAIT: Duration = Duration::from_secs(30);

fn main() {
    let args = Arguments::from_args();
    let mut trials = Vec::new();
    for broker in timer_brokers::PLUGINS.iter() {
        if broker.test_server.is_none() {
            continue; // the memory broker has no consumer outside the service
        }
        // Both protocols of OTLP, over the brokers.
        let protocol = match broker.kind {
            "nats" => Protocol::Grpc,
            _ => Protocol::Http,
        };
        trials.push(server_trial(
            &format!(
                "tracing::one_trace_from_the_request_to_the_{}_consumer_otlp_{}",
                broker.kind,
                protocol.name()
            ),
            broker.unavailable(),
            move || one_trace(broker, protocol),
        ));
    }
    trials.push(server_trial(
        "tracing::an_exporter_that_cannot_reach_its_endpoint_never_slows_firing",
        None,
        exporter_down,
    ));
    trials.push(server_trial(
        "tracing::a_collector_that_never_answers_does_not_hold_the_stop",
        None,
        collector_hangs,
    ));
    libtest_mimic::run(&args, trials).exit();
}

/// The service on the config `sections` (written to a file in `dir`).
async fn start(dir: &Path, sections: Value) -> Service {
    let config = write_config(dir, &sections);
    Service::start(
        Path::new(BIN),
        dir,
        &[("TIMER_CONFIG", config.display().to_string())],
    )
    .await
}

fn ok<T>(result: timer_core::Result<T>) -> T {
    result.unwrap_or_else(|e| panic!("{}", e.chain()))
}

fn sqlite() -> &'static StorePlugin {
    timer_stores::PLUGINS
        .iter()
        .find(|p| p.kind == "sqlite")
        .expect("the sqlite store")
}

/// One span as the receiver decoded it: ids in hex.
#[derive(Debug, Clone)]
struct Got {
    trace: String,
    span: String,
    parent: String,
    name: String,
    kind: i32,
    attributes: HashMap<String, String>,
    /// (trace id, span id) of each link.
    links: Vec<(String, String)>,
    service: String,
}

type Spans = Arc<Mutex<Vec<Got>>>;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(value: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(n)) => n.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

/// Keeps the spans of an export request.
fn record(sink: &Spans, request: ExportTraceServiceRequest) {
    let mut got = Vec::new();
    for resource in request.resource_spans {
        let service = resource
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .map(|kv| text(kv.value.as_ref()))
            .unwrap_or_default();
        for span in resource.scope_spans.into_iter().flat_map(|s| s.spans) {
            got.push(Got {
                trace: hex(&span.trace_id),
                span: hex(&span.span_id),
                parent: hex(&span.parent_span_id),
                name: span.name,
                kind: span.kind,
                attributes: span
                    .attributes
                    .iter()
                    .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
                    .collect(),
                links: span
                    .links
                    .iter()
                    .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                    .collect(),
                service: service.clone(),
            });
        }
    }
    if let Ok(mut spans) = sink.lock() {
        spans.extend(got);
    }
}

/// How the receiver takes OTLP.
#[derive(Debug, Clone, Copy)]
enum Protocol {
    Grpc,
    Http,
}

impl Protocol {
    fn name(self) -> &'static str {
        match self {
            Protocol::Grpc => "grpc",
            Protocol::Http => "http",
        }
    }
}

/// The gRPC collector service: each export's spans recorded.
struct Collector(Spans);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        record(&self.0, request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// An OTLP receiver of `protocol` on a port of 127.0.0.1: every span it was sent.
async fn receiver(protocol: Protocol) -> (u16, Spans) {
    let spans: Spans = Arc::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the receiver");
    let port = listener.local_addr().expect("addr").port();
    let sink = spans.clone();
    match protocol {
        Protocol::Grpc => {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let service = TraceServiceServer::new(Collector(sink));
            tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(service)
                    .serve_with_incoming(incoming),
            );
        }
        Protocol::Http => {
            let app = axum::Router::new().route(
                "/v1/traces",
                axum::routing::post(move |body: Bytes| {
                    let sink = sink.clone();
                    async move {
                        let Ok(request) = ExportTraceServiceRequest::decode(body) else {
                            return (axum::http::StatusCode::BAD_REQUEST, Vec::new());
                        };
                        record(&sink, request);
                        let answer = ExportTraceServiceResponse::default().encode_to_vec();
                        (axum::http::StatusCode::OK, answer)
                    }
                }),
            );
            tokio::spawn(async move { axum::serve(listener, app).await });
        }
    }
    (port, spans)
}

fn snapshot(spans: &Spans) -> Vec<Got> {
    spans.lock().map(|s| s.clone()).unwrap_or_default()
}

/// Waits for the span `name` (as a prefix) of `trace`.
async fn span_of(spans: &Spans, trace: &str, name: &str) -> Got {
    wait_for(WAIT, || async {
        snapshot(spans)
            .into_iter()
            .find(|s| s.trace == trace && s.name.starts_with(name))
    })
    .await
    .unwrap_or_else(|| {
        let names: Vec<(String, String)> = snapshot(spans)
            .into_iter()
            .map(|s| (s.trace, s.name))
            .collect();
        panic!("no span {name:?} of trace {trace}; got {names:?}")
    })
}

async fn schedule(service: &Service, body: &Value, traceparent: Option<&str>) -> u16 {
    let mut request = service
        .http
        .post(format!("{}/v1/timers", service.base))
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(traceparent) = traceparent {
        request = request.header("traceparent", traceparent);
    }
    request
        .send()
        .await
        .expect("POST /v1/timers")
        .status()
        .as_u16()
}

async fn one_trace(broker_plugin: &'static BrokerPlugin, protocol: Protocol) {
    let broker = broker_plugin.kind;
    let resources = ok((broker_plugin.isolated)("tr"));
    let client = ok(resources.config.test_client().await);
    let store = ok((sqlite().isolated)("tr"));
    let (port, spans) = receiver(protocol).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let service = start(
        dir.path(),
        json!({
            "store": ok(store.config.to_value()),
            "broker": ok(resources.config.to_value()),
            "engine": {"poll_interval": "1s"},
            "telemetry": {
                "otlp_endpoint": format!("http://127.0.0.1:{port}"),
                "protocol": protocol.name(),
                "trace_url": "https://tempo.example/trace/{traceId}",
            },
        }),
    )
    .await;
    let caller = format!("00-{TRACE}-{CALLER_SPAN}-01");
    let timer = |id: &str| json!({"tenantId": "tr", "serviceCallId": id, "dueInMs": 300});
    assert_eq!(
        schedule(&service, &timer("traced"), Some(&caller)).await,
        201
    );
    assert_eq!(schedule(&service, &timer("fresh"), None).await, 201);
    assert_eq!(
        schedule(&service, &timer("malformed"), Some("00-not-a-trace")).await,
        201,
        "a malformed traceparent is ignored, never refused"
    );

    // The consumer's side: each event with a well-formed traceparent header.
    let events = wait_for(WAIT, || async {
        client.events().await.ok().filter(|e| e.len() >= 3)
    })
    .await
    .unwrap_or_else(|| panic!("{broker}: 3 events; log:\n{}", service.log_text()));
    let header_of = |id: &str| {
        let event = events
            .iter()
            .find(|e| {
                serde_json::from_slice::<Value>(&e.body).is_ok_and(|v| v["aggregateId"] == id)
            })
            .unwrap_or_else(|| panic!("{broker}: the event of {id}"));
        let header = event.headers.get("traceparent").unwrap_or_else(|| {
            panic!(
                "{broker}: {id}'s event has no traceparent: {:?}",
                event.headers
            )
        });
        let context = TraceContext::parse(header, None)
            .unwrap_or_else(|e| panic!("{broker}: {id}'s traceparent {header:?}: {e}"));
        let body: Value = serde_json::from_slice(&event.body).expect("an envelope");
        assert_eq!(
            body["traceparent"],
            header.as_str(),
            "{broker}: the envelope's traceparent field is the header's"
        );
        context
    };
    let traced = header_of("traced");
    assert_eq!(
        traced.trace_id(),
        TRACE,
        "{broker}: the caller's trace, carried across the wait"
    );
    let fresh = header_of("fresh");
    let malformed = header_of("malformed");
    assert_ne!(fresh.trace_id(), TRACE);
    assert_ne!(malformed.trace_id(), TRACE);

    // The exported spans: request → schedule → publish, the consumer's parent the publish.
    let server = span_of(&spans, TRACE, "POST /v1/timers").await;
    assert_eq!(
        (server.kind, server.parent.as_str()),
        (2, CALLER_SPAN),
        "{server:?}"
    );
    assert_eq!(server.service, "timer-service");
    let scheduled = span_of(&spans, TRACE, "schedule").await;
    assert_eq!(
        scheduled.parent, server.span,
        "schedule is the request's child"
    );
    assert_eq!(
        scheduled
            .attributes
            .get("timer.service_call_id")
            .map(String::as_str),
        Some("traced")
    );
    let publish = span_of(&spans, TRACE, "publish").await;
    assert_eq!(publish.kind, 4, "a producer span: {publish:?}");
    assert_eq!(
        publish.parent, scheduled.span,
        "publish is the schedule's child"
    );
    assert_eq!(
        publish
            .attributes
            .get("messaging.system")
            .map(String::as_str),
        Some(broker),
        "{publish:?}"
    );
    assert!(
        publish.attributes.contains_key("messaging.message.id"),
        "{publish:?}"
    );
    let destination = publish.attributes.get("messaging.destination.name");
    assert!(
        destination.is_some_and(|d| publish.name == format!("publish {d}")),
        "{broker}: the events destination names the span: {publish:?}"
    );
    assert_eq!(
        traced.parent_id(),
        publish.span,
        "{broker}: the consumer's parent is the publish span"
    );
    // The claim and the settle: traces of their own, linked to the timer's.
    for name in ["claim", "settle"] {
        let linked = wait_for(WAIT, || async {
            snapshot(&spans).into_iter().find(|s| {
                s.name == name
                    && s.links
                        .iter()
                        .any(|(trace, span)| trace == TRACE && *span == scheduled.span)
            })
        })
        .await;
        let linked =
            linked.unwrap_or_else(|| panic!("{broker}: a {name} span linked to the timer"));
        assert_ne!(linked.trace, TRACE, "a {name} is a trace of its own");
    }
    // Without a context: a fresh trace, the request's span its root.
    let root = span_of(&spans, fresh.trace_id(), "POST /v1/timers").await;
    assert_eq!(
        root.parent, "",
        "a fresh trace starts at the request: {root:?}"
    );

    // A command over the broker with its own context: the action's span continues it.
    assert_eq!(
        schedule(
            &service,
            &json!({"tenantId": "tr", "serviceCallId": "later", "dueInMs": 600_000}),
            None
        )
        .await,
        201
    );
    let (command_trace, command_span) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
    let headers = std::collections::BTreeMap::from([(
        "traceparent".to_owned(),
        format!("00-{command_trace}-{command_span}-01"),
    )]);
    let cancel = json!({"type": "CancelTimer", "tenantId": "tr", "serviceCallId": "later"});
    ok(client
        .send_command_with_headers(cancel.to_string().as_bytes(), &headers)
        .await);
    let cancelled = span_of(&spans, command_trace, "control cancel").await;
    assert_eq!(cancelled.parent, command_span, "{broker}: {cancelled:?}");

    let (_, view) = service.get("/v1/tenants/tr/timers/traced").await;
    assert_eq!(view["traceId"], TRACE, "{view}");
    assert_eq!(
        view["traceUrl"],
        format!("https://tempo.example/trace/{TRACE}"),
        "{view}"
    );
    let metrics = service.text("/metrics").await;
    assert!(
        metric(&metrics, "timer_trace_context_ignored{source=\"http\"}") >= 1.0,
        "the malformed traceparent counted:\n{metrics}"
    );
    assert_eq!(service.terminate().await, Some(0), "a clean stop");
}

async fn exporter_down() {
    const N: usize = 100;
    // A port nothing listens on: bound, then let go.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let dir = tempfile::tempdir().expect("tempdir");
    let store = ok((sqlite().isolated)("down"));
    let service = start(
        dir.path(),
        json!({
            "store": ok(store.config.to_value()),
            "telemetry": {"otlp_endpoint": format!("http://127.0.0.1:{port}"), "protocol": "grpc",
                          "export_timeout": "2s"},
        }),
    )
    .await;
    let events = service.events().await;
    let now = chrono::Utc::now().timestamp_millis();
    let commands: Vec<Value> = (0..N)
        .map(|i| {
            json!({"tenantId": "down", "serviceCallId": format!("t{i}"),
                        "dueTimeMs": now + 1_000 + (i as i64) * 10})
        })
        .collect();
    service.schedule_batch(&commands).await;
    if events.wait(N, WAIT).await.is_none() {
        panic!(
            "{} of {N} fired; log:\n{}",
            events.len(),
            service.log_text()
        );
    }
    on_time("exporter down", &events.snapshot());
    let dropped = wait_for(WAIT, || async {
        let text = service.text("/metrics").await;
        let n = metric(
            &text,
            "timer_telemetry_spans_dropped{reason=\"export_failed\"}",
        );
        (n > 0.0).then_some(n)
    })
    .await;
    assert!(
        dropped.is_some(),
        "the spans that could not be sent are counted"
    );
    assert_eq!(service.terminate().await, Some(0), "a clean stop");
}

async fn collector_hangs() {
    // Takes connections and never answers one.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let store = ok((sqlite().isolated)("hang"));
    let service = start(
        dir.path(),
        json!({
            "store": ok(store.config.to_value()),
            "telemetry": {"otlp_endpoint": format!("http://127.0.0.1:{port}"), "protocol": "http",
                          "export_timeout": "1s"},
        }),
    )
    .await;
    // 10,000 schedule spans: far more batches than one export timeout lets out.
    let due = chrono::Utc::now().timestamp_millis() + 3_600_000;
    for chunk in 0..10 {
        let commands: Vec<Value> = (0..1_000)
            .map(|i| json!({"tenantId": "hang", "serviceCallId": format!("t{chunk}-{i}"), "dueTimeMs": due}))
            .collect();
        service.schedule_batch(&commands).await;
    }
    let started = std::time::Instant::now();
    assert_eq!(service.terminate().await, Some(0), "a clean stop");
    // About one export timeout (1 s) for what waits, not one per batch (about 16 s): a bound
    // that fails only when the stop waits batch by batch.
    let took = started.elapsed();
    assert!(took < Duration::from_secs(8), "the stop took {took:?}");
}
