//! Helpers for end-to-end tests on the built `timer-service` binary: start it on a free port
//! with a config given as environment or as a TOML file, wait until it is ready, read its event
//! stream, stop it with SIGTERM or SIGKILL (by the pid we started, never by name); run a command
//! to its end; restart a test server through its script; read figures off event envelopes.

use std::fmt::Display;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};
use tokio::process::{Child, Command};

use crate::wait_for;

mod events;
mod processes;
mod timers;

pub use events::{
    count_by_key, due_ms, lateness_at_reader, lateness_ms, metric, on_time, percentiles, timer_of,
    EventLog, Received, ON_TIME_P99_MS,
};
pub use processes::{
    missing_var, refused_to_run, run_ok, run_to_end, Exit, PrivateServer, RestartOnDrop,
    ScriptedServer,
};
pub use timers::{
    assert_reached, catch_holding_leases, drained, freeze_holding_leases, new_timers,
    not_reached_within, recovered_after, store_timers,
};

/// A running service process.
pub struct Service {
    child: Child,
    pub addr: SocketAddr,
    pub base: String,
    pub log: PathBuf,
    pub http: reqwest::Client,
}

/// A free port on 127.0.0.1 (the OS picks it; the service binds it right after).
pub fn free_addr() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local addr")
}

/// The wall clock, epoch ms.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// A `ScheduleTimer` command body.
pub fn schedule(tenant: &str, id: &str, due_ms: i64) -> String {
    json!({ "tenantId": tenant, "serviceCallId": id, "dueTimeMs": due_ms }).to_string()
}

/// Writes `config` (sections as JSON objects: `store`, `broker`, `engine`, ...) to
/// `dir/timer-service.toml` for `TIMER_CONFIG`; keys whose value is `null` are left out.
pub fn write_config(dir: &Path, config: &Value) -> PathBuf {
    fn without_nulls(v: &Value) -> Value {
        match v {
            Value::Object(map) => Value::Object(
                map.iter()
                    .filter(|(_, v)| !v.is_null())
                    .map(|(k, v)| (k.clone(), without_nulls(v)))
                    .collect(),
            ),
            other => other.clone(),
        }
    }
    let text = toml::to_string(&without_nulls(config)).expect("the config renders as TOML");
    let path = dir.join("timer-service.toml");
    std::fs::write(&path, text).expect("write the config file");
    path
}

impl Service {
    /// Starts `bin run` in `dir` with `env` (`TIMER_*` settings) and waits for `/readyz`.
    pub async fn start(bin: &Path, dir: &Path, env: &[(&str, String)]) -> Service {
        Service::start_with(bin, dir, env, "http", reqwest::Client::new()).await
    }

    /// [`Service::start`], reached at `scheme://` (`https` with `http.tls_cert` set) with
    /// `http`, a client that trusts the service's certificate.
    pub async fn start_with(
        bin: &Path,
        dir: &Path,
        env: &[(&str, String)],
        scheme: &str,
        http: reqwest::Client,
    ) -> Service {
        let addr = free_addr();
        let log = dir.join(format!("service-{}.log", addr.port()));
        let log_file = std::fs::File::create(&log).expect("create log file");
        let mut command = Command::new(bin);
        command
            .arg("run")
            .current_dir(dir)
            .env("TIMER_HTTP__ADDR", addr.to_string())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log_file))
            .kill_on_drop(true);
        for (k, v) in env {
            command.env(k, v);
        }
        let child = command.spawn().expect("spawn timer-service");
        let mut service = Service {
            child,
            addr,
            base: format!("{scheme}://{addr}"),
            log,
            http,
        };
        service.wait_ready().await;
        service
    }

    pub fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    async fn wait_ready(&mut self) {
        if !self.ready_again(Duration::from_secs(60)).await {
            let status = self.child.try_wait().ok().flatten();
            panic!(
                "timer-service did not become ready (exit status {status:?}); log:\n{}",
                self.log_text()
            );
        }
    }

    /// Waits until `/readyz` answers `status` (`503` while cut off, `200` after), within
    /// `deadline`; how long that took, ms.
    pub async fn readyz_turns(&self, status: u16, deadline: Duration) -> Option<i64> {
        let from = now_ms();
        wait_for(deadline, || async {
            let (got, _) = self
                .send(reqwest::Method::GET, "/readyz", None)
                .await
                .ok()?;
            (got == status).then_some(())
        })
        .await
        .map(|()| now_ms() - from)
    }

    /// Cuts `proxy` (the service's way to a server) and waits until `/readyz` answers 503
    /// (within 10 s, else the test fails): when the cut began, and the not-ready answer.
    pub async fn cut_off(&self, proxy: &crate::proxy::Proxy) -> CutOff {
        let (at, at_ms) = (tokio::time::Instant::now(), now_ms());
        proxy.cut();
        let not_ready_ms = self
            .readyz_turns(503, Duration::from_secs(10))
            .await
            .unwrap_or_else(|| self.fail("/readyz answers 503 within 10 s of the cut"));
        let (_, readyz) = self.get("/readyz").await;
        CutOff {
            at,
            at_ms,
            not_ready_ms,
            readyz,
        }
    }

    /// Heals `proxy` and waits until `/readyz` answers 200 again (within 60 s, else the test
    /// fails): when the heal came (epoch ms), and how long after it the service was ready.
    pub async fn heal(&self, proxy: &crate::proxy::Proxy) -> (i64, i64) {
        let healed_ms = now_ms();
        proxy.heal();
        let ready = self
            .readyz_turns(200, Duration::from_secs(60))
            .await
            .unwrap_or_else(|| self.fail("/readyz answers 200 again after the cut"));
        (healed_ms, ready)
    }

    /// Waits until `/readyz` answers 200 (again, after an outage), within `deadline`.
    pub async fn ready_again(&self, deadline: Duration) -> bool {
        self.readyz_turns(200, deadline).await.is_some()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Fails the test: `what` did not happen, with the service's log.
    pub fn fail(&self, what: impl Display) -> ! {
        panic!("{what}; log:\n{}", self.log_text())
    }

    /// SIGKILL: the crash.
    pub async fn kill9(mut self) {
        self.child.start_kill().expect("SIGKILL");
        let _ = self.child.wait().await;
    }

    /// Waits up to `within` for the process to end by itself: its exit code (`None` when a
    /// signal ended it), or `Err` when it still runs.
    pub async fn exited_within(&mut self, within: Duration) -> Result<Option<i32>, ()> {
        match tokio::time::timeout(within, self.child.wait()).await {
            Ok(exit) => Ok(exit.expect("wait").code()),
            Err(_) => Err(()),
        }
    }

    /// SIGTERM, then waits for exit; returns the exit code.
    pub async fn terminate(mut self) -> Option<i32> {
        signal(self.pid(), "-TERM").await;
        let exit = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("service exits within 30 s of SIGTERM")
            .expect("wait");
        exit.code()
    }

    /// Sends `method path` with a JSON `body`; the status and the JSON answer (`Null` when it is
    /// not JSON).
    pub async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<String>,
    ) -> reqwest::Result<(u16, Value)> {
        let mut request = self.http.request(method, format!("{}{path}", self.base));
        if let Some(body) = body {
            request = request
                .header("content-type", "application/json")
                .body(body);
        }
        let r = request.send().await?;
        let status = r.status().as_u16();
        Ok((status, r.json().await.unwrap_or(Value::Null)))
    }

    /// Sends `method path`, with `Authorization: Bearer key` when there is a key and `body` as
    /// JSON when there is one; the answer as it came (a request that cannot be sent fails the
    /// test, naming it).
    pub async fn respond(
        &self,
        method: reqwest::Method,
        path: &str,
        key: Option<&str>,
        body: Option<&Value>,
    ) -> reqwest::Response {
        let mut request = self
            .http
            .request(method.clone(), format!("{}{path}", self.base));
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        if let Some(body) = body {
            request = request.json(body);
        }
        request
            .send()
            .await
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    pub async fn post(&self, path: &str, body: impl Into<String>) -> (u16, Value) {
        let body = Some(body.into());
        self.send(reqwest::Method::POST, path, body)
            .await
            .expect("POST")
    }

    /// `POST /v1/timers/batch` of `commands`, which must be accepted (200); its answer.
    pub async fn schedule_batch(&self, commands: &[Value]) -> Value {
        let body = serde_json::json!({ "commands": commands }).to_string();
        let (status, v) = self.post("/v1/timers/batch", body).await;
        assert_eq!(status, 200, "the batch was refused: {v}");
        v
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        self.send(reqwest::Method::GET, path, None)
            .await
            .expect("GET")
    }

    pub async fn delete(&self, path: &str) -> (u16, Value) {
        self.send(reqwest::Method::DELETE, path, None)
            .await
            .expect("DELETE")
    }

    /// `GET path` as text (`/metrics`).
    pub async fn text(&self, path: &str) -> String {
        self.http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .expect("GET")
            .text()
            .await
            .expect("a text answer")
    }

    /// Subscribes to `/v1/events` and collects events in the background.
    pub async fn events(&self) -> EventLog {
        self.events_as(None).await
    }

    /// [`Service::events`], authenticated with `Authorization: Bearer key` when given.
    pub async fn events_as(&self, key: Option<&str>) -> EventLog {
        self.events_at("/v1/events", key).await
    }

    /// The events of the event stream at `path` (`/v1/events?tenant=...`), as they arrive.
    pub async fn events_at(&self, path: &str, key: Option<&str>) -> EventLog {
        let mut request = self.http.get(format!("{}{path}", self.base));
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        let response = request.send().await.expect("open the event stream");
        assert!(
            response.status().is_success(),
            "event stream: {}",
            response.status()
        );
        let log = EventLog::default();
        let sink = log.clone();
        tokio::spawn(async move {
            let mut stream = response.bytes_stream();
            let mut buf = String::new();
            while let Some(Ok(chunk)) = stream.next().await {
                buf.push_str(&String::from_utf8_lossy(&chunk));
                while let Some(end) = buf.find('\n') {
                    let line: String = buf.drain(..=end).collect();
                    if let Some(data) = line.trim_end().strip_prefix("data: ") {
                        if let Ok(v) = serde_json::from_str::<Value>(data) {
                            sink.push(v);
                        }
                    }
                }
            }
        });
        log
    }
}

/// A cut as [`Service::cut_off`] saw it.
pub struct CutOff {
    /// When it began, on the monotonic clock and as epoch ms.
    pub at: tokio::time::Instant,
    pub at_ms: i64,
    /// How long after it `/readyz` answered 503, ms, and that answer.
    pub not_ready_ms: i64,
    pub readyz: Value,
}

/// Sends `signal` (`-TERM`, `-KILL`, `-STOP`, ...) to a process this test started, by its pid.
pub async fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .await
        .expect("run kill");
    assert!(status.success(), "kill {signal} {pid}");
}

/// Whether process `pid` still runs (a zombie does not: it holds no port any more).
pub(super) fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let state = stat.rsplit_once(") ")?.1.chars().next()?;
            Some(state != 'Z' && state != 'X')
        })
        .unwrap_or(false)
}
