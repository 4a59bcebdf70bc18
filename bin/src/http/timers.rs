//! One timer: schedule it (`POST /v1/timers`), read it with its next fire times, cancel it.

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use timer_core::policy::fire_time;
use timer_core::wire::{addressed, Addressed};
use timer_core::{
    CancelOutcome, Reason, ScheduleOutcome, Scheduled, Timer, TimerKey, TimerState, Timestamp,
};

use crate::http::auth::{audited, Principal};
use crate::http::error::{ApiError, ErrorBody, ErrorDetail};
use crate::http::params::timer_parameters;
use crate::http::state::{trace_headers, AppState, PathTimer, TenantPath, TimerPath};
use crate::http::views::{Occurrence, Outcome, ScheduleTimer, TimerOutcome, TimerView};

/// The outcome code of a stored schedule, as the API names it (`outcome`, and the reason of a
/// 409).
pub fn outcome_code(outcome: ScheduleOutcome) -> &'static str {
    match outcome {
        ScheduleOutcome::Created => "created",
        ScheduleOutcome::Updated => "updated",
        ScheduleOutcome::AlreadyReached => "already_reached",
        ScheduleOutcome::AlreadyCancelled => "already_cancelled",
        ScheduleOutcome::AlreadyFailed => "already_failed",
    }
}

/// Schedules a timer, or moves a Scheduled one with the same key.
#[utoipa::path(
    post,
    path = "/v1/timers",
    tag = "timers",
    request_body = ScheduleTimer,
    responses(
        (status = 201, description = "Created", body = TimerOutcome),
        (status = 200, description = "Updated (same key, new due time or fields)", body = TimerOutcome),
        (status = 409, description = "The timer already fired, was cancelled or failed; nothing changed", body = TimerOutcome),
        (status = 400, description = "The command is refused; `field` names what is wrong", body = ErrorBody),
        (status = 429, description = "The tenant is over its rate limit (`rate_limited`, with a `Retry-After` header in seconds), or at its limit of pending timers (`tenant_limit`); nothing was written", body = ErrorBody),
        (status = 503, description = "The store is unavailable", body = ErrorBody),
    )
)]
pub async fn schedule(
    State(app): State<AppState>,
    Extension(caller): Extension<Principal>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let command = addressed(&body);
    let answer = schedule_command(app, caller, &headers, &body, &command).await;
    audited(command, answer)
}

async fn schedule_command(
    app: AppState,
    caller: Principal,
    headers: &HeaderMap,
    body: &Bytes,
    command: &Addressed,
) -> Result<Response, ApiError> {
    caller.need_tenant_of(command)?;
    let timer = app.engine.admit_schedule(body, &trace_headers(headers))?;
    caller.need_tenant(&timer.key.tenant_id, Some("tenantId"))?;
    app.engine.within_rate(std::slice::from_ref(&timer)).await?;
    let key = timer.key.clone();
    let outcome = match app.engine.schedule_one(timer).await? {
        Scheduled::Stored(outcome) => outcome,
        Scheduled::Refused(r) if r.reason == Reason::TenantLimit => {
            let error = ApiError::new(StatusCode::TOO_MANY_REQUESTS, r.reason.as_str(), &r.message);
            return Err(match r.field {
                Some(field) => error.field(field),
                None => error,
            });
        }
        Scheduled::Refused(r) => return Err(r.into()),
    };
    let status = match outcome {
        ScheduleOutcome::Created => StatusCode::CREATED,
        ScheduleOutcome::Updated => StatusCode::OK,
        _ => StatusCode::CONFLICT,
    };
    let outcome = outcome_code(outcome);
    let timer = app.engine.store().get(&key).await?;
    let timer = timer.as_ref().map(TimerView::of);
    let error = (status == StatusCode::CONFLICT).then(|| {
        let message = match outcome {
            "already_reached" => "the timer already fired; nothing changed",
            "already_failed" => "the timer failed (engine.max_attempts publishes); nothing changed",
            _ => "the timer was cancelled; nothing changed",
        };
        ErrorDetail::new(outcome, None, message)
    });
    let body = TimerOutcome {
        outcome,
        timer,
        error,
    };
    Ok((status, Json(body)).into_response())
}

/// A timer; with `next=N`, its next N fire times too; with `body=true`, its message's body.
#[utoipa::path(
    get,
    path = "/v1/tenants/{tenant}/timers/{id}",
    tag = "timers",
    params(
        TimerPath,
        ("next" = Option<usize>, Query, description = "Add `nextOccurrences`: up to this many (at most 100) coming fire times"),
        ("body" = Option<bool>, Query, description = "`true`: add `message.bodyBase64`, the body of the timer's own message"),
    ),
    responses(
        (status = 200, description = "The timer", body = TimerView),
        (status = 400, description = "A bad query parameter", body = ErrorBody),
    )
)]
pub async fn get_timer(
    State(app): State<AppState>,
    PathTimer(key): PathTimer,
    RawQuery(query): RawQuery,
) -> Result<Json<TimerView>, ApiError> {
    let parameters = timer_parameters(query.as_deref())?;
    let Some(timer) = app.engine.store().get(&key).await? else {
        return Err(ApiError::no_such_timer());
    };
    let mut view = TimerView::of(&timer);
    if let (Some(template), Some(id)) = (&app.trace_url, &view.trace_id) {
        view.trace_url = Some(template.replace("{traceId}", id));
    }
    if parameters.body {
        view.add_message_body(&timer);
    }
    if let Some(n) = parameters.next {
        let now = app.engine.clock().now();
        view.next_occurrences = Some(next_occurrences(&timer, now, n));
    }
    Ok(Json(view))
}

/// Cancels a Scheduled or Paused timer.
#[utoipa::path(
    delete,
    path = "/v1/tenants/{tenant}/timers/{id}",
    tag = "timers",
    params(TimerPath),
    responses(
        (status = 200, description = "`cancelled`, or `already_cancelled`", body = Outcome),
        (status = 409, description = "It already fired or failed (`already_reached`, `already_failed`), or is firing right now (`firing`)", body = ErrorBody),
    )
)]
pub async fn cancel_timer(
    State(app): State<AppState>,
    PathTimer(key): PathTimer,
) -> Result<Json<Outcome>, ApiError> {
    let outcome = match app.engine.cancel(&key).await? {
        CancelOutcome::Cancelled => "cancelled",
        CancelOutcome::AlreadyCancelled => "already_cancelled",
        CancelOutcome::AlreadyReached => {
            return Err(ApiError::conflict(
                "already_reached",
                "the timer already fired",
            ))
        }
        CancelOutcome::AlreadyFailed => {
            return Err(ApiError::conflict(
                "already_failed",
                "the timer failed (engine.max_attempts publishes)",
            ))
        }
        CancelOutcome::Firing => {
            return Err(ApiError::conflict(
                "firing",
                "the timer's event is being published right now; it fires once (retry the \
                 cancel if you need it gone should the publish fail)",
            ))
        }
        CancelOutcome::NotFound => return Err(ApiError::no_such_timer()),
    };
    Ok(Json(Outcome { outcome }))
}

/// Up to `n` coming fire times of `timer`, each in UTC and on the wall clock of its time zone:
/// a Scheduled series' next occurrences, a Scheduled one-shot timer's due time, nothing for a
/// finished timer.
pub fn next_occurrences(timer: &Timer, now: Timestamp, n: usize) -> Vec<Occurrence> {
    if timer.state != TimerState::Scheduled {
        return Vec::new();
    }
    let Some(recurrence) = &timer.recurrence else {
        let at = timer.due_at.to_rfc3339();
        return vec![Occurrence {
            utc: at.clone(),
            local: at,
        }];
    };
    let Ok(schedule) = recurrence.schedule() else {
        return Vec::new();
    };
    // With a jitter, the occurrences (cron times) each fire at their own offset: the due time
    // is the next one's fire time, `work.nominal` its cron time.
    let policy = timer.policy.as_ref();
    let nominal = timer
        .work
        .as_ref()
        .and_then(|w| w.nominal)
        .filter(|_| policy.is_some_and(|p| p.jitter.is_some()))
        .unwrap_or(timer.due_at);
    schedule
        .upcoming(nominal, timer.occurrences, now, n)
        .into_iter()
        .map(|at| fire_time(&timer.key, at, policy))
        .map(|at| Occurrence {
            utc: at.to_rfc3339(),
            local: schedule.local_rfc3339(at),
        })
        .collect()
}

/// The id the bulk route's path ends in: `GET` and `DELETE …/timers/bulk` are the timer of
/// that id's (the route takes only `POST`, and its fixed segment comes before `{id}`).
pub const BULK_ID: &str = "bulk";

/// `GET /v1/tenants/{tenant}/timers/bulk`: [`get_timer`] of the timer `bulk`.
pub async fn get_timer_bulk(
    State(app): State<AppState>,
    Path(TenantPath { tenant }): Path<TenantPath>,
    query: RawQuery,
) -> Result<Json<TimerView>, ApiError> {
    get_timer(State(app), PathTimer(TimerKey::new(tenant, BULK_ID)), query).await
}

/// `DELETE /v1/tenants/{tenant}/timers/bulk`: [`cancel_timer`] of the timer `bulk`.
pub async fn cancel_timer_bulk(
    State(app): State<AppState>,
    Path(TenantPath { tenant }): Path<TenantPath>,
) -> Result<Json<Outcome>, ApiError> {
    cancel_timer(State(app), PathTimer(TimerKey::new(tenant, BULK_ID))).await
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use timer_core::policy::{Policy, Work};
    use timer_core::Recurrence;

    use super::*;

    /// A jittered series lists each coming occurrence at its own fire time (cron time plus its
    /// offset), as it will fire, not the cron times after the first.
    #[test]
    fn next_occurrences_of_a_jittered_series_are_fire_times() {
        let hour = 3_600_000;
        let nominal = Timestamp::from_millis(1_800_000_000_000 / hour * hour);
        let key = TimerKey::new("acme", "report");
        let policy = Policy {
            jitter: Some(Duration::from_secs(1_800)),
            ..Policy::default()
        };
        let timer = Timer {
            key: key.clone(),
            due_at: fire_time(&key, nominal, Some(&policy)),
            state: TimerState::Scheduled,
            registered_at: nominal,
            reached_at: None,
            correlation_id: None,
            payload: None,
            attempts: 0,
            last_error: None,
            lease_owner: None,
            available_at: nominal,
            recurrence: Some(Recurrence {
                cron: "0 * * * *".into(),
                time_zone: "UTC".into(),
                end_at: None,
                max_occurrences: None,
            }),
            occurrences: 0,
            policy: Some(policy.clone()),
            work: Some(Work {
                nominal: Some(nominal),
                ..Work::default()
            }),
            target: None,
            message: None,
            trace: None,
        };
        let got: Vec<String> = next_occurrences(&timer, nominal, 3)
            .into_iter()
            .map(|o| o.utc)
            .collect();
        let want: Vec<String> = (0..3)
            .map(|h| {
                let at = Timestamp::from_millis(nominal.as_millis() + h * hour);
                fire_time(&key, at, Some(&policy)).to_rfc3339()
            })
            .collect();
        assert_eq!(got, want);
        let second = Timestamp::from_millis(nominal.as_millis() + hour).to_rfc3339();
        assert_ne!(got[1], second, "this key's offset is not 0");
    }
}
