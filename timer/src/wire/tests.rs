//! Unit tests of decoding, validation, reasons and events.

use super::validate::json_depth;
use super::*;
use crate::config::Limits;
use crate::model::{ClaimedTimer, NewTimer, TimerKey, Timestamp};
use crate::recurrence::Recurrence;
use std::time::Duration;

#[test]
fn every_reason_has_its_own_code() {
    let mut codes: Vec<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
    codes.sort_unstable();
    codes.dedup();
    assert_eq!(codes.len(), Reason::ALL.len());
    assert_eq!(
        serde_json::to_string(&Reason::TooFar).unwrap(),
        "\"too_far\""
    );
}

const NOW: Timestamp = Timestamp::from_millis(1_800_000_000_000);

fn decode(s: &str) -> Result<NewTimer, Rejection> {
    decode_schedule(s.as_bytes(), &Limits::default(), NOW)
}

#[test]
fn bare_command_with_offset() {
    let t =
        decode(r#"{"tenantId":"t1","serviceCallId":"c1","dueAt":"2027-01-15T10:00:00.250+02:00"}"#)
            .unwrap();
    assert_eq!(t.key, TimerKey::new("t1", "c1"));
    assert_eq!(t.due_at.to_rfc3339(), "2027-01-15T08:00:00.250Z");
    assert_eq!(t.correlation_id, None);
    assert_eq!(t.payload, None);
}

#[test]
fn due_time_ms_and_payload() {
    let t = decode(r#"{"tenantId":"t","serviceCallId":"c","dueTimeMs":1800000000500,"correlationId":"corr","payload":{"a":[1,2]}}"#).unwrap();
    assert_eq!(t.due_at.as_millis(), 1_800_000_000_500);
    assert_eq!(t.correlation_id.as_deref(), Some("corr"));
    assert_eq!(t.payload.as_deref(), Some(r#"{"a":[1,2]}"#));
}

#[test]
fn envelope_form() {
    let t = decode(r#"{"id":"x","type":"ScheduleTimer","tenantId":"t","correlationId":"k","timestampMs":1,"payload":{"serviceCallId":"c","dueTimeMs":5,"payload":"opaque"}}"#).unwrap();
    assert_eq!(t.key, TimerKey::new("t", "c"));
    assert_eq!(t.correlation_id.as_deref(), Some("k"));
    assert_eq!(t.payload.as_deref(), Some(r#""opaque""#));
}

#[test]
fn envelope_tenant_mismatch() {
    let e = decode(r#"{"type":"ScheduleTimer","tenantId":"a","payload":{"tenantId":"b","serviceCallId":"c","dueTimeMs":5}}"#).unwrap_err();
    assert_eq!(e.field.as_deref(), Some("payload.tenantId"));
}

#[test]
fn rejections_name_the_field() {
    let cases = [
        (
            r#"{"tenantId":"t","dueTimeMs":5}"#,
            "missing_field",
            Some("serviceCallId"),
        ),
        (
            r#"{"tenantId":"","serviceCallId":"c","dueTimeMs":5}"#,
            "invalid_id",
            Some("tenantId"),
        ),
        (
            r#"{"tenantId":"t\u0007","serviceCallId":"c","dueTimeMs":5}"#,
            "invalid_id",
            Some("tenantId"),
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"c"}"#,
            "missing_field",
            Some("dueAt"),
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"c","dueAt":"tomorrow"}"#,
            "invalid_time",
            Some("dueAt"),
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"c","dueAt":"2027-01-15T10:00:00"}"#,
            "invalid_time",
            Some("dueAt"),
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"c","dueTimeMs":-1}"#,
            "invalid_time",
            Some("dueTimeMs"),
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"c","dueTimeMs":99999999999999999}"#,
            "too_far",
            Some("dueTimeMs"),
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"c","dueTimeMs":1e30}"#,
            "invalid_json",
            Some("dueTimeMs"),
        ),
        (
            r#"{"tenantId":5,"serviceCallId":"c","dueTimeMs":5}"#,
            "invalid_json",
            Some("tenantId"),
        ),
        (
            r#"{"type":"CancelEverything","tenantId":"t"}"#,
            "unknown_type",
            Some("type"),
        ),
        (
            r#"{"type":"ScheduleTimer","tenantId":"t"}"#,
            "missing_field",
            Some("payload"),
        ),
        // serde reports a duplicate at the object, naming the key in the message.
        (
            r#"{"tenantId":"t","tenantId":"u","serviceCallId":"c","dueTimeMs":5}"#,
            "invalid_json",
            None,
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"c","dueTimeMs":5} trailing"#,
            "invalid_json",
            None,
        ),
        ("not json", "invalid_json", None),
        ("{not json", "invalid_json", None),
        ("", "invalid_json", None),
    ];
    for (input, reason, field) in cases {
        let e = decode(input).expect_err(input);
        assert_eq!(e.reason, reason, "{input}: {e}");
        assert_eq!(e.field.as_deref(), field, "{input}: {e}");
    }
}

#[test]
fn limits_apply() {
    let limits = Limits {
        max_message_bytes: 200,
        max_id_bytes: 4,
        max_payload_bytes: 8,
        max_horizon: Duration::from_secs(60),
        ..Limits::default()
    };
    let d = |s: &str| decode_schedule(s.as_bytes(), &limits, NOW).unwrap_err();
    assert_eq!(
        d(r#"{"tenantId":"toolong","serviceCallId":"c","dueTimeMs":5}"#).reason,
        "invalid_id"
    );
    assert_eq!(
        d(r#"{"tenantId":"t","serviceCallId":"c","dueTimeMs":5,"payload":"123456789"}"#).reason,
        "payload_too_large"
    );
    assert_eq!(
        d(&format!(
            r#"{{"tenantId":"t","serviceCallId":"c","dueTimeMs":{}}}"#,
            NOW.as_millis() + 61_000
        ))
        .reason,
        "too_far"
    );
    assert_eq!(d(&" ".repeat(201)).reason, "too_large");
}

#[test]
fn invalid_utf8_and_deep_json_are_rejected() {
    assert_eq!(
        decode_schedule(b"{\"tenantId\":\"\xff\"}", &Limits::default(), NOW)
            .unwrap_err()
            .reason,
        "invalid_json"
    );
    let deep = format!(
        r#"{{"tenantId":"t","serviceCallId":"c","dueTimeMs":5,"payload":{}{}}}"#,
        "[".repeat(10_000),
        "]".repeat(10_000)
    );
    assert_eq!(decode(&deep).unwrap_err().reason, "invalid_json");
}

#[test]
fn json_depth_ignores_strings() {
    assert_eq!(json_depth(r#"{"a":[1,{"b":"[[[{"}],"c":"\\\"]"}"#), 3);
    assert_eq!(json_depth("5"), 0);
}

fn decode_any(s: &str) -> Result<Command, Rejection> {
    super::decode_command(s.as_bytes(), &Limits::default(), NOW)
}

#[test]
fn cancel_bare_and_in_an_envelope() {
    let key = TimerKey::new("t", "c");
    assert_eq!(
        decode_any(r#"{"type":"CancelTimer","tenantId":"t","serviceCallId":"c"}"#).unwrap(),
        Command::Cancel(key.clone())
    );
    assert_eq!(
        decode_any(r#"{"type":"CancelTimer","tenantId":"t","payload":{"serviceCallId":"c"}}"#)
            .unwrap(),
        Command::Cancel(key)
    );
    let e =
        decode_any(r#"{"type":"CancelTimer","tenantId":"t","serviceCallId":"c","dueTimeMs":5}"#)
            .unwrap_err();
    assert_eq!(e.field.as_deref(), Some("dueTimeMs"), "{e}");
    let e = decode_any(r#"{"type":"CancelTimer","tenantId":"t"}"#).unwrap_err();
    assert_eq!(e.reason, "missing_field");
    // The HTTP API's schedule endpoint takes no cancels.
    let e = decode(r#"{"type":"CancelTimer","tenantId":"t","serviceCallId":"c"}"#).unwrap_err();
    assert_eq!(e.reason, "not_accepted_here");
    let e = decode_any(r#"{"type":"Nope","tenantId":"t","serviceCallId":"c"}"#).unwrap_err();
    assert!(e.message.contains("CancelTimer"), "{e}");
}

#[test]
fn cron_timers_start_at_their_first_occurrence() {
    // NOW = 2027-01-15T08:00:00Z; 09:30 in Berlin (UTC+1 in winter) is 08:30Z.
    let t = decode(r#"{"tenantId":"t","serviceCallId":"c","cron":"30 9 * * *","timeZone":"Europe/Berlin","maxOccurrences":3}"#).unwrap();
    assert_eq!(t.due_at.to_rfc3339(), "2027-01-15T08:30:00.000Z");
    let r = t.recurrence.unwrap();
    assert_eq!(r.time_zone, "Europe/Berlin");
    assert_eq!(r.max_occurrences, Some(3));
    // The time zone defaults to UTC.
    let t = decode(r#"{"tenantId":"t","serviceCallId":"c","cron":"0 12 * * *"}"#).unwrap();
    assert_eq!(t.due_at.to_rfc3339(), "2027-01-15T12:00:00.000Z");
}

#[test]
fn cron_mistakes_are_rejected_naming_the_field() {
    let cases = [
        (
            r#"{"tenantId":"t","serviceCallId":"c","cron":"* * * * *","dueTimeMs":5}"#,
            "cron",
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"c","cron":"99 * * * *"}"#,
            "cron",
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"c","cron":"* * * * *","timeZone":"Nowhere/Land"}"#,
            "timeZone",
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"c","dueTimeMs":5,"timeZone":"UTC"}"#,
            "timeZone",
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"c","cron":"* * * * *","maxOccurrences":0}"#,
            "maxOccurrences",
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"c","cron":"0 0 1 1 *","endAt":"2026-01-01T00:00:00Z"}"#,
            "cron",
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"c","cron":"* * * * *","endAt":"soon"}"#,
            "endAt",
        ),
    ];
    for (input, field) in cases {
        let e = decode(input).unwrap_err();
        assert_eq!(e.field.as_deref(), Some(field), "{input}: {e}");
    }
}

#[test]
fn recurring_events_say_which_occurrence() {
    let timer = ClaimedTimer {
        key: TimerKey::new("t", "c"),
        due_at: Timestamp::from_millis(1_000),
        registered_at: Timestamp::from_millis(0),
        correlation_id: None,
        payload: None,
        attempts: 0,
        revision: 4,
        recurrence: Some(Recurrence {
            cron: "* * * * * *".into(),
            time_zone: "UTC".into(),
            end_at: None,
            max_occurrences: None,
        }),
        occurrences: 4,
        policy: None,
        work: None,
    };
    let ev = DueTimeReachedEnvelope::for_timer(&timer, Timestamp::from_millis(1_002));
    assert_eq!(ev.payload.occurrence, Some(5));
    let failed = TimerFailedEnvelope::for_timer(&timer, Timestamp::from_millis(9), 3, "down");
    let v: serde_json::Value = serde_json::from_slice(&failed.to_json()).unwrap();
    assert_eq!(v["type"], "TimerFailed");
    assert_eq!(v["payload"]["attempts"], 3);
    assert_eq!(v["payload"]["lastError"], "down");
    assert_eq!(v["payload"]["occurrence"], 5);
    assert_eq!(
        failed.id,
        TimerFailedEnvelope::for_timer(&timer, Timestamp::from_millis(99), 3, "x").id,
        "a repeat carries the same id"
    );
}

#[test]
fn event_envelope_shape() {
    let timer = ClaimedTimer {
        key: TimerKey::new("t", "c"),
        due_at: Timestamp::from_millis(1_000),
        registered_at: Timestamp::from_millis(0),
        correlation_id: Some("corr".into()),
        payload: Some(r#"{"x":1}"#.into()),
        attempts: 0,
        revision: 0,
        recurrence: None,
        occurrences: 0,
        policy: None,
        work: None,
    };
    let ev = DueTimeReachedEnvelope::for_timer(&timer, Timestamp::from_millis(1_005));
    let v: serde_json::Value = serde_json::from_slice(&ev.to_json()).unwrap();
    assert_eq!(v["type"], "DueTimeReached");
    assert_eq!(v["id"].as_str().unwrap(), ev.id.to_string());
    assert_eq!(ev.id.get_version_num(), 7);
    // Same timer revision: same id, whenever it fires; another revision or key: another id.
    let again = DueTimeReachedEnvelope::for_timer(&timer, Timestamp::from_millis(9_999));
    assert_eq!(again.id, ev.id);
    // A publish retried after failures repeats the id (consumers drop the repeat by it).
    let retried = ClaimedTimer {
        attempts: 3,
        ..timer.clone()
    };
    assert_eq!(
        DueTimeReachedEnvelope::for_timer(&retried, Timestamp::from_millis(9_999)).id,
        ev.id,
        "a retry of a failed publish carries the same id"
    );
    let moved = ClaimedTimer {
        revision: 1,
        ..timer.clone()
    };
    assert_ne!(
        DueTimeReachedEnvelope::for_timer(&moved, Timestamp::from_millis(1_005)).id,
        ev.id
    );
    let other = ClaimedTimer {
        key: TimerKey::new("t", "d"),
        ..timer.clone()
    };
    assert_ne!(event_id(&other), ev.id);
    let (secs, nanos) = ev.id.get_timestamp().expect("v7 timestamp").to_unix();
    assert_eq!(
        secs * 1000 + u64::from(nanos) / 1_000_000,
        1_000,
        "timestamp = due time"
    );
    assert_eq!(v["tenantId"], "t");
    assert_eq!(v["aggregateId"], "c");
    assert_eq!(v["correlationId"], "corr");
    assert!(v["causationId"].is_null());
    assert_eq!(v["timestampMs"], 1_005);
    assert_eq!(v["payload"]["dueAt"], "1970-01-01T00:00:01.000Z");
    assert_eq!(v["payload"]["reachedAt"], "1970-01-01T00:00:01.005Z");
    assert_eq!(v["payload"]["serviceCallId"], "c");
    assert_eq!(v["payload"]["payload"]["x"], 1);
}
