//! The broker path: commands in batches, applied in arrival order (runs of schedules in one
//! transaction each; cancels, pauses, resumes and completions between them), acknowledged only
//! after the store committed them.
//! A refused command goes to the dead-letter destination before it is acknowledged.
//! A schedule of a tenant over its rate limit (`limits.rate`) is held back, unacknowledged,
//! with every later command of that tenant; the other tenants' commands go on. So is a
//! `CancelTimer`, `PauseTimer` or `TimerCompleted` that meets a fire in progress, until it is
//! tried again.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use opentelemetry::trace::{FutureExt as _, TraceContextExt as _};
use opentelemetry::Context;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Level};

use super::held::{Held, Unacknowledged, Waits};
use super::retry::pause;
use super::{metrics as metric, Engine, Scheduled};
use crate::broker::Delivery;
use crate::control::Action;
use crate::model::{ControlOutcome, NewTimer, TimerKey};
use crate::trace::TraceContext;
use crate::wire::{Command, Reason, Rejection};

/// Counts a schedule held back for its tenant's rate limit.
fn throttled() {
    ::metrics::counter!(metric::COMMANDS_THROTTLED, "path" => "broker").increment(1);
}

/// How often a `CancelTimer`, `PauseTimer` or `TimerCompleted` that met a fire in progress is
/// tried again.
const FIRING_RECHECK: Duration = Duration::from_millis(100);

/// The longest one receive waits for commands (shorter while held commands wait for their
/// tenant's allowance).
const RECEIVE_WAIT: Duration = Duration::from_secs(1);
/// How long handing back the unacknowledged commands at a stop may take
/// ([`Broker::give_back`](crate::Broker::give_back)); what is left the broker delivers again
/// after its ack wait.
const GIVE_BACK_WITHIN: Duration = Duration::from_secs(5);

/// What a command asks for.
// As `Command`: one lives for a message; boxing the schedule would allocate for each.
#[allow(clippy::large_enum_variant)]
enum Work {
    /// A `ScheduleTimer`.
    Schedule(NewTimer),
    /// A `CancelTimer`, `PauseTimer`, `ResumeTimer` or `TimerCompleted`.
    Act(TimerKey, Action),
}

impl From<Command> for Work {
    fn from(command: Command) -> Self {
        match command {
            Command::Schedule(timer) => Work::Schedule(timer),
            Command::Cancel(key) => Work::Act(key, Action::Cancel),
            Command::Pause(key) => Work::Act(key, Action::Pause { note: None }),
            Command::Resume(key) => Work::Act(key, Action::Resume),
            Command::Complete(key, completion) => Work::Act(key, Action::Complete(completion)),
        }
    }
}

/// One step of an ingested batch, with the positions of the deliveries it came from.
enum Step {
    /// Timers to store together.
    Schedule(Vec<NewTimer>, Vec<usize>),
    /// An action on one timer.
    Act(TimerKey, Action, usize),
}

/// The context of a delivery's trace context headers, for the span of the action it asks for.
fn context_of(delivery: &Delivery) -> Context {
    match TraceContext::carried(&delivery.trace, "broker") {
        Some(trace) => Context::new().with_remote_span_context(trace.span_context()),
        None => Context::new(),
    }
}

/// A received command, decoded (or refused).
struct Admitted {
    delivery: Delivery,
    work: Result<Work, Rejection>,
    /// When its ack wait last started ([`Unacknowledged`]).
    kept: tokio::time::Instant,
}

impl Admitted {
    /// The tenant of a command that was decoded.
    fn tenant(&self) -> Option<&str> {
        match self.work.as_ref().ok()? {
            Work::Schedule(timer) => Some(&timer.key.tenant_id),
            Work::Act(key, _) => Some(&key.tenant_id),
        }
    }

    fn is_schedule(&self) -> bool {
        matches!(self.work, Ok(Work::Schedule(_)))
    }
}

impl Unacknowledged for Admitted {
    fn tag(&self) -> u64 {
        self.delivery.tag
    }

    fn kept(&mut self) -> &mut tokio::time::Instant {
        &mut self.kept
    }
}

/// Commands of a batch that wait for a fire in progress: the one that met it, and every later
/// one of its tenant (by position in the batch), each with what it waits for.
#[derive(Default)]
struct Behind {
    tenants: HashSet<String>,
    commands: Vec<(usize, Work, Waits)>,
}

impl Behind {
    /// Whether a command of `tenant` waits behind one that met a fire.
    fn waits(&self, tenant: &str) -> bool {
        self.tenants.contains(tenant)
    }

    /// A command that met a fire in progress: tried again after [`FIRING_RECHECK`].
    fn met_fire(&mut self, at: usize, key: TimerKey, action: Action) {
        let again = tokio::time::Instant::now() + FIRING_RECHECK;
        self.tenants.insert(key.tenant_id.clone());
        self.commands
            .push((at, Work::Act(key, action), Waits::Until(again)));
    }

    /// A later command of a tenant that waits.
    fn queue(&mut self, at: usize, work: Work) {
        self.commands.push((at, work, Waits::Turn));
    }

    /// The commands that wait, with the deliveries (of the whole batch, by position) they came
    /// from, to hold in the order they came.
    fn into_held(
        mut self,
        deliveries: Vec<(Delivery, tokio::time::Instant)>,
    ) -> Vec<(String, Admitted, Waits)> {
        self.commands.sort_by_key(|(at, ..)| *at);
        let mut commands = self.commands.into_iter().peekable();
        deliveries
            .into_iter()
            .enumerate()
            .filter_map(|(at, (delivery, kept))| {
                let (_, work, waits) = commands.next_if(|(of, ..)| *of == at)?;
                let admitted = Admitted {
                    delivery,
                    work: Ok(work),
                    kept,
                };
                let tenant = admitted.tenant()?.to_owned();
                Some((tenant, admitted, waits))
            })
            .collect()
    }
}

/// A command of a delivery the broker binds to a tenant ([`Delivery::tenant`]) must name that
/// tenant: a producer allowed to send for one tenant cannot act on another's timers.
fn bound_to(delivery: &Delivery, command: Command) -> Result<Command, Rejection> {
    let Some(bound) = &delivery.tenant else {
        return Ok(command);
    };
    let named = &command.key().tenant_id;
    if named == bound {
        return Ok(command);
    }
    Err(Rejection::new(
        Reason::InvalidId,
        Some("tenantId"),
        format!(
            "is {named:?}, but the broker delivered this command for tenant {bound:?} \
             (broker.bind_tenant)"
        ),
    ))
}

/// Takes one of the schedules `tenant` was granted for this batch; false when none is left.
fn take_granted(granted: &mut HashMap<String, u32>, tenant: &str) -> bool {
    match granted.get_mut(tenant) {
        Some(left) if *left > 0 => {
            *left -= 1;
            true
        }
        _ => false,
    }
}

/// How often the tenants' allowances of the rate limit are tidied up.
const FORGET_IDLE_EVERY: Duration = Duration::from_secs(60);

impl Engine {
    pub(super) async fn ingest_loop(self, shutdown: CancellationToken) {
        let inner = &self.inner;
        let retry = self.broker_retry(&shutdown, "receiving commands");
        let max_held = inner.limits.rate.max_held.max(1);
        let mut held: Held<Admitted> = Held::default();
        let mut tidied = tokio::time::Instant::now();
        loop {
            // Commands of tenants back within their rate go first, in their order.
            let (released, mut next) = held.release(&inner.throttle).await;
            if !released.is_empty() {
                let behind = self.apply(released, &shutdown).await;
                if !behind.is_empty() {
                    // Met a fire again: tried again after FIRING_RECHECK, whatever `next` was.
                    next = Some(next.map_or(FIRING_RECHECK, |next| next.min(FIRING_RECHECK)));
                }
                held.put_back(behind);
                ::metrics::gauge!(metric::COMMANDS_HELD).set(held.len() as f64);
            }
            self.keep_held(&mut held).await;
            if tidied.elapsed() >= FORGET_IDLE_EVERY {
                inner.throttle.forget_idle().await;
                tidied = tokio::time::Instant::now();
            }
            let mut wait = next.map_or(RECEIVE_WAIT, |next| next.min(RECEIVE_WAIT));
            if !held.is_empty() {
                // Back in time to keep them, however short the broker's ack wait.
                wait = self.keep_every().map_or(wait, |every| wait.min(every));
            }
            let room = max_held.saturating_sub(held.len());
            if room == 0 {
                // As many held as allowed: read nothing more (every tenant waits now) until the
                // next release.
                if !pause(&shutdown, wait).await {
                    break;
                }
                continue;
            }
            let received = retry
                .until_ok(|| async {
                    tokio::select! {
                        _ = shutdown.cancelled() => Ok(None),
                        r = inner.broker.receive(inner.config.batch_size.min(room), wait) => r.map(Some),
                    }
                })
                .await;
            let deliveries = match received {
                Some(Some(deliveries)) => deliveries,
                Some(None) | None => break,
            };
            let admitted: Vec<Admitted> =
                deliveries.into_iter().map(|d| self.admitted(d)).collect();
            // The schedules of each tenant not held already take from its allowance at once
            // (one call of the store per tenant when the allowances are shared); a schedule
            // beyond what it got is held with every later command of its tenant.
            let mut asked: BTreeMap<&str, u32> = BTreeMap::new();
            for a in admitted.iter().filter(|a| a.is_schedule()) {
                if let Some(tenant) = a.tenant().filter(|tenant| !held.holds(tenant)) {
                    *asked.entry(tenant).or_default() += 1;
                }
            }
            let mut granted: HashMap<String, u32> = HashMap::with_capacity(asked.len());
            for (tenant, n) in asked {
                granted.insert(
                    tenant.to_owned(),
                    inner.throttle.take_up_to(tenant, n).await,
                );
            }
            let mut ready = Vec::with_capacity(admitted.len());
            for mut admitted in admitted {
                if let Some(refusal) = admitted
                    .tenant()
                    .and_then(|tenant| self.over_held_share(&held, tenant))
                {
                    // Refused: a dead letter, acknowledged in its turn.
                    super::admit::rejected(refusal.reason);
                    admitted.work = Err(refusal);
                    ready.push(admitted);
                    continue;
                }
                let schedule = admitted.is_schedule();
                // Behind its tenant's held commands, whatever it is; a schedule also when it is
                // over its tenant's rate.
                let hold = admitted
                    .tenant()
                    .filter(|tenant| {
                        held.holds(tenant) || (schedule && !take_granted(&mut granted, tenant))
                    })
                    .map(str::to_owned);
                match hold {
                    None => ready.push(admitted),
                    Some(tenant) => {
                        let waits = if schedule {
                            throttled();
                            Waits::Allowance
                        } else {
                            Waits::Turn
                        };
                        held.push(&tenant, admitted, waits);
                    }
                }
            }
            if !ready.is_empty() {
                held.put_back(self.apply(ready, &shutdown).await);
            }
            ::metrics::gauge!(metric::COMMANDS_HELD).set(held.len() as f64);
        }
        // Held commands stay unacknowledged: the broker delivers them again, to another
        // instance at once where it can be told to.
        ::metrics::gauge!(metric::COMMANDS_HELD).set(0.0);
        match tokio::time::timeout(GIVE_BACK_WITHIN, inner.broker.give_back()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                warn!(error = %e.chain(), "handing back the commands not acknowledged failed; the broker delivers them again after its ack wait")
            }
            Err(_) => {
                warn!("handing back the commands not acknowledged did not finish in time; the broker delivers the rest again after its ack wait")
            }
        }
        debug!(held = held.len(), "ingest task stopped");
    }

    /// A refusal when `tenant` holds its whole share of `limits.rate.max_held` already.
    fn over_held_share(&self, held: &Held<Admitted>, tenant: &str) -> Option<Rejection> {
        let share = self.inner.limits.rate.max_held_per_tenant;
        let holding = held.of(tenant);
        (share > 0 && holding >= share).then(|| {
            Rejection::new(
                Reason::TenantLimit,
                Some("tenantId"),
                format!(
                    "tenant {tenant:?} has {holding} commands held back, for its rate limit or \
                     behind a fire in progress (limits.rate.max_held_per_tenant); this one was \
                     refused: send it again later, and slower"
                ),
            )
        })
    }

    /// Tells the broker to keep the held commands (restart their ack wait) a third of the way
    /// into it, so it does not deliver them again while they wait.
    async fn keep_held(&self, held: &mut Held<Admitted>) {
        let Some(every) = self.keep_every() else {
            return;
        };
        let tags = held.due_to_keep(every);
        if tags.is_empty() {
            return;
        }
        if let Err(e) = self.inner.broker.keep(&tags).await {
            // They may come again: a second copy of a command is applied like the first.
            warn!(error = %e.chain(), held = tags.len(), "asking the broker to keep held commands failed; it may deliver them again");
        }
    }

    /// How often held commands are kept: a third of the broker's ack wait (none without one).
    fn keep_every(&self) -> Option<Duration> {
        self.inner.broker.ack_wait().map(|ack_wait| ack_wait / 3)
    }

    /// Decodes a delivery (counted by `admit`), then refuses (and counts) a `PauseTimer`,
    /// `ResumeTimer` or `TimerCompleted` the store cannot do, and a command for another tenant
    /// than the broker binds the delivery to.
    fn admitted(&self, delivery: Delivery) -> Admitted {
        let work = self
            .admit(&delivery.body, &delivery.trace)
            .and_then(|command| {
                bound_to(&delivery, command)
                    .inspect_err(|refused| super::admit::rejected(refused.reason))
            })
            .map(Work::from);
        Admitted {
            delivery,
            work,
            kept: tokio::time::Instant::now(),
        }
    }

    /// Applies commands in their order and acknowledges them. A `CancelTimer`, `PauseTimer` or
    /// `TimerCompleted` that meets a fire in progress is not waited for here, where every
    /// tenant's commands would wait with it: it is returned, unacknowledged, with every later
    /// command of its tenant, to be held and tried again once that fire may have settled.
    async fn apply(
        &self,
        commands: Vec<Admitted>,
        shutdown: &CancellationToken,
    ) -> Vec<(String, Admitted, Waits)> {
        let mut deliveries = Vec::with_capacity(commands.len());
        let mut steps: Vec<Step> = Vec::new();
        let mut acks = Vec::with_capacity(commands.len());
        for (at, admitted) in commands.into_iter().enumerate() {
            let Admitted {
                delivery,
                work,
                kept,
            } = admitted;
            match work {
                Ok(Work::Schedule(timer)) => match steps.last_mut() {
                    Some(Step::Schedule(run, from)) => {
                        run.push(timer);
                        from.push(at);
                    }
                    _ => steps.push(Step::Schedule(vec![timer], vec![at])),
                },
                Ok(Work::Act(key, action)) => steps.push(Step::Act(key, action, at)),
                Err(rejection) => {
                    warn!(reason = rejection.reason.as_str(), error = %rejection, "command rejected; dead-lettering it");
                    if !self
                        .dead_letter(&delivery.body, &rejection.to_string(), shutdown)
                        .await
                    {
                        return Vec::new(); // shutting down: unacknowledged, the batch comes again
                    }
                    acks.push(delivery.tag);
                }
            }
            deliveries.push((delivery, kept));
        }
        let retry = super::retry::Retry {
            level: Level::ERROR,
            ..self.store_retry(shutdown, "storing commands (not acknowledged)")
        };
        let mut behind = Behind::default();
        for step in steps {
            match step {
                Step::Schedule(timers, from) => {
                    let mut run = Vec::with_capacity(timers.len());
                    let mut run_from = Vec::with_capacity(timers.len());
                    for (timer, at) in timers.into_iter().zip(from) {
                        if behind.waits(&timer.key.tenant_id) {
                            behind.queue(at, Work::Schedule(timer));
                        } else {
                            run.push(timer);
                            run_from.push(at);
                        }
                    }
                    if run.is_empty() {
                        continue;
                    }
                    let Some(results) = retry.until_ok(|| self.schedule(&run)).await else {
                        return Vec::new(); // unacknowledged: the broker delivers the batch again
                    };
                    for (result, at) in results.iter().zip(run_from) {
                        let delivery = &deliveries[at].0;
                        if let Scheduled::Refused(rejection) = result {
                            warn!(
                                reason = rejection.reason.as_str(),
                                "command refused; dead-lettering it"
                            );
                            if !self
                                .dead_letter(&delivery.body, &rejection.to_string(), shutdown)
                                .await
                            {
                                continue; // unacknowledged: it comes back
                            }
                        }
                        acks.push(delivery.tag);
                    }
                }
                Step::Act(key, action, at) => {
                    if behind.waits(&key.tenant_id) {
                        behind.queue(at, Work::Act(key, action));
                        continue;
                    }
                    let context = context_of(&deliveries[at].0);
                    let applied = retry
                        .until_ok(|| {
                            async {
                                match &action {
                                    Action::Cancel => {
                                        self.cancel(&key).await.map(ControlOutcome::from)
                                    }
                                    _ => Ok(self
                                        .control(std::slice::from_ref(&key), &action)
                                        .await?
                                        .first()
                                        .copied()
                                        .unwrap_or(ControlOutcome::NotFound)),
                                }
                            }
                            .with_context(context.clone())
                        })
                        .await;
                    let Some(outcome) = applied else {
                        return Vec::new(); // unacknowledged: the command comes again
                    };
                    match outcome {
                        // Its event is being published: tried again once that fire may have
                        // settled (bounded by half the lease), to act on what is left then (a
                        // recurring series, or a timer whose publish failed).
                        ControlOutcome::Firing => {
                            debug!(timer = %key, action = action.as_str(), "command met a fire in progress; held until it settles");
                            behind.met_fire(at, key, action);
                            continue;
                        }
                        outcome if outcome.changed() => {}
                        other => {
                            info!(timer = %key, action = action.as_str(), outcome = other.as_str(), "command changed nothing");
                        }
                    }
                    acks.push(deliveries[at].0.tag);
                }
            }
        }
        if let Err(e) = self.inner.broker.ack(&acks).await {
            // Stored but not acked: redelivery applies the same commands again, which is
            // harmless (schedules are upserts, a second cancel changes nothing).
            warn!(error = %e.chain(), "acknowledging commands failed; they will be redelivered");
        }
        behind.into_held(deliveries)
    }

    /// Sends a refused command to the dead-letter destination, retrying with backoff until it
    /// went out (a broker may not deliver an unacknowledged command again, e.g. Kafka within one
    /// session). False only when shutdown came first: the command stays unacknowledged.
    ///
    /// A body larger than a command may be (`limits.max_command_bytes`) goes out cut to that
    /// size, the reason saying so: the broker took the command, but may not take it back with
    /// the dead letter's header (NATS refuses a message over the server's `max_payload`), and
    /// a dead letter retried for ever would hold every tenant's commands behind it.
    async fn dead_letter(&self, body: &[u8], reason: &str, shutdown: &CancellationToken) -> bool {
        let (body, reason) = dead_letter_of(body, reason, self.inner.limits.command_bytes());
        let retry = super::retry::Retry {
            level: Level::ERROR,
            ..self.broker_retry(
                shutdown,
                "dead-lettering a refused command (not acknowledged)",
            )
        };
        retry
            .until_ok(|| self.inner.broker.dead_letter(body, &reason))
            .await
            .is_some()
    }
}

/// A refused command's dead letter: its body, cut to `max` bytes when longer, and the reason,
/// saying how much of it the letter holds when cut.
fn dead_letter_of<'a>(body: &'a [u8], reason: &str, max: usize) -> (&'a [u8], String) {
    if body.len() <= max {
        return (body, reason.to_owned());
    }
    let reason = format!(
        "{reason} (the dead letter holds its first {max} of {} bytes)",
        body.len()
    );
    (&body[..max], reason)
}
