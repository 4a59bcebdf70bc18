//! HTTP targets: a timer whose `target` is `{"url": "https://…", "method": "POST", "headers":
//! {…}}` is called at its due time, beside whatever broker is configured, signed per the
//! Standard Webhooks spec. Any 2xx is delivered; 408, 429 (with its `Retry-After`), 5xx,
//! connection errors and timeouts are retried with the engine's backoff; a redirect (not
//! followed) or another 4xx fails the timer at once. The engine runs each call on its own task
//! ([`Caller`](timer_core::Caller)); this module bounds them per host and overall, so one slow
//! host never delays another's calls, and hands a host's turns round between the tenants calling
//! it (`turns.rs`), so one tenant's backlog there does not delay the others'. See `README.md`
//! here.

mod address;
pub mod config;
mod sign;
mod turns;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use reqwest::{Method, StatusCode};
use serde_json::Value;
use timer_core::{Called, Caller, Error, MessageMeta, OutboundEvent, Target};
use tokio::sync::Semaphore;
use url::Url;

pub use address::not_public;
pub use config::{TenantWebhooks, WebhookConfig};
pub use sign::signature;
use turns::{Turn, Turns};

/// Metric names (`timer.webhook.*`), labelled by `host`, with their descriptions.
pub mod metric {
    use timer_core::engine::metric::Kind;

    /// Calls that ended, by `host` and `outcome` (`delivered`, `retry`, `refused`, `busy`).
    pub const CALLS: &str = "timer.webhook.calls";
    /// How long calls took, answer included, by `host`.
    pub const CALL_DURATION: &str = "timer.webhook.call.duration";

    /// Every webhook metric: name, kind, description.
    pub const ALL: &[(&str, Kind, &str)] = &[
        (
            CALLS,
            Kind::Counter,
            "Calls of HTTP targets, by host (label host, host:port) and outcome (label outcome): delivered (2xx), retry (5xx, 408, 429, no connection, timeout), refused (another 4xx, a redirect), busy (the host's line full with the tenant's share of it, or too many calls waiting in all: handed back)",
        ),
        (
            CALL_DURATION,
            Kind::Histogram,
            "How long calls of HTTP targets took, answer included, by host (label host)",
        ),
    ];

    /// Registers every description with the installed recorder.
    pub fn describe() {
        for (name, kind, text) in ALL {
            match kind {
                Kind::Histogram => {
                    ::metrics::describe_histogram!(*name, ::metrics::Unit::Seconds, *text)
                }
                _ => ::metrics::describe_counter!(*name, *text),
            }
        }
    }
}

/// Headers the service sets itself, which a target or message may not set.
const RESERVED: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-authorization",
    "proxy-connection",
    "trailer",
    "expect",
    "upgrade",
    "te",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
];

/// The methods an HTTP target may use.
const METHODS: &[&str] = &["POST", "PUT", "PATCH"];

/// The longest `Retry-After` honoured; a longer one waits this long.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 3600);

/// Most hosts with metrics of their own; calls to further hosts count under `other`.
const METRIC_HOSTS: usize = 1_000;

/// The longest cut of an answer that goes into an error.
const ERROR_CUT: usize = 300;

/// An HTTP target, as read from a timer's `target`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpTarget {
    pub url: Url,
    pub method: Method,
    pub headers: HeaderMap,
}

impl HttpTarget {
    /// Reads and checks `target`; `Err` says what is wrong with which field.
    pub fn parse(target: &Target, allow_private: bool) -> Result<Self, String> {
        for field in target.fields().keys() {
            if !matches!(field.as_str(), "url" | "method" | "headers") {
                return Err(format!(
                    "target.{field} is not a field of an HTTP target (url, method, headers)"
                ));
            }
        }
        let text = target
            .text("url")
            .ok_or("target.url must be a string (an http:// or https:// URL)")?;
        let url = Url::parse(text).map_err(|e| format!("target.url is not a URL: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(format!(
                "target.url: scheme {:?} is not http or https",
                url.scheme()
            ));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(
                "target.url carries credentials; send them in target.headers instead (a URL \
                 goes into logs and errors, headers do not)"
                    .into(),
            );
        }
        let Some(host) = url.host() else {
            return Err("target.url has no host".into());
        };
        if !allow_private {
            let ip = match host {
                url::Host::Ipv4(ip) => Some(std::net::IpAddr::V4(ip)),
                url::Host::Ipv6(ip) => Some(std::net::IpAddr::V6(ip)),
                url::Host::Domain(name) => {
                    let name = name.trim_end_matches('.').to_ascii_lowercase();
                    if name == "localhost" || name.ends_with(".localhost") {
                        return Err(format!(
                            "target.url: {name} is a loopback name; webhooks go to public \
                             addresses unless webhooks.allow_private_networks = true"
                        ));
                    }
                    None
                }
            };
            if let Some(why) = ip.and_then(not_public) {
                return Err(format!(
                    "target.url: {} is {why}; webhooks go to public addresses unless \
                     webhooks.allow_private_networks = true",
                    url.host_str().unwrap_or_default()
                ));
            }
        }
        let method = match target.fields().get("method") {
            None => Method::POST,
            Some(Value::String(m)) if METHODS.contains(&m.to_ascii_uppercase().as_str()) => {
                Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                    .map_err(|_| format!("target.method {m:?} is not a method"))?
            }
            Some(other) => {
                return Err(format!(
                    "target.method must be one of {}, not {other}",
                    METHODS.join(", ")
                ))
            }
        };
        let mut headers = HeaderMap::new();
        match target.fields().get("headers") {
            None => {}
            Some(Value::Object(fields)) => {
                for (name, value) in fields {
                    let Value::String(value) = value else {
                        return Err(format!("target.headers.{name} must be a string"));
                    };
                    let (name, mut value) = header(name, value)
                        .map_err(|why| format!("target.headers.{name}: {why}"))?;
                    // Kept out of `Debug`: a target's headers may carry credentials.
                    value.set_sensitive(true);
                    headers.append(name, value);
                }
            }
            Some(_) => return Err("target.headers must be an object of strings".into()),
        }
        Ok(HttpTarget {
            url,
            method,
            headers,
        })
    }

    /// `host:port`, as calls are bounded and metrics labelled.
    fn host(&self) -> String {
        format!(
            "{}:{}",
            self.url.host_str().unwrap_or_default(),
            self.url.port_or_known_default().unwrap_or_default()
        )
    }
}

/// One header a target or message may set.
fn header(name: &str, value: &str) -> Result<(HeaderName, HeaderValue), String> {
    let name = HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| "not a valid HTTP header name".to_owned())?;
    if RESERVED.contains(&name.as_str()) {
        return Err("set by the service itself".into());
    }
    let value =
        HeaderValue::from_str(value).map_err(|_| "not a valid HTTP header value".to_owned())?;
    Ok((name, value))
}

/// Calls HTTP targets.
pub struct Webhooks {
    config: WebhookConfig,
    client: reqwest::Client,
    /// Calls at once, over all hosts.
    all: Semaphore,
    /// Per host: its calls at once, and the calls that hold or wait for a turn, per tenant.
    turns: Turns,
    /// The hosts that have metrics of their own ([`METRIC_HOSTS`] at most).
    metric_hosts: Mutex<std::collections::HashSet<String>>,
}

impl Webhooks {
    pub fn new(config: WebhookConfig) -> Result<Self, Error> {
        config.check()?;
        let mut client = reqwest::Client::builder()
            // No proxy from the environment (HTTP_PROXY …): a proxy would resolve and connect
            // where the public-address check cannot see.
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(config.timeout)
            .connect_timeout(config.connect_timeout)
            .pool_max_idle_per_host(config.per_host_concurrency)
            .user_agent(concat!("timer-service/", env!("CARGO_PKG_VERSION")));
        if !config.allow_private_networks {
            client = client.dns_resolver(Arc::new(address::PublicOnly));
        }
        let client = client
            .build()
            .map_err(|e| Error::config("cannot build the webhook HTTP client").with_source(e))?;
        Ok(Webhooks {
            all: Semaphore::new(config.concurrency),
            turns: Turns::new(turns::Bounds {
                per_host: config.per_host_concurrency,
                line: config
                    .per_host_concurrency
                    .saturating_add(config.per_host_waiting),
                all: config.concurrency.saturating_add(config.max_waiting),
            }),
            config,
            client,
            metric_hosts: Mutex::new(std::collections::HashSet::new()),
        })
    }

    /// `host` as metrics label it: itself, or `other` past [`METRIC_HOSTS`] hosts.
    fn metric_host(&self, host: &str) -> String {
        match self.metric_hosts.lock() {
            Ok(mut known) if known.contains(host) || known.len() < METRIC_HOSTS => {
                known.insert(host.to_owned());
                host.to_owned()
            }
            _ => "other".to_owned(),
        }
    }

    /// Calls `target` with `event`, on `turn` (told when the request starts: the host's pace is
    /// timed from there).
    async fn send(
        &self,
        target: &HttpTarget,
        event: &OutboundEvent,
        turn: &mut Turn<'_>,
    ) -> Called {
        let mut headers = target.headers.clone();
        match &event.message {
            Some(meta) => {
                if let Some(content_type) = &meta.content_type {
                    match HeaderValue::from_str(content_type) {
                        Ok(v) => {
                            headers.insert(CONTENT_TYPE, v);
                        }
                        Err(_) => {
                            return Called::Refused {
                                error: "message.contentType is not a valid HTTP header value"
                                    .into(),
                            }
                        }
                    }
                }
                for (name, value) in &meta.headers {
                    match header(name, value) {
                        Ok((name, value)) => {
                            headers.insert(name, value);
                        }
                        Err(why) => {
                            return Called::Refused {
                                error: format!("message.headers.{name}: {why}"),
                            }
                        }
                    }
                }
            }
            None => {
                headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            }
        }
        // The fire's trace context, unless the target or the message gave such headers.
        let own = headers.contains_key("traceparent") || headers.contains_key("tracestate");
        for (name, value) in event.trace_headers().filter(|_| !own) {
            if let Ok(value) = HeaderValue::from_str(value) {
                headers.insert(HeaderName::from_static(name), value);
            }
        }
        let id = event.id.to_string();
        let timestamp = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or_default();
        let keys = self.config.keys_of(&event.key.tenant_id);
        let signed = signature(&keys, &id, timestamp, &event.body);
        for (name, value) in [
            ("webhook-id", Some(id)),
            ("webhook-timestamp", Some(timestamp.to_string())),
            ("webhook-signature", signed),
        ] {
            if let Some(value) = value.and_then(|v| HeaderValue::from_str(&v).ok()) {
                headers.insert(HeaderName::from_static(name), value);
            }
        }
        let request = self
            .client
            .request(target.method.clone(), target.url.clone())
            .headers(headers)
            .body(event.body.clone());
        turn.call_starts();
        let answer = match request.send().await {
            Ok(answer) => answer,
            Err(e) => {
                return Called::Retry {
                    error: format!(
                        "calling {}: {}",
                        target.host(),
                        timer_core::error::one_line(&e.without_url())
                    ),
                    not_before: None,
                }
            }
        };
        let status = answer.status();
        let retry_after = answer
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(retry_after);
        let location = answer
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = read_some(answer, self.config.max_answer_bytes).await;
        let said = format!("{} answered {}", target.host(), status_text(status));
        if status.is_success() {
            Called::Delivered { answer: said }
        } else if status.is_redirection() {
            Called::Refused {
                error: format!(
                    "{said}, a redirect to {}: redirects are not followed; use the final URL",
                    location.as_deref().unwrap_or("nowhere")
                ),
            }
        } else if status.is_server_error()
            || status == StatusCode::REQUEST_TIMEOUT
            || status == StatusCode::TOO_MANY_REQUESTS
        {
            Called::Retry {
                error: with_cut(&said, &body),
                not_before: retry_after,
            }
        } else {
            Called::Refused {
                error: with_cut(&said, &body),
            }
        }
    }
}

#[async_trait]
impl Caller for Webhooks {
    fn name(&self) -> &'static str {
        "webhook"
    }

    fn takes(&self, target: &Target) -> bool {
        target.fields().contains_key("url")
    }

    fn check_target(&self, target: &Target) -> Result<String, String> {
        HttpTarget::parse(target, self.config.allow_private_networks).map(|t| t.url.to_string())
    }

    fn check_message(&self, meta: &MessageMeta) -> Result<(), String> {
        if let Some(content_type) = &meta.content_type {
            HeaderValue::from_str(content_type).map_err(|_| {
                "message.contentType is not a valid HTTP header value (an HTTP target)".to_owned()
            })?;
        }
        for (name, value) in &meta.headers {
            header(name, value)
                .map_err(|why| format!("message.headers.{name}: {why} (an HTTP target)"))?;
        }
        Ok(())
    }

    async fn call(&self, event: &OutboundEvent) -> Called {
        let target = match event
            .target
            .as_ref()
            .map(|t| HttpTarget::parse(t, self.config.allow_private_networks))
        {
            Some(Ok(target)) => target,
            Some(Err(why)) => return Called::Refused { error: why },
            None => {
                return Called::Refused {
                    error: "no HTTP target".into(),
                }
            }
        };
        let host = target.host();
        let label = self.metric_host(&host);
        let busy = |after| {
            ::metrics::counter!(metric::CALLS, "host" => label.clone(), "outcome" => "busy")
                .increment(1);
            Called::Busy { after }
        };
        let entry = match self.turns.enter(&host, &event.key.tenant_id) {
            Ok(entry) => entry,
            Err(after) => return busy(after),
        };
        // The host's turn first: calls waiting for a slow host hold none of the others'. A call
        // waits for its turns at most `webhooks.timeout` (its timer cannot be cancelled while
        // it waits): then it is handed back.
        let both_turns = async {
            let host_turn = entry.turn().await;
            let all = self.all.acquire().await.ok()?;
            Some((host_turn, all))
        };
        let Ok(Some((mut host_turn, _all))) =
            tokio::time::timeout(self.config.timeout, both_turns).await
        else {
            // It waited its time already: again soon.
            return busy(turns::AGAIN_SOONEST);
        };
        let started = Instant::now();
        let called = self.send(&target, event, &mut host_turn).await;
        let outcome = match &called {
            Called::Delivered { .. } => "delivered",
            Called::Retry { .. } => "retry",
            Called::Refused { .. } => "refused",
            Called::Busy { .. } => "busy",
        };
        ::metrics::histogram!(metric::CALL_DURATION, "host" => label.clone())
            .record(started.elapsed().as_secs_f64());
        ::metrics::counter!(metric::CALLS, "host" => label, "outcome" => outcome).increment(1);
        drop(host_turn);
        match called {
            Called::Delivered { answer } => Called::Delivered {
                answer: format!("{answer} in {} ms", started.elapsed().as_millis()),
            },
            other => other,
        }
    }
}

/// `503 Service Unavailable`.
fn status_text(status: StatusCode) -> String {
    match status.canonical_reason() {
        Some(reason) => format!("{} {reason}", status.as_u16()),
        None => status.as_u16().to_string(),
    }
}

/// `said`, and the start of the answer's body if it has one.
fn with_cut(said: &str, body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    if text.is_empty() {
        return said.to_owned();
    }
    let mut end = text.len().min(ERROR_CUT);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let more = if end < text.len() { " …" } else { "" };
    format!("{said}: {}{more}", &text[..end])
}

/// Up to `limit` bytes of the answer's body; the rest is dropped.
async fn read_some(mut answer: reqwest::Response, limit: usize) -> Vec<u8> {
    let mut body = Vec::new();
    while body.len() < limit {
        match answer.chunk().await {
            Ok(Some(chunk)) => {
                let room = limit - body.len();
                body.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            _ => break,
        }
    }
    body
}

/// A `Retry-After` value: seconds, or an HTTP date.
fn retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    let wait = match value.parse::<u64>() {
        Ok(seconds) => Duration::from_secs(seconds),
        Err(_) => {
            let at = httpdate::parse_http_date(value).ok()?;
            at.duration_since(SystemTime::now()).unwrap_or_default()
        }
    };
    Some(wait.min(MAX_RETRY_AFTER))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(json: serde_json::Value) -> Target {
        let Value::Object(fields) = json else {
            unreachable!("an object")
        };
        Target::new(fields)
    }

    #[test]
    fn targets_are_read_and_checked() {
        let t = HttpTarget::parse(
            &target(serde_json::json!({
                "url": "https://hooks.example.com/due?x=1",
                "method": "put",
                "headers": {"Authorization": "Bearer x"}
            })),
            false,
        )
        .unwrap();
        assert_eq!(t.method, Method::PUT);
        assert_eq!(t.host(), "hooks.example.com:443");
        assert_eq!(t.headers.get("authorization").unwrap(), "Bearer x");

        for (json, says) in [
            (serde_json::json!({"url": 3}), "target.url must be a string"),
            (
                serde_json::json!({"url": "ftp://x.com/"}),
                "not http or https",
            ),
            (
                serde_json::json!({"url": "https://u:p@x.com/"}),
                "credentials",
            ),
            (
                serde_json::json!({"url": "http://169.254.169.254/latest"}),
                "link-local",
            ),
            (serde_json::json!({"url": "http://10.0.0.1/"}), "private"),
            (serde_json::json!({"url": "http://[::1]:8080/"}), "loopback"),
            (
                serde_json::json!({"url": "http://localhost:8080/"}),
                "loopback name",
            ),
            (
                serde_json::json!({"url": "https://x.com/", "method": "GET"}),
                "target.method",
            ),
            (
                serde_json::json!({"url": "https://x.com/", "topic": "t"}),
                "target.topic",
            ),
            (
                serde_json::json!({"url": "https://x.com/", "headers": {"webhook-id": "1"}}),
                "target.headers.webhook-id: set by the service",
            ),
            (
                serde_json::json!({"url": "https://x.com/", "headers": {"a b": "1"}}),
                "not a valid HTTP header name",
            ),
        ] {
            let e = HttpTarget::parse(&target(json.clone()), false).unwrap_err();
            assert!(e.contains(says), "{json}: {e}");
        }
        // Private addresses are allowed when the config says so.
        HttpTarget::parse(
            &target(serde_json::json!({"url": "http://127.0.0.1:9/"})),
            true,
        )
        .unwrap();
    }

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        assert_eq!(retry_after("7"), Some(Duration::from_secs(7)));
        assert_eq!(
            retry_after("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::ZERO)
        );
        assert_eq!(retry_after("soon"), None);
        assert_eq!(retry_after("99999999999"), Some(MAX_RETRY_AFTER), "capped");
    }

    #[test]
    fn answers_are_cut_for_errors() {
        assert_eq!(
            with_cut("h answered 404 Not Found", b""),
            "h answered 404 Not Found"
        );
        let long = "é".repeat(400);
        let cut = with_cut("s", long.as_bytes());
        assert!(cut.ends_with(" …") && cut.len() < 320, "{cut}");
    }
}
