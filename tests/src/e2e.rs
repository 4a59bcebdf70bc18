//! Helpers for end-to-end tests on the built `timer-service` binary: start it on a free port
//! with a config given as environment or as a TOML file, wait until it is ready, read its event
//! stream, stop it with SIGTERM or SIGKILL (by the pid we started, never by name); run a command
//! to its end; restart a test server through its script; read figures off event envelopes.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fmt::Display;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};
use timer_core::plugin::TestServer;
use timer_core::{NewTimer, Store, TimerKey, TimerState, Timestamp};
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

    pub async fn post(&self, path: &str, body: impl Into<String>) -> (u16, Value) {
        let body = Some(body.into());
        self.send(reqwest::Method::POST, path, body)
            .await
            .expect("POST")
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
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let state = stat.rsplit_once(") ")?.1.chars().next()?;
            Some(state != 'Z' && state != 'X')
        })
        .unwrap_or(false)
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
        let at_ms = now_ms();
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

/// The timer a `DueTimeReached` envelope is about: `tenantId/aggregateId`.
pub fn timer_of(envelope: &Value) -> String {
    format!(
        "{}/{}",
        envelope["tenantId"].as_str().unwrap_or("?"),
        envelope["aggregateId"].as_str().unwrap_or("?")
    )
}

/// The due time of an envelope (`payload.dueAt`), epoch ms; 0 when it has none.
pub fn due_ms(envelope: &Value) -> i64 {
    chrono::DateTime::parse_from_rfc3339(envelope["payload"]["dueAt"].as_str().unwrap_or(""))
        .map(|d| d.timestamp_millis())
        .unwrap_or(0)
}

/// How late the service fired it: `timestampMs` − `payload.dueAt`, ms.
pub fn lateness_ms(envelope: &Value) -> i64 {
    envelope["timestampMs"].as_i64().unwrap_or(0) - due_ms(envelope)
}

/// The value of one series in a Prometheus text answer (`name` or `name{label="value"}`); 0 when
/// it is not there (a counter never incremented is not shown).
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .filter_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .find_map(|value| value.trim().parse().ok())
        .unwrap_or(0.0)
}

/// How many times each `tenantId/aggregateId` appears.
pub fn count_by_key(events: &[Received]) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for e in events {
        *counts.entry(timer_of(&e.envelope)).or_insert(0) += 1;
    }
    counts
}

/// p50/p99/max of how late events reached their reader: receive time − `payload.dueAt`, ms
/// (what a consumer sees, publish and delivery included).
pub fn lateness_at_reader(received: &[Received]) -> (i64, i64, i64) {
    percentiles(
        received
            .iter()
            .map(|r| r.at_ms - due_ms(&r.envelope))
            .collect(),
    )
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

/// `n` timers `<prefix>00000`, ... of tenants `tenant-0` to `tenant-<tenants - 1>` in turn, due
/// evenly over `spread_ms` from `due_from` (epoch ms).
pub fn new_timers(
    prefix: &str,
    n: usize,
    tenants: usize,
    due_from: i64,
    spread_ms: i64,
) -> Vec<NewTimer> {
    (0..n)
        .map(|i| NewTimer {
            key: TimerKey::new(format!("tenant-{}", i % tenants), format!("{prefix}{i:05}")),
            due_at: Timestamp::from_millis(due_from + (i as i64 * spread_ms) / n as i64),
            correlation_id: None,
            payload: None,
            recurrence: None,
            policy: None,
            work: None,
        })
        .collect()
}

/// Stores `timers` directly (as an instance sharing the store would).
pub async fn store_timers(store: &dyn Store, timers: &[NewTimer]) {
    store
        .schedule(timers, Timestamp::from_millis(now_ms()))
        .await
        .expect("schedule");
}

/// Waits until `store` has no pending timer; false at the deadline.
pub async fn drained(store: &dyn Store, deadline: Duration) -> bool {
    wait_for(deadline, || async {
        (store.scheduled_count().await.ok()? == 0).then_some(())
    })
    .await
    .is_some()
}

/// Freezes process `pid` (SIGSTOP) at a moment `leased` finds it holding leases, and returns
/// what it held then; it stays frozen (kill it, or SIGCONT it). Panics after `deadline`.
pub async fn freeze_holding_leases(
    pid: u32,
    deadline: Duration,
    leased: impl AsyncFnMut() -> Vec<TimerKey>,
) -> Vec<TimerKey> {
    catch_holding_leases(
        &format!("process {pid}"),
        deadline,
        leased,
        async || signal(pid, "-STOP").await,
        async || signal(pid, "-CONT").await,
    )
    .await
}

/// Catches an instance holding leases: at a moment `leased` finds some, runs `stop` (freezes
/// the instance, cuts it off) and returns what it held then, once two looks 200 ms apart agree
/// (a mark sent before the stop may still land; at most 20 looks). When it held nothing after
/// all, runs `resume` and waits for the next moment. Panics after `deadline`, naming `who`.
pub async fn catch_holding_leases(
    who: &str,
    deadline: Duration,
    mut leased: impl AsyncFnMut() -> Vec<TimerKey>,
    mut stop: impl AsyncFnMut(),
    mut resume: impl AsyncFnMut(),
) -> Vec<TimerKey> {
    let end = tokio::time::Instant::now() + deadline;
    while tokio::time::Instant::now() < end {
        if leased().await.is_empty() {
            tokio::time::sleep(Duration::from_millis(2)).await;
            continue;
        }
        stop().await;
        let mut held = leased().await;
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let again = leased().await;
            if again == held {
                break;
            }
            held = again;
        }
        if !held.is_empty() {
            return held;
        }
        resume().await;
    }
    panic!("never caught {who} holding leases within {deadline:?}");
}

/// Waits until every timer of `keys` is Reached, then returns how long after `since_ms`
/// (epoch ms) the last of them was: the time their fires took to recover.
pub async fn recovered_after(
    store: &dyn Store,
    keys: &[TimerKey],
    since_ms: i64,
    deadline: Duration,
) -> i64 {
    let last = wait_for(deadline, || async {
        let mut last = i64::MIN;
        for key in keys {
            let t = store.get(key).await.ok()??;
            if t.state != TimerState::Reached {
                return None;
            }
            last = last.max(t.reached_at?.as_millis());
        }
        Some(last)
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "the {} timers in flight did not all fire within {deadline:?}",
            keys.len()
        )
    });
    last - since_ms
}

/// Asserts that every timer of `keys` is stored as Reached, and did not fire before it was due
/// (Reached means the broker confirmed the publish first: publish, then mark).
pub async fn assert_reached<'a>(store: &dyn Store, keys: impl IntoIterator<Item = &'a TimerKey>) {
    for key in keys {
        let t = store.get(key).await.expect("get").expect("row exists");
        assert_eq!(t.state, TimerState::Reached, "{key}");
        assert!(
            t.reached_at.expect("reached_at") >= t.due_at,
            "{key} not fired early"
        );
    }
}

/// How a command run to its end went.
pub struct Exit {
    /// The exit code; `None` when a signal ended it.
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Exit {
    /// The last line it wrote to stderr (where `run` reports why it stopped).
    pub fn last_line(&self) -> &str {
        self.stderr.lines().last().unwrap_or_default()
    }
}

/// Runs `program args` in `dir` with `env` added, to its end, which must come `within` that
/// long; killed if the test ends first (a service that starts after all must not outlive it).
pub async fn run_to_end<K, V>(
    program: &Path,
    dir: &Path,
    args: &[&str],
    env: &[(K, V)],
    within: Duration,
) -> Exit
where
    K: AsRef<OsStr>,
    V: AsRef<OsStr>,
{
    let mut command = Command::new(program);
    command.args(args).current_dir(dir).kill_on_drop(true);
    for (k, v) in env {
        command.env(k, v);
    }
    let out = tokio::time::timeout(within, command.output())
        .await
        .unwrap_or_else(|_| panic!("{} exits within {within:?}", program.display()))
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()));
    Exit {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs `program args` (a `run` of the service, perhaps through a launcher) that must refuse
/// to start: it exits 1 within a minute. Returns how it went, for the message to be checked.
pub async fn refused_to_run(
    program: &Path,
    args: &[&str],
    dir: &Path,
    env: &[(&str, String)],
) -> Exit {
    let mut env = env.to_vec();
    // Should it start after all, on a port of its own.
    env.push(("TIMER_HTTP__ADDR", "127.0.0.1:0".to_owned()));
    let exit = run_to_end(program, dir, args, &env, Duration::from_secs(60)).await;
    assert_eq!(exit.code, Some(1), "refuses to run: {}", exit.stderr);
    exit
}

/// Runs `command` to its end and panics, with its stderr, unless it succeeds.
pub async fn run_ok(command: &mut Command, what: impl Display) -> Output {
    let out = command
        .output()
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Why a test needing all of `vars` cannot run, if one is not set; `starts` says what sets
/// them (`bash scripts/test.sh starts PostgreSQL`).
pub fn missing_var(vars: &[&str], starts: &str) -> Option<String> {
    vars.iter()
        .find(|v| std::env::var(v).is_err())
        .map(|v| format!("{v} is not set ({starts})"))
}

/// A test server started by one of the project's scripts (`scripts/servers/<name>.sh`), which a
/// test stops and starts again (by the pid the script recorded, never by name).
pub struct ScriptedServer {
    name: String,
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
            name: name.to_owned(),
            script,
            dir,
            port_env,
            port,
        }
    }

    /// The server a plugin's tests run against, as its variables describe it; the reason when
    /// one is missing.
    pub fn of(server: &TestServer) -> Result<Self, String> {
        let starts = format!("bash scripts/test.sh starts {}", server.script);
        if let Some(why) = missing_var(&[server.address_env, server.dir_env], &starts) {
            return Err(why);
        }
        let dir = std::env::var(server.dir_env).map_err(|e| e.to_string())?;
        let port = server
            .port()
            .ok_or_else(|| format!("no port in {}", server.address_env))?;
        Ok(Self::new(server.script, dir, server.port_env, port))
    }

    /// Runs `script start|stop DIR`; panics with the script's output when it fails.
    pub async fn run(&self, action: &str) {
        let mut command = Command::new("bash");
        command
            .arg(&self.script)
            .args([action, &self.dir])
            .env(self.port_env, self.port.to_string());
        run_ok(&mut command, format!("{} {action}", self.script.display())).await;
    }

    /// SIGKILL to the server, by the pid its script recorded (`DIR/<name>.pid`); returns once
    /// it is gone (its port free for the next start).
    pub async fn kill9(&self) {
        let pid_file = Path::new(&self.dir).join(format!("{}.pid", self.name));
        let pid: u32 = std::fs::read_to_string(&pid_file)
            .unwrap_or_else(|e| panic!("{}: {e}", pid_file.display()))
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{}: {e}", pid_file.display()));
        signal(pid, "-KILL").await;
        let gone = wait_for(Duration::from_secs(30), || async {
            (!running(pid)).then_some(())
        })
        .await;
        assert!(
            gone.is_some(),
            "{} (pid {pid}) ended after SIGKILL",
            self.name
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
