//! Supervision of the engine's tasks: a task that panics (a bug, or an SDK that panics on input
//! it should have refused) is started again after a backoff, counted, and reported as down
//! meanwhile, so one bad timer or command cannot stop every tenant's firing for good while the
//! instance still reads as ready.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

use super::retry::{backoff, pause};
use super::{metrics as metric, Engine};

/// A task that ran this long since its last start is healthy again: its next panic waits the
/// first backoff, not a longer one.
const HEALTHY_AFTER: Duration = Duration::from_secs(60);

/// The engine's tasks that are down right now: name → why.
#[derive(Default)]
pub(super) struct TasksDown(Mutex<BTreeMap<&'static str, String>>);

impl TasksDown {
    fn set(&self, task: &'static str, why: Option<String>) {
        // A poisoned lock only means a panic while it was held: the map is still whole.
        let mut down = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match why {
            Some(why) => down.insert(task, why),
            None => down.remove(task),
        };
    }

    fn list(&self) -> Vec<(&'static str, String)> {
        let down = self.0.lock().unwrap_or_else(|p| p.into_inner());
        down.iter().map(|(k, v)| (*k, v.clone())).collect()
    }
}

impl Engine {
    /// The engine's tasks that are down (a panic, waiting to be started again), with what
    /// happened; empty while all run. `/readyz` answers 503 while it is not empty.
    pub fn tasks_down(&self) -> Vec<(&'static str, String)> {
        self.inner.down.list()
    }

    /// Runs the task `make` builds until it ends by itself (at shutdown); when it panics, marks
    /// it down, counts it in `timer.engine.task_restarts`, waits the retry backoff (longer
    /// after each panic in a row) and starts it again. The task runs in a set of its own, so
    /// aborting the supervisor aborts it too.
    pub(super) async fn supervise<F, Fut>(
        self,
        task: &'static str,
        shutdown: CancellationToken,
        make: F,
    ) where
        F: Fn(Engine, CancellationToken) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let mut in_a_row = 0u32;
        loop {
            let started = Instant::now();
            let mut one = JoinSet::new();
            one.spawn(make(self.clone(), shutdown.clone()));
            let ended = one.join_next().await;
            let panic = match ended {
                Some(Err(e)) if e.is_panic() => panic_message(e.into_panic()),
                // Ended by itself (shutdown), or cancelled with the engine.
                _ => return,
            };
            if started.elapsed() >= HEALTHY_AFTER {
                in_a_row = 0;
            }
            in_a_row = in_a_row.saturating_add(1);
            let wait = backoff(&self.inner.config, in_a_row);
            ::metrics::counter!(metric::TASK_RESTARTS, "task" => task).increment(1);
            error!(task, panic = %panic, restart_in = ?wait, "engine task panicked; restarting it");
            self.inner
                .down
                .set(task, Some(format!("panicked ({panic}); restarting")));
            if !pause(&shutdown, wait).await {
                return;
            }
            self.inner.down.set(task, None);
            info!(task, "engine task restarted");
        }
    }
}

/// The text a panic carried, when it is one.
fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "a panic without a message".to_owned()
    }
}
