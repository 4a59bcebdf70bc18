//! What is Kafka's own (against tansu, a Kafka-protocol server): the consumer group commits
//! only offsets of stored commands (told to the shared scenarios), two instances in one group
//! split the partitions, and a missing topic it may not create is named.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::{json, Value};
use timer_brokers::kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use timer_brokers::kafka::rdkafka::{Offset, TopicPartitionList};
use timer_brokers::kafka::{client_config, KafkaBroker, KafkaConfig, KafkaTestClient};
use timer_conformance::e2e::now_ms;
use timer_conformance::scenarios::{envelope, timers, BrokerCase, BrokerTraits, Setup};
use timer_conformance::{check, wait_for, Check};
use timer_core::plugin::BrokerConfig;
use timer_core::TimerKey;

pub fn traits() -> BrokerTraits {
    BrokerTraits {
        settings: json!({}),
        // The service publishes a batch again when tansu did not confirm all of it in time, and
        // Kafka keeps both copies (a consumer drops repeats by the `timer-event-id` header): at
        // most a batch in flight (`engine.batch_size`, 500) and a retry of it; measured 0.
        max_repeated: Some(1_000),
        unreachable: Some((
            json!({"kind": "kafka", "brokers": "127.0.0.1:{port}", "connect_timeout": "2s"}),
            "error: kafka broker: cannot reach 127.0.0.1:{port}",
        )),
        acknowledged: Some(committed_commands),
        // A successor joining the group gets no partitions while the killed member is still in
        // it, and tansu (its test server) does not expire that member: the commands wait for
        // good. A Kafka cluster hands them over after `session.timeout.ms`.
        no_takeover: Some("tansu 0.6.0 keeps a killed group member's partitions"),
        bound_tenant: "test",
    }
}

pub fn checks() -> Vec<Check<Arc<BrokerCase>>> {
    vec![
        check!(two_instances_in_one_group_split_the_partitions),
        check!(a_missing_topic_it_may_not_create_is_named),
        // How soon the other timer is settled is what it checks.
        check!(a_message_for_a_missing_topic_is_retried_and_holds_back_no_other).alone(),
    ]
}

fn kafka_config(config: &dyn BrokerConfig) -> KafkaConfig {
    config
        .as_any()
        .downcast_ref::<KafkaConfig>()
        .expect("a kafka config")
        .clone()
}

/// How many commands the consumer group committed: the sum of its committed offsets over the
/// command topic's partitions.
fn committed_commands(config: &dyn BrokerConfig) -> BoxFuture<'_, u64> {
    let c = kafka_config(config);
    Box::pin(async move {
        tokio::task::spawn_blocking(move || {
            let consumer: BaseConsumer = client_config(&c)
                .set("group.id", &c.group_id)
                .set("enable.auto.commit", "false")
                .create()
                .expect("a consumer in the service's group");
            let metadata = consumer
                .fetch_metadata(Some(&c.commands_topic), Duration::from_secs(10))
                .expect("metadata");
            let mut list = TopicPartitionList::new();
            for t in metadata
                .topics()
                .iter()
                .filter(|t| t.name() == c.commands_topic)
            {
                for p in t.partitions() {
                    list.add_partition(&c.commands_topic, p.id());
                }
            }
            let committed = consumer
                .committed_offsets(list, Duration::from_secs(10))
                .expect("committed offsets");
            committed
                .elements()
                .iter()
                .filter_map(|e| match e.offset() {
                    Offset::Offset(n) if n > 0 => Some(n as u64),
                    _ => None,
                })
                .sum()
        })
        .await
        .expect("committed offsets task")
    })
}

/// `n` commands keyed by their tenant (seven), as producing services would spread them over
/// the partitions; `(tenant, body)`.
fn keyed_commands(n: usize, due_from: i64, spread_ms: i64) -> Vec<(String, String)> {
    (0..n)
        .map(|i| {
            let tenant = format!("tenant-{}", i % 7);
            let body = json!({"tenantId": tenant, "serviceCallId": format!("g{i:05}"),
                              "dueTimeMs": due_from + (i as i64 * spread_ms) / n as i64});
            (tenant, body.to_string())
        })
        .collect()
}

/// Two instances, each with a store of its own, in one consumer group: each command reaches one
/// of them (a rebalance may hand a command to both: then its repeats share the event id), so
/// every timer fires and both take part.
async fn two_instances_in_one_group_split_the_partitions(case: Arc<BrokerCase>) {
    const N: usize = 2_000;
    let first = Setup::new(&case);
    let second = first.another(&case);
    let client = first.client().await;
    let a = first.start().await;
    let b = second.start().await;
    // Produce once the group settled: B has its partitions (A's were revoked and re-assigned
    // in the same rebalance).
    wait_for(Duration::from_secs(60), || async {
        (a.log_text().contains("partitions assigned")
            && b.log_text().contains("partitions assigned"))
        .then_some(())
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "both joined the group; logs:\n{}\n---\n{}",
            a.log_text(),
            b.log_text()
        )
    });
    let commands = keyed_commands(N, now_ms() + 3_000, 2_000);
    client
        .as_any()
        .downcast_ref::<KafkaTestClient>()
        .expect("the kafka test client")
        .produce_many(&commands)
        .await
        .expect("produce");
    let read = wait_for(Duration::from_secs(90), || async {
        client.events().await.ok().filter(|e| timers(e).len() >= N)
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "every timer fired; logs:\n{}\n---\n{}",
            a.log_text(),
            b.log_text()
        )
    });
    let mut per_instance = Vec::new();
    for setup in [&first, &second] {
        let store = setup.store().await;
        let mut stored = 0;
        for (tenant, body) in &commands {
            let v: Value = serde_json::from_str(body).expect("json");
            let id = v["serviceCallId"].as_str().unwrap_or_default();
            if store
                .get(&TimerKey::new(tenant.as_str(), id))
                .await
                .expect("get")
                .is_some()
            {
                stored += 1;
            }
        }
        per_instance.push(stored);
    }
    println!(
        "two instances in one group: timers stored per instance {per_instance:?}; {} events",
        read.len()
    );
    assert_eq!(timers(&read).len(), N, "every timer fired");
    let mut ids: HashMap<String, HashSet<String>> = HashMap::new();
    for e in &read {
        let v = envelope(e);
        ids.entry(timer_conformance::e2e::timer_of(&v))
            .or_default()
            .insert(v["id"].as_str().unwrap_or_default().to_owned());
    }
    assert!(
        ids.values().all(|i| i.len() == 1),
        "a timer delivered twice carries the same id"
    );
    assert!(
        per_instance.iter().all(|n| *n > 0),
        "both instances took part: {per_instance:?}"
    );
    assert!(per_instance.iter().sum::<usize>() >= N, "{per_instance:?}");
    a.terminate().await;
    b.terminate().await;
}

async fn a_missing_topic_it_may_not_create_is_named(case: Arc<BrokerCase>) {
    let setup = Setup::new(&case);
    let c = KafkaConfig {
        create_topics: false,
        ..kafka_config(setup.broker.config.as_ref())
    };
    let err = match KafkaBroker::connect(&c).await {
        Ok(_) => panic!("a missing topic with create_topics off must fail"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains(&c.commands_topic) && err.contains("broker.create_topics is off"),
        "{err}"
    );
}

/// A timer's message for a target topic that does not exist (its record would wait out the
/// delivery timeout, and its batch with it) is refused alone and retried, the topic named in
/// its `lastError`; a timer due at the same moment is delivered and Reached at once.
async fn a_message_for_a_missing_topic_is_retried_and_holds_back_no_other(case: Arc<BrokerCase>) {
    // Tenant `t` may send to a topic `<events topic>-nowhere` (its name is fresh).
    let sections = json!({
        "engine": { "retry_base": "200ms", "retry_max": "400ms" },
        "targets": { "allow": [], "tenants": { "t": { "allow": ["*-nowhere"] } } },
    });
    let setup = Setup::with_sections(&case, sections);
    let service = setup.start().await;
    let topic = format!(
        "{}-nowhere",
        kafka_config(setup.broker.config.as_ref()).events_topic
    );
    // Due together a moment ahead, so they are claimed and published in one batch.
    let due = now_ms() + 1_000;
    let delayed = json!({"tenantId": "t", "serviceCallId": "a-to-nowhere", "dueTimeMs": due,
        "target": {"topic": topic}, "message": {"body": {"n": 1}}});
    let (status, v) = service.post("/v1/timers", delayed.to_string()).await;
    assert_eq!(status, 201, "{v}");
    let plain = json!({"tenantId": "t", "serviceCallId": "b-plain", "dueTimeMs": due});
    let (status, v) = service.post("/v1/timers", plain.to_string()).await;
    assert_eq!(status, 201, "{v}");
    let failing = wait_for(Duration::from_secs(30), || async {
        let (_, t) = service.get("/v1/tenants/t/timers/a-to-nowhere").await;
        (t["attempts"].as_u64()? >= 1).then_some(t)
    })
    .await
    .expect("a failed publish recorded");
    assert_eq!(failing["state"], "Scheduled", "{failing}");
    let error = failing["lastError"].as_str().unwrap_or("");
    assert!(error.contains(&topic), "the topic is named: {failing}");
    let plain = wait_for(Duration::from_secs(30), || async {
        let (_, t) = service.get("/v1/tenants/t/timers/b-plain").await;
        (t["state"] == "Reached").then_some(t)
    })
    .await
    .expect("the other timer of the batch fired");
    // Settled soon after its due time, not held back by the record for the missing topic
    // (were it sent, its batch would wait for its delivery report: the producer's timeouts,
    // seconds). Its `reachedAt` is stamped before the publish, so the time it was seen
    // settled is what tells.
    let settled_late = now_ms() - due;
    assert_eq!(plain["attempts"], 0, "never refused: {plain}");
    assert!(
        settled_late < 3_000,
        "the other timer was settled {settled_late} ms after its due time: {plain}"
    );
    service.terminate().await;
    setup.clean_up().await;
}
