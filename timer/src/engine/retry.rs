//! Retrying: the backoff of failed publishes, and the one loop every engine task uses when the
//! store or the broker fails (count the failures in a row, log, pause, try again).

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{error, warn, Level};

use crate::config::EngineConfig;
use crate::error::{Error, ErrorKind, Result};

/// Exponential backoff: `retry_base * 2^(attempt-1)`, capped at `retry_max`.
pub fn backoff(config: &EngineConfig, attempt: u32) -> Duration {
    let exp = attempt.saturating_sub(1).min(30);
    config
        .retry_base
        .saturating_mul(1u32 << exp)
        .min(config.retry_max)
}

/// Shortens `delay` by a random share of up to `percent` percent.
pub(super) fn jittered(delay: Duration, percent: u32) -> Duration {
    let percent = u128::from(percent.min(100));
    if percent == 0 {
        return delay;
    }
    let cut = uuid::Uuid::new_v4().as_u128() % (percent + 1);
    let ms = delay.as_millis() * (100 - cut) / 100;
    Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX))
}

/// `call`, or an `Unavailable` error when the store gives no answer within `limit`
/// (`engine.store_timeout`): a connection that hangs without a reset would otherwise hold the
/// task until the OS gives up on it, for many minutes.
pub(super) async fn within_store_timeout<T>(
    limit: Duration,
    call: impl Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(limit, call).await.unwrap_or_else(|_| {
        Err(Error::unavailable(format!(
            "store: no answer within {} (engine.store_timeout)",
            humantime::format_duration(limit)
        )))
    })
}

/// Waits `d` unless shutdown comes first; false when shutting down.
pub(super) async fn pause(shutdown: &CancellationToken, d: Duration) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

/// How one task retries an operation on the store or the broker.
pub(super) struct Retry<'a> {
    pub config: &'a EngineConfig,
    pub shutdown: &'a CancellationToken,
    /// What failed, for the log line: "claiming due timers failed; retrying".
    pub what: &'static str,
    /// Which plugin it asked (`store`/`broker` = its kind), for the log line.
    pub plugin: (&'static str, &'static str),
    /// `Level::ERROR` where a failure holds up acknowledged work, else `Level::WARN`.
    pub level: Level,
    /// Gives up after this many failures of any kind but [`ErrorKind::Unavailable`] (ones the
    /// plugin would answer the same way again); an unreachable server is waited for. `None`:
    /// only shutdown stops it.
    pub max_failures: Option<u32>,
    /// Longest one attempt on the store may take (`engine.store_timeout`,
    /// [`within_store_timeout`]). `None`: the operation bounds itself (a receive's wait, a
    /// publish's timeout).
    pub timeout: Option<Duration>,
}

impl Retry<'_> {
    /// Runs `op` until it succeeds, pausing after each failure: the retry backoff, but never
    /// longer than the poll interval, so a recovered server is used again promptly. `None`
    /// when it failed and shutdown came, or `max_failures` was reached.
    pub async fn until_ok<T, F, Fut>(&self, mut op: F) -> Option<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let mut failures = 0u32;
        // Failures that are not an unreachable server's.
        let mut lasting = 0u32;
        loop {
            // The first attempt runs even during shutdown: work already in hand (a batch
            // received, a publish the broker confirmed within the grace) is finished, not left
            // to a redelivery or an expiring lease. Shutdown only ends the retries.
            let attempt = match self.timeout {
                None => op().await,
                Some(limit) => within_store_timeout(limit, op()).await,
            };
            let e: Error = match attempt {
                Ok(value) => return Some(value),
                Err(e) => e,
            };
            failures += 1;
            if e.kind() != ErrorKind::Unavailable {
                lasting += 1;
            }
            let (role, kind) = self.plugin;
            if self.level == Level::ERROR {
                error!(plugin = role, kind, failures, error = %e.chain(), "{} failed; retrying", self.what);
            } else {
                warn!(plugin = role, kind, failures, error = %e.chain(), "{} failed; retrying", self.what);
            }
            if self.max_failures.is_some_and(|max| lasting >= max) {
                return None;
            }
            let wait = backoff(self.config, failures).min(self.config.poll_interval);
            if !pause(self.shutdown, wait).await {
                return None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let config = EngineConfig {
            retry_base: Duration::from_millis(100),
            retry_max: Duration::from_secs(1),
            ..EngineConfig::default()
        };
        let got: Vec<u128> = (1..=6).map(|a| backoff(&config, a).as_millis()).collect();
        assert_eq!(got, vec![100, 200, 400, 800, 1000, 1000]);
        assert_eq!(backoff(&config, u32::MAX), Duration::from_secs(1));
    }

    #[test]
    fn jitter_only_shortens_within_its_share() {
        let d = Duration::from_millis(1_000);
        assert_eq!(jittered(d, 0), d);
        let got: Vec<Duration> = (0..200).map(|_| jittered(d, 20)).collect();
        assert!(got
            .iter()
            .all(|g| *g >= Duration::from_millis(800) && *g <= d));
        assert!(got.iter().any(|g| *g < d), "some delays are shortened");
    }

    #[tokio::test(start_paused = true)]
    async fn until_ok_retries_and_gives_up_or_stops() {
        let config = EngineConfig::default();
        let shutdown = CancellationToken::new();
        let retry = retry(&config, &shutdown, Some(3));
        assert_eq!(answering_after(&retry, 2).await, Some(3));
        assert_eq!(
            always_failing(&retry, || Error::internal("broken")).await,
            (None, 3),
            "gives up after max_failures"
        );
        // An unreachable server is waited for: 20 failures, then it answers.
        assert_eq!(
            answering_after(&retry, 20).await,
            Some(21),
            "max_failures counts no unreachable server"
        );
        shutdown.cancel();
        let got = retry.until_ok(|| async { Ok(1) }).await;
        assert_eq!(got, Some(1), "the first attempt runs during shutdown too");
        assert_eq!(
            always_failing(&retry, || Error::unavailable("down")).await,
            (None, 1),
            "no retry after shutdown"
        );
    }

    /// However long a server stays away, the next try comes within `engine.poll_interval`
    /// (the backoff is capped by it), so a server that is back is used within one poll
    /// interval.
    #[tokio::test(start_paused = true)]
    async fn retries_come_at_least_every_poll_interval() {
        let config = EngineConfig {
            retry_base: Duration::from_secs(1),
            retry_max: Duration::from_secs(600),
            poll_interval: Duration::from_secs(3),
            ..EngineConfig::default()
        };
        let shutdown = CancellationToken::new();
        let retry = retry(&config, &shutdown, None);
        let mut tries = Vec::new();
        let got = retry
            .until_ok(|| {
                tries.push(tokio::time::Instant::now());
                let n = tries.len();
                async move {
                    if n <= 12 {
                        Err(Error::unavailable("down"))
                    } else {
                        Ok(n)
                    }
                }
            })
            .await;
        assert_eq!(got, Some(13));
        let gaps: Vec<Duration> = tries.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(
            gaps.iter().all(|gap| *gap <= config.poll_interval),
            "every gap within the poll interval: {gaps:?}"
        );
        assert!(
            gaps.iter()
                .rev()
                .take(5)
                .all(|gap| *gap > config.poll_interval / 2),
            "the backoff grew up to the cap: {gaps:?}"
        );
    }

    /// Retries of a test's store calls, without a time limit of their own.
    fn retry<'a>(
        config: &'a EngineConfig,
        shutdown: &'a CancellationToken,
        max_failures: Option<u32>,
    ) -> Retry<'a> {
        Retry {
            config,
            shutdown,
            what: "testing",
            plugin: ("store", "memory"),
            level: Level::WARN,
            max_failures,
            timeout: None,
        }
    }

    /// What `until_ok` gives for an operation whose server is unreachable for its first
    /// `failures` calls, then answers with the number of the call.
    async fn answering_after(retry: &Retry<'_>, failures: u32) -> Option<u32> {
        let mut calls = 0;
        retry
            .until_ok(|| {
                calls += 1;
                let n = calls;
                async move {
                    if n <= failures {
                        Err(Error::unavailable("down"))
                    } else {
                        Ok(n)
                    }
                }
            })
            .await
    }

    /// What `until_ok` gives for an operation that always fails with `error`, and how often it
    /// was tried.
    async fn always_failing(retry: &Retry<'_>, error: fn() -> Error) -> (Option<()>, u32) {
        let mut calls = 0;
        let got = retry
            .until_ok(|| {
                calls += 1;
                async move { Err(error()) }
            })
            .await;
        (got, calls)
    }
}
