//! The Broker conformance suite. Each check gets a [`TestClient`] on fresh, isolated resources
//! (queue, stream, topics): an independent producer and reader, as a real client would be, that
//! also connects the plugin under test.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use timer_core::plugin::{BrokerConfig, BrokerPlugin, ConfigSection};
pub use timer_core::plugin::{ReadDeadLetter, ReadEvent, TestClient};
use timer_core::{Broker, OutboundEvent, TimerKey};
use uuid::Uuid;

mod targets;
mod trace;

pub use targets::a_message_goes_to_its_target_byte_exact;
pub use trace::trace_context_goes_in_and_out_as_headers;

use crate::e2e::PrivateServer;
use crate::fixtures::Fresh;
use crate::proxy::Proxy;
use crate::{wait_for, Check};

/// A broker's fresh resources with their test client and config.
pub type FreshBroker = Fresh<Arc<dyn TestClient>, dyn BrokerConfig>;

/// Every Broker check, by name.
pub fn checks() -> Vec<Check<Arc<dyn TestClient>>> {
    crate::checks![
        published_event_readable_with_its_id,
        many_events_confirmed_together,
        odd_tenant_ids_delivered_or_refused_alone,
        unacked_command_redelivered,
        acked_command_not_redelivered,
        unacked_command_delivered_again_after_the_ack_wait,
        kept_delivery_not_delivered_again,
        commands_arrive_in_batches,
        dead_letter_carries_the_reason,
        health_ok_when_reachable,
        a_message_goes_to_its_target_byte_exact,
        trace_context_goes_in_and_out_as_headers,
    ]
}

const WAIT: Duration = Duration::from_secs(20);

fn event(i: usize) -> OutboundEvent {
    OutboundEvent {
        id: Uuid::now_v7(),
        key: TimerKey::new(format!("tenant{}", i % 3), format!("call{i}")),
        body: format!(r#"{{"n":{i}}}"#).into_bytes(),
        target: None,
        message: None,
        trace: None,
    }
}

async fn receive_all(broker: &dyn Broker, n: usize) -> Vec<timer_core::Delivery> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    while got.len() < n && tokio::time::Instant::now() < deadline {
        got.extend(
            broker
                .receive(n - got.len(), Duration::from_millis(500))
                .await
                .expect("receive"),
        );
    }
    got
}

/// Waits until at least `n` events are readable at the events destination; all of them.
async fn read_events(fx: &dyn TestClient, n: usize) -> Vec<ReadEvent> {
    wait_for(WAIT, || async {
        fx.events().await.ok().filter(|e| e.len() >= n)
    })
    .await
    .unwrap_or_else(|| panic!("{n} event(s) readable"))
}

/// One receive of up to 10 commands, waiting up to `wait`; each acknowledged. Their bodies.
async fn receive_and_ack(broker: &dyn Broker, wait: Duration) -> Vec<Vec<u8>> {
    let mut bodies = Vec::new();
    for d in broker.receive(10, wait).await.expect("receive") {
        broker.ack(&[d.tag]).await.expect("ack");
        bodies.push(d.body);
    }
    bodies
}

pub async fn published_event_readable_with_its_id(fx: Arc<dyn TestClient>) {
    let broker = fx.connect().await.expect("connect");
    let events: Vec<OutboundEvent> = (0..3).map(event).collect();
    let undelivered = broker.publish(&events).await.expect("publish");
    assert!(undelivered.is_empty(), "refused: {undelivered:?}");
    let read = wait_for(WAIT, || async {
        fx.events().await.ok().filter(|e| e.len() >= 3)
    })
    .await
    .expect("3 events readable");
    for e in &events {
        let found = read.iter().find(|r| r.id == e.id);
        let found = found.unwrap_or_else(|| panic!("event {} not read back with its id", e.id));
        assert_eq!(found.body, e.body);
    }
}

/// One publish of more events than a client may leave waiting for their confirms (NATS's
/// JetStream context: 5,000), as a large `engine.batch_size` asks: every one confirmed.
pub async fn many_events_confirmed_together(fx: Arc<dyn TestClient>) {
    const N: usize = 6_000;
    let broker = fx.connect().await.expect("connect");
    let events: Vec<OutboundEvent> = (0..N).map(event).collect();
    let undelivered = tokio::time::timeout(Duration::from_secs(60), broker.publish(&events))
        .await
        .expect("6,000 publishes confirmed within a minute")
        .expect("publish");
    assert!(undelivered.is_empty(), "refused: {undelivered:?}");
    let read = wait_for(WAIT, || async {
        fx.events().await.ok().filter(|e| e.len() >= N)
    })
    .await
    .expect("all events readable");
    let ids: HashSet<Uuid> = read.iter().map(|r| r.id).collect();
    assert!(
        events.iter().all(|e| ids.contains(&e.id)),
        "every confirmed event is readable"
    );
}

/// The longest and oddest tenant ids: the longest valid one of the default limits
/// (`limits.max_id_bytes` = 128) in characters every broker escapes, the characters that mean
/// something in subjects, routing keys and URLs, multi-byte text, and ids far longer than the
/// default allows (a deployment may raise the limit).
fn odd_tenants() -> Vec<String> {
    vec![
        ".".repeat(128),
        "*".repeat(128),
        ">".repeat(128),
        "%".repeat(128),
        "#".repeat(128),
        "ü".repeat(64),
        "🦀".repeat(32),
        "a.*.>.#.%2E. x".into(),
        ".".repeat(1_500),
        "x".repeat(5_000),
    ]
}

/// Each odd tenant's event, in one batch with an ordinary one: what [`Broker::check_key`]
/// accepts is delivered and readable with its id; what it refuses comes back alone as
/// undelivered (never a panic, never the whole batch failed), and the ordinary event is
/// delivered all the same.
pub async fn odd_tenant_ids_delivered_or_refused_alone(fx: Arc<dyn TestClient>) {
    let broker = fx.connect().await.expect("connect");
    let mut events = vec![event(0)];
    for (i, tenant) in odd_tenants().into_iter().enumerate() {
        events.push(OutboundEvent {
            id: Uuid::now_v7(),
            key: TimerKey::new(tenant, format!("odd{i}")),
            body: format!(r#"{{"odd":{i}}}"#).into_bytes(),
            target: None,
            message: None,
            trace: None,
        });
    }
    let refused_by_check: Vec<usize> = (0..events.len())
        .filter(|&i| broker.check_key(&events[i].key).is_err())
        .collect();
    let undelivered = broker.publish(&events).await.expect("publish");
    let undelivered: Vec<usize> = undelivered.iter().map(|u| u.index).collect();
    assert_eq!(
        undelivered, refused_by_check,
        "publish refuses exactly the events whose key check_key refuses, one by one"
    );
    let expected: Vec<&OutboundEvent> = (0..events.len())
        .filter(|i| !undelivered.contains(i))
        .map(|i| &events[i])
        .collect();
    assert!(
        expected.len() > 1,
        "the ordinary event and some odd ones are delivered"
    );
    let read = wait_for(WAIT, || async {
        fx.events().await.ok().filter(|e| e.len() >= expected.len())
    })
    .await
    .expect("every delivered event readable");
    for e in expected {
        let found = read.iter().find(|r| r.id == e.id);
        let found = found.unwrap_or_else(|| panic!("event of {:?} not read back", e.key));
        assert_eq!(found.body, e.body);
    }
}

pub async fn unacked_command_redelivered(fx: Arc<dyn TestClient>) {
    fx.send_command(b"first").await.expect("send");
    let first = fx.connect().await.expect("connect");
    let got = receive_all(first.as_ref(), 1).await;
    assert_eq!(got.len(), 1, "command delivered");
    assert_eq!(got[0].body, b"first");
    drop(first); // gone without acknowledging: a crash before the store committed
    let second = fx.connect().await.expect("connect");
    let again = receive_all(second.as_ref(), 1).await;
    assert_eq!(
        again.len(),
        1,
        "an unacknowledged command is delivered again"
    );
    assert_eq!(again[0].body, b"first");
    second.ack(&[again[0].tag]).await.expect("ack");
}

pub async fn acked_command_not_redelivered(fx: Arc<dyn TestClient>) {
    fx.send_command(b"once").await.expect("send");
    let first = fx.connect().await.expect("connect");
    let got = receive_all(first.as_ref(), 1).await;
    assert_eq!(got.len(), 1);
    first.ack(&[got[0].tag]).await.expect("ack");
    drop(first);
    let second = fx.connect().await.expect("connect");
    fx.send_command(b"marker").await.expect("send marker");
    // Once the marker (sent later) arrives, an acknowledged command would have come before it.
    let mut bodies = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    while !bodies.iter().any(|b: &Vec<u8>| b == b"marker") && tokio::time::Instant::now() < deadline
    {
        bodies.extend(receive_and_ack(second.as_ref(), Duration::from_millis(500)).await);
    }
    // A broker that delivers again by itself after its ack wait (NATS) would do so later than
    // the marker: read on until that wait is over too.
    if let Some(ack_wait) = second.ack_wait() {
        let until = tokio::time::Instant::now() + ack_wait + Duration::from_secs(1);
        while tokio::time::Instant::now() < until {
            bodies.extend(receive_and_ack(second.as_ref(), Duration::from_millis(250)).await);
        }
    }
    assert_eq!(
        bodies,
        vec![b"marker".to_vec()],
        "the acknowledged command did not come back"
    );
}

/// Where the broker delivers an unacknowledged command again by itself after its ack wait
/// ([`Broker::ack_wait`]), it does, to the same connected consumer; elsewhere only a consumer
/// that goes away gives its deliveries back ([`unacked_command_redelivered`]).
pub async fn unacked_command_delivered_again_after_the_ack_wait(fx: Arc<dyn TestClient>) {
    let broker = fx.connect().await.expect("connect");
    let Some(ack_wait) = broker.ack_wait() else {
        return;
    };
    fx.send_command(b"slow").await.expect("send");
    let got = receive_all(broker.as_ref(), 1).await;
    assert_eq!(got.len(), 1, "command delivered");
    let first = tokio::time::Instant::now();
    let again = receive_all(broker.as_ref(), 1).await;
    assert_eq!(
        again.iter().map(|d| d.body.as_slice()).collect::<Vec<_>>(),
        [b"slow".as_slice()],
        "not acknowledged within {ack_wait:?}: delivered again"
    );
    // Not at once (a nack would be): the wait began at the delivery, a little before `first`.
    assert!(
        first.elapsed() + Duration::from_millis(500) >= ack_wait,
        "delivered again after {:?}, before the ack wait of {ack_wait:?}",
        first.elapsed()
    );
    broker.ack(&[again[0].tag]).await.expect("ack");
}

/// [`Broker::keep`] restarts the ack wait: a delivery kept for several ack waits is not
/// delivered again meanwhile, and once acknowledged never is.
pub async fn kept_delivery_not_delivered_again(fx: Arc<dyn TestClient>) {
    let broker = fx.connect().await.expect("connect");
    let Some(ack_wait) = broker.ack_wait() else {
        return; // the engine never calls keep on a broker without its own ack wait
    };
    fx.send_command(b"held").await.expect("send");
    let got = receive_all(broker.as_ref(), 1).await;
    assert_eq!(got.len(), 1, "command delivered");
    let tag = got[0].tag;
    let until = tokio::time::Instant::now() + ack_wait * 5 / 2;
    let mut again = Vec::new();
    while tokio::time::Instant::now() < until {
        broker.keep(&[tag]).await.expect("keep");
        again.extend(
            broker
                .receive(10, ack_wait / 4)
                .await
                .expect("receive")
                .into_iter()
                .map(|d| d.body),
        );
    }
    assert!(
        again.is_empty(),
        "kept for 2.5 ack waits of {ack_wait:?}, yet delivered again: {again:?}"
    );
    broker.ack(&[tag]).await.expect("ack");
    let after = broker
        .receive(10, ack_wait + Duration::from_secs(1))
        .await
        .expect("receive");
    assert!(
        after.is_empty(),
        "acknowledged, yet delivered again: {after:?}"
    );
}

pub async fn commands_arrive_in_batches(fx: Arc<dyn TestClient>) {
    const N: usize = 200;
    for i in 0..N {
        fx.send_command(format!("cmd{i}").as_bytes())
            .await
            .expect("send");
    }
    let broker = fx.connect().await.expect("connect");
    // Every command is in the broker: a receive takes as many as are there, up to its max.
    let mut got = Vec::new();
    let mut largest = 0;
    let deadline = tokio::time::Instant::now() + WAIT;
    while got.len() < N && tokio::time::Instant::now() < deadline {
        let batch = broker
            .receive(N - got.len(), Duration::from_millis(500))
            .await
            .expect("receive");
        largest = largest.max(batch.len());
        got.extend(batch);
    }
    assert_eq!(got.len(), N);
    assert!(
        largest > 1,
        "{N} commands waiting came one per receive: a receive takes a batch"
    );
    let bodies: HashSet<Vec<u8>> = got.iter().map(|d| d.body.clone()).collect();
    assert_eq!(bodies.len(), N, "each command once");
    let tags: Vec<u64> = got.iter().map(|d| d.tag).collect();
    broker.ack(&tags).await.expect("ack");
    let more = broker
        .receive(10, Duration::from_millis(300))
        .await
        .expect("receive");
    assert!(
        more.is_empty(),
        "nothing left after acknowledging all: {more:?}"
    );
}

pub async fn dead_letter_carries_the_reason(fx: Arc<dyn TestClient>) {
    let broker = fx.connect().await.expect("connect");
    broker
        .dead_letter(
            b"{not json",
            "invalid_json: expected value at line 1 column 2",
        )
        .await
        .expect("dead letter");
    let letters = wait_for(WAIT, || async {
        fx.dead_letters().await.ok().filter(|d| !d.is_empty())
    })
    .await
    .expect("dead letter readable");
    assert_eq!(letters[0].body, b"{not json");
    assert_eq!(
        letters[0].reason,
        "invalid_json: expected value at line 1 column 2"
    );
}

pub async fn health_ok_when_reachable(fx: Arc<dyn TestClient>) {
    let broker = fx.connect().await.expect("connect");
    broker.health().await.expect("healthy");
}

/// The plugin under test connected to a stand-in for its test server that a check may take
/// away ([`Removable::take_the_server_away`]): a [`Proxy`] in front of the shared server
/// ([`through_a_proxy`]), or, for a server whose clients go around proxies, a private server
/// of its own ([`on_a_private_server`]).
pub struct Removable {
    pub broker: Arc<dyn Broker>,
    pub kind: &'static str,
    stand_in: StandIn,
    _keep: crate::fixtures::Keep,
}

enum StandIn {
    Proxy(Proxy),
    Private(PrivateServer),
}

impl Removable {
    /// The server goes: the proxy stops and closes every connection, or the private server
    /// gets SIGKILL.
    pub async fn take_the_server_away(&self) {
        match &self.stand_in {
            StandIn::Proxy(proxy) => proxy.stop(),
            StandIn::Private(server) => server.crash().await,
        }
    }
}

/// `fresh`'s config with every mention of the test server's address pointed at a new proxy in
/// front of it, loaded by `plugin` and connected.
pub async fn through_a_proxy(
    plugin: &'static BrokerPlugin,
    fresh: FreshBroker,
) -> timer_core::Result<Removable> {
    let server = test_server(plugin)?;
    let proxy = Proxy::in_front_of(&server.address()?, 0).await;
    let upstream = proxy.upstream().to_string();
    let to = proxy.addr().to_string();
    connect_instead(plugin, fresh, &upstream, &to, StandIn::Proxy(proxy)).await
}

/// `fresh`'s config with every mention of the test server's address pointed at a private
/// server its script starts on a free port ([`PrivateServer`]), loaded by `plugin` and
/// connected (the plugin creates what it needs there as on a new cluster).
pub async fn on_a_private_server(
    plugin: &'static BrokerPlugin,
    fresh: FreshBroker,
) -> timer_core::Result<Removable> {
    let server = test_server(plugin)?;
    let shared = server.address()?;
    let private = PrivateServer::start(server.script, server.port_env).await;
    let to = private.address().to_owned();
    connect_instead(plugin, fresh, &shared, &to, StandIn::Private(private)).await
}

fn test_server(plugin: &BrokerPlugin) -> timer_core::Result<timer_core::plugin::TestServer> {
    plugin
        .test_server
        .ok_or_else(|| timer_core::Error::config("a broker without a test server"))
}

async fn connect_instead(
    plugin: &'static BrokerPlugin,
    fresh: FreshBroker,
    from: &str,
    to: &str,
    stand_in: StandIn,
) -> timer_core::Result<Removable> {
    let (_client, config, keep) = fresh.into_parts();
    let mut value = config.to_value()?;
    let mut rewritten = 0;
    rewrite_strings(&mut value, &mut |s: &str| {
        s.contains(from).then(|| {
            rewritten += 1;
            s.replace(from, to)
        })
    });
    if rewritten == 0 {
        return Err(timer_core::Error::config(format!(
            "the {} config names the test server's address {from} nowhere",
            plugin.kind
        )));
    }
    let locate = |_: &str| String::new();
    let section = ConfigSection {
        name: "broker",
        value,
        locate: &locate,
    };
    let broker = (plugin.load)(&section)?.connect().await?;
    Ok(Removable {
        broker,
        kind: plugin.kind,
        stand_in,
        _keep: keep,
    })
}

fn rewrite_strings(value: &mut serde_json::Value, f: &mut impl FnMut(&str) -> Option<String>) {
    match value {
        serde_json::Value::String(s) => {
            if let Some(new) = f(s) {
                *s = new;
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(|v| rewrite_strings(v, f)),
        serde_json::Value::Object(map) => map.values_mut().for_each(|v| rewrite_strings(v, f)),
        _ => {}
    }
}

/// The checks that take the server away, by name.
pub fn server_gone_checks() -> Vec<Check<Removable>> {
    crate::checks![
        health_and_publish_fail_once_the_server_is_gone,
        health_fails_and_drop_returns_when_the_server_goes_at_once,
    ]
}

/// With the server gone (its address answers no more: the proxy stopped and every connection
/// closed, or the private server killed), `health` fails, and so does `publish`, within a
/// bound: neither answers Ok for what it cannot know or do. And dropping the broker (what the
/// service does when it stops) returns within a bound too.
pub async fn health_and_publish_fail_once_the_server_is_gone(p: Removable) {
    p.broker
        .health()
        .await
        .expect("healthy while the server is there");
    let undelivered = p.broker.publish(&[event(0)]).await.expect("publish");
    assert!(undelivered.is_empty(), "{undelivered:?}");
    p.take_the_server_away().await;
    health_fails(&p).await;
    let kind = p.kind;
    let published =
        tokio::time::timeout(Duration::from_secs(60), p.broker.publish(&[event(1)])).await;
    match published {
        Ok(Err(e)) => println!("{kind} with the server gone: publish says {}", e.chain()),
        Ok(Ok(undelivered)) => {
            panic!("{kind}: publish answered Ok with the server gone (undelivered {undelivered:?})")
        }
        Err(_) => {
            panic!("{kind}: publish neither failed nor returned within 60 s of the server gone")
        }
    }
    let_go_within_a_bound(p).await;
}

/// With the server gone right after the broker connected (a Kafka consumer still joining its
/// group), `health` fails and dropping the broker returns within a bound. (rdkafka's drop of
/// such a consumer could wait for the server forever: seen in about one run in four.)
pub async fn health_fails_and_drop_returns_when_the_server_goes_at_once(p: Removable) {
    p.take_the_server_away().await;
    health_fails(&p).await;
    let_go_within_a_bound(p).await;
}

async fn health_fails(p: &Removable) {
    let unhealthy = wait_for(WAIT, || async { p.broker.health().await.err() }).await;
    let Some(e) = unhealthy else {
        panic!(
            "{}: health still Ok {WAIT:?} after the server went away",
            p.kind
        );
    };
    println!("{} with the server gone: health says {}", p.kind, e.chain());
}

/// Drops the broker (what the service does when it stops), which must not wait for the server
/// to return; on a thread of its own, so a drop that hangs fails the check instead of holding
/// it.
async fn let_go_within_a_bound(p: Removable) {
    let Removable { broker, kind, .. } = p;
    let (dropped, dropping) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let started = Instant::now();
        drop(broker);
        let _ = dropped.send(started.elapsed());
    });
    match tokio::time::timeout(Duration::from_secs(60), dropping).await {
        Ok(Ok(took)) => println!("{kind} with the server gone: dropped in {took:?}"),
        Ok(Err(_)) => panic!("{kind}: dropping the broker panicked"),
        Err(_) => panic!("{kind}: dropping the broker took over 60 s with the server gone"),
    }
}
