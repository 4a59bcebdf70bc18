//! timer-conformance: the Store and Broker conformance suites as libraries of async check
//! functions, the fixtures that give each check a fresh isolated resource of a plugin, and
//! helpers for the end-to-end tests. `tests/conformance.rs` runs every check on every plugin of
//! the registries; a plugin needs nothing here.

pub mod broker;
pub mod e2e;
pub mod fixtures;
pub mod lanes;
pub mod proxy;
pub mod scenarios;
pub mod store;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use lanes::Lane;

/// A named check: an async function taking the resource under test.
pub struct Check<R> {
    pub name: &'static str,
    pub run: fn(R) -> Pin<Box<dyn Future<Output = ()> + Send>>,
    /// It measures time (how late, how soon), so where trials run at once ([`lanes`]) it runs
    /// with none beside it.
    pub alone: bool,
}

impl<R> Check<R> {
    /// This check, run with no other trial beside it where trials run at once ([`lanes`]).
    pub fn alone(self) -> Self {
        Self {
            alone: true,
            ..self
        }
    }

    /// Where this check's trial runs when its other trials are in `lane`.
    pub fn lane(&self, lane: &'static str) -> Lane {
        if self.alone {
            Lane::Alone
        } else {
            Lane::Of(lane)
        }
    }
}

/// A [`Check`] of a check function's name.
#[macro_export]
macro_rules! check {
    ($name:ident) => {
        $crate::Check {
            name: stringify!($name),
            run: |r| Box::pin($name(r)),
            alone: false,
        }
    };
}

/// Builds a `Vec<Check<_>>` from check function names.
#[macro_export]
macro_rules! checks {
    ($($name:ident),* $(,)?) => {
        vec![$($crate::check!($name)),*]
    };
}

/// How long a trial may run before it counts as hung ([`server_trial`]).
pub const TRIAL_LIMIT: Duration = Duration::from_secs(15 * 60);

/// A libtest-mimic trial that needs a server: ignored (with the reason printed) when `missing`
/// is set, unless `TIMER_TEST_REQUIRE=1` makes it a failure. The test runs on its own runtime,
/// on a thread of its own, and fails when it has not ended within [`TRIAL_LIMIT`].
pub fn server_trial<F, Fut>(name: &str, missing: Option<String>, test: F) -> libtest_mimic::Trial
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    server_trial_in(name, missing, None, TRIAL_LIMIT, test)
}

/// [`server_trial`] in a [`Lane`], if given: it starts once its lane is free, and holds it
/// until it ends. With a limit of its own (a soak runs for as long as it is told), counted from
/// when it starts: a test past its limit fails, naming the limit, instead of holding the whole
/// run until CI's hard limit cuts it off without saying which test hung; its thread is left
/// behind (the process ends it when the other trials are done).
pub fn server_trial_in<F, Fut>(
    name: &str,
    missing: Option<String>,
    lane: Option<Lane>,
    limit: Duration,
    test: F,
) -> libtest_mimic::Trial
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    let require = fixtures::require_servers();
    if let Some(why) = &missing {
        if !require {
            eprintln!("{name}: ignored: {why}");
        }
    }
    let ignored = missing.is_some() && !require;
    let thread = name.to_owned();
    let name = name.to_owned();
    libtest_mimic::Trial::test(name.clone(), move || {
        if let Some(why) = missing {
            return Err(format!("server required (TIMER_TEST_REQUIRE=1) but {why}").into());
        }
        // Its limit counts from when it starts, not from when it began to wait for its lane.
        let entered = lane.map(Lane::enter).transpose()?;
        run_within(thread, limit, test).unwrap_or_else(|Hung(why)| {
            // Its thread runs on, perhaps with its server down: nothing else enters its lane.
            if let Some(entered) = entered {
                entered.hung(&name);
            }
            Err(why.into())
        })
    })
    .with_ignored_flag(ignored)
}

/// A test still running after its limit: why it failed.
#[derive(Debug)]
struct Hung(String);

/// Runs `test` on a runtime on a thread of its own (named `thread`, as a panic's message
/// shows), and panics again with its panic; [`Hung`] when it has not ended within `limit`
/// (leaving the thread behind).
fn run_within<F, Fut>(
    thread: String,
    limit: Duration,
    test: F,
) -> Result<Result<(), libtest_mimic::Failed>, Hung>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    let (done, outcome) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new().name(thread).spawn(move || {
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .map_err(|e| format!("tokio runtime: {e}"))?;
            runtime.block_on(test());
            Ok::<(), String>(())
        }));
        let _ = done.send(ran);
    });
    if let Err(e) = spawned {
        return Ok(Err(format!("a thread for the test: {e}").into()));
    }
    match outcome.recv_timeout(limit) {
        Ok(Ok(ran)) => Ok(ran.map_err(Into::into)),
        // The panic's message was printed where it happened; libtest-mimic reports it.
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(Hung(format!(
            "still running after {limit:?}: hung (left running)"
        ))),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            Ok(Err("the test's thread ended without an outcome".into()))
        }
    }
}

/// A trial that cannot run against the test servers we have, for a reason that is not a
/// missing server (a limit of the test server): ignored in every run, CI's too, with `why`
/// printed, so it stays in sight instead of being left out.
pub fn known_gap_trial(name: String, why: &str) -> libtest_mimic::Trial {
    eprintln!("{name}: ignored: {why}");
    libtest_mimic::Trial::test(name, || Ok(())).with_ignored_flag(true)
}

/// Polls `probe` until it returns `Some`, or gives up after `deadline` (no bare sleeps).
pub async fn wait_for<T, F, Fut>(deadline: Duration, mut probe: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let end = tokio::time::Instant::now() + deadline;
    let mut pause = Duration::from_millis(2);
    loop {
        if let Some(v) = probe().await {
            return Some(v);
        }
        if tokio::time::Instant::now() >= end {
            return None;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trial_passes_fails_on_a_panic_and_fails_when_it_hangs() {
        let limit = Duration::from_secs(60);
        assert!(matches!(
            run_within("ends".to_owned(), limit, || async {}),
            Ok(Ok(()))
        ));
        let panicked = std::panic::catch_unwind(|| {
            run_within("panics".to_owned(), limit, || async {
                panic!("a panic on purpose")
            })
        });
        assert!(panicked.is_err(), "{panicked:?}");
        // A test that never ends: it fails once the limit is past.
        let hung = run_within(
            "hangs".to_owned(),
            Duration::from_millis(100),
            std::future::pending::<()>,
        );
        let Err(Hung(why)) = hung else {
            panic!("a test that never ends passed");
        };
        assert!(why.contains("still running after 100ms"), "{why}");
    }
}
