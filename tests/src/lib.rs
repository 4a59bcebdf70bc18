//! timer-conformance: the Store and Broker conformance suites as libraries of async check
//! functions, the fixtures that give each check a fresh isolated resource, and helpers for the
//! end-to-end tests. Each plugin's test is a few lines: a fixture, then `store::checks()` or
//! `broker::checks()`.

pub mod broker;
pub mod e2e;
pub mod fixtures;
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
