//! What is RabbitMQ's own: an event no queue is bound to comes back to the service, which
//! retries it until one is (then it arrives persistent, routed by its tenant).

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use timer_brokers::rabbitmq::{sink_queue, RabbitmqConfig, RabbitmqTestClient};
use timer_conformance::e2e::{now_ms, schedule};
use timer_conformance::scenarios::{BrokerCase, BrokerTraits, Outage, Setup};
use timer_conformance::{checks, wait_for, Check};

pub fn traits() -> BrokerTraits {
    BrokerTraits {
        settings: json!({}),
        // Its script's clean stop; the durable queues and persistent messages come back.
        outage: Outage::Stop,
        // A publish whose confirm was lost with the connection is published again; the queue
        // keeps both (same message id).
        max_repeated: None,
        unreachable: Some((
            json!({"kind": "rabbitmq", "url": "amqp://guest:secret@127.0.0.1:{port}/%2f"}),
            "error: rabbitmq broker: cannot connect to amqp://***@127.0.0.1:{port}/%2f",
        )),
        acknowledged: None,
        no_takeover: None,
    }
}

pub fn checks() -> Vec<Check<Arc<BrokerCase>>> {
    checks![an_unroutable_event_is_retried_not_lost]
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
    let failing = wait_for(Duration::from_secs(30), || async {
        let (_, t) = service.get("/v1/tenants/t/timers/nobody-listens").await;
        (t["attempts"].as_u64()? >= 1).then_some(t)
    })
    .await
    .expect("publish attempts recorded");
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
    let config: &RabbitmqConfig = setup
        .broker
        .config
        .as_any()
        .downcast_ref()
        .expect("a rabbitmq config");
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
