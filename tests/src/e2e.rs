//! Helpers for end-to-end tests on the built `timer-service` binary: start it on a free port
//! with a config given as environment, wait until it is ready, read its event stream, stop it
//! with SIGTERM or SIGKILL (by the pid we started, never by name).

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use serde_json::Value;
use tokio::process::{Child, Command};

use crate::wait_for;

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

impl Service {
    /// Starts `bin run` in `dir` with `env` (`TIMER_*` settings) and waits for `/readyz`.
    pub async fn start(bin: &Path, dir: &Path, env: &[(&str, String)]) -> Service {
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
            base: format!("http://{addr}"),
            log,
            http: reqwest::Client::new(),
        };
        service.wait_ready().await;
        service
    }

    pub fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    async fn wait_ready(&mut self) {
        let url = format!("{}/readyz", self.base);
        let http = self.http.clone();
        let ready = wait_for(Duration::from_secs(60), || {
            let http = http.clone();
            let url = url.clone();
            async move {
                let r = http.get(&url).send().await.ok()?;
                r.status().is_success().then_some(())
            }
        })
        .await;
        if ready.is_none() {
            let status = self.child.try_wait().ok().flatten();
            panic!(
                "timer-service did not become ready (exit status {status:?}); log:\n{}",
                self.log_text()
            );
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL: the crash.
    pub async fn kill9(mut self) {
        self.child.start_kill().expect("SIGKILL");
        let _ = self.child.wait().await;
    }

    /// SIGTERM, then waits for exit; returns the exit code.
    pub async fn terminate(mut self) -> Option<i32> {
        let pid = self.pid().to_string();
        let status = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .await
            .expect("run kill");
        assert!(status.success(), "kill -TERM {pid}");
        let exit = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("service exits within 30 s of SIGTERM")
            .expect("wait");
        exit.code()
    }

    pub async fn post(&self, path: &str, body: impl Into<String>) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.into())
            .send()
            .await
            .expect("POST");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let r = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .expect("GET");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    pub async fn delete(&self, path: &str) -> (u16, Value) {
        let r = self
            .http
            .delete(format!("{}{path}", self.base))
            .send()
            .await
            .expect("DELETE");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// Subscribes to `/v1/events` and collects events in the background.
    pub async fn events(&self) -> EventLog {
        let response = self
            .http
            .get(format!("{}/v1/events", self.base))
            .send()
            .await
            .expect("open the event stream");
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

/// One event as received, with the wall-clock time it arrived (epoch ms).
#[derive(Debug, Clone)]
pub struct Received {
    pub at_ms: i64,
    pub envelope: Value,
}

#[derive(Clone, Default)]
pub struct EventLog {
    inner: Arc<Mutex<Vec<Received>>>,
}

impl EventLog {
    fn push(&self, envelope: Value) {
        let at_ms = chrono::Utc::now().timestamp_millis();
        if let Ok(mut v) = self.inner.lock() {
            v.push(Received { at_ms, envelope });
        }
    }

    pub fn snapshot(&self) -> Vec<Received> {
        self.inner.lock().map(|v| v.clone()).unwrap_or_default()
    }

    pub fn len(&self) -> usize {
        self.inner.lock().map(|v| v.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Waits until at least `n` events arrived; returns them, or None at the deadline.
    pub async fn wait(&self, n: usize, deadline: Duration) -> Option<Vec<Received>> {
        wait_for(deadline, || async {
            (self.len() >= n).then(|| self.snapshot())
        })
        .await
    }
}

/// How many times each `tenantId/serviceCallId` appears.
pub fn count_by_key(events: &[Received]) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for e in events {
        let key = format!(
            "{}/{}",
            e.envelope["tenantId"].as_str().unwrap_or("?"),
            e.envelope["aggregateId"].as_str().unwrap_or("?")
        );
        *counts.entry(key).or_insert(0) += 1;
    }
    counts
}

/// p50/p99/max of a list of millisecond figures.
pub fn percentiles(mut values: Vec<i64>) -> (i64, i64, i64) {
    if values.is_empty() {
        return (0, 0, 0);
    }
    values.sort_unstable();
    let at = |p: f64| values[((values.len() - 1) as f64 * p).round() as usize];
    (at(0.50), at(0.99), at(1.0))
}

/// A test server started by one of the project's scripts (`scripts/servers/<name>.sh`), which a
/// test stops and starts again (by the pid the script recorded, never by name).
pub struct ScriptedServer {
    script: PathBuf,
    dir: String,
    port_env: &'static str,
    port: u16,
}

impl ScriptedServer {
    /// `name`: the script (`postgres`, `nats`, `rabbitmq`); `dir`: its data directory (what
    /// `scripts/test.sh` exported); `port_env`/`port`: the port it must come back on.
    pub fn new(name: &str, dir: String, port_env: &'static str, port: u16) -> Self {
        let script = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../scripts/servers")
            .join(format!("{name}.sh"));
        ScriptedServer {
            script,
            dir,
            port_env,
            port,
        }
    }

    /// Runs `script start|stop DIR`; panics with the script's output when it fails.
    pub async fn run(&self, action: &str) {
        let out = Command::new("bash")
            .arg(&self.script)
            .args([action, &self.dir])
            .env(self.port_env, self.port.to_string())
            .output()
            .await
            .expect("run the server script");
        assert!(
            out.status.success(),
            "{} {action}: {}",
            self.script.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// While the returned guard lives, a test ending (or panicking) with the server down
    /// starts it again, so the test binaries after this one find it.
    pub fn restart_guard(&self) -> RestartOnDrop<'_> {
        RestartOnDrop(self)
    }
}

pub struct RestartOnDrop<'a>(&'a ScriptedServer);

impl Drop for RestartOnDrop<'_> {
    fn drop(&mut self) {
        let _ = std::process::Command::new("bash")
            .arg(&self.0.script)
            .args(["start", &self.0.dir])
            .env(self.0.port_env, self.0.port.to_string())
            .output();
    }
}
