//! The CLI's client of a running service's HTTP API: schedule (one, or a file of commands in
//! batches), get, cancel, list, summary, pause, resume, trigger, complete, history, bulk, status.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::{json, Value};

pub struct Client {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

/// How a client speaks HTTPS: the system's CAs plus `ca_file`, and a client certificate for a
/// service that asks for one (`http.tls_client_ca`).
#[derive(Debug, Default, Clone, clap::Args)]
pub struct ClientTls {
    /// A CA certificate (PEM) to trust for https:// besides the system's (a private CA).
    #[arg(long, value_name = "FILE")]
    pub ca_file: Option<PathBuf>,
    /// A client certificate chain (PEM), for a service with http.tls_client_ca.
    #[arg(long, value_name = "FILE", requires = "client_key")]
    pub client_cert: Option<PathBuf>,
    /// The private key (PEM) of --client-cert.
    #[arg(long, value_name = "FILE", requires = "client_cert")]
    pub client_key: Option<PathBuf>,
}

impl ClientTls {
    /// A reqwest client builder set up for these options.
    pub fn builder(&self) -> anyhow::Result<reqwest::ClientBuilder> {
        let mut builder = reqwest::Client::builder();
        if let Some(file) = &self.ca_file {
            let pem = std::fs::read(file)
                .with_context(|| format!("--ca-file {}: cannot read it", file.display()))?;
            for cert in reqwest::Certificate::from_pem_bundle(&pem)
                .with_context(|| format!("--ca-file {}: not PEM certificates", file.display()))?
            {
                builder = builder.add_root_certificate(cert);
            }
        }
        if let (Some(cert), Some(key)) = (&self.client_cert, &self.client_key) {
            let mut pem = std::fs::read(cert)
                .with_context(|| format!("--client-cert {}: cannot read it", cert.display()))?;
            pem.extend(
                std::fs::read(key)
                    .with_context(|| format!("--client-key {}: cannot read it", key.display()))?,
            );
            let identity = reqwest::Identity::from_pem(&pem).with_context(|| {
                format!(
                    "--client-cert {} with --client-key {}: not a certificate and its key",
                    cert.display(),
                    key.display()
                )
            })?;
            builder = builder.identity(identity);
        }
        Ok(builder)
    }
}

impl Client {
    pub fn new(base: &str, token: Option<String>, tls: &ClientTls) -> anyhow::Result<Self> {
        let http = tls
            .builder()?
            .timeout(Duration::from_secs(30))
            .build()
            .context("cannot build an HTTP client")?;
        Ok(Client {
            base: base.trim_end_matches('/').to_owned(),
            token,
            http,
        })
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> anyhow::Result<Value> {
        let request = match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        };
        let response = request.send().await.map_err(|e| {
            anyhow::anyhow!(
                "cannot reach the timer-service HTTP API at {}: {} (is `timer-service run` \
                 running there? set --url)",
                self.base,
                root_cause(&e)
            )
        })?;
        let status = response.status();
        let header_id = response
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let text = response.text().await.context("reading the response")?;
        let body: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        if !status.is_success() {
            bail!("{}", failure(status, &body, header_id.as_deref()));
        }
        Ok(body)
    }

    /// `POST /v1/timers/batch` with these commands.
    pub async fn schedule_batch(&self, commands: &[Value]) -> anyhow::Result<Value> {
        self.send(
            self.http
                .post(format!("{}/v1/timers/batch", self.base))
                .json(&json!({ "commands": commands })),
        )
        .await
    }

    pub async fn schedule(&self, command: Value) -> anyhow::Result<Value> {
        self.send(
            self.http
                .post(format!("{}/v1/timers", self.base))
                .json(&command),
        )
        .await
    }

    fn timer_url(&self, tenant: &str, id: &str) -> String {
        format!(
            "{}/v1/tenants/{}/timers/{}",
            self.base,
            encode(tenant),
            encode(id)
        )
    }

    pub async fn get(&self, tenant: &str, id: &str) -> anyhow::Result<Value> {
        self.send(self.http.get(self.timer_url(tenant, id))).await
    }

    /// `GET /v1/tenants/{tenant}/timers` with these query parameters.
    pub async fn list(&self, tenant: &str, query: &[(&str, String)]) -> anyhow::Result<Value> {
        let url = format!("{}/v1/tenants/{}/timers", self.base, encode(tenant));
        self.send(self.http.get(url).query(query)).await
    }

    /// `GET /v1/tenants/{tenant}/summary`, or `GET /v1/summary` for every tenant.
    pub async fn summary(
        &self,
        tenant: Option<&str>,
        query: &[(&str, String)],
    ) -> anyhow::Result<Value> {
        let url = match tenant {
            Some(tenant) => format!("{}/v1/tenants/{}/summary", self.base, encode(tenant)),
            None => format!("{}/v1/summary", self.base),
        };
        self.send(self.http.get(url).query(query)).await
    }

    pub async fn cancel(&self, tenant: &str, id: &str) -> anyhow::Result<Value> {
        self.send(self.http.delete(self.timer_url(tenant, id)))
            .await
    }

    /// `POST /v1/tenants/{tenant}/timers/{id}/{action}` (pause, resume, retry, trigger, complete).
    pub async fn act(
        &self,
        tenant: &str,
        id: &str,
        action: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        let request = self
            .http
            .post(format!("{}/{action}", self.timer_url(tenant, id)));
        let request = match body {
            Some(body) => request.json(&body),
            None => request,
        };
        self.send(request).await
    }

    /// `GET /v1/tenants/{tenant}/timers/{id}/history` with these query parameters.
    pub async fn history(
        &self,
        tenant: &str,
        id: &str,
        query: &[(&str, String)],
    ) -> anyhow::Result<Value> {
        let url = format!("{}/history", self.timer_url(tenant, id));
        self.send(self.http.get(url).query(query)).await
    }

    /// `POST /v1/tenants/{tenant}/timers/bulk`: waits as long as the action runs.
    pub async fn bulk(&self, tenant: &str, body: &Value) -> anyhow::Result<Value> {
        let url = format!("{}/v1/tenants/{}/timers/bulk", self.base, encode(tenant));
        // A bulk action over a big tenant takes as long as it takes; no client timeout.
        let request = self
            .http
            .post(url)
            .json(body)
            .timeout(Duration::from_secs(24 * 3600));
        self.send(request).await
    }

    /// `GET /v1/status`
    pub async fn status(&self) -> anyhow::Result<Value> {
        self.send(self.http.get(format!("{}/v1/status", self.base)))
            .await
    }
}

/// An error answer as the CLI prints it: the status, the message, the field it names and, for
/// a 5xx, the request id the service's log has the cause under (from the body, else the
/// `x-request-id` header).
fn failure(status: reqwest::StatusCode, body: &Value, header_id: Option<&str>) -> String {
    let error = &body["error"];
    let message = match (error["message"].as_str(), body.as_str()) {
        (Some(message), _) => message,
        // Not our error body (a proxy's page): its text.
        (None, Some(text)) => text.trim(),
        (None, None) => "",
    };
    let field = error["field"]
        .as_str()
        .map(|f| format!(" (field {f})"))
        .unwrap_or_default();
    let request = error["requestId"]
        .as_str()
        .or(header_id.filter(|_| status.is_server_error()))
        .map(|id| format!(" (requestId {id})"))
        .unwrap_or_default();
    format!("{status}: {message}{field}{request}")
}

fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = e;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

/// Percent-encodes one path segment.
fn encode(segment: &str) -> String {
    url::form_urlencoded::byte_serialize(segment.as_bytes())
        .collect::<String>()
        .replace('+', "%20")
}

/// The `ScheduleTimer` command for the CLI's arguments.
pub fn command(
    tenant: &str,
    id: &str,
    due_at: Option<&str>,
    due_in: Option<Duration>,
    correlation_id: Option<&str>,
    payload: Option<&str>,
) -> anyhow::Result<Value> {
    let mut cmd = json!({ "tenantId": tenant, "serviceCallId": id });
    match (due_at, due_in) {
        (Some(at), None) => cmd["dueAt"] = json!(at),
        (None, Some(d)) => {
            let due = chrono::Duration::from_std(d)
                .ok()
                .and_then(|d| chrono::Utc::now().checked_add_signed(d))
                .context("--in is too far in the future")?;
            cmd["dueTimeMs"] = json!(due.timestamp_millis());
        }
        _ => bail!("give exactly one of --at RFC3339 or --in DURATION"),
    }
    if let Some(c) = correlation_id {
        cmd["correlationId"] = json!(c);
    }
    if let Some(p) = payload {
        let value: Value = serde_json::from_str(p).context("--payload is not valid JSON")?;
        cmd["payload"] = value;
    }
    Ok(cmd)
}

/// The commands in `path`: a JSON array of `ScheduleTimer` commands, or one command per line
/// (NDJSON; empty lines are skipped). A line that is not JSON is an error naming it.
pub fn read_commands(path: &Path) -> anyhow::Result<Vec<Value>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    if text.trim_start().starts_with('[') {
        return serde_json::from_str(&text)
            .with_context(|| format!("{} is not a JSON array of commands", path.display()));
    }
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(n, line)| {
            serde_json::from_str(line)
                .with_context(|| format!("{} line {}: not a JSON command", path.display(), n + 1))
        })
        .collect()
}

/// Sends `commands` in batches of `batch_size`, one batch after the other, and counts the
/// outcomes (`created`, `updated`, ... and `refused` for a command the store's limits refused).
/// A batch the service refuses stops the run: the batches before it are stored, it is not.
pub async fn schedule_all(
    client: &Client,
    commands: &[Value],
    batch_size: usize,
    progress: &indicatif::ProgressBar,
) -> anyhow::Result<Value> {
    let mut counts = serde_json::Map::new();
    for (n, chunk) in commands.chunks(batch_size.max(1)).enumerate() {
        let first = n * batch_size.max(1);
        let answer = client.schedule_batch(chunk).await.with_context(|| {
            let before = match first {
                0 => "nothing was stored".to_owned(),
                n => format!("the {n} commands before it were stored"),
            };
            format!(
                "the batch of commands {first} to {} (counted from 0; commands[i] in the \
                 message is command {first} + i) was refused and not stored; {before}",
                first + chunk.len() - 1
            )
        })?;
        for result in answer["results"].as_array().into_iter().flatten() {
            let outcome = result["outcome"].as_str().unwrap_or("refused");
            let count = counts.entry(outcome).or_insert(json!(0));
            *count = json!(count.as_u64().unwrap_or(0) + 1);
            if let Some(error) = result.get("error") {
                // On stderr whether or not the bar is drawn (a hidden bar prints nothing).
                progress.suspend(|| {
                    eprintln!(
                        "refused: {}/{}: {}",
                        result["tenantId"].as_str().unwrap_or(""),
                        result["serviceCallId"].as_str().unwrap_or(""),
                        error["message"].as_str().unwrap_or("")
                    )
                });
            }
        }
        progress.inc(chunk.len() as u64);
    }
    progress.finish_and_clear();
    Ok(json!({ "sent": commands.len(), "outcomes": counts }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_due_time_past_what_a_date_holds_is_an_error() {
        let far = Duration::from_secs(300_000 * 366 * 24 * 3600);
        let e = command("a", "b", None, Some(far), None, None).unwrap_err();
        assert!(
            e.to_string().contains("--in is too far in the future"),
            "{e}"
        );
        let near = command("a", "b", None, Some(Duration::from_secs(60)), None, None);
        assert!(near.is_ok_and(|c| c["dueTimeMs"].is_i64()));
    }

    /// A 5xx names its request id (the log has the cause under it); a 4xx its field.
    #[test]
    fn an_error_answer_names_its_field_and_request_id() {
        let internal = json!({"error": {"reason": "internal", "message": "an internal error",
                                         "requestId": "r-1"}});
        let status = reqwest::StatusCode::INTERNAL_SERVER_ERROR;
        assert_eq!(
            failure(status, &internal, Some("r-2")),
            "500 Internal Server Error: an internal error (requestId r-1)"
        );
        let bare = json!({"error": {"reason": "unavailable", "message": "the store"}});
        let status = reqwest::StatusCode::SERVICE_UNAVAILABLE;
        assert!(failure(status, &bare, Some("r-2")).ends_with("the store (requestId r-2)"));
        let refused = json!({"error": {"reason": "invalid_id", "message": "empty",
                                        "field": "tenantId"}});
        let status = reqwest::StatusCode::BAD_REQUEST;
        assert_eq!(
            failure(status, &refused, Some("r-3")),
            "400 Bad Request: empty (field tenantId)"
        );
        let page = Value::String("<html>bad gateway</html>\n".into());
        let status = reqwest::StatusCode::BAD_GATEWAY;
        assert_eq!(
            failure(status, &page, None),
            "502 Bad Gateway: <html>bad gateway</html>"
        );
    }
}
