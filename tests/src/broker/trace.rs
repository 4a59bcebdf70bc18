//! Trace context through a broker: a command's `traceparent` and `tracestate` headers arrive
//! with its delivery, and every event goes out with its timer's, as headers a consumer reads.

use std::collections::BTreeMap;
use std::sync::Arc;

use timer_core::plugin::TestClient;
use timer_core::trace::{TRACEPARENT, TRACESTATE};
use timer_core::{MessageMeta, OutboundEvent, TimerKey, TraceContext};
use uuid::Uuid;

use super::{read_events, receive_all, WAIT};
use crate::wait_for;

const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const STATE: &str = "congo=t61rcWkgMzE";

/// A command sent with trace context headers is delivered with them; an event published in a
/// trace carries its `traceparent` and `tracestate` headers, at the events destination and at
/// a target; a timer's own message that has a `traceparent` header keeps its own.
pub async fn trace_context_goes_in_and_out_as_headers(fx: Arc<dyn TestClient>) {
    let broker = fx.connect().await.expect("connect");
    let headers = BTreeMap::from([
        (TRACEPARENT.to_owned(), PARENT.to_owned()),
        (TRACESTATE.to_owned(), STATE.to_owned()),
        ("x-other".to_owned(), "1".to_owned()),
    ]);
    fx.send_command_with_headers(br#"{"traced":true}"#, &headers)
        .await
        .expect("send a command with headers");
    let delivered = receive_all(broker.as_ref(), 1).await;
    assert_eq!(delivered.len(), 1, "the command delivered");
    assert_eq!(delivered[0].trace.traceparent.as_deref(), Some(PARENT));
    assert_eq!(delivered[0].trace.tracestate.as_deref(), Some(STATE));
    broker.ack(&[delivered[0].tag]).await.expect("ack");

    let trace = TraceContext::parse(PARENT, Some(STATE)).expect("a well-formed context");
    let mut event = OutboundEvent::envelope(
        Uuid::now_v7(),
        TimerKey::new("acme", "traced"),
        br#"{"n":1}"#.to_vec(),
    );
    event.trace = Some(trace.clone());
    let untraced = OutboundEvent::envelope(
        Uuid::now_v7(),
        TimerKey::new("acme", "untraced"),
        br#"{"n":2}"#.to_vec(),
    );
    let undelivered = broker
        .publish(&[event.clone(), untraced.clone()])
        .await
        .expect("publish");
    assert!(undelivered.is_empty(), "all confirmed: {undelivered:?}");
    let events = read_events(fx.as_ref(), 2).await;
    let read = |id| {
        events
            .iter()
            .find(|e| e.id == id)
            .unwrap_or_else(|| panic!("event {id} read back"))
    };
    let traced = read(event.id);
    assert_eq!(
        traced.headers.get(TRACEPARENT).map(String::as_str),
        Some(PARENT)
    );
    assert_eq!(
        traced.headers.get(TRACESTATE).map(String::as_str),
        Some(STATE)
    );
    assert_eq!(read(untraced.id).headers.get(TRACEPARENT), None);

    let Some(target) = fx.make_target("traced").await.expect("make a target") else {
        return;
    };
    let own_parent = "00-11111111111111111111111111111111-2222222222222222-00";
    let message = |own: Option<&str>| OutboundEvent {
        id: Uuid::now_v7(),
        key: TimerKey::new("acme", "traced-message"),
        body: b"body".to_vec(),
        target: Some(target.clone()),
        message: Some(MessageMeta {
            content_type: None,
            headers: own
                .map(|parent| (TRACEPARENT.to_owned(), parent.to_owned()))
                .into_iter()
                .collect(),
        }),
        trace: Some(trace.clone()),
    };
    let (ours, theirs) = (message(None), message(Some(own_parent)));
    let undelivered = broker
        .publish(&[ours.clone(), theirs.clone()])
        .await
        .expect("publish to a target");
    assert!(undelivered.is_empty(), "all confirmed: {undelivered:?}");
    let got = wait_for(WAIT, || async {
        fx.read_target(&target).await.ok().filter(|m| m.len() >= 2)
    })
    .await
    .expect("2 messages at the target");
    let parent_of = |id| {
        got.iter()
            .find(|m| m.id == Some(id))
            .unwrap_or_else(|| panic!("message {id} at the target"))
            .headers
            .get(TRACEPARENT)
            .cloned()
    };
    assert_eq!(
        parent_of(ours.id).as_deref(),
        Some(PARENT),
        "the fire's trace"
    );
    assert_eq!(
        parent_of(theirs.id).as_deref(),
        Some(own_parent),
        "a message's own traceparent goes out unchanged"
    );
}
