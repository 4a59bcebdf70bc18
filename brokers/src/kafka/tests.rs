//! The Kafka broker on the test server (`TIMER_TEST_KAFKA_BROKERS`): what only a real
//! producer shows.

use rdkafka::bindings::{rd_kafka_resp_err_t, rd_kafka_test_fatal_error};
use rdkafka::producer::Producer as _;
use timer_core::plugin::fresh_name;
use timer_core::{Broker, OutboundEvent, TimerKey};
use uuid::Uuid;

use super::{KafkaBroker, KafkaConfig, TEST_SERVER};

/// The server's address; `None` (skipped) without one, unless `TIMER_TEST_REQUIRE=1`.
fn server() -> Option<String> {
    match TEST_SERVER.address() {
        Ok(brokers) => Some(brokers),
        Err(e) if std::env::var("TIMER_TEST_REQUIRE").is_ok_and(|v| v == "1") => {
            panic!("server required (TIMER_TEST_REQUIRE=1) but {e}")
        }
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

/// Breaks the broker's producer as a failover can break an idempotent producer's sequence: a
/// fatal error, after which librdkafka sends nothing more on it.
fn break_producer(broker: &KafkaBroker) {
    let used = broker.producer();
    // SAFETY: the handle is the live producer's (`used` holds it), the reason a C string.
    unsafe {
        rd_kafka_test_fatal_error(
            used.client().native_ptr(),
            rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER,
            c"the test broke the sequence".as_ptr(),
        );
    }
}

/// A producer that hit a fatal error sends nothing more: the next health check, or the next
/// publish that fails on it, says so and makes it anew, so the publish after goes out.
#[tokio::test]
async fn a_producer_that_hit_a_fatal_error_is_made_anew() {
    let Some(brokers) = server() else { return };
    let name = fresh_name("fatal");
    let config = KafkaConfig {
        brokers,
        group_id: name.clone(),
        commands_topic: format!("{name}.commands"),
        events_topic: format!("{name}.events"),
        dead_letter_topic: format!("{name}.dead"),
        delay_topic: format!("{name}.delay"),
        ..KafkaConfig::default()
    };
    let broker = KafkaBroker::connect(&config).await.expect("connect");
    let event = || OutboundEvent::envelope(Uuid::now_v7(), TimerKey::new("t", "x"), b"{}".to_vec());
    let sent = broker.publish(&[event()]).await.expect("publish");
    assert!(sent.is_empty(), "{sent:?}");
    // The health check finds the broken producer, says so, and makes it anew.
    break_producer(&broker);
    let unhealthy = broker.health().await.expect_err("not healthy");
    assert!(unhealthy.to_string().contains("fatal"), "{unhealthy}");
    let sent = broker.publish(&[event()]).await.expect("publish");
    assert!(sent.is_empty(), "made anew, it sends: {sent:?}");
    broker.health().await.expect("healthy again");
    // So does the first publish that fails on it.
    break_producer(&broker);
    let failed = broker.publish(&[event()]).await;
    assert!(
        failed.as_ref().map_or(true, |refused| refused.len() == 1),
        "the publish on the broken producer failed: {failed:?}"
    );
    let sent = broker.publish(&[event()]).await.expect("publish");
    assert!(sent.is_empty(), "made anew, it sends: {sent:?}");
    broker.health().await.expect("healthy again");
}
