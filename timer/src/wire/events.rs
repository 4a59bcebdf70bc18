//! The events the service sends: the [`Envelope`] of a `DueTimeReached` or a `TimerFailed`, and
//! the ids of fires.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use uuid::Uuid;

use super::DUE_TIME_REACHED;
use crate::model::{ClaimedTimer, Timer, TimerKey, Timestamp};
use crate::trace::TraceContext;

/// Namespace of the name-based part of event ids (a fixed random UUID; never change it).
const EVENT_ID_NAMESPACE: Uuid = Uuid::from_u128(0x6c1f_4a2e_93b7_4d0a_8e55_0b3c_d2f1_7a64);

/// The envelope id of a timer's fire: a UUIDv7 whose timestamp is the due time (ids sort by due
/// time) and whose other 74 bits come from a SHA-1 name hash of tenant, service call id,
/// revision and due time. The same fire always gets the same id; a rescheduled timer gets a new
/// one.
pub fn event_id(timer: &ClaimedTimer) -> Uuid {
    refired_event_id(timer, 0)
}

/// [`event_id`] of the `refire`-th fire again of a one-shot timer whose work did not complete
/// in time (0: the first fire, whose id is [`event_id`]): a new id for each, so a broker's
/// de-duplication does not drop it.
pub fn refired_event_id(timer: &ClaimedTimer, refire: u32) -> Uuid {
    let mut name = format!(
        "{}\u{0}{}\u{0}{}\u{0}{}",
        timer.key.tenant_id,
        timer.key.service_call_id,
        timer.revision,
        timer.due_at.as_millis()
    );
    if refire > 0 {
        name.push_str(&format!("\u{0}refire\u{0}{refire}"));
    }
    let hash = Uuid::new_v5(&EVENT_ID_NAMESPACE, name.as_bytes()).into_bytes();
    let mut bits = [0u8; 10];
    bits.copy_from_slice(&hash[..10]);
    let millis = u64::try_from(timer.due_at.as_millis()).unwrap_or(0);
    uuid::Builder::from_unix_timestamp_millis(millis, &bits).into_uuid()
}

/// The envelope our events and dead letters travel in: a UUID id, the `type`, tenant and
/// aggregate (the serviceCallId), and `causationId` always null because time, not a message,
/// caused it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Envelope<P> {
    pub id: Uuid,
    #[serde(rename = "type")]
    pub kind: String,
    pub tenant_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
    pub causation_id: Option<String>,
    pub aggregate_id: String,
    pub timestamp_ms: i64,
    /// The W3C trace context of the timer's scheduling (`crate::trace`), for consumers that
    /// see no broker headers; the same values go in the `traceparent` and `tracestate` headers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
    pub payload: P,
}

/// The `DueTimeReached` event, as published and as consumers read it.
pub type DueTimeReachedEnvelope = Envelope<DueTimeReached>;

/// The `TimerFailed` dead letter sent when a timer's publish failed `engine.max_attempts`
/// times.
pub type TimerFailedEnvelope = Envelope<TimerFailed>;

impl<P: Serialize> Envelope<P> {
    fn about(timer: &ClaimedTimer, id: Uuid, kind: &str, at: Timestamp, payload: P) -> Self {
        Envelope {
            id,
            kind: kind.to_owned(),
            tenant_id: timer.key.tenant_id.clone(),
            correlation_id: timer.correlation_id.clone(),
            causation_id: None,
            aggregate_id: timer.key.service_call_id.clone(),
            timestamp_ms: at.as_millis(),
            traceparent: traceparent(timer.trace.as_ref()),
            tracestate: tracestate(timer.trace.as_ref()),
            payload,
        }
    }

    pub fn to_json(&self) -> Vec<u8> {
        // Serializing owned strings, numbers and valid raw JSON cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

fn traceparent(trace: Option<&TraceContext>) -> Option<String> {
    trace.map(|t| t.traceparent().to_owned())
}

fn tracestate(trace: Option<&TraceContext>) -> Option<String> {
    trace.and_then(|t| t.tracestate().map(str::to_owned))
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DueTimeReached {
    pub tenant_id: String,
    pub service_call_id: String,
    pub due_at: String,
    pub reached_at: String,
    /// For a recurring timer: which occurrence this is (1 for the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub occurrence: Option<u32>,
    /// `manual` for an extra fire asked for by `POST …/trigger` (it is not an occurrence and
    /// did not move the schedule); absent for a fire at the due time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger: Option<String>,
    /// A one-shot timer with a `completionTimeout` fired again because no `TimerCompleted`
    /// came in time: the how-manyth time (absent for the first fire).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refire: Option<u32>,
    /// The command's opaque payload, echoed back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<Box<RawValue>>,
}

/// The `trigger` of a manual fire.
pub const MANUAL_TRIGGER: &str = "manual";

/// The envelope id of a manual trigger of `key` at `at`: like [`event_id`], a UUIDv7 with `at`
/// as its time and a name hash of the key and `at`, distinct from any scheduled fire's id.
pub fn manual_event_id(key: &TimerKey, at: Timestamp) -> Uuid {
    let name = format!(
        "{}\u{0}{}\u{0}{MANUAL_TRIGGER}\u{0}{}",
        key.tenant_id,
        key.service_call_id,
        at.as_millis()
    );
    let hash = Uuid::new_v5(&EVENT_ID_NAMESPACE, name.as_bytes()).into_bytes();
    let mut bits = [0u8; 10];
    bits.copy_from_slice(&hash[..10]);
    let millis = u64::try_from(at.as_millis()).unwrap_or(0);
    uuid::Builder::from_unix_timestamp_millis(millis, &bits).into_uuid()
}

impl Envelope<DueTimeReached> {
    /// The event for a claimed timer. Its id is [`event_id`]: every fire of the same timer
    /// revision carries the same id, so a repeat (after a crash between publish and mark, or a
    /// publish retried after an outage) is dropped by the broker's de-duplication and is
    /// recognisable to consumers.
    pub fn for_timer(timer: &ClaimedTimer, reached_at: Timestamp) -> Self {
        Self::for_fire(timer, reached_at, 0)
    }

    /// [`for_timer`](Self::for_timer) for the `refire`-th fire again of a one-shot timer
    /// ([`refired_event_id`]; 0 is the first fire).
    pub fn for_fire(timer: &ClaimedTimer, reached_at: Timestamp, refire: u32) -> Self {
        // A payload was valid JSON when accepted; a store that hands back something else is
        // corrupt, and the event still goes out without it rather than not at all.
        let payload = timer.payload.as_ref().and_then(|p| {
            RawValue::from_string(p.clone())
                .map_err(|e| tracing::error!(timer = %timer.key, error = %e, "stored payload is not JSON; dropped from event"))
                .ok()
        });
        let id = refired_event_id(timer, refire);
        Self::about(
            timer,
            id,
            DUE_TIME_REACHED,
            reached_at,
            DueTimeReached {
                tenant_id: timer.key.tenant_id.clone(),
                service_call_id: timer.key.service_call_id.clone(),
                due_at: timer.due_at.to_rfc3339(),
                reached_at: reached_at.to_rfc3339(),
                occurrence: timer
                    .recurrence
                    .as_ref()
                    .map(|_| timer.occurrences.saturating_add(1)),
                trigger: None,
                refire: (refire > 0).then_some(refire),
                payload,
            },
        )
    }

    /// The event of a manual trigger of `timer` at `at`: due and reached at `at`, with
    /// `"trigger": "manual"`, its id [`manual_event_id`].
    pub fn manual(timer: &Timer, at: Timestamp) -> Self {
        Envelope {
            id: manual_event_id(&timer.key, at),
            kind: DUE_TIME_REACHED.to_owned(),
            tenant_id: timer.key.tenant_id.clone(),
            correlation_id: timer.correlation_id.clone(),
            causation_id: None,
            aggregate_id: timer.key.service_call_id.clone(),
            timestamp_ms: at.as_millis(),
            traceparent: traceparent(timer.trace.as_ref()),
            tracestate: tracestate(timer.trace.as_ref()),
            payload: DueTimeReached {
                tenant_id: timer.key.tenant_id.clone(),
                service_call_id: timer.key.service_call_id.clone(),
                due_at: at.to_rfc3339(),
                reached_at: at.to_rfc3339(),
                occurrence: None,
                trigger: Some(MANUAL_TRIGGER.to_owned()),
                refire: None,
                payload: timer
                    .payload
                    .as_ref()
                    .and_then(|p| RawValue::from_string(p.clone()).ok()),
            },
        }
    }
}

pub const TIMER_FAILED: &str = "TimerFailed";

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TimerFailed {
    pub tenant_id: String,
    pub service_call_id: String,
    pub due_at: String,
    pub failed_at: String,
    pub attempts: u32,
    pub last_error: String,
    /// For a recurring timer: the occurrence that could not be published (1 for the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub occurrence: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<Box<RawValue>>,
}

impl Envelope<TimerFailed> {
    /// The dead letter for `timer`, whose `attempts`-th publish failed with `error`. Its id is
    /// derived from the fire's id, so a repeat carries the same one.
    pub fn for_timer(timer: &ClaimedTimer, at: Timestamp, attempts: u32, error: &str) -> Self {
        let fire = event_id(timer);
        let id = Uuid::new_v5(&fire, TIMER_FAILED.as_bytes());
        Self::about(
            timer,
            id,
            TIMER_FAILED,
            at,
            TimerFailed {
                tenant_id: timer.key.tenant_id.clone(),
                service_call_id: timer.key.service_call_id.clone(),
                due_at: timer.due_at.to_rfc3339(),
                failed_at: at.to_rfc3339(),
                attempts,
                last_error: error.to_owned(),
                occurrence: timer
                    .recurrence
                    .as_ref()
                    .map(|_| timer.occurrences.saturating_add(1)),
                payload: timer
                    .payload
                    .as_ref()
                    .and_then(|p| RawValue::from_string(p.clone()).ok()),
            },
        )
    }
}
