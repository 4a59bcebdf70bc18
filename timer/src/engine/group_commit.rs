//! Group commit: single schedules (one per HTTP request) queue up and are written together in
//! one transaction, so many requests share one fsync instead of paying one each.

use std::sync::atomic::Ordering;

use tokio::sync::oneshot;

use super::{Engine, LoweredOnPanic, Scheduled};
use crate::error::{Error, Result};
use crate::model::NewTimer;

pub(super) type Waiting = (NewTimer, oneshot::Sender<Result<Scheduled>>);

impl Engine {
    /// Schedules one timer, sharing a transaction with whoever else schedules at the same time.
    pub async fn schedule_one(&self, timer: NewTimer) -> Result<Scheduled> {
        let (tx, rx) = oneshot::channel();
        self.inner
            .queue
            .lock()
            .map_err(|_| Error::internal("schedule queue poisoned"))?
            .push((timer, tx));
        if !self.inner.flushing.swap(true, Ordering::SeqCst) {
            // A task of its own, so a caller that goes away cannot strand the queue.
            tokio::spawn(self.clone().flush_queue());
        }
        rx.await
            .map_err(|_| Error::internal("the schedule flush task stopped without an answer"))?
    }

    async fn flush_queue(self) {
        let inner = &self.inner;
        // A panic (of the store plugin) ends this task: the next schedule starts another,
        // rather than queue behind a flag nobody lowers (its batch's callers get an error).
        let on_panic = LoweredOnPanic(&inner.flushing);
        loop {
            let batch: Vec<Waiting> = match inner.queue.lock() {
                Ok(mut q) => {
                    let n = q.len().min(inner.config.batch_size.max(1));
                    q.drain(..n).collect()
                }
                Err(_) => Vec::new(),
            };
            if batch.is_empty() {
                inner.flushing.store(false, Ordering::SeqCst);
                // Someone may have queued after the drain but before the flag dropped.
                let more = inner.queue.lock().map(|q| !q.is_empty()).unwrap_or(false);
                if more && !inner.flushing.swap(true, Ordering::SeqCst) {
                    continue;
                }
                // Not by a panic: the flag is another task's now, if raised.
                std::mem::forget(on_panic);
                return;
            }
            let (timers, waiters): (Vec<NewTimer>, Vec<_>) = batch.into_iter().unzip();
            match self.schedule(&timers).await {
                Ok(results) => {
                    for (waiter, result) in waiters.into_iter().zip(results) {
                        let _ = waiter.send(Ok(result));
                    }
                }
                Err(e) => {
                    for waiter in waiters {
                        let _ = waiter.send(Err(Error::new(e.kind(), e.chain())));
                    }
                }
            }
        }
    }
}
