//! `schedule`, `get`, `cancel`: talk to a running service's HTTP API.

use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::{json, Value};

pub struct Client {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl Client {
    pub fn new(base: &str, token: Option<String>) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder()
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
        let text = response.text().await.context("reading the response")?;
        let body: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        if !status.is_success() {
            let message = body["error"]["message"].as_str().unwrap_or("").to_owned();
            let field = body["error"]["field"]
                .as_str()
                .map(|f| format!(" (field {f})"))
                .unwrap_or_default();
            bail!("{status}: {message}{field}");
        }
        Ok(body)
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
            let due = chrono::Utc::now()
                + chrono::Duration::from_std(d).context("--in is too far in the future")?;
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
