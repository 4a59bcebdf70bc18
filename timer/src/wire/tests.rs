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
fn envelope_and_payload_may_both_name_the_same_tenant() {
    let t = decode(r#"{"type":"ScheduleTimer","tenantId":"a","payload":{"tenantId":"a","serviceCallId":"c","dueTimeMs":5}}"#).unwrap();
    assert_eq!(t.key, TimerKey::new("a", "c"));
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
        max_command_bytes: 200,
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
        due_at: Timestamp::from_millis(1_000),
        revision: 4,
        recurrence: Some(Recurrence {
            cron: "* * * * * *".into(),
            time_zone: "UTC".into(),
            end_at: None,
            max_occurrences: None,
        }),
        occurrences: 4,
        ..ClaimedTimer::for_tests(TimerKey::new("t", "c"))
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
        due_at: Timestamp::from_millis(1_000),
        correlation_id: Some("corr".into()),
        payload: Some(r#"{"x":1}"#.into()),
        ..ClaimedTimer::for_tests(TimerKey::new("t", "c"))
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

/// A reason equals its own code and no other (the tests compare reasons with text).
#[test]
fn a_reason_equals_its_code_only() {
    assert!(Reason::TooLarge == "too_large");
    assert!(Reason::TooLarge != "too_far");
    assert!(Reason::InvalidPolicy != "");
}

/// Each limit admits a command exactly at it and refuses one just past it (naming the reason).
#[test]
fn every_limit_admits_its_bound_and_refuses_one_past_it() {
    let limits = Limits {
        max_command_bytes: 200,
        max_id_bytes: 9,
        max_payload_bytes: 10,
        max_horizon: Duration::from_secs(60),
        ..Limits::default()
    };
    let d = |s: &str| decode_schedule(s.as_bytes(), &limits, NOW);
    let reason = |s: &str| d(s).err().map(|e| e.reason.as_str());
    let horizon = NOW.as_millis() + 60_000;

    // The message: 200 bytes pass, 201 do not (padded with spaces after the JSON).
    let command = format!(r#"{{"tenantId":"t","serviceCallId":"c","dueTimeMs":{horizon}}}"#);
    let padded = |n: usize| format!("{command}{}", " ".repeat(n - command.len()));
    assert_eq!(reason(&padded(200)), None);
    assert_eq!(reason(&padded(201)), Some("too_large"));
    // From the broker as over HTTP.
    let command_reason = |s: String| {
        super::decode_command(s.as_bytes(), &limits, NOW)
            .err()
            .map(|e| e.reason.as_str())
    };
    assert_eq!(command_reason(padded(200)), None);
    assert_eq!(command_reason(padded(201)), Some("too_large"));
    // Ids: 9 bytes pass, 10 do not.
    assert_eq!(
        reason(r#"{"tenantId":"123456789","serviceCallId":"c","dueTimeMs":5}"#),
        None
    );
    assert_eq!(
        reason(r#"{"tenantId":"1234567890","serviceCallId":"c","dueTimeMs":5}"#),
        Some("invalid_id")
    );
    // A cron or time zone is held to the id limit too.
    assert_eq!(
        reason(r#"{"tenantId":"t","serviceCallId":"c","cron":"0 8 * * * *","timeZone":"UTC"}"#),
        Some("invalid_recurrence")
    );
    assert_eq!(
        reason(r#"{"tenantId":"t","serviceCallId":"c","cron":"0 8 * * *","timeZone":"Etc/GMT+0"}"#),
        None
    );
    // The payload: 10 bytes pass, 11 do not.
    assert_eq!(
        reason(r#"{"tenantId":"t","serviceCallId":"c","dueTimeMs":5,"payload":"12345678"}"#),
        None
    );
    assert_eq!(
        reason(r#"{"tenantId":"t","serviceCallId":"c","dueTimeMs":5,"payload":"123456789"}"#),
        Some("payload_too_large")
    );
    // The horizon: due exactly at it passes, a millisecond later does not.
    assert_eq!(reason(&command), None);
    let past = format!(
        r#"{{"tenantId":"t","serviceCallId":"c","dueTimeMs":{}}}"#,
        horizon + 1
    );
    assert_eq!(reason(&past), Some("too_far"));
    // The epoch is a due time (long past: fires at once); before it is not.
    assert_eq!(
        reason(r#"{"tenantId":"t","serviceCallId":"c","dueTimeMs":0}"#),
        None
    );
    assert!(reason(r#"{"tenantId":"t","serviceCallId":"c","dueTimeMs":-1}"#).is_some());
}

/// A payload nesting exactly `MAX_PAYLOAD_DEPTH` levels passes; one more does not.
#[test]
fn payload_depth_admits_its_bound() {
    let nested = |n: usize| {
        format!(
            r#"{{"tenantId":"t","serviceCallId":"c","dueTimeMs":5,"payload":{}{}}}"#,
            "[".repeat(n),
            "]".repeat(n)
        )
    };
    assert!(decode(&nested(validate::MAX_PAYLOAD_DEPTH)).is_ok());
    assert_eq!(
        decode(&nested(validate::MAX_PAYLOAD_DEPTH + 1))
            .unwrap_err()
            .reason,
        "invalid_json"
    );
}

#[test]
fn json_depth_counts_closed_levels_out_and_escapes_in_strings() {
    // Closing a level counts it out: siblings do not add up.
    assert_eq!(json_depth("[[],[],[]]"), 2);
    // An escaped quote does not end a string, so what follows it is text.
    assert_eq!(json_depth(r#"{"a":"\"[[[["}"#), 1);
    // An escaped backslash ends the escape: the quote after it closes the string.
    assert_eq!(json_depth(r#"["\\",[[]]]"#), 3);
}

fn policy_of(extra: &str) -> Result<Option<crate::policy::Policy>, Rejection> {
    decode(&format!(
        r#"{{"tenantId":"t","serviceCallId":"c","cron":"0 * * * *","timeZone":"UTC"{extra}}}"#
    ))
    .map(|t| t.policy)
}

/// Each policy field is read as given; any one of them makes a policy, none makes none; the
/// defaults fill in what a policy leaves out.
#[test]
fn policies_are_read_field_by_field() {
    use crate::policy::{CatchUp, Overlap, DEFAULT_CATCH_UP_LIMIT};
    assert_eq!(policy_of(""), Ok(None));
    for overlap in Overlap::ALL {
        let policy = policy_of(&format!(r#","overlap":"{}""#, overlap.as_str()));
        assert_eq!(policy.map(|p| p.map(|p| p.overlap)), Ok(Some(overlap)));
    }
    for catch_up in CatchUp::ALL {
        let policy = policy_of(&format!(r#","catchUp":"{}""#, catch_up.as_str()));
        assert_eq!(
            policy.map(|p| p.and_then(|p| p.catch_up)),
            Ok(Some(catch_up))
        );
    }
    // Any one field alone makes a policy.
    for one in [
        r#","completionTimeout":"1m""#,
        r#","catchUpWindow":"1s""#,
        r#","jitter":"1s""#,
    ] {
        assert!(matches!(policy_of(one), Ok(Some(_))), "{one}");
    }
    // `catchUp: all` without a limit gets the default one; a limit needs `catchUp: all`.
    let all = policy_of(r#","catchUp":"all""#).unwrap().unwrap();
    assert_eq!(all.catch_up_limit, Some(DEFAULT_CATCH_UP_LIMIT));
    let once = policy_of(r#","catchUp":"once","catchUpLimit":2"#);
    assert_eq!(
        once.unwrap_err().field.as_deref(),
        Some("catchUpLimit"),
        "a limit without catchUp all"
    );
    // Durations up to the horizon pass, longer ones do not; a window of 1 s is the least.
    let horizon = Limits::default().max_horizon.as_millis();
    assert!(policy_of(&format!(r#","completionTimeout":{horizon}"#)).is_ok());
    assert_eq!(
        policy_of(&format!(r#","completionTimeout":{}"#, horizon + 1))
            .unwrap_err()
            .reason,
        "invalid_policy"
    );
    assert!(policy_of(r#","catchUpWindow":1000"#).is_ok());
    assert_eq!(
        policy_of(r#","catchUpWindow":999"#).unwrap_err().reason,
        "invalid_policy"
    );
}

/// A completion's message is cut at `MAX_COMPLETION_MESSAGE_BYTES`, at a character boundary;
/// a shorter one is kept whole.
#[test]
fn a_completion_message_is_cut_at_its_bound_on_a_character() {
    let completion = |message: &str| {
        let body = serde_json::json!({
            "type": "TimerCompleted", "tenantId": "t", "serviceCallId": "c", "message": message,
        });
        match decode_any(&body.to_string()) {
            Ok(Command::Complete(_, completion)) => completion.message.unwrap_or_default(),
            other => panic!("a completion: {other:?}"),
        }
    };
    assert_eq!(completion("done"), "done");
    // 1023 bytes of ASCII, then a 2-byte character across the bound: cut before it.
    let long = format!(
        "{}é and more",
        "a".repeat(validate::MAX_COMPLETION_MESSAGE_BYTES - 1)
    );
    assert_eq!(
        completion(&long),
        "a".repeat(validate::MAX_COMPLETION_MESSAGE_BYTES - 1)
    );
}

/// A field a command of its type does not take is named, with what the type takes.
#[test]
fn a_stray_field_says_what_the_command_takes() {
    let completed =
        decode_any(r#"{"type":"TimerCompleted","tenantId":"t","serviceCallId":"c","dueTimeMs":5}"#)
            .unwrap_err();
    assert_eq!(completed.field.as_deref(), Some("dueTimeMs"));
    assert!(
        completed
            .message
            .contains("occurrence, outcome and message"),
        "{completed:?}"
    );
    let cancel = decode_any(
        r#"{"type":"CancelTimer","tenantId":"t","serviceCallId":"c","outcome":"failed"}"#,
    )
    .unwrap_err();
    assert_eq!(cancel.field.as_deref(), Some("outcome"));
    assert!(cancel.message.contains("only tenantId"), "{cancel:?}");
}

/// A jittered series keeps the cron time of its first occurrence in `work.nominal` (the next
/// ones follow from it), and is first due that time plus its jitter offset.
#[test]
fn a_jittered_series_keeps_the_cron_time_of_its_first_occurrence() {
    let t = decode(
        r#"{"tenantId":"t","serviceCallId":"c","cron":"0 9 * * *","timeZone":"UTC","jitter":"10m"}"#,
    )
    .unwrap();
    // NOW is 2027-01-15T08:00Z: the first occurrence is at 09:00 that day.
    let nine = Timestamp::from_millis(NOW.as_millis() + 3_600_000);
    assert_eq!(nine.to_rfc3339(), "2027-01-15T09:00:00.000Z");
    assert_eq!(t.work.as_ref().and_then(|w| w.nominal), Some(nine));
    let offset = crate::policy::jitter_offset(&t.key, nine, Duration::from_secs(600));
    assert_eq!(t.due_at, nine.saturating_add(offset));
}

/// A schedule of `extra` fields (JSON object members) beside a key and a due time.
fn with(extra: &str) -> String {
    format!(r#"{{"tenantId":"t","serviceCallId":"c","dueTimeMs":5,{extra}}}"#)
}

/// The reason and field a command is refused with.
fn refusal(s: &str, limits: &Limits) -> (String, Option<String>) {
    let r = decode_schedule(s.as_bytes(), limits, NOW).unwrap_err();
    (r.reason.as_str().to_owned(), r.field)
}

#[test]
fn a_message_body_is_its_json_text_or_its_base64_bytes() {
    let t = decode(&with(
        r#""message":{"body": {"a": [1, 2]},"contentType":"application/json","headers":{"x-a":"1"}}"#,
    ))
    .unwrap();
    let m = t.message.unwrap();
    assert_eq!(m.body, br#"{"a": [1, 2]}"#, "the JSON text as given");
    assert_eq!(m.meta.content_type.as_deref(), Some("application/json"));
    assert_eq!(m.meta.headers.get("x-a").map(String::as_str), Some("1"));
    let t = decode(&with(r#""message":{"bodyBase64":"AAEC/w=="}"#)).unwrap();
    let m = t.message.unwrap();
    assert_eq!(m.body, [0, 1, 2, 255]);
    assert_eq!(m.meta, crate::outbound::MessageMeta::default());
    assert!(decode(&with(r#""payload":1"#)).unwrap().message.is_none());
}

#[test]
fn a_message_body_is_bounded_by_max_message_bytes() {
    let limits = Limits {
        max_message_bytes: 4,
        ..Limits::default()
    };
    let at = with(r#""message":{"bodyBase64":"AAECAw=="}"#);
    let over = with(r#""message":{"bodyBase64":"AAECAwQ="}"#);
    assert_eq!(
        decode_schedule(at.as_bytes(), &limits, NOW)
            .unwrap()
            .message
            .unwrap()
            .body
            .len(),
        4
    );
    assert_eq!(
        refusal(&over, &limits),
        ("payload_too_large".to_owned(), Some("message".to_owned()))
    );
    let json = with(r#""message":{"body":"ab"}"#);
    assert_eq!(
        decode_schedule(json.as_bytes(), &limits, NOW)
            .unwrap()
            .message
            .unwrap()
            .body,
        br#""ab""#
    );
    let json = with(r#""message":{"body":"abc"}"#);
    assert_eq!(refusal(&json, &limits).0, "payload_too_large");
}

#[test]
fn the_command_limit_makes_room_for_a_message_in_base64() {
    let limits = Limits::default();
    assert_eq!(limits.command_bytes(), 256 * 1024 / 3 * 4 + 4 + 64 * 1024);
    let set = Limits {
        max_command_bytes: 100,
        ..Limits::default()
    };
    assert_eq!(set.command_bytes(), 100);
    // A message at the limit fits in a command at the derived limit.
    let body = base64::Engine::encode(
        &base64::engine::general_purpose::STANDARD,
        vec![7u8; limits.max_message_bytes],
    );
    let cmd = with(&format!(r#""message":{{"bodyBase64":"{body}"}}"#));
    assert!(cmd.len() <= limits.command_bytes());
    let t = decode_schedule(cmd.as_bytes(), &limits, NOW).unwrap();
    assert_eq!(t.message.unwrap().body.len(), limits.max_message_bytes);
}

#[test]
fn malformed_messages_are_refused_naming_the_field() {
    let limits = Limits::default();
    let cases = [
        (r#""message":"text""#, "invalid_json", "message"),
        (r#""message":{}"#, "missing_field", "message.body"),
        (
            r#""message":{"body":1,"bodyBase64":"AA=="}"#,
            "invalid_json",
            "message.body",
        ),
        (
            r#""message":{"bodyBase64":"not base64!"}"#,
            "invalid_json",
            "message.bodyBase64",
        ),
        (
            r#""message":{"body":1,"extra":1}"#,
            "invalid_json",
            "message.extra",
        ),
        (
            r#""message":{"body":1,"headers":{"a":1}}"#,
            "invalid_json",
            "message.headers.a",
        ),
        (
            r#""message":{"body":1,"headers":{"a b":"1"}}"#,
            "invalid_json",
            "message.headers.a b",
        ),
        (
            r#""message":{"body":1,"headers":{"a:b":"1"}}"#,
            "invalid_json",
            "message.headers.a:b",
        ),
        (
            r#""message":{"body":1,"headers":{"":"1"}}"#,
            "invalid_json",
            "message.headers.",
        ),
        (
            r#""message":{"body":1,"headers":{"a":"x\ny"}}"#,
            "invalid_json",
            "message.headers.a",
        ),
        (
            r#""message":{"body":1,"contentType":"a\u0000"}"#,
            "invalid_json",
            "message.contentType",
        ),
        (
            r#""message":{"body":1},"payload":2"#,
            "invalid_json",
            "message",
        ),
    ];
    for (extra, reason, field) in cases {
        assert_eq!(
            refusal(&with(extra), &limits),
            (reason.to_owned(), Some(field.to_owned())),
            "{extra}"
        );
    }
    let many: Vec<String> = (0..=MAX_HEADERS)
        .map(|i| format!(r#""h{i}":"v""#))
        .collect();
    let extra = format!(r#""message":{{"body":1,"headers":{{{}}}}}"#, many.join(","));
    assert_eq!(
        refusal(&with(&extra), &limits).1.as_deref(),
        Some("message.headers")
    );
    let at: Vec<String> = (0..MAX_HEADERS).map(|i| format!(r#""h{i}":"v""#)).collect();
    let extra = format!(r#""message":{{"body":1,"headers":{{{}}}}}"#, at.join(","));
    assert!(decode(&with(&extra)).is_ok(), "{MAX_HEADERS} headers");
    let long = "v".repeat(MAX_HEADER_VALUE_BYTES);
    assert!(decode(&with(&format!(
        r#""message":{{"body":1,"headers":{{"a":"{long}"}}}}"#
    )))
    .is_ok());
    let extra = format!(r#""message":{{"body":1,"headers":{{"a":"{long}v"}}}}"#);
    assert_eq!(refusal(&with(&extra), &limits).0, "invalid_json");
    let name = "n".repeat(MAX_HEADER_NAME_BYTES);
    assert!(decode(&with(&format!(
        r#""message":{{"body":1,"headers":{{"{name}":"v"}}}}"#
    )))
    .is_ok());
    let extra = format!(r#""message":{{"body":1,"headers":{{"{name}n":"v"}}}}"#);
    assert_eq!(refusal(&with(&extra), &limits).0, "invalid_json");
}

#[test]
fn a_target_is_a_small_object() {
    let limits = Limits::default();
    let t = decode(&with(r#""target":{"topic":"orders","partition":2}"#)).unwrap();
    let target = t.target.unwrap();
    assert_eq!(target.text("topic"), Some("orders"));
    assert_eq!(target.fields()["partition"], 2);
    // `null` is no target, like an absent one.
    assert!(decode(&with(r#""target":null"#)).unwrap().target.is_none());
    for extra in [r#""target":"orders""#, r#""target":{}"#, r#""target":[1]"#] {
        assert_eq!(
            refusal(&with(extra), &limits),
            ("invalid_target".to_owned(), Some("target".to_owned())),
            "{extra}"
        );
    }
    // At the bound, and one past it.
    let fill = |n: usize| {
        let overhead = r#"{"subject":""}"#.len();
        format!(r#""target":{{"subject":"{}"}}"#, "s".repeat(n - overhead))
    };
    assert!(decode(&with(&fill(MAX_TARGET_BYTES))).is_ok());
    assert_eq!(
        refusal(&with(&fill(MAX_TARGET_BYTES + 1)), &limits).0,
        "invalid_target"
    );
}

#[test]
fn only_a_schedule_takes_a_target_and_a_completion_message_is_text() {
    let limits = Limits::default();
    let cancel =
        r#"{"type":"CancelTimer","tenantId":"t","serviceCallId":"c","target":{"subject":"x"}}"#;
    let r = decode_command(cancel.as_bytes(), &limits, NOW).unwrap_err();
    assert_eq!(
        (r.reason, r.field.as_deref()),
        (Reason::InvalidJson, Some("target"))
    );
    let done = r#"{"type":"TimerCompleted","tenantId":"t","serviceCallId":"c","message":"ok"}"#;
    match decode_command(done.as_bytes(), &limits, NOW).unwrap() {
        Command::Complete(_, completion) => assert_eq!(completion.message.as_deref(), Some("ok")),
        other => panic!("{other:?}"),
    }
    let done =
        r#"{"type":"TimerCompleted","tenantId":"t","serviceCallId":"c","message":{"body":1}}"#;
    let r = decode_command(done.as_bytes(), &limits, NOW).unwrap_err();
    assert_eq!(
        (r.reason, r.field.as_deref()),
        (Reason::InvalidJson, Some("message"))
    );
}

#[test]
fn due_in_ms_counts_from_now() {
    let t = decode(r#"{"tenantId":"t","serviceCallId":"c","dueInMs":1500}"#).unwrap();
    assert_eq!(t.due_at, NOW.saturating_add(Duration::from_millis(1_500)));
    let r = decode(r#"{"tenantId":"t","serviceCallId":"c","dueInMs":-1}"#).unwrap_err();
    assert_eq!(
        (r.reason, r.field.as_deref()),
        (Reason::InvalidTime, Some("dueInMs"))
    );
    let r =
        decode(r#"{"tenantId":"t","serviceCallId":"c","dueInMs":1,"dueTimeMs":5}"#).unwrap_err();
    assert_eq!(r.reason, Reason::InvalidTime, "one of the three");
    let r = decode(r#"{"tenantId":"t","serviceCallId":"c","dueInMs":1,"cron":"* * * * *"}"#)
        .unwrap_err();
    assert_eq!(
        (r.reason, r.field.as_deref()),
        (Reason::InvalidRecurrence, Some("cron"))
    );
    let cancel = r#"{"type":"CancelTimer","tenantId":"t","serviceCallId":"c","dueInMs":1}"#;
    let r = decode_command(cancel.as_bytes(), &Limits::default(), NOW).unwrap_err();
    assert_eq!(r.field.as_deref(), Some("dueInMs"));
}

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

#[test]
fn a_schedule_keeps_its_own_trace_context() {
    let t = decode(&with(&format!(
        r#""traceparent":"{TRACEPARENT}","tracestate":"vendor=x""#
    )))
    .unwrap();
    let trace = t.trace.unwrap();
    assert_eq!(trace.traceparent(), TRACEPARENT);
    assert_eq!(trace.tracestate(), Some("vendor=x"));

    // The envelope's context, unless its payload gives one.
    let inner = "00-11111111111111111111111111111111-2222222222222222-00";
    let envelope = |payload_trace: &str| {
        format!(
            r#"{{"type":"ScheduleTimer","tenantId":"t","traceparent":"{TRACEPARENT}","payload":{{"serviceCallId":"c","dueTimeMs":5{payload_trace}}}}}"#
        )
    };
    let outer = decode(&envelope("")).unwrap().trace.unwrap();
    assert_eq!(outer.traceparent(), TRACEPARENT);
    let own = decode(&envelope(&format!(r#","traceparent":"{inner}""#)))
        .unwrap()
        .trace
        .unwrap();
    assert_eq!(own.traceparent(), inner);
}

#[test]
fn a_malformed_trace_context_is_ignored_never_refused() {
    for bad in [r#""nonsense""#, "42", "null", r#"{"a":1}"#, r#""00-0-0-0""#] {
        let t = decode(&with(&format!(r#""traceparent":{bad}"#)))
            .unwrap_or_else(|r| panic!("{bad}: refused {r:?}"));
        assert_eq!(t.trace, None, "{bad}");
    }
    // Other commands are not refused for one (their spans follow their transport's headers).
    let cancel = format!(
        r#"{{"type":"CancelTimer","tenantId":"t","serviceCallId":"c","traceparent":"{TRACEPARENT}"}}"#
    );
    assert!(decode_command(cancel.as_bytes(), &Limits::default(), NOW).is_ok());
}

#[test]
fn events_carry_the_trace_context_of_their_timer() {
    let mut timer = crate::model::ClaimedTimer::for_tests(TimerKey::new("t", "c"));
    let event = DueTimeReachedEnvelope::for_timer(&timer, NOW);
    let json: serde_json::Value = serde_json::from_slice(&event.to_json()).unwrap();
    assert!(json.get("traceparent").is_none(), "{json}");

    timer.trace = Some(crate::trace::TraceContext::parse(TRACEPARENT, Some("v=1")).unwrap());
    let event = DueTimeReachedEnvelope::for_timer(&timer, NOW);
    let json: serde_json::Value = serde_json::from_slice(&event.to_json()).unwrap();
    assert_eq!(json["traceparent"], TRACEPARENT);
    assert_eq!(json["tracestate"], "v=1");
    let failed = TimerFailedEnvelope::for_timer(&timer, NOW, 1, "broken");
    let json: serde_json::Value = serde_json::from_slice(&failed.to_json()).unwrap();
    assert_eq!(json["traceparent"], TRACEPARENT);
}
