//! Retention: finished timers are deleted `engine.retention` after they finished, a small batch
//! at a time every `engine.purge_interval`, so firing never waits long for it.

use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{metrics as metric, Engine};

impl Engine {
    pub(super) async fn purge_loop(self, shutdown: CancellationToken) {
        let inner = &self.inner;
        let retention = inner.config.retention;
        if retention.is_zero() {
            return;
        }
        let batch = inner.config.purge_batch.max(1);
        loop {
            let older_than = inner.clock.now().saturating_sub(retention);
            loop {
                if shutdown.is_cancelled() {
                    return;
                }
                match self.bounded(inner.store.purge(older_than, batch)).await {
                    Ok(n) => {
                        ::metrics::counter!(metric::TIMERS_PURGED).increment(n);
                        if (n as usize) < batch {
                            break;
                        }
                        tokio::task::yield_now().await;
                    }
                    Err(e) => {
                        warn!(error = %e.chain(), "purging finished timers failed; trying again next round");
                        break;
                    }
                }
            }
            let next = inner
                .clock
                .now()
                .saturating_add(inner.config.purge_interval);
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = inner.clock.sleep_until(next) => {}
            }
        }
    }
}
