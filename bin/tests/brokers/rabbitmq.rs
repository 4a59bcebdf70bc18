//! What is RabbitMQ's own: an event no queue is bound to comes back to the service, which
//! retries it until one is (then it arrives persistent, routed by its tenant).

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use timer_brokers::rabbitmq::{declare_sink, sink_queue, RabbitmqConfig, RabbitmqTestClient};
use timer_conformance::e2e::{now_ms, schedule};
use timer_conformance::scenarios::{
    an_event_its_destination_refuses_is_retried_alone, delivered_cancelled_and_dead_lettered,
    fires, refusing_destination_setup, timers, BrokerCase, BrokerTraits, Setup,
};
use timer_conformance::{checks, wait_for, Check};

pub fn traits() -> BrokerTraits {
    BrokerTraits {
        settings: json!({}),
        // A publish whose confirm was lost with the connection is published again; the queue
        // keeps both (same message id).
        // At most the batches in flight when the server went (`engine.batch_size`, 500) and a
        // retry of them; measured: 20 (RabbitMQ), 0 (Kafka) of 10,000.
        max_repeated: Some(1_000),
        unreachable: Some((
            json!({"kind": "rabbitmq", "url": "amqp://guest:secret@127.0.0.1:{port}/%2f"}),
            "error: rabbitmq broker: cannot connect to amqp://***@127.0.0.1:{port}/%2f",
        )),
        acknowledged: None,
        no_takeover: None,
        bound_tenant: "guest",
    }
}

pub fn checks() -> Vec<Check<Arc<BrokerCase>>> {
    checks![
        an_unroutable_event_is_retried_not_lost,
        a_tenant_too_long_for_a_routing_key_is_refused_and_nothing_stops_firing,
        a_message_amqp_cannot_carry_is_refused_and_nothing_stops_firing,
        an_event_the_broker_refuses_is_retried_alone,
        a_tenant_without_a_bound_queue_does_not_hold_back_the_others,
        a_message_for_a_missing_exchange_is_retried_and_holds_back_no_other,
        a_message_sent_to_the_delay_exchange_arrives_at_its_time,
        a_topology_the_server_lost_is_declared_again,
    ]
}

/// The server loses what the service declared while it runs (deleted by hand, a node reset),
/// and the service declares it again when it connects again:
/// - the events exchange alone: the next publish there fails (the server closes the channel),
///   the service connects again, declares it and retries; the event reaches the queue its
///   consumer bound again (bindings go with their exchange);
/// - then the exchanges and the commands queue: the server cancels the service's consumer, and
///   the service connects again; a command sent then is applied and fires.
async fn a_topology_the_server_lost_is_declared_again(case: Arc<BrokerCase>) {
    let setup = Setup::new(&case);
    let service = setup.start().await;
    let config = rabbitmq_config(&setup);
    let client = setup.client().await;
    fires(client.as_ref(), &service, "before", "before the loss").await;
    let connection =
        lapin::Connection::connect(&config.url, lapin::ConnectionProperties::default())
            .await
            .expect("connect");
    let channel = connection.create_channel().await.expect("channel");
    let events = &config.events_exchange;
    channel
        .exchange_delete(events.as_str().into(), Default::default())
        .await
        .expect("delete the events exchange");
    let (status, v) = service
        .post("/v1/timers", schedule("t", "exchange-lost", now_ms()))
        .await;
    assert_eq!(status, 201, "{v}");
    declared_again(&service, "the events exchange", || {
        exists(config, Named::Exchange(events))
    })
    .await;
    declare_sink(config).await.expect("the sink bound again");
    let delivered = wait_for(Duration::from_secs(30), || async {
        let events = client.events().await.ok()?;
        timers(&events).contains("t/exchange-lost").then_some(())
    })
    .await;
    if delivered.is_none() {
        service.fail("the event of a timer fired after its exchange was lost did not arrive");
    }

    // Exchanges first: the consumer, cancelled last, finds them gone when it declares again.
    for exchange in [events, &config.dead_letter_exchange, &config.delay_exchange] {
        channel
            .exchange_delete(exchange.as_str().into(), Default::default())
            .await
            .unwrap_or_else(|e| panic!("delete exchange {exchange}: {e}"));
    }
    let commands = &config.commands_queue;
    channel
        .queue_delete(commands.as_str().into(), Default::default())
        .await
        .expect("delete the commands queue");
    declared_again(&service, "the commands queue", || {
        exists(config, Named::Queue(commands))
    })
    .await;
    declared_again(&service, "the events exchange", || {
        exists(config, Named::Exchange(events))
    })
    .await;
    declare_sink(config).await.expect("the sink bound again");
    fires(client.as_ref(), &service, "after", "after the loss").await;
    let _ = connection.close(200, "done".into()).await;
    service.terminate().await;
    setup.clean_up().await;
}

/// Waits until `exists` says the service declared `what` again (60 s).
async fn declared_again<F, Fut>(service: &timer_conformance::e2e::Service, what: &str, exists: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let declared = wait_for(Duration::from_secs(60), || async {
        exists().await.then_some(())
    })
    .await;
    if declared.is_none() {
        service.fail(format!("{what} was not declared again within 60 s"));
    }
}

/// A queue or an exchange of the server of `config`, for [`exists`].
enum Named<'a> {
    Queue(&'a str),
    Exchange(&'a str),
}

/// Whether `what` exists on the server of `config` (a passive declare, on a connection of its
/// own: a missing one closes the channel).
async fn exists(config: &RabbitmqConfig, what: Named<'_>) -> bool {
    let Ok(connection) =
        lapin::Connection::connect(&config.url, lapin::ConnectionProperties::default()).await
    else {
        return false;
    };
    let found = match (connection.create_channel().await, what) {
        (Ok(channel), Named::Queue(queue)) => {
            let passive = lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            let declared = channel.queue_declare(queue.into(), passive, Default::default());
            declared.await.is_ok()
        }
        (Ok(channel), Named::Exchange(exchange)) => {
            let passive = lapin::options::ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            };
            let kind = lapin::ExchangeKind::Topic;
            let declared =
                channel.exchange_declare(exchange.into(), kind, passive, Default::default());
            declared.await.is_ok()
        }
        (Err(_), _) => false,
    };
    let _ = connection.close(200, "checked".into()).await;
    found
}

/// Tenant `a` has no queue bound for its routing key (it unbound it), tenant `b` has one. Their
/// timers fall due together, so their events are published in one batch: RabbitMQ returns `a`'s
/// event, and only `a`'s timer is retried, with `a`'s routing key in its `lastError`; `b`'s is
/// delivered and Reached at once, with no error and no attempt counted.
async fn a_tenant_without_a_bound_queue_does_not_hold_back_the_others(case: Arc<BrokerCase>) {
    use lapin::options::QueueBindOptions;
    use lapin::types::FieldTable;
    let setup = Setup::with_engine(&case, json!({ "retry_base": "1s", "retry_max": "2s" }));
    let service = setup.start().await; // declares the events exchange
    let config = rabbitmq_config(&setup);
    let queue = format!("{}.b-only", config.events_exchange);
    let (_connection, channel) = channel_with_queue(config, &queue, Default::default()).await;
    channel
        .queue_bind(
            queue.as_str().into(),
            config.events_exchange.as_str().into(),
            "b".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind");
    let due = now_ms() + 500;
    for tenant in ["a", "b"] {
        let (status, v) = service
            .post("/v1/timers", schedule(tenant, "together", due))
            .await;
        assert_eq!(status, 201, "{v}");
    }
    let b = wait_for(Duration::from_secs(30), || async {
        let (_, t) = service.get("/v1/tenants/b/timers/together").await;
        (t["state"] == "Reached").then_some(t)
    })
    .await
    .expect("b's timer is delivered");
    assert_eq!(
        (b["attempts"].as_u64(), &b["lastError"]),
        (Some(0), &Value::Null),
        "{b}"
    );
    let a = retried(&service, "/v1/tenants/a/timers/together").await;
    assert_eq!(a["state"], "Scheduled", "{a}");
    let error = a["lastError"].as_str().unwrap_or_default();
    assert!(error.contains("routing key \"a\""), "{a}");
    let _ = channel
        .queue_delete(
            queue.as_str().into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await;
    service.terminate().await;
    setup.clean_up().await;
}

/// A tenant id whose routing key is longer than AMQP's 255 bytes (86 dots, valid under the
/// default `limits.max_id_bytes`) once stopped every fire of a RabbitMQ deployment: the firing
/// task panicked building the routing key, and the next instance took the timer over and died
/// the same way. Now it is refused at admission, over HTTP and on the broker path, naming the
/// field; the longest that fits (85 dots: a 255-byte routing key) fires; and a timer of the long
/// tenant stored before the check (written to the store beside the service) is retried on its
/// own with the reason, while the other tenants' timers fire and `/readyz` stays 200.
async fn a_tenant_too_long_for_a_routing_key_is_refused_and_nothing_stops_firing(
    case: Arc<BrokerCase>,
) {
    let setup = Setup::with_engine(
        &case,
        json!({ "retry_base": "100ms", "retry_max": "200ms" }),
    );
    let client = setup.client().await; // binds a queue for every routing key
    let service = setup.start().await;
    let long = ".".repeat(86);
    let fits = ".".repeat(85);

    let (status, v) = service
        .post("/v1/timers", schedule(&long, "http", now_ms()))
        .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["reason"], "invalid_id", "{v}");
    assert_eq!(v["error"]["field"], "tenantId", "{v}");
    let message = v["error"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains("258 bytes") && message.contains("255"),
        "{v}"
    );

    let command = schedule(&long, "broker", now_ms());
    client.send_command(command.as_bytes()).await.expect("send");
    let letters = wait_for(Duration::from_secs(30), || async {
        client.dead_letters().await.ok().filter(|d| !d.is_empty())
    })
    .await
    .expect("the command is dead-lettered");
    assert!(
        letters[0].reason.starts_with("tenantId (invalid_id)"),
        "{}",
        letters[0].reason
    );

    // As if stored by a release that did not check: straight into the store.
    let limits = timer_core::Limits {
        max_id_bytes: 1_000,
        ..timer_core::Limits::default()
    };
    let now = timer_core::Timestamp::from_millis(now_ms());
    let stored = schedule(&long, "stored", now_ms());
    let stored = timer_core::decode_schedule(stored.as_bytes(), &limits, now).expect("valid");
    let store = setup.store().await;
    store.schedule(&[stored], now).await.expect("stored");

    for (tenant, id) in [("t", "ok"), (fits.as_str(), "fits")] {
        let (status, v) = service
            .post("/v1/timers", schedule(tenant, id, now_ms()))
            .await;
        assert_eq!(status, 201, "{v}");
    }
    let fired = wait_for(Duration::from_secs(30), || async {
        let events = client.events().await.ok()?;
        let ids: Vec<String> = events
            .iter()
            .filter_map(|e| serde_json::from_slice::<Value>(&e.body).ok())
            .filter_map(|v| v["aggregateId"].as_str().map(str::to_owned))
            .collect();
        (ids.contains(&"ok".to_owned()) && ids.contains(&"fits".to_owned())).then_some(ids)
    })
    .await
    .expect("the other tenants' timers fire");
    assert!(!fired.contains(&"stored".to_owned()), "{fired:?}");
    let retried = retried_twice(&store, timer_core::TimerKey::new(long.clone(), "stored")).await;
    let error = retried.last_error.unwrap_or_default();
    assert!(
        error.contains("routing key") && error.contains("255"),
        "{error}"
    );
    let (status, ready) = service.get("/readyz").await;
    assert_eq!(status, 200, "{ready}");
    assert_eq!(ready["engine"]["status"], "ok", "{ready}");
    service.terminate().await;
    setup.clean_up().await;
}

/// A timer's own message that AMQP cannot carry is refused at admission, naming `message`: a
/// content type or header name over 255 bytes (a short string), or headers that outgrow the
/// one frame AMQP sends properties in. The largest message admission takes is delivered whole.
/// One stored anyway (by a release that did not check) is retried on its own with the reason,
/// and the service goes on firing the others (lapin panics on a short string too long: this
/// one did at every fire, before the check).
async fn a_message_amqp_cannot_carry_is_refused_and_nothing_stops_firing(case: Arc<BrokerCase>) {
    let setup = Setup::with_engine(
        &case,
        json!({ "retry_base": "100ms", "retry_max": "200ms" }),
    );
    let client = setup.client().await; // binds a queue for every routing key
    let service = setup.start().await;
    let with = |id: &str, message: Value| {
        json!({ "tenantId": "t", "serviceCallId": id, "dueTimeMs": now_ms(), "message": message })
            .to_string()
    };
    let long_type = json!({ "body": 1, "contentType": format!("text/{}", "a".repeat(300)) });
    let long_name = json!({ "body": 1, "headers": { "n".repeat(256): "v" } });
    // 30 headers of names of 255 bytes and values of `value` bytes.
    let headers = |value: usize| {
        let headers: serde_json::Map<String, Value> = (0..30)
            .map(|i| (format!("{i:x>255}"), json!("v".repeat(value))))
            .collect();
        json!({ "body": 1, "headers": headers })
    };
    for (message, says) in [
        (
            long_type.clone(),
            "contentType is 305 bytes; AMQP allows at most 255",
        ),
        (long_name, "is 256 bytes; AMQP allows at most 255"),
        (
            headers(4096),
            "RabbitMQ allows 131072 bytes by default (frame_max)",
        ),
    ] {
        let (status, v) = service.post("/v1/timers", with("refused", message)).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["reason"], "invalid_target", "{v}");
        assert_eq!(v["error"]["field"], "message", "{v}");
        let message = v["error"]["message"].as_str().unwrap_or("");
        assert!(message.contains(says), "{v}");
    }
    // The largest headers admission takes: values shortened a byte at a time from 4 KiB.
    let mut value = 4096;
    loop {
        let (status, v) = service
            .post("/v1/timers", with("largest", headers(value)))
            .await;
        match status {
            201 => break,
            400 if value > 3_500 => value -= 1,
            _ => panic!("{status} {v}"),
        }
    }
    assert!(value < 4096, "the first try is over a frame");

    // As if stored by a release that did not check: straight into the store.
    let now = timer_core::Timestamp::from_millis(now_ms());
    let stored = with("stored", long_type);
    let limits = timer_core::Limits::default();
    let stored = timer_core::decode_schedule(stored.as_bytes(), &limits, now).expect("valid");
    let store = setup.store().await;
    store.schedule(&[stored], now).await.expect("stored");
    let (status, v) = service
        .post("/v1/timers", schedule("t", "ok", now_ms()))
        .await;
    assert_eq!(status, 201, "{v}");

    let fired = wait_for(Duration::from_secs(30), || async {
        let events = client.events().await.ok()?;
        let largest = events.iter().find(|e| e.headers.len() >= 30)?.clone();
        events
            .iter()
            .filter_map(|e| serde_json::from_slice::<Value>(&e.body).ok())
            .any(|v| v["aggregateId"] == "ok")
            .then_some(largest)
    })
    .await
    .expect("the largest message and the other timer are delivered");
    let own: Vec<_> = fired
        .headers
        .iter()
        .filter(|(name, _)| name.len() == 255)
        .collect();
    assert_eq!(own.len(), 30, "{:?}", fired.headers.keys());
    assert!(
        own.iter().all(|(_, v)| v.len() == value),
        "values of {value} bytes"
    );
    let retried = retried_twice(&store, timer_core::TimerKey::new("t", "stored")).await;
    let error = retried.last_error.unwrap_or_default();
    assert!(error.contains("the content type is 305 bytes"), "{error}");
    service.terminate().await;
    setup.clean_up().await;
}

/// An event the broker nacks (its target queue is full, with `x-overflow: reject-publish`) is
/// refused alone ([`an_event_its_destination_refuses_is_retried_alone`]).
async fn an_event_the_broker_refuses_is_retried_alone(case: Arc<BrokerCase>) {
    use lapin::types::{AMQPValue, FieldTable};
    let setup = refusing_destination_setup(&case);
    let config = rabbitmq_config(&setup).clone();
    let queue = format!("{}.full", config.events_exchange);
    let mut arguments = FieldTable::default();
    arguments.insert("x-max-length".into(), AMQPValue::LongInt(1));
    arguments.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    let (_connection, channel) = channel_with_queue(&config, &queue, arguments).await;
    let target = json!({ "exchange": "", "routingKey": queue });
    let says = "the broker refused the event (a nack";
    an_event_its_destination_refuses_is_retried_alone(&setup, target, says).await;
    let _ = channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await;
    setup.clean_up().await;
}

/// A channel with publisher confirms (a publish awaited is on the server, ahead of whatever is
/// sent after it) of a connection of its own to the test server of `config` (returned too: the
/// channel closes with it), and a queue `queue` declared on it (with `arguments`, e.g.
/// `x-max-length`).
async fn channel_with_queue(
    config: &RabbitmqConfig,
    queue: &str,
    arguments: lapin::types::FieldTable,
) -> (lapin::Connection, lapin::Channel) {
    use lapin::options::QueueDeclareOptions;
    let connection =
        lapin::Connection::connect(&config.url, lapin::ConnectionProperties::default())
            .await
            .expect("connect");
    let channel = connection.create_channel().await.expect("channel");
    channel
        .confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    channel
        .queue_declare(queue.into(), QueueDeclareOptions::default(), arguments)
        .await
        .unwrap_or_else(|e| panic!("declaring queue {queue}: {e}"));
    (connection, channel)
}

/// The `[broker]` config of a RabbitMQ scenario.
fn rabbitmq_config(setup: &Setup) -> &RabbitmqConfig {
    setup
        .broker
        .config
        .as_any()
        .downcast_ref()
        .expect("a rabbitmq config")
}

/// The stored timer `key` once two of its publishes failed: retried on its own, not lost.
async fn retried_twice(
    store: &Arc<dyn timer_core::Store>,
    key: timer_core::TimerKey,
) -> timer_core::Timer {
    wait_for(Duration::from_secs(30), || async {
        let t = store.get(&key).await.ok().flatten()?;
        (t.attempts >= 2).then_some(t)
    })
    .await
    .unwrap_or_else(|| panic!("{key}: retried on its own"))
}

/// The timer at `path` once a failed publish was recorded (`attempts` at least 1).
async fn retried(service: &timer_conformance::e2e::Service, path: &str) -> Value {
    wait_for(Duration::from_secs(30), || async {
        let (_, t) = service.get(path).await;
        (t["attempts"].as_u64()? >= 1).then_some(t)
    })
    .await
    .unwrap_or_else(|| panic!("{path}: a failed publish recorded"))
}

async fn an_unroutable_event_is_retried_not_lost(case: Arc<BrokerCase>) {
    let setup = Setup::with_engine(
        &case,
        json!({ "retry_base": "100ms", "retry_max": "200ms" }),
    );
    let service = setup.start().await;
    let (status, v) = service
        .post("/v1/timers", schedule("t", "nobody-listens", now_ms()))
        .await;
    assert_eq!(status, 201, "{v}");
    // No queue is bound to the events exchange: RabbitMQ returns the event, the timer stays.
    let failing = retried(&service, "/v1/tenants/t/timers/nobody-listens").await;
    assert_eq!(failing["state"], "Scheduled", "{failing}");
    assert!(
        failing["lastError"]
            .as_str()
            .unwrap_or("")
            .contains("no queue is bound"),
        "{failing}"
    );
    // Once a queue is bound (the test client binds its sink), the retry delivers it.
    let client = setup.client().await;
    let config = rabbitmq_config(&setup);
    let reader = client
        .as_any()
        .downcast_ref::<RabbitmqTestClient>()
        .expect("the rabbitmq test client");
    let event = wait_for(Duration::from_secs(30), || async {
        reader
            .drain(&sink_queue(config))
            .await
            .ok()
            .and_then(|mut got| (!got.is_empty()).then(|| got.remove(0)))
    })
    .await
    .expect("delivered after the binding");
    let v: Value = serde_json::from_slice(&event.delivery.data).expect("json");
    assert_eq!(v["aggregateId"], "nobody-listens");
    assert_eq!(
        event.delivery.routing_key.as_str(),
        "t",
        "routing key = tenant"
    );
    assert_eq!(
        event.delivery.properties.delivery_mode(),
        &Some(2),
        "persistent"
    );
    service.terminate().await;
    setup.clean_up().await;
}

/// A timer's message whose target exchange does not exist (a publish there would close the
/// channel, failing the whole batch) is refused alone and retried, with the exchange in its
/// `lastError`; a timer due at the same moment is delivered and Reached at once. Once the
/// exchange exists (with a queue bound), the retry delivers the message.
async fn a_message_for_a_missing_exchange_is_retried_and_holds_back_no_other(
    case: Arc<BrokerCase>,
) {
    // Tenant `t` may send to an exchange `<events exchange>.later` (its name is fresh).
    let sections = json!({
        "engine": { "retry_base": "200ms", "retry_max": "400ms" },
        "targets": { "allow": [], "tenants": { "t": { "allow": ["*.later/*"] } } },
    });
    let setup = Setup::with_sections(&case, sections);
    let service = setup.start().await;
    let client = setup.client().await; // binds the events sink
    let config = rabbitmq_config(&setup).clone();
    let exchange = format!("{}.later", config.events_exchange);
    // Due together a moment ahead, so they are claimed and published in one batch.
    let due = now_ms() + 1_000;
    let delayed = json!({"tenantId": "t", "serviceCallId": "a-to-nowhere", "dueTimeMs": due,
        "target": {"exchange": exchange, "routingKey": "k"},
        "message": {"body": {"n": 1}}});
    let (status, v) = service.post("/v1/timers", delayed.to_string()).await;
    assert_eq!(status, 201, "{v}");
    let (status, v) = service
        .post("/v1/timers", schedule("t", "b-plain", due))
        .await;
    assert_eq!(status, 201, "{v}");
    let failing = retried(&service, "/v1/tenants/t/timers/a-to-nowhere").await;
    assert_eq!(failing["state"], "Scheduled", "{failing}");
    let error = failing["lastError"].as_str().unwrap_or("");
    assert!(
        error.contains(&exchange),
        "the exchange is named: {failing}"
    );
    let plain = wait_for(Duration::from_secs(30), || async {
        let (_, t) = service.get("/v1/tenants/t/timers/b-plain").await;
        (t["state"] == "Reached").then_some(t)
    })
    .await
    .expect("the other timer of the batch fired");
    assert_eq!(plain["attempts"], 0, "and was never refused: {plain}");
    drop(client);

    // The exchange appears, with a queue: the retry delivers the message there.
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
    use lapin::types::FieldTable;
    let queue = format!("{exchange}.q");
    let (_connection, channel) = channel_with_queue(&config, &queue, Default::default()).await;
    channel
        .exchange_declare(
            exchange.as_str().into(),
            lapin::ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("declare the exchange");
    channel
        .queue_bind(
            queue.as_str().into(),
            exchange.as_str().into(),
            "k".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind it");
    let reached = wait_for(Duration::from_secs(30), || async {
        let (_, t) = service.get("/v1/tenants/t/timers/a-to-nowhere").await;
        (t["state"] == "Reached").then_some(t)
    })
    .await;
    assert!(reached.is_some(), "delivered once the exchange exists");
    let got = channel
        .basic_get(
            queue.as_str().into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await
        .expect("basic.get")
        .expect("the message is in the queue");
    assert_eq!(got.delivery.data, br#"{"n":1}"#);
    for delete in [
        channel
            .queue_delete(queue.as_str().into(), Default::default())
            .await
            .map(|_| ()),
        channel
            .exchange_delete(exchange.as_str().into(), Default::default())
            .await,
    ] {
        delete.expect("clean up");
    }
    service.terminate().await;
    setup.clean_up().await;
}

/// The delay exchange, as a producer moving off the delayed-message plugin uses it: messages
/// published there with `x-delay` or `x-deliver-at` arrive at their time (never before) in the
/// queue their routing key names, byte for byte with their content type and headers, the
/// event id as `message_id`; one cancelled by its `message_id` never arrives (a later one
/// does); one that says no time is dead-lettered naming what is missing.
async fn a_message_sent_to_the_delay_exchange_arrives_at_its_time(case: Arc<BrokerCase>) {
    use lapin::options::{BasicGetOptions, BasicPublishOptions};
    use lapin::types::{AMQPValue, FieldTable};
    use lapin::BasicProperties;
    let setup = Setup::with_sections(&case, json!({ "targets": { "allow": ["*"] } }));
    let service = setup.start().await; // declares the delay exchange
    let client = setup.client().await;
    let config = rabbitmq_config(&setup).clone();
    let queue = format!("{}.delayed", config.events_exchange);
    let (_connection, channel) = channel_with_queue(&config, &queue, Default::default()).await;
    let body = b"hello \x00\xff delayed".to_vec();
    let publish = |id: &'static str, time: Option<(&'static str, AMQPValue)>| {
        let channel = channel.clone();
        let (queue, body, exchange) = (queue.clone(), body.clone(), config.delay_exchange.clone());
        async move {
            let mut headers = FieldTable::default();
            headers.insert("x-order".into(), AMQPValue::LongString("42".into()));
            if let Some((name, value)) = time {
                headers.insert(name.into(), value);
            }
            let properties = BasicProperties::default()
                .with_message_id(id.into())
                .with_content_type("text/plain".into())
                .with_headers(headers);
            channel
                .basic_publish(
                    exchange.as_str().into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    &body,
                    properties,
                )
                .await
                .expect("publish")
                .await
                .expect("confirm");
        }
    };
    // Due no earlier than this: m-2 at it, the others after (1.5 s and more after they were
    // sent, which is after it).
    let earliest = now_ms() + 1_500;
    let at = chrono::DateTime::from_timestamp_millis(earliest)
        .expect("a time")
        .to_rfc3339();
    publish("m-1", Some(("x-delay", AMQPValue::LongInt(1_500)))).await;
    publish(
        "m-2",
        Some(("x-deliver-at", AMQPValue::LongString(at.into()))),
    )
    .await;
    publish("m-3", Some(("x-delay", AMQPValue::LongLongInt(2_000)))).await;
    publish("m-none", None).await;
    // The producer cancels m-3 by its message id (in the tenant `broker.delay_tenant`).
    let cancel = json!({"type": "CancelTimer", "tenantId": "default", "serviceCallId": "m-3"});
    client
        .send_command(cancel.to_string().as_bytes())
        .await
        .expect("send the cancel");
    publish("m-4", Some(("x-delay", AMQPValue::LongInt(2_500)))).await;

    let got = std::sync::Mutex::new(Vec::new());
    let all = wait_for(Duration::from_secs(30), || async {
        let mut new = Vec::new();
        while let Ok(Some(m)) = channel
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
        {
            new.push((now_ms(), m));
        }
        let mut got = got.lock().ok()?;
        got.extend(new);
        (got.len() >= 3).then_some(())
    })
    .await;
    let got = got.into_inner().unwrap_or_default();
    assert!(all.is_some(), "m-1, m-2 and m-4 arrived: {}", got.len());
    for (arrived, m) in &got {
        assert_eq!(m.delivery.data, body, "byte for byte");
        let properties = &m.delivery.properties;
        assert_eq!(
            properties.content_type().as_ref().map(|c| c.as_str()),
            Some("text/plain")
        );
        let order = properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get("x-order").cloned());
        assert_eq!(
            order,
            Some(AMQPValue::LongString("42".into())),
            "its own header"
        );
        let id = properties
            .message_id()
            .as_ref()
            .map(|i| i.to_string())
            .unwrap_or_default();
        assert!(
            uuid::Uuid::parse_str(&id).is_ok(),
            "the event id as message_id: {id}"
        );
        assert!(
            *arrived >= earliest,
            "not early: {} ms before the earliest due time",
            earliest - arrived
        );
    }
    assert_eq!(
        got.len(),
        3,
        "the cancelled m-3 never arrived (m-4, due after it, did)"
    );
    delivered_cancelled_and_dead_lettered(&service, client.as_ref(), ("m-1", "m-3", "m-4")).await;
    let _ = channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await;
    service.terminate().await;
    setup.clean_up().await;
}
