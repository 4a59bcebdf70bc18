//! SQLite on a full disk and on a read-only file system: the service runs in a mount
//! namespace of its own (`unshare -m`) with its database on a small tmpfs, so the test can fill
//! it up, grow it, or mount it read-only without touching the machine. Each asserts a clear error
//! naming what is wrong and that every write that was acknowledged (HTTP 201) is there (and, once
//! there is room again, fires). Needs root (mounting a tmpfs); CI runs
//! `bash scripts/test.sh` as root.

use std::path::Path;
use std::time::Duration;

use libtest_mimic::Arguments;
use serde_json::json;
use timer_conformance::e2e::{count_by_key, now_ms, refused_to_run, run_ok, Service};
use timer_conformance::server_trial;

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");

fn main() {
    let args = Arguments::from_args();
    let missing = unavailable();
    let trials = vec![
        server_trial(
            "disk::a_full_disk_refuses_new_timers_clearly_and_keeps_every_acknowledged_one",
            missing.clone(),
            full_disk,
        ),
        server_trial(
            "disk::a_read_only_file_system_is_refused_at_start_naming_the_file",
            missing,
            read_only,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

/// Why these tests cannot run here, if they cannot.
fn unavailable() -> Option<String> {
    let root = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false);
    if !root {
        return Some("needs root to mount a tmpfs in a mount namespace".into());
    }
    for tool in ["unshare", "nsenter", "mount"] {
        let found = std::env::var_os("PATH")
            .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(tool).is_file()));
        if !found {
            return Some(format!("{tool} is not installed (util-linux)"));
        }
    }
    None
}

/// A launcher that starts `timer-service run` in a new mount namespace with `db_dir` on a tmpfs
/// of `size`; the service keeps the launcher's pid (unshare and sh exec it).
fn launcher(dir: &Path, db_dir: &Path, size: &str) -> std::path::PathBuf {
    std::fs::create_dir_all(db_dir).expect("db dir");
    let script = dir.join("run-on-tmpfs.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nexec unshare -m sh -c 'mount -t tmpfs -o size={size} tmpfs \"$0\" && exec \"$1\" \"$2\"' {} {} \"$1\"\n",
            db_dir.display(),
            BIN
        ),
    )
    .expect("write launcher");
    let mut perms = std::fs::metadata(&script).expect("meta").permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&script, perms).expect("chmod");
    script
}

fn env(db_dir: &Path) -> Vec<(&'static str, String)> {
    vec![
        ("TIMER_STORE__KIND", "sqlite".into()),
        (
            "TIMER_STORE__URL",
            format!("sqlite://{}", db_dir.join("timers.db").display()),
        ),
        ("TIMER_BROKER__KIND", "memory".into()),
        ("TIMER_ENGINE__POLL_INTERVAL", "1s".into()),
    ]
}

/// Runs `mount ARGS` inside the service's mount namespace.
async fn mount_in(service: &Service, args: &[&str]) {
    let mut command = tokio::process::Command::new("nsenter");
    command
        .args(["-t", &service.pid().to_string(), "-m", "mount"])
        .args(args);
    run_ok(&mut command, format!("mount {args:?}")).await;
}

async fn full_disk() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db_dir = dir.path().join("db");
    let bin = launcher(dir.path(), &db_dir, "1m");
    let service = Service::start(&bin, dir.path(), &env(&db_dir)).await;
    let events = service.events().await;
    let payload = "x".repeat(30_000);
    let due = now_ms() + 3_000;
    let mut accepted = Vec::new();
    let mut refusal = None;
    for i in 0..200 {
        let body = json!({"tenantId": "t", "serviceCallId": format!("f{i}"), "dueTimeMs": due,
                          "payload": {"fill": payload}});
        let (status, v) = service.post("/v1/timers", body.to_string()).await;
        match status {
            201 => accepted.push(format!("f{i}")),
            _ => {
                refusal = Some((status, v));
                break;
            }
        }
    }
    let (status, v) = refusal.expect("a 1 MB file system fills up within 200 × 30 KB");
    println!(
        "disk full after {} timers: HTTP {status} {}",
        accepted.len(),
        v["error"]["message"]
    );
    assert_eq!(status, 503, "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("full"), "says the disk is full: {v}");
    assert!(!accepted.is_empty(), "some fit before it was full");
    // Every acknowledged timer is stored.
    for id in &accepted {
        let (status, v) = service.get(&format!("/v1/tenants/t/timers/{id}")).await;
        assert_eq!(status, 200, "{id} is stored: {v}");
    }
    // Claiming needs to write too, so nothing fires while the disk is full; once the operator
    // adds space the service carries on by itself and every acknowledged timer fires.
    let db = db_dir.display().to_string();
    mount_in(&service, &["-o", "remount,size=16m", &db]).await;
    let (status, v) = service
        .post(
            "/v1/timers",
            json!({"tenantId": "t", "serviceCallId": "after-space", "dueTimeMs": due}).to_string(),
        )
        .await;
    assert_eq!(status, 201, "writes work again without a restart: {v}");
    accepted.push("after-space".into());
    let fired = events
        .wait(accepted.len(), Duration::from_secs(60))
        .await
        .unwrap_or_else(|| service.fail("accepted timers fire"));
    let counts = count_by_key(&fired);
    for id in &accepted {
        assert!(counts.contains_key(&format!("t/{id}")), "{id} fired");
    }
    service.terminate().await;
}

async fn read_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A database made by a normal run, with one timer in it.
    let prepared = dir.path().join("prepared");
    std::fs::create_dir_all(&prepared).expect("dir");
    let service = Service::start(Path::new(BIN), dir.path(), &env(&prepared)).await;
    let far = now_ms() + 3_600_000;
    let body = json!({"tenantId": "t", "serviceCallId": "kept", "dueTimeMs": far}).to_string();
    assert_eq!(service.post("/v1/timers", body).await.0, 201);
    assert_eq!(service.terminate().await, Some(0));

    // The same file, its directory bind-mounted read-only where the service looks for it
    // (in a mount namespace of its own). SQLite cannot open a WAL database there (it must
    // create the -shm and -wal files next to it), so `run` refuses to start, in one line naming
    // the file; nothing was acknowledged, and the file itself is untouched.
    let original = std::fs::read(prepared.join("timers.db")).expect("read the prepared file");
    let db_dir = dir.path().join("db");
    std::fs::create_dir_all(&db_dir).expect("db dir");
    let script = dir.path().join("run-read-only.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nexec unshare -m sh -c 'mount --bind {} \"$0\" && mount -o remount,bind,ro \"$0\" && exec \"$1\" run' {} {}\n",
            prepared.display(),
            db_dir.display(),
            BIN
        ),
    )
    .expect("write launcher");
    let script = script.display().to_string();
    let exit = refused_to_run(Path::new("sh"), &[&script], dir.path(), &env(&db_dir)).await;
    let (err, last) = (&exit.stderr, exit.last_line());
    println!("read-only: {last}");
    assert!(
        // The lock file beside it (kept from the run that made the file) or the file itself.
        last.starts_with("error: sqlite store: cannot open")
            && last.contains(&db_dir.join("timers.db").display().to_string()),
        "one line naming the file: {err}"
    );
    // Nothing lost: the very file the service was refused is as it was, and holds the timer.
    let after = std::fs::read(prepared.join("timers.db")).expect("read the file again");
    assert!(
        after == original,
        "the file the service could not open is unchanged"
    );
    let store = timer_stores::sqlite::SqliteStore::open(
        &timer_stores::sqlite::SqliteConfig::for_path(prepared.join("timers.db")),
    )
    .await
    .expect("open the prepared file");
    let kept = timer_core::Store::get(&store, &timer_core::TimerKey::new("t", "kept"))
        .await
        .expect("get");
    assert!(kept.is_some());
}
