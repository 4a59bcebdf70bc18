//! Wall-clock jumps on the built binary: libfaketime (Debian `faketime`) preloaded into the
//! service moves its wall clock while it runs, by an offset the test writes to a file; the
//! monotonic clock, which its sleeps run on, stays real. Needs `TIMER_TEST_FAKETIME` (the
//! library; `bash scripts/test.sh` installs it); without it the trials are ignored with the
//! reason, or fail under `TIMER_TEST_REQUIRE=1`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use libtest_mimic::Arguments;
use serde_json::{json, Value};
use timer_conformance::e2e::{now_ms, timer_of, EventLog, Service};
use timer_conformance::server_trial;

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");
const HOUR_MS: i64 = 3_600_000;

fn main() {
    let args = Arguments::from_args();
    let missing = std::env::var("TIMER_TEST_FAKETIME")
        .is_err()
        .then(|| "TIMER_TEST_FAKETIME is not set (libfaketime)".to_owned());
    let trials = vec![
        server_trial(
            "clock::a_forward_jump_fires_what_became_due_at_once",
            missing.clone(),
            a_forward_jump_fires_what_became_due_at_once,
        ),
        server_trial(
            "clock::a_backward_jump_fires_nothing_early",
            missing,
            a_backward_jump_fires_nothing_early,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

/// A service whose wall clock is real time plus the offset in its `offset` file.
struct Jumping {
    service: Service,
    offset: PathBuf,
    _dir: tempfile::TempDir,
}

impl Jumping {
    async fn start() -> Jumping {
        let dir = tempfile::tempdir().expect("tempdir");
        let offset = dir.path().join("offset");
        std::fs::write(&offset, "+0\n").expect("write the offset");
        let library = std::env::var("TIMER_TEST_FAKETIME").expect("TIMER_TEST_FAKETIME");
        let env = vec![
            ("LD_PRELOAD", library),
            ("FAKETIME_TIMESTAMP_FILE", offset.display().to_string()),
            // Read the file at every clock read, so a jump shows at once.
            ("FAKETIME_NO_CACHE", "1".to_owned()),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_owned()),
            ("TIMER_STORE__KIND", "sqlite".to_owned()),
            (
                "TIMER_STORE__URL",
                format!("sqlite://{}", dir.path().join("timers.db").display()),
            ),
            ("TIMER_BROKER__KIND", "memory".to_owned()),
            // Far longer than the bounds below: a jump noticed only by polling cannot pass.
            ("TIMER_ENGINE__POLL_INTERVAL", "60s".to_owned()),
        ];
        let service = Service::start(Path::new(BIN), dir.path(), &env).await;
        Jumping {
            service,
            offset,
            _dir: dir,
        }
    }

    /// Sets the service's wall clock to real time plus `seconds`.
    fn jump_to(&self, seconds: i64) {
        std::fs::write(&self.offset, format!("{seconds:+}\n")).expect("write the offset");
    }

    async fn schedule(&self, id: &str, due_ms: i64) {
        let (status, body) = self
            .service
            .post(
                "/v1/timers",
                json!({"tenantId": "t", "serviceCallId": id, "dueTimeMs": due_ms}).to_string(),
            )
            .await;
        assert_eq!(status, 201, "{body}");
    }

    async fn state(&self, id: &str) -> String {
        let (status, body) = self
            .service
            .get(&format!("/v1/tenants/t/timers/{id}"))
            .await;
        assert_eq!(status, 200, "{body}");
        body["state"].as_str().unwrap_or_default().to_owned()
    }
}

/// The first event of `id` in `events`, waited for up to `deadline`.
async fn fired(events: &EventLog, id: &str, deadline: Duration) -> Option<(i64, Value)> {
    timer_conformance::wait_for(deadline, || async {
        events
            .snapshot()
            .into_iter()
            .find(|e| timer_of(&e.envelope).ends_with(&format!("/{id}")))
            .map(|e| (e.at_ms, e.envelope))
    })
    .await
}

fn ms_of(envelope: &Value, field: &str) -> i64 {
    let text = envelope["payload"][field]
        .as_str()
        .unwrap_or_else(|| panic!("{field} in {envelope}"));
    chrono::DateTime::parse_from_rfc3339(text)
        .unwrap_or_else(|e| panic!("{field} {text:?}: {e}"))
        .timestamp_millis()
}

async fn a_forward_jump_fires_what_became_due_at_once() {
    let j = Jumping::start().await;
    let events = j.service.events().await;
    j.schedule("in-an-hour", now_ms() + HOUR_MS).await;
    assert_eq!(j.state("in-an-hour").await, "Scheduled");
    let jumped_ms = now_ms();
    j.jump_to(3_600 + 5);
    let (at_ms, envelope) = fired(&events, "in-an-hour", Duration::from_secs(30))
        .await
        .unwrap_or_else(|| j.service.fail("the timer fired after the jump"));
    let after = at_ms - jumped_ms;
    println!("fired {after} ms after the wall clock jumped an hour forward");
    assert!(
        ms_of(&envelope, "reachedAt") >= ms_of(&envelope, "dueAt"),
        "not early by the service's clock: {envelope}"
    );
    // Measured here: about 200 ms (the sleep reads the wall clock every 250 ms); the bound is
    // ten times that, and far below the 60 s poll interval.
    assert!(after < 2_500, "fired {after} ms after the jump");
}

async fn a_backward_jump_fires_nothing_early() {
    let j = Jumping::start().await;
    let events = j.service.events().await;
    // Due in 2 s of real time; then the clock goes back an hour, so it is due in an hour.
    j.schedule("soon", now_ms() + 2_000).await;
    j.jump_to(-3_600);
    // Due 3 s after the jump on the service's new clock: fires, and `soon` must not before it.
    j.schedule("after-the-jump", now_ms() - HOUR_MS + 3_000)
        .await;
    let (_, envelope) = fired(&events, "after-the-jump", Duration::from_secs(30))
        .await
        .unwrap_or_else(|| j.service.fail("the timer due after the jump fired"));
    assert!(
        ms_of(&envelope, "reachedAt") >= ms_of(&envelope, "dueAt"),
        "not early by the service's clock: {envelope}"
    );
    let early: Vec<String> = events
        .snapshot()
        .iter()
        .map(|e| timer_of(&e.envelope))
        .filter(|t| t.ends_with("/soon"))
        .collect();
    assert!(
        early.is_empty(),
        "a timer due an hour later on the service's clock fired: {early:?}"
    );
    assert_eq!(j.state("soon").await, "Scheduled");
}
