//! timer-conformance: the Store and Broker conformance suites as libraries of async check
//! functions, the fixtures that give each check a fresh isolated resource of a plugin, and
//! helpers for the end-to-end tests. `tests/conformance.rs` runs every check on every plugin of
//! the registries; a plugin needs nothing here.

pub mod broker;
pub mod e2e;
pub mod fixtures;
pub mod proxy;
pub mod scenarios;
pub mod store;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// A named check: an async function taking the resource under test.
pub struct Check<R> {
    pub name: &'static str,
    pub run: fn(R) -> Pin<Box<dyn Future<Output = ()> + Send>>,
}

/// Builds a `Vec<Check<_>>` from check function names.
#[macro_export]
macro_rules! checks {
    ($($name:ident),* $(,)?) => {
        vec![$($crate::Check { name: stringify!($name), run: |r| Box::pin($name(r)) }),*]
    };
}

/// A libtest-mimic trial that needs a server: ignored (with the reason printed) when `missing`
/// is set, unless `TIMER_TEST_REQUIRE=1` makes it a failure. The test runs on its own runtime.
pub fn server_trial<F, Fut>(name: &str, missing: Option<String>, test: F) -> libtest_mimic::Trial
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
    libtest_mimic::Trial::test(name, move || {
        if let Some(why) = missing {
            return Err(format!("server required (TIMER_TEST_REQUIRE=1) but {why}").into());
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| format!("tokio runtime: {e}"))?;
        runtime.block_on(test());
        Ok(())
    })
    .with_ignored_flag(ignored)
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
