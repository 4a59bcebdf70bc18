//! The broker path: commands in batches, applied in arrival order (runs of schedules in one
//! transaction each; cancels, pauses and resumes between them), acknowledged only after the
//! store committed them.
//! A refused command goes to the dead-letter destination before it is acknowledged.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Level};

use super::retry::pause;
use super::{Engine, Scheduled};
use crate::broker::Delivery;
use crate::control::Action;
use crate::model::{ControlOutcome, NewTimer, TimerKey};
use crate::wire::Command;

/// How often a `CancelTimer` or `PauseTimer` that met a fire in progress looks again.
const FIRING_RECHECK: Duration = Duration::from_millis(100);

/// One step of an ingested batch.
enum Step<'a> {
    /// Timers to store together, with the deliveries they came from.
    Schedule(Vec<NewTimer>, Vec<&'a Delivery>),
    /// A `CancelTimer`, `PauseTimer` or `ResumeTimer`.
    Control(TimerKey, Action),
}

impl Engine {
    pub(super) async fn ingest_loop(self, shutdown: CancellationToken) {
        let inner = &self.inner;
        let retry = self.broker_retry(&shutdown, "receiving commands");
        loop {
            let received = retry
                .until_ok(|| async {
                    tokio::select! {
                        _ = shutdown.cancelled() => Ok(None),
                        r = inner.broker.receive(inner.config.batch_size, Duration::from_secs(1)) => r.map(Some),
                    }
                })
                .await;
            match received {
                Some(Some(deliveries)) if deliveries.is_empty() => {}
                Some(Some(deliveries)) => self.ingest_batch(deliveries, &shutdown).await,
                Some(None) | None => break,
            }
        }
        debug!("ingest task stopped");
    }

    async fn ingest_batch(&self, deliveries: Vec<Delivery>, shutdown: &CancellationToken) {
        let mut steps: Vec<Step> = Vec::new();
        let mut acks = Vec::with_capacity(deliveries.len());
        for delivery in &deliveries {
            let admitted = self
                .admit(&delivery.body)
                .and_then(|command| match command {
                    Command::Pause(_) | Command::Resume(_)
                        if self.inner.store.control().is_none() =>
                    {
                        Err(crate::wire::Rejection::new(
                            crate::wire::Reason::NotAcceptedHere,
                            Some("type"),
                            format!(
                                "the {} store cannot pause or resume timers",
                                self.inner.store.name()
                            ),
                        ))
                    }
                    command => Ok(command),
                });
            match admitted {
                Ok(Command::Schedule(timer)) => {
                    match steps.last_mut() {
                        Some(Step::Schedule(run, from)) => {
                            run.push(timer);
                            from.push(delivery);
                        }
                        _ => steps.push(Step::Schedule(vec![timer], vec![delivery])),
                    }
                    acks.push(delivery.tag);
                }
                Ok(Command::Cancel(key)) => {
                    steps.push(Step::Control(key, Action::Cancel));
                    acks.push(delivery.tag);
                }
                Ok(Command::Pause(key)) => {
                    steps.push(Step::Control(key, Action::Pause { note: None }));
                    acks.push(delivery.tag);
                }
                Ok(Command::Resume(key)) => {
                    steps.push(Step::Control(key, Action::Resume));
                    acks.push(delivery.tag);
                }
                Err(rejection) => {
                    warn!(reason = rejection.reason.as_str(), error = %rejection, "command rejected; dead-lettering it");
                    if !self
                        .dead_letter(&delivery.body, &rejection.to_string(), shutdown)
                        .await
                    {
                        return; // shutting down: unacknowledged, the batch comes again
                    }
                    acks.push(delivery.tag);
                }
            }
        }
        let retry = super::retry::Retry {
            level: Level::ERROR,
            ..self.store_retry(shutdown, "storing commands (not acknowledged)")
        };
        for step in &steps {
            match step {
                Step::Schedule(timers, from) => {
                    let Some(results) = retry.until_ok(|| self.schedule(timers)).await else {
                        return; // unacknowledged: the broker delivers the batch again
                    };
                    for (result, delivery) in results.iter().zip(from) {
                        let Scheduled::Refused(rejection) = result else {
                            continue;
                        };
                        warn!(
                            reason = rejection.reason.as_str(),
                            "command refused; dead-lettering it"
                        );
                        if !self
                            .dead_letter(&delivery.body, &rejection.to_string(), shutdown)
                            .await
                        {
                            acks.retain(|tag| *tag != delivery.tag); // it comes back
                        }
                    }
                }
                Step::Control(key, action) => loop {
                    let applied = retry
                        .until_ok(|| async {
                            match action {
                                Action::Cancel => self.cancel(key).await.map(ControlOutcome::from),
                                _ => Ok(self
                                    .control(std::slice::from_ref(key), action)
                                    .await?
                                    .first()
                                    .copied()
                                    .unwrap_or(ControlOutcome::NotFound)),
                            }
                        })
                        .await;
                    let Some(outcome) = applied else {
                        return; // unacknowledged: the command comes again
                    };
                    match outcome {
                        // Its event is being published: wait for that fire to settle (bounded
                        // by half the lease), then act on what is left (a recurring series, or
                        // a timer whose publish failed).
                        ControlOutcome::Firing => {
                            if !pause(shutdown, FIRING_RECHECK).await {
                                return;
                            }
                        }
                        outcome if outcome.changed() => break,
                        other => {
                            info!(timer = %key, action = action.as_str(), outcome = other.as_str(), "command changed nothing");
                            break;
                        }
                    }
                },
            }
        }
        if let Err(e) = self.inner.broker.ack(&acks).await {
            // Stored but not acked: redelivery applies the same commands again, which is
            // harmless (schedules are upserts, a second cancel changes nothing).
            warn!(error = %e.chain(), "acknowledging commands failed; they will be redelivered");
        }
    }

    /// Sends a refused command to the dead-letter destination, retrying with backoff until it
    /// went out (a broker may not deliver an unacknowledged command again, e.g. Kafka within one
    /// session). False only when shutdown came first: the command stays unacknowledged.
    async fn dead_letter(&self, body: &[u8], reason: &str, shutdown: &CancellationToken) -> bool {
        let retry = super::retry::Retry {
            level: Level::ERROR,
            ..self.broker_retry(
                shutdown,
                "dead-lettering a refused command (not acknowledged)",
            )
        };
        retry
            .until_ok(|| self.inner.broker.dead_letter(body, reason))
            .await
            .is_some()
    }
}
