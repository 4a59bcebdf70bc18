//! Span export over OTLP (`[telemetry]`): the OpenTelemetry SDK's tracer provider, with a
//! sampler from `telemetry.sampling_ratio`, this instance as its resource, and an exporting
//! processor of our own that never blocks a span's end: finished spans wait in a bounded queue
//! for a task that exports them in batches; what does not fit, or fails to export within
//! `telemetry.export_timeout`, is dropped and counted (`timer.telemetry.spans_dropped`). At the
//! stop, what waits is sent within about one more export timeout.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use opentelemetry::global::BoxedTracer;
use opentelemetry::KeyValue;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    Sampler, SdkTracerProvider, Span, SpanData, SpanExporter as _, SpanProcessor,
};
use opentelemetry_sdk::Resource;
use timer_core::engine::metric;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::config::{OtlpProtocol, TelemetryConfig};

/// Spans exported together at most.
const BATCH: usize = 512;
/// How long a batch waits to fill once its first span is there.
const LINGER: Duration = Duration::from_millis(200);

/// The installed tracer provider and its export task.
pub struct Telemetry {
    provider: SdkTracerProvider,
    stop: CancellationToken,
    exporting: tokio::task::JoinHandle<()>,
    counts: Arc<Counts>,
}

/// Spans exported and dropped since the start.
#[derive(Debug, Default)]
struct Counts {
    exported: AtomicU64,
    dropped: AtomicU64,
}

impl Counts {
    fn dropped(&self, why: &'static str, spans: usize) {
        self.dropped.fetch_add(spans as u64, Ordering::Relaxed);
        metrics::counter!(metric::SPANS_DROPPED, "reason" => why).increment(spans as u64);
    }
}

impl Telemetry {
    /// Starts exporting as `config` says, for the instance `instance_id`; `None` when no
    /// endpoint is set. Installs the provider as the global one.
    pub fn start(config: &TelemetryConfig, instance_id: &str) -> anyhow::Result<Option<Self>> {
        let Some(endpoint) = config.otlp_endpoint.as_deref() else {
            return Ok(None);
        };
        let mut exporter = exporter(config, endpoint)?;
        let mut attributes = vec![
            KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
            KeyValue::new("service.instance.id", instance_id.to_owned()),
        ];
        attributes.extend(
            config
                .resource
                .iter()
                .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
        );
        let resource = Resource::builder_empty()
            .with_service_name("timer-service")
            .with_attributes(attributes)
            .build();
        exporter.set_resource(&resource);
        let (tx, rx) = mpsc::channel(config.max_queued_spans);
        let stop = CancellationToken::new();
        let counts = Arc::new(Counts::default());
        let exporting = tokio::spawn(export(
            rx,
            exporter,
            config.export_timeout,
            stop.clone(),
            counts.clone(),
        ));
        let provider = SdkTracerProvider::builder()
            .with_span_processor(Queue {
                tx,
                counts: counts.clone(),
            })
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                config.sampling_ratio,
            ))))
            .with_resource(resource)
            .build();
        opentelemetry::global::set_tracer_provider(provider.clone());
        Ok(Some(Telemetry {
            provider,
            stop,
            exporting,
            counts,
        }))
    }

    /// The tracer the engine and the HTTP API make their spans with.
    pub fn tracer(&self) -> BoxedTracer {
        opentelemetry::global::tracer("timer-service")
    }

    /// Exports what waits (within the export timeout) and stops; how many spans were
    /// exported and dropped in all.
    pub async fn stop(self) -> (u64, u64) {
        self.stop.cancel();
        let _ = self.exporting.await;
        // Nothing waits in the SDK itself: our processor holds no spans.
        let _ = self.provider.shutdown();
        let counts = &self.counts;
        (
            counts.exported.load(Ordering::Relaxed),
            counts.dropped.load(Ordering::Relaxed),
        )
    }
}

/// The PEM of `telemetry.tls_ca`, checked to hold certificates (`check-config` reads it too).
pub fn ca_of(config: &TelemetryConfig) -> Result<Option<Vec<u8>>, timer_core::Error> {
    let Some(path) = &config.tls_ca else {
        return Ok(None);
    };
    let pem = std::fs::read(path).map_err(|e| {
        timer_core::Error::config(format!(
            "cannot read telemetry.tls_ca {}: {e}",
            path.display()
        ))
    })?;
    match reqwest::Certificate::from_pem_bundle(&pem) {
        Ok(certs) if !certs.is_empty() => Ok(Some(pem)),
        _ => Err(timer_core::Error::config(format!(
            "telemetry.tls_ca {} holds no PEM certificate",
            path.display()
        ))),
    }
}

/// The OTLP exporter of `config`'s protocol, endpoint, headers and CA.
fn exporter(
    config: &TelemetryConfig,
    endpoint: &str,
) -> anyhow::Result<opentelemetry_otlp::SpanExporter> {
    let ca = ca_of(config)?;
    let built = match config.protocol {
        OtlpProtocol::Grpc => {
            let mut headers = axum::http::HeaderMap::new();
            for (name, value) in &config.headers {
                let key =
                    axum::http::HeaderName::from_bytes(name.as_bytes()).with_context(|| {
                        format!("telemetry.headers: {name:?} is not a gRPC metadata name")
                    })?;
                let value = axum::http::HeaderValue::from_str(value).with_context(|| {
                    format!("telemetry.headers.{name}: not a valid gRPC metadata value")
                })?;
                headers.insert(key, value);
            }
            let metadata =
                opentelemetry_otlp::tonic_types::metadata::MetadataMap::from_headers(headers);
            let mut builder = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .with_timeout(config.export_timeout)
                .with_metadata(metadata);
            if endpoint.starts_with("https://") {
                use opentelemetry_otlp::tonic_types::transport::{Certificate, ClientTlsConfig};
                let mut tls = ClientTlsConfig::new().with_native_roots();
                if let Some(pem) = &ca {
                    tls = tls.ca_certificate(Certificate::from_pem(pem));
                }
                builder = builder.with_tls_config(tls);
            }
            builder.build()
        }
        OtlpProtocol::Http => {
            let mut client = reqwest::Client::builder().timeout(config.export_timeout);
            if let Some(pem) = &ca {
                for cert in reqwest::Certificate::from_pem_bundle(pem)? {
                    client = client.add_root_certificate(cert);
                }
            }
            let client = client.build().context("the OTLP HTTP client")?;
            let url = match url::Url::parse(endpoint) {
                Ok(url) if matches!(url.path(), "" | "/") => {
                    format!("{}/v1/traces", endpoint.trim_end_matches('/'))
                }
                _ => endpoint.to_owned(),
            };
            opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_endpoint(url)
                .with_timeout(config.export_timeout)
                .with_headers(
                    config
                        .headers
                        .clone()
                        .into_iter()
                        .collect::<HashMap<_, _>>(),
                )
                .with_http_client(Reqwest(client))
                .build()
        }
    };
    built.with_context(|| format!("the OTLP exporter to telemetry.otlp_endpoint {endpoint}"))
}

/// OTLP over HTTP through the service's own HTTP client (rustls, the system's roots and
/// `telemetry.tls_ca`).
#[derive(Debug)]
struct Reqwest(reqwest::Client);

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for Reqwest {
    async fn send_bytes(
        &self,
        request: opentelemetry_http::Request<opentelemetry_http::Bytes>,
    ) -> Result<
        opentelemetry_http::Response<opentelemetry_http::Bytes>,
        opentelemetry_http::HttpError,
    > {
        let (parts, body) = request.into_parts();
        let answer = self
            .0
            .request(parts.method, parts.uri.to_string())
            .headers(parts.headers)
            .body(body)
            .send()
            .await?;
        let mut response = opentelemetry_http::Response::builder().status(answer.status());
        if let Some(headers) = response.headers_mut() {
            *headers = answer.headers().clone();
        }
        Ok(response.body(answer.bytes().await?)?)
    }
}

/// The span processor: a finished span goes into the bounded queue, or is dropped and counted
/// when the queue is full. Never waits.
#[derive(Debug)]
struct Queue {
    tx: mpsc::Sender<SpanData>,
    counts: Arc<Counts>,
}

impl SpanProcessor for Queue {
    fn on_start(&self, _span: &mut Span, _cx: &opentelemetry::Context) {}

    fn on_end(&self, span: SpanData) {
        if self.tx.try_send(span).is_err() {
            self.counts.dropped("queue_full", 1);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// Exports the queue's spans in batches until `stop`, then what is left.
async fn export(
    mut rx: mpsc::Receiver<SpanData>,
    exporter: opentelemetry_otlp::SpanExporter,
    timeout: Duration,
    stop: CancellationToken,
    counts: Arc<Counts>,
) {
    let warned = AtomicBool::new(false);
    let export_one = |batch| send(&exporter, batch, timeout, &warned, &counts);
    loop {
        let mut batch = Vec::with_capacity(BATCH);
        // The stop first: spans keep coming while it waits, and must not keep it waiting.
        tokio::select! {
            biased;
            _ = stop.cancelled() => {}
            n = rx.recv_many(&mut batch, BATCH) => if n == 0 { return },
        }
        let linger = tokio::time::sleep(LINGER);
        tokio::pin!(linger);
        while batch.len() < BATCH && !stop.is_cancelled() {
            let room = BATCH - batch.len();
            tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                _ = &mut linger => break,
                n = rx.recv_many(&mut batch, room) => if n == 0 { break },
            }
        }
        if stop.is_cancelled() {
            // What waits goes out within about one export timeout: a collector that hangs
            // must not hold the stop for a timeout per batch.
            rx.close();
            while let Ok(span) = rx.try_recv() {
                batch.push(span);
            }
            let deadline = tokio::time::Instant::now() + timeout;
            let mut left = batch.into_iter().peekable();
            while left.peek().is_some() {
                if tokio::time::Instant::now() >= deadline {
                    counts.dropped("shutdown", left.count());
                    break;
                }
                export_one(left.by_ref().take(BATCH).collect()).await;
            }
            return;
        }
        export_one(batch).await;
    }
}

/// Exports one batch within `timeout`; a failed one is dropped and counted (the first
/// failure logged until an export succeeds again).
async fn send(
    exporter: &opentelemetry_otlp::SpanExporter,
    batch: Vec<SpanData>,
    timeout: Duration,
    warned: &AtomicBool,
    counts: &Counts,
) {
    if batch.is_empty() {
        return;
    }
    let n = batch.len();
    let error = match tokio::time::timeout(timeout, exporter.export(batch)).await {
        Ok(Ok(())) => {
            counts.exported.fetch_add(n as u64, Ordering::Relaxed);
            warned.store(false, Ordering::Relaxed);
            return;
        }
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!("no answer within {timeout:?} (telemetry.export_timeout)"),
    };
    counts.dropped("export_failed", n);
    if !warned.swap(true, Ordering::Relaxed) {
        warn!(spans = n, %error, "exporting spans failed; they are dropped (timer.telemetry.spans_dropped counts them; logged again after an export succeeds)");
    }
}
