//! The engine's metrics: each name with its kind and description, in one table. The binary
//! installs an exporter and calls [`describe`].

/// Commands read from the broker or the HTTP API.
pub const COMMANDS_RECEIVED: &str = "timer.commands.received";
/// Commands refused, labelled by `reason` (a [`Reason`](crate::wire::Reason) code).
pub const COMMANDS_REJECTED: &str = "timer.commands.rejected";
/// Commands over their tenant's rate limit, labelled by `path` (`http`: answered 429;
/// `broker`: held back).
pub const COMMANDS_THROTTLED: &str = "timer.commands.throttled";
/// Commands the broker path holds back for their tenant's rate limit right now.
pub const COMMANDS_HELD: &str = "timer.commands.held";
pub const SCHEDULES_PROCESSED: &str = "timer.schedules.processed";
pub const POLLING_DURATION: &str = "timer.polling.duration";
pub const TIMERS_FIRED: &str = "timer.timers.fired";
pub const PUBLISH_FAILURES: &str = "timer.publish.failures";
pub const FIRE_LATENESS: &str = "timer.fire.lateness";
pub const PENDING: &str = "timer.pending";
pub const CANCELS_PROCESSED: &str = "timer.cancels.processed";
pub const TIMERS_FAILED: &str = "timer.timers.failed";
pub const TIMERS_PURGED: &str = "timer.timers.purged";
pub const PAUSED: &str = "timer.paused";
pub const CONTROL_ACTIONS: &str = "timer.control.actions";
pub const TRIGGERS: &str = "timer.triggers";
pub const BULK_ACTIONS: &str = "timer.bulk.actions";
pub const HISTORY_WRITES: &str = "timer.history.writes";
/// Occurrences of series that did not fire, labelled by `reason`
/// ([`SkipReason`](crate::policy::SkipReason)).
pub const OCCURRENCES_SKIPPED: &str = "timer.occurrences.skipped";
pub const OCCURRENCES_BUFFERED: &str = "timer.occurrences.buffered";
pub const OCCURRENCES_CAUGHT_UP: &str = "timer.occurrences.caught_up";
pub const COMPLETIONS_TIMED_OUT: &str = "timer.completions.timed_out";
/// Leases of dead instances this instance released ([`LeaseOwners`](crate::LeaseOwners)).
pub const LEASES_TAKEN_OVER: &str = "timer.leases.taken_over";
/// Claims this instance stopped firing because its leases could be lost.
pub const CLAIMS_ABANDONED: &str = "timer.claims.abandoned";
/// Times this instance lost its membership in the store and joined again.
pub const MEMBERSHIP_LOST: &str = "timer.membership.lost";
/// Fires held back for their tenant's fire rate (`limits.fire_rate`), labelled by `tenant`.
pub const FIRES_PACED: &str = "timer.fires.paced";
/// How long each held-back fire waits for its turn, labelled by `tenant`.
pub const FIRE_PACE_DELAY: &str = "timer.fire.pace_delay";
/// Engine tasks started again after a panic, labelled by `task` (`ingest`, `firing`, `purge`,
/// `membership`, `take-over`).
pub const TASK_RESTARTS: &str = "timer.engine.task_restarts";
/// Malformed `traceparent` values ignored (the timer got a fresh trace), labelled by `source`
/// (`command`, `http`, `broker`).
pub const TRACE_CONTEXT_IGNORED: &str = "timer.trace_context.ignored";
/// Spans not exported, labelled by `reason` (`queue_full`, `export_failed`, `shutdown`).
pub const SPANS_DROPPED: &str = "timer.telemetry.spans_dropped";

/// How a metric is recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    /// In seconds.
    Histogram,
}

/// Every metric: name, kind, description.
pub const ALL: &[(&str, Kind, &str)] = &[
    (
        COMMANDS_RECEIVED,
        Kind::Counter,
        "Commands received (ScheduleTimer, CancelTimer, PauseTimer, ResumeTimer, TimerCompleted), from the broker and from POST /v1/timers and its batch route",
    ),
    (
        COMMANDS_REJECTED,
        Kind::Counter,
        "Commands rejected, by reason code (label reason)",
    ),
    (
        COMMANDS_THROTTLED,
        Kind::Counter,
        "Commands over their tenant's rate limit (limits.rate), by path (label path): http (answered 429, nothing written; every command of a refused batch), broker (held back unacknowledged until they fit; a held cancel, pause or resume waiting behind its tenant's schedules is not counted)",
    ),
    (
        COMMANDS_HELD,
        Kind::Gauge,
        "Commands the broker path holds back, unacknowledged, because their tenant is over its rate limit",
    ),
    (
        SCHEDULES_PROCESSED,
        Kind::Counter,
        "Timers created or rescheduled",
    ),
    (
        TIMERS_FIRED,
        Kind::Counter,
        "DueTimeReached events the broker confirmed (one per occurrence of a recurring timer)",
    ),
    (
        PUBLISH_FAILURES,
        Kind::Counter,
        "Timers whose publish failed (they are retried, or given up after engine.max_attempts)",
    ),
    (
        POLLING_DURATION,
        Kind::Histogram,
        "Duration of one claim query",
    ),
    (FIRE_LATENESS, Kind::Histogram, "Fire time minus due time; a timer scheduled with a due time in the past counts from when it was scheduled"),
    (
        FIRES_PACED,
        Kind::Counter,
        "Claimed timers handed back until their turn because their tenant is over its fire rate (limits.fire_rate), by tenant (label tenant); a timer counts once per hand-back",
    ),
    (
        FIRE_PACE_DELAY,
        Kind::Histogram,
        "How much later than its claim a timer over its tenant's fire rate gets its turn: the lateness the fire rate adds, by tenant (label tenant)",
    ),
    (PENDING, Kind::Gauge, "Timers in state Scheduled (a recurring timer counts as one), refreshed every 5 s"),
    (
        CANCELS_PROCESSED,
        Kind::Counter,
        "Cancels from CancelTimer commands and DELETE, by outcome (label outcome): cancelled, firing, not_found, already_finished (Reached, Cancelled or Failed)",
    ),
    (
        TIMERS_FAILED,
        Kind::Counter,
        "Timers given up after engine.max_attempts failed publishes (or fires whose work never completed within completionTimeout), whose TimerFailed was sent",
    ),
    (
        TIMERS_PURGED,
        Kind::Counter,
        "Finished timers deleted after engine.retention",
    ),
    (PAUSED, Kind::Gauge, "Timers in state Paused, refreshed every 5 s"),
    (
        CONTROL_ACTIONS,
        Kind::Counter,
        "Pause, resume, cancel, retry and complete actions of the control plane (HTTP, PauseTimer/ResumeTimer/TimerCompleted commands, bulk), by action and outcome (labels action, outcome; a completion's outcome is completed, completed_late, already_completed, unknown_occurrence, not_found or firing)",
    ),
    (
        TRIGGERS,
        Kind::Counter,
        "Manual triggers whose DueTimeReached the broker confirmed",
    ),
    (
        BULK_ACTIONS,
        Kind::Counter,
        "Bulk actions run (POST /v1/tenants/{tenant}/timers/bulk), by action (label action)",
    ),
    (
        HISTORY_WRITES,
        Kind::Counter,
        "Changes of timers recorded in their history by the engine's own paths (schedules, fires, failed publishes, pauses, resumes, bulk actions, triggers; one per changed timer, so a resume that also records skipped occurrences counts once; cancels by DELETE or CancelTimer are not counted); 0 while engine.history_per_timer is 0",
    ),
    (
        OCCURRENCES_SKIPPED,
        Kind::Counter,
        "Occurrences of recurring timers that did not fire, by reason (label reason): overlap (the previous occurrence's work had not completed), catch_up (missed, and catchUp dropped it), catch_up_window (later than catchUpWindow); pause skips are counted in the history only",
    ),
    (
        OCCURRENCES_BUFFERED,
        Kind::Counter,
        "Occurrences that waited for the previous one's completion (overlap: bufferOne)",
    ),
    (
        OCCURRENCES_CAUGHT_UP,
        Kind::Counter,
        "Missed occurrences that fired late, with later ones due behind them (catchUp once or all)",
    ),
    (
        COMPLETIONS_TIMED_OUT,
        Kind::Counter,
        "Fires whose work did not report TimerCompleted within completionTimeout (a series is free again, a one-shot timer fires again)",
    ),
    (
        LEASES_TAKEN_OVER,
        Kind::Counter,
        "Leases of instances found dead that this instance released, so their timers fire at once instead of when the leases run out (postgres)",
    ),
    (
        CLAIMS_ABANDONED,
        Kind::Counter,
        "Claimed timers whose publish this instance stopped waiting for without settling them, because their leases could be lost (membership in the store lost, or renewals failing until the lease nearly ran out); another instance fires them",
    ),
    (
        MEMBERSHIP_LOST,
        Kind::Counter,
        "Times this instance lost the store connection that shows it alive and joined again (postgres)",
    ),
    (
        TASK_RESTARTS,
        Kind::Counter,
        "Engine tasks started again after a panic, by task (label task); /readyz answers 503 until it runs again",
    ),
    (
        TRACE_CONTEXT_IGNORED,
        Kind::Counter,
        "Malformed traceparent values ignored, the timer given a fresh trace, by where they came from (label source: command, http, broker)",
    ),
    (
        SPANS_DROPPED,
        Kind::Counter,
        "Spans not exported (label reason: queue_full, export_failed, shutdown); firing never waits for an exporter",
    ),
];

/// Registers every description with the installed recorder.
pub fn describe() {
    for (name, kind, text) in ALL {
        match kind {
            Kind::Counter => ::metrics::describe_counter!(*name, *text),
            Kind::Gauge => ::metrics::describe_gauge!(*name, *text),
            Kind::Histogram => {
                ::metrics::describe_histogram!(*name, ::metrics::Unit::Seconds, *text)
            }
        }
    }
}
