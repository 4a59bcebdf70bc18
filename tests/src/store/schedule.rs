//! Scheduling: outcomes of a schedule, rescheduling, batches, what a timer keeps (due time to the
//! millisecond, payload, correlation id).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use timer_core::{
    decode_schedule, CancelOutcome, Limits, Message, MessageMeta, NewTimer, ScheduleOutcome, Store,
    Target, TimerKey, TimerState, TraceContext,
};

use super::{
    at, cancel, claim, find, ids, mark_reached, put, row, scheduled_count, state_of, timer, T0,
    T0_MS,
};

pub async fn upsert_outcomes(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let out = put(s, &[timer("t", "a", T0_MS + 1_000)], T0).await;
    assert_eq!(out, vec![ScheduleOutcome::Created]);
    let got = row(s, "t", "a").await;
    assert_eq!(got.state, TimerState::Scheduled);
    assert_eq!(got.registered_at, T0);
    assert_eq!(got.attempts, 0);
    assert_eq!(got.reached_at, None);

    let out = put(s, &[timer("t", "a", T0_MS + 2_000)], at(T0_MS + 10)).await;
    assert_eq!(out, vec![ScheduleOutcome::Updated]);
    let got = row(s, "t", "a").await;
    assert_eq!(got.registered_at, T0, "registered_at is kept on reschedule");

    // Fire it, then scheduling again changes nothing.
    let claimed = claim(s, at(T0_MS + 2_000), 10, "i1", T0_MS + 32_000).await;
    assert_eq!(ids(&claimed), ["a"]);
    assert_eq!(mark_reached(s, &claimed, "i1", at(T0_MS + 2_001)).await, 1);
    let out = put(s, &[timer("t", "a", T0_MS + 9_000)], T0).await;
    assert_eq!(out, vec![ScheduleOutcome::AlreadyReached]);
    let got = row(s, "t", "a").await;
    assert_eq!(got.state, TimerState::Reached);
    assert_eq!(
        got.due_at,
        at(T0_MS + 2_000),
        "a reached timer keeps its due time"
    );
    assert_eq!(got.reached_at, Some(at(T0_MS + 2_001)));

    put(s, &[timer("t", "b", T0_MS)], T0).await;
    assert_eq!(cancel(s, "t", "b", T0).await, CancelOutcome::Cancelled);
    let out = put(s, &[timer("t", "b", T0_MS)], T0).await;
    assert_eq!(out, vec![ScheduleOutcome::AlreadyCancelled]);
    assert_eq!(state_of(s, "t", "b").await, TimerState::Cancelled);

    // The same service call id under another tenant is another timer.
    let out = put(s, &[timer("u", "a", T0_MS)], T0).await;
    assert_eq!(out, vec![ScheduleOutcome::Created]);
    assert!(find(s, "v", "a").await.is_none());
}

pub async fn reschedule_moves_due_time(store: Arc<dyn Store>) {
    let s = store.as_ref();
    put(s, &[timer("t", "a", T0_MS + 1_000)], T0).await;
    put(s, &[timer("t", "a", T0_MS + 5_000)], T0).await;
    assert_eq!(row(s, "t", "a").await.due_at, at(T0_MS + 5_000));
    let early = claim(s, at(T0_MS + 4_999), 10, "i1", T0_MS + 60_000).await;
    assert!(
        early.is_empty(),
        "a moved timer is not due at its old time: {early:?}"
    );
    let due = claim(s, at(T0_MS + 5_000), 10, "i1", T0_MS + 60_000).await;
    assert_eq!(ids(&due), ["a"]);
    assert_eq!(due[0].due_at, at(T0_MS + 5_000));

    // Moving it earlier works too.
    put(s, &[timer("t", "b", T0_MS + 9_000)], T0).await;
    put(s, &[timer("t", "b", T0_MS + 100)], T0).await;
    let due = claim(s, at(T0_MS + 100), 10, "i1", T0_MS + 60_000).await;
    assert_eq!(ids(&due), ["b"]);
}

pub async fn duplicate_key_in_one_batch(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let batch = [timer("t", "a", T0_MS + 1), timer("t", "a", T0_MS + 2)];
    let out = put(s, &batch, T0).await;
    assert_eq!(
        out,
        vec![ScheduleOutcome::Created, ScheduleOutcome::Updated]
    );
    assert_eq!(
        row(s, "t", "a").await.due_at,
        at(T0_MS + 2),
        "the later entry of a batch wins"
    );
    assert_eq!(scheduled_count(s).await, 1);
    // A big batch (stores may write it in several statements) with a key early and late.
    let mut big: Vec<NewTimer> = (0..2_500)
        .map(|i| timer("big", &format!("k{i:04}"), T0_MS + 10))
        .collect();
    big[2_010] = timer("big", "k0010", T0_MS + 20);
    let out = put(s, &big, T0).await;
    assert_eq!(out[10], ScheduleOutcome::Created);
    assert_eq!(out[2_010], ScheduleOutcome::Updated, "the repeat updates");
    let created = out
        .iter()
        .filter(|o| **o == ScheduleOutcome::Created)
        .count();
    assert_eq!(created, 2_499);
    assert_eq!(row(s, "big", "k0010").await.due_at, at(T0_MS + 20));
    assert_eq!(scheduled_count(s).await, 2_500);
}

pub async fn millisecond_precision_across_offsets(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let limits = Limits::default();
    // The same instant written in three offsets, and its neighbours one millisecond apart.
    let commands = [
        (
            r#"{"tenantId":"t","serviceCallId":"utc","dueAt":"2027-03-01T12:00:00.500Z"}"#,
            0,
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"plus","dueAt":"2027-03-01T13:30:00.500+01:30"}"#,
            0,
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"minus","dueAt":"2027-03-01T07:00:00.500-05:00"}"#,
            0,
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"next","dueAt":"2027-03-01T12:00:00.501Z"}"#,
            1,
        ),
        (
            r#"{"tenantId":"t","serviceCallId":"prev","dueAt":"2027-03-01T12:00:00.499Z"}"#,
            -1,
        ),
    ];
    let base = chrono::DateTime::parse_from_rfc3339("2027-03-01T12:00:00.500Z")
        .expect("valid")
        .timestamp_millis();
    let mut batch = Vec::new();
    for (json, delta) in commands {
        let t = decode_schedule(json.as_bytes(), &limits, T0).expect("valid command");
        assert_eq!(t.due_at.as_millis(), base + delta, "{json}");
        batch.push(t);
    }
    put(s, &batch, T0).await;
    for (id, delta) in [
        ("utc", 0),
        ("plus", 0),
        ("minus", 0),
        ("next", 1),
        ("prev", -1),
    ] {
        assert_eq!(
            row(s, "t", id).await.due_at.as_millis(),
            base + delta,
            "{id} stored to the millisecond"
        );
    }
    let until = base + 60_000;
    assert_eq!(
        ids(&claim(s, at(base - 2), 10, "i1", until).await),
        Vec::<String>::new()
    );
    assert_eq!(
        ids(&claim(s, at(base - 1), 10, "i1", until).await),
        ["prev"]
    );
    let mut same = ids(&claim(s, at(base), 10, "i1", until).await);
    same.sort();
    assert_eq!(
        same,
        ["minus", "plus", "utc"],
        "due exactly at now is due (inclusive)"
    );
    assert_eq!(
        ids(&claim(s, at(base + 1), 10, "i1", until).await),
        ["next"]
    );
}

/// A timer's payload, correlation id and trace context come back as stored, from `get` and from
/// a claim; a reschedule replaces the trace context.
pub async fn payload_correlation_and_trace_round_trip(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let payload = r#"{"order":{"id":42,"items":["ä","\u0000"]},"n":1.5e3}"#;
    let trace = TraceContext::parse(
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"),
    )
    .map(Some)
    .expect("a well-formed context");
    let mut t = NewTimer {
        key: TimerKey::new("tenant-ü", "call/1 with spaces"),
        due_at: T0,
        correlation_id: Some("corr-1".into()),
        payload: Some(payload.into()),
        recurrence: None,
        policy: None,
        work: None,
        target: None,
        message: None,
        trace: trace.clone(),
    };
    put(s, std::slice::from_ref(&t), T0).await;
    let got = row(s, "tenant-ü", "call/1 with spaces").await;
    assert_eq!(got.payload.as_deref(), Some(payload));
    assert_eq!(got.correlation_id.as_deref(), Some("corr-1"));
    assert_eq!(got.trace, trace, "the trace context, read back");
    let claimed = claim(s, T0, 1, "i1", T0_MS + 1_000).await;
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].key, t.key);
    assert_eq!(claimed[0].payload.as_deref(), Some(payload));
    assert_eq!(claimed[0].correlation_id.as_deref(), Some("corr-1"));
    assert_eq!(claimed[0].registered_at, T0);
    assert_eq!(claimed[0].trace, trace, "the trace context, claimed");

    t.trace = Some(TraceContext::fresh());
    put(s, std::slice::from_ref(&t), T0).await;
    let got = row(s, "tenant-ü", "call/1 with spaces").await;
    assert_eq!(
        got.trace, t.trace,
        "a reschedule's trace context replaces the first"
    );
}

/// A timer's target and message come back as stored: the message body byte for byte at
/// `limits.max_message_bytes` (every byte value, NUL and invalid UTF-8 included), its content
/// type and headers, from `get` and from a claim; a reschedule replaces them, and takes them
/// away when it gives none.
pub async fn target_and_message_round_trip(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let size = Limits::default().max_message_bytes;
    let body: Vec<u8> = (0..size).map(|i| (i * 7 % 256) as u8).collect();
    let Ok(serde_json::Value::Object(fields)) =
        serde_json::from_str(r#"{"topic":"orders.ü","key":"o-42","partition":3}"#)
    else {
        panic!("a target object")
    };
    let message = Message {
        body,
        meta: MessageMeta {
            content_type: Some("application/octet-stream".into()),
            headers: [
                ("x-a".to_owned(), "1".to_owned()),
                ("X-B".to_owned(), "ü ö".to_owned()),
            ]
            .into(),
        },
    };
    let mut t = timer("t", "delayed", T0_MS);
    t.target = Some(Target::new(fields));
    t.message = Some(message.clone());
    put(s, std::slice::from_ref(&t), T0).await;
    let got = row(s, "t", "delayed").await;
    assert_eq!(got.target, t.target, "the target, read back");
    let got_message = got.message.expect("the message, read back");
    assert_eq!(got_message.body.len(), size);
    assert!(got_message.body == message.body, "the body, byte for byte");
    assert_eq!(got_message.meta, message.meta);
    let claimed = claim(s, T0, 1, "i1", T0_MS + 1_000).await;
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].target, t.target, "a claim carries the target");
    assert!(
        claimed[0].message.as_ref() == Some(&message),
        "a claim carries the message"
    );

    // An empty body is a message too; a reschedule replaces both, or takes them away.
    put(s, &[timer("t", "plain", T0_MS + 5_000)], T0).await;
    let mut empty = timer("t", "plain", T0_MS + 6_000);
    empty.message = Some(Message::default());
    put(s, &[empty], T0).await;
    let got = row(s, "t", "plain").await;
    assert_eq!(got.message, Some(Message::default()));
    assert_eq!(got.target, None);
    put(s, &[timer("t", "plain", T0_MS + 7_000)], T0).await;
    let got = row(s, "t", "plain").await;
    assert_eq!((got.message, got.target), (None, None), "taken away");
}

pub async fn batch_of_10k(store: Arc<dyn Store>) {
    const N: usize = 10_000;
    let s = store.as_ref();
    let batch: Vec<NewTimer> = (0..N)
        .map(|i| {
            let tenant = format!("tenant{}", i % 7);
            timer(&tenant, &format!("b{i:05}"), T0_MS + (i % 1000) as i64)
        })
        .collect();
    let out = tokio::time::timeout(Duration::from_secs(120), put(s, &batch, T0))
        .await
        .expect("a 10k batch finishes");
    assert_eq!(out.len(), N);
    assert!(out.iter().all(|o| *o == ScheduleOutcome::Created));
    assert_eq!(scheduled_count(s).await, N as u64);
    let now = at(T0_MS + 1_000);
    let mut seen = HashSet::new();
    loop {
        let got = claim(s, now, 1_000, "i1", now.as_millis() + 60_000).await;
        if got.is_empty() {
            break;
        }
        assert_eq!(mark_reached(s, &got, "i1", now).await, got.len() as u64);
        for c in got {
            assert!(seen.insert(c.key), "claimed twice");
        }
    }
    assert_eq!(seen.len(), N);
    assert_eq!(scheduled_count(s).await, 0);
}
