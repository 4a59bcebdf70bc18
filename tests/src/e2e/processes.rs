//! Commands run to their end, and the test servers' scripts (stop, start, restart).

use std::ffi::OsStr;
use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use timer_core::plugin::TestServer;
use tokio::process::Command;

use super::{running, signal};
use crate::wait_for;

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
    /// The file of its data directory with the pid of the server process when the script's
    /// own pid file names a launcher ([`TestServer::server_pid_file`]).
    server_pid_file: Option<&'static str>,
    /// Why a crash of it is not tested ([`TestServer::not_restartable`]).
    not_restartable: Option<&'static str>,
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
            server_pid_file: None,
            not_restartable: None,
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
        Ok(ScriptedServer {
            server_pid_file: server.server_pid_file,
            not_restartable: server.not_restartable,
            ..Self::new(server.script, dir, server.port_env, port)
        })
    }

    /// The test server of `plugin`, for a test that takes it down; panics when the plugin has
    /// none or its variables are missing.
    pub fn of_plugin<C: ?Sized>(plugin: &timer_core::plugin::Plugin<C>) -> Self {
        let server = plugin
            .test_server
            .as_ref()
            .unwrap_or_else(|| panic!("the {} plugin has no test server", plugin.kind));
        Self::of(server).unwrap_or_else(|e| panic!("the {} test server: {e}", plugin.kind))
    }

    /// Runs `script start|stop DIR`; panics with the script's output when it fails.
    pub async fn run(&self, action: &str) {
        self.run_for_output(action).await;
    }

    /// [`ScriptedServer::run`], returning what the script printed.
    async fn run_for_output(&self, action: &str) -> Output {
        let mut command = Command::new("bash");
        command
            .arg(&self.script)
            .args([action, &self.dir])
            .env(self.port_env, self.port.to_string());
        run_ok(&mut command, format!("{} {action}", self.script.display())).await
    }

    /// Why a crash of this server is not tested (a limit of the test server, not of its
    /// plugin), as its plugin says; `None` when [`ScriptedServer::crash`] brings one about.
    pub fn crash_left_out(&self) -> Option<&'static str> {
        self.not_restartable
    }

    /// The crash: SIGKILL to the server process, by the pid its script recorded
    /// (`DIR/<name>.pid`, or the plugin's [`TestServer::server_pid_file`], after which the
    /// script's `stop` ends what is left: RabbitMQ's launcher and epmd). Returns once it is
    /// gone, its port free for the next start. Panics for a server whose crash is left out.
    pub async fn crash(&self) {
        if let Some(why) = self.not_restartable {
            panic!("a crash of {} is left out: {why}", self.name);
        }
        match self.server_pid_file {
            Some(pid_file) => {
                self.kill9_recorded(pid_file).await;
                self.run("stop").await;
            }
            None => self.kill9_recorded(&format!("{}.pid", self.name)).await,
        }
    }

    /// SIGKILL to the process whose pid the script recorded in `DIR/<pid_file>`; returns once
    /// it is gone.
    async fn kill9_recorded(&self, pid_file: &str) {
        let pid_file = Path::new(&self.dir).join(pid_file);
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

/// A server of its own for one check, started by its script on a free port in a directory of
/// its own ([`PrivateServer::start`]): a check may take it away without touching the server
/// the other tests share. Stopped when dropped.
pub struct PrivateServer {
    server: ScriptedServer,
    address: String,
    /// The `export NAME=VALUE` lines its script printed when it started.
    exported: Vec<(String, String)>,
    _dir: tempfile::TempDir,
}

impl PrivateServer {
    /// Starts `script` (`kafka`) as `kafka.sh start DIR` with `port_env` set to a free port.
    /// The directory is readable by every user: a server that runs as a user of its own
    /// (PostgreSQL's, when the tests run as root) must reach it.
    pub async fn start(script: &str, port_env: &'static str) -> Self {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("a directory for the private server");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("the private server's directory opened to its user");
        let port = private_port();
        let server = ScriptedServer::new(
            script,
            dir.path().to_string_lossy().into_owned(),
            port_env,
            port,
        );
        let printed = server.run_for_output("start").await;
        let exported = String::from_utf8_lossy(&printed.stdout)
            .lines()
            .filter_map(|line| line.strip_prefix("export ")?.split_once('='))
            .map(|(name, value)| (name.to_owned(), value.to_owned()))
            .collect();
        PrivateServer {
            server,
            address: format!("127.0.0.1:{port}"),
            exported,
            _dir: dir,
        }
    }

    /// `127.0.0.1:PORT`, where it listens.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// What its script exported as `name` when it started (`TIMER_TEST_POSTGRES_URL`); panics
    /// naming it when the script did not.
    pub fn exported(&self, name: &str) -> &str {
        self.exported
            .iter()
            .find_map(|(n, value)| (n == name).then_some(value.as_str()))
            .unwrap_or_else(|| panic!("{} exported no {name}", self.server.script.display()))
    }

    /// The server, for a test that stops and starts it ([`ScriptedServer::run`]).
    pub fn server(&self) -> &ScriptedServer {
        &self.server
    }

    /// The crash ([`ScriptedServer::crash`]); returns once it is gone.
    pub async fn crash(&self) {
        self.server.crash().await;
    }
}

/// A port for a private server, free now and outside the range the system takes ports for
/// outgoing connections from (32768 and up by default): a server a test stops and starts
/// again must find its port free, which a connection's ephemeral port could take meanwhile.
/// Taken from 24000 up, each once per process (two private servers starting at once do not
/// find the same port free).
fn private_port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(24_000);
    loop {
        let port = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        assert!(
            port < 32_000,
            "no free port for a private server below 32000"
        );
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        // After a kill9 this only removes the stale pid file.
        let _ = std::process::Command::new("bash")
            .arg(&self.server.script)
            .args(["stop", &self.server.dir])
            .output();
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
