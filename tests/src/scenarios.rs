//! End-to-end scenarios every broker plugin passes, on the built `timer-service` binary: a
//! malformed command is dead-lettered while the events keep flowing; an unreachable server is a
//! one-line error; `PauseTimer` and `ResumeTimer` hold a timer back and let it go; a service
//! killed during ingest loses no command (on every durable store); 10,000 timers survive a
//! service restart during ingest and a server outage while they fire; a tenant flooding at 10
//! times its rate limit is slowed without holding up another; a series with `overlap: skip`
//! fires only after each `TimerCompleted`.
//!
//! Like the conformance suite, each scenario is an async check function; [`trials`] runs them
//! for one broker plugin. The service gets fresh resources from the plugin's `isolated` config,
//! written with a store section to a TOML file (`TIMER_CONFIG`); the test sends commands and
//! reads events and dead letters with the plugin's [`TestClient`], and takes the server down
//! with the script its [`TestServer`](timer_core::plugin::TestServer) names. What differs
//! between brokers is data in [`BrokerTraits`].

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::{json, Value};
use timer_core::plugin::{
    BrokerConfig, Isolated, ReadDeadLetter, ReadEvent, StoreConfig, TestClient,
};
use timer_core::{BrokerPlugin, Store, StorePlugin};

use crate::e2e::{
    due_ms, free_addr, lateness_ms, metric, now_ms, percentiles, refused_to_run, schedule,
    write_config, EventLog, ScriptedServer, Service,
};
use crate::{server_trial, wait_for, Check};

/// One broker under test, and the store the service keeps its timers in.
#[derive(Clone)]
pub struct BrokerCase {
    pub plugin: &'static BrokerPlugin,
    pub store: &'static StorePlugin,
    /// The `timer-service` binary under test.
    pub bin: PathBuf,
    pub traits: BrokerTraits,
}

/// What differs between brokers in these scenarios. Where a broker can promise more than the
/// others, its bound is here, not a weaker one for all.
#[derive(Clone)]
pub struct BrokerTraits {
    /// `[broker]` keys the service gets on top of the isolated config.
    pub settings: Value,
    /// How the outage scenario takes the server down.
    pub outage: Outage,
    /// Timers whose event may arrive more than once (always with the same id) after a server
    /// outage; `None`: no bound beyond the same id.
    pub max_repeated: Option<usize>,
    /// A `[broker]` section pointing at a closed port, and how the last line of `run` must
    /// start; `{port}` in them stands for the port. The address carries the password `secret`
    /// where it can: it must not be shown.
    pub unreachable: Option<(Value, &'static str)>,
    /// How many commands the service's consumer has acknowledged to the broker, where the
    /// broker tells (Kafka: the group's committed offsets). They must all be stored.
    pub acknowledged: Option<for<'a> fn(&'a dyn BrokerConfig) -> BoxFuture<'a, u64>>,
    /// Why the test server cannot hand a killed consumer's commands to its successor, where it
    /// cannot: the ingest-kill scenario is left out, saying so.
    pub no_takeover: Option<&'static str>,
    /// The tenant the broker binds its test client's commands to with `broker.bind_tenant`
    /// (the NATS subject's last token, the Kafka key, the RabbitMQ user).
    pub bound_tenant: &'static str,
}

impl Default for BrokerTraits {
    fn default() -> Self {
        BrokerTraits {
            settings: json!({}),
            outage: Outage::Kill,
            max_repeated: Some(0),
            unreachable: None,
            acknowledged: None,
            no_takeover: None,
            bound_tenant: "test",
        }
    }
}

/// How a scenario takes a test server down before starting it again.
#[derive(Clone, Copy, Debug)]
pub enum Outage {
    /// SIGKILL, by the pid its script recorded: the crash.
    Kill,
    /// Its script's `stop`: a clean shutdown.
    Stop,
}

/// Every scenario as a trial for `case.plugin`, named `brokers::<kind>::<scenario>`, and the
/// broker's `own` checks after them: the scenarios through the service's HTTP API for a broker
/// inside the service, all of them for a broker with a server (the ingest kill on every durable
/// store of `stores`). A trial whose server is not there is ignored with the reason.
pub fn trials(
    case: BrokerCase,
    stores: &[&'static StorePlugin],
    own: Vec<Check<Arc<BrokerCase>>>,
) -> Vec<libtest_mimic::Trial> {
    let kind = case.plugin.kind;
    let Some(server) = case.plugin.test_server else {
        let mut checks: Vec<Check<Arc<BrokerCase>>> = crate::checks![
            malformed_command_is_dead_lettered_and_events_keep_flowing,
            pause_and_resume_commands_hold_a_timer_back_and_let_it_go,
            a_flooding_tenant_is_slowed_and_the_others_are_not,
            an_overlap_skip_series_fires_after_each_completion,
        ];
        checks.extend(own);
        return to_trials(&format!("brokers::{kind}"), &Arc::new(case), None, checks);
    };
    let missing = ScriptedServer::of(&server).err();
    let mut checks = crate::checks![
        malformed_command_is_dead_lettered_and_events_keep_flowing,
        pause_and_resume_commands_hold_a_timer_back_and_let_it_go,
        a_flooding_tenant_is_slowed_and_the_others_are_not,
        an_overlap_skip_series_fires_after_each_completion,
        an_unreachable_server_is_a_one_line_error,
        ten_thousand_timers_survive_a_service_restart_and_a_server_outage,
        a_bound_broker_takes_commands_of_its_tenant_only,
    ];
    checks.extend(own);
    let mut trials = to_trials(
        &format!("brokers::{kind}"),
        &Arc::new(case.clone()),
        missing.clone(),
        checks,
    );
    if let Some(why) = case.traits.no_takeover {
        eprintln!("brokers::{kind}: service_killed_during_ingest_loses_no_command left out: {why}");
        return trials;
    }
    for store in stores {
        let case = Arc::new(BrokerCase {
            store,
            ..case.clone()
        });
        trials.extend(to_trials(
            &format!("brokers::{kind}::on_{}", store.kind),
            &case,
            missing.clone().or_else(|| store.unavailable()),
            crate::checks![service_killed_during_ingest_loses_no_command],
        ));
    }
    trials
}

fn to_trials(
    prefix: &str,
    case: &Arc<BrokerCase>,
    missing: Option<String>,
    checks: Vec<Check<Arc<BrokerCase>>>,
) -> Vec<libtest_mimic::Trial> {
    checks
        .into_iter()
        .map(|check| {
            let case = case.clone();
            server_trial(
                &format!("{prefix}::{}", check.name),
                missing.clone(),
                move || (check.run)(case),
            )
        })
        .collect()
}

const WAIT: Duration = Duration::from_secs(60);

/// One scenario's service: fresh broker resources and store, and a config file naming them.
pub struct Setup {
    bin: PathBuf,
    pub broker: Arc<Isolated<dyn BrokerConfig>>,
    /// The `[broker]` section the service reads.
    section: Value,
    /// The other sections (`engine`, `limits`).
    sections: Value,
    pub store: Isolated<dyn StoreConfig>,
    pub dir: tempfile::TempDir,
    env: Vec<(&'static str, String)>,
}

impl Setup {
    /// Fresh resources for `case`, with the engine polling every second and retrying within
    /// two seconds.
    pub fn new(case: &BrokerCase) -> Setup {
        Self::with_engine(case, json!({}))
    }

    /// [`new`](Self::new) with `[engine]` keys of the test's own on top.
    pub fn with_engine(case: &BrokerCase, engine: Value) -> Setup {
        Self::with_sections(case, json!({ "engine": engine }))
    }

    /// [`new`](Self::new) with sections of the test's own (`engine` keys on top of the
    /// scenarios' ones, `limits`).
    pub fn with_sections(case: &BrokerCase, mut sections: Value) -> Setup {
        let broker = (case.plugin.isolated)("e2e").expect("isolated broker resources");
        let mut section = broker.config.to_value().expect("the broker section");
        merge(&mut section, &case.traits.settings);
        let mut engine = json!({ "retry_max": "2s", "poll_interval": "1s" });
        merge(&mut engine, &sections["engine"]);
        sections["engine"] = engine;
        Self::instance(case, Arc::new(broker), section, sections)
    }

    /// Another instance on the same broker resources, with a store of its own.
    pub fn another(&self, case: &BrokerCase) -> Setup {
        Self::instance(
            case,
            self.broker.clone(),
            self.section.clone(),
            self.sections.clone(),
        )
    }

    fn instance(
        case: &BrokerCase,
        broker: Arc<Isolated<dyn BrokerConfig>>,
        section: Value,
        sections: Value,
    ) -> Setup {
        let store = (case.store.isolated)("e2e").expect("an isolated store");
        let dir = tempfile::tempdir().expect("tempdir");
        let mut setup = Setup {
            bin: case.bin.clone(),
            broker,
            section,
            sections,
            store,
            dir,
            env: Vec::new(),
        };
        setup.write();
        setup
    }

    /// Writes the config file the service reads.
    fn write(&mut self) {
        let mut config = json!({
            "store": self.store.config.to_value().expect("the store section"),
            "broker": self.section,
        });
        merge(&mut config, &self.sections);
        let path = write_config(self.dir.path(), &config);
        self.env = vec![("TIMER_CONFIG", path.display().to_string())];
    }

    /// The service reads `value` as `key` of its `[broker]` section (the address of a proxy in
    /// front of the server); the test's clients reach the server as before.
    pub fn with_broker_key(mut self, key: &str, value: Value) -> Setup {
        self.section[key] = value;
        self.write();
        self
    }

    /// Starts the service on this setup and waits until it is ready.
    pub async fn start(&self) -> Service {
        Service::start(&self.bin, self.dir.path(), &self.env).await
    }

    /// For a broker with a server, an independent client on its resources, made before the
    /// service starts: it makes the resources (and, on RabbitMQ, a queue for the events). None
    /// for a broker inside the service.
    pub async fn client_if_served(&self, plugin: &BrokerPlugin) -> Option<Arc<dyn TestClient>> {
        match plugin.test_server {
            Some(_) => Some(self.client().await),
            None => None,
        }
    }

    /// An independent client on the broker resources (created when missing).
    pub async fn client(&self) -> Arc<dyn TestClient> {
        self.broker
            .config
            .test_client()
            .await
            .expect("a test client")
    }

    /// A handle on the service's store beside it, to count with.
    pub async fn store(&self) -> Arc<dyn Store> {
        self.store.config.attach().await.expect("open the store")
    }

    /// Removes what the broker created, where it can.
    pub async fn clean_up(self) {
        let _ = self.broker.config.clean_up().await;
        let _ = self.store.config.clean_up().await;
    }
}

/// `extra`'s keys over `value`'s (both JSON objects).
fn merge(value: &mut Value, extra: &Value) {
    if let (Some(value), Some(extra)) = (value.as_object_mut(), extra.as_object()) {
        value.extend(extra.clone());
    }
}

/// Where a scenario sends commands and reads what the service published: an independent
/// client of the broker's server, or the service's HTTP API for a broker inside the service
/// (`POST /v1/commands`, `/v1/events`, `/v1/dead-letters`).
enum Access<'a> {
    Client(Arc<dyn TestClient>),
    Http(&'a Service, EventLog),
}

impl<'a> Access<'a> {
    /// Through `client` when the broker has a server ([`Setup::client_if_served`]), else
    /// through `service`'s HTTP API.
    async fn of(client: Option<Arc<dyn TestClient>>, service: &'a Service) -> Access<'a> {
        match client {
            Some(client) => Access::Client(client),
            None => Access::Http(service, service.events().await),
        }
    }

    async fn send(&self, body: &str) {
        match self {
            Access::Client(client) => client.send_command(body.as_bytes()).await.expect("send"),
            Access::Http(service, _) => {
                let (status, v) = service.post("/v1/commands", body).await;
                assert_eq!(status, 202, "{v}");
            }
        }
    }

    async fn events(&self) -> Option<Vec<ReadEvent>> {
        match self {
            Access::Client(client) => client.events().await.ok(),
            Access::Http(_, log) => log
                .snapshot()
                .into_iter()
                .map(|e| {
                    Some(ReadEvent {
                        id: e.envelope["id"].as_str()?.parse().ok()?,
                        body: e.envelope.to_string().into_bytes(),
                    })
                })
                .collect(),
        }
    }

    async fn dead_letters(&self) -> Option<Vec<ReadDeadLetter>> {
        match self {
            Access::Client(client) => client.dead_letters().await.ok(),
            Access::Http(service, _) => {
                let (_, v) = service.get("/v1/dead-letters").await;
                v["deadLetters"]
                    .as_array()?
                    .iter()
                    .map(|l| {
                        Some(ReadDeadLetter {
                            body: l["body"].as_str()?.as_bytes().to_vec(),
                            reason: l["reason"].as_str()?.to_owned(),
                        })
                    })
                    .collect()
            }
        }
    }
}

/// An event's body as JSON.
pub fn envelope(event: &ReadEvent) -> Value {
    serde_json::from_slice(&event.body).expect("an event is JSON")
}

/// The distinct timers among `events`.
pub fn timers(events: &[ReadEvent]) -> HashSet<String> {
    events
        .iter()
        .filter_map(|e| serde_json::from_slice::<Value>(&e.body).ok())
        .map(|v| crate::e2e::timer_of(&v))
        .collect()
}

/// `n` commands `<prefix>00000`, ... of tenants `tenant-0` to `tenant-<tenants - 1>`, due evenly
/// over `spread_ms` from `due_from`.
pub fn commands(
    prefix: &str,
    n: usize,
    tenants: usize,
    due_from: i64,
    spread_ms: i64,
) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| {
            let tenant = format!("tenant-{}", i % tenants);
            schedule(
                &tenant,
                &format!("{prefix}{i:05}"),
                due_from + (i as i64 * spread_ms) / n as i64,
            )
            .into_bytes()
        })
        .collect()
}

/// Waits until `store` holds at least `n` pending timers; how many, or `None` at the deadline.
async fn stored(store: &dyn Store, n: usize) -> Option<u64> {
    wait_for(WAIT, || async {
        let pending = store.scheduled_count().await.ok()?;
        (pending >= n as u64).then_some(pending)
    })
    .await
}

/// Commands the service must dead-letter, with how their reasons start.
const MALFORMED: [(&str, &str); 4] = [
    ("{not json", "invalid_json"),
    (
        r#"{"tenantId":"t","dueTimeMs":1}"#,
        "serviceCallId (missing_field)",
    ),
    (r#"{"type":"Nope","tenantId":"t"}"#, "type (unknown_type)"),
    (
        r#"{"tenantId":"t","serviceCallId":"c","dueAt":"yesterday"}"#,
        "dueAt (invalid_time)",
    ),
];

/// Malformed commands land on the dead-letter destination with their reason, and the command
/// after them fires, its event carrying the envelope id.
pub async fn malformed_command_is_dead_lettered_and_events_keep_flowing(case: Arc<BrokerCase>) {
    let setup = Setup::new(&case);
    let client = setup.client_if_served(case.plugin).await;
    let service = setup.start().await;
    let access = Access::of(client, &service).await;
    for (body, _) in MALFORMED {
        access.send(body).await;
    }
    access.send(&schedule("t", "after-bad", now_ms())).await;
    let events = wait_for(WAIT, || async {
        access.events().await.filter(|e| !e.is_empty())
    })
    .await
    .unwrap_or_else(|| service.fail("the good command fired"));
    let v = envelope(&events[0]);
    assert_eq!(v["aggregateId"], "after-bad");
    assert_eq!(
        v["id"].as_str(),
        Some(events[0].id.to_string().as_str()),
        "the broker carries the envelope id"
    );
    let letters = wait_for(WAIT, || async {
        access
            .dead_letters()
            .await
            .filter(|l| l.len() >= MALFORMED.len())
    })
    .await
    .unwrap_or_else(|| service.fail("dead letters"));
    for (body, reason) in MALFORMED {
        assert!(
            letters
                .iter()
                .any(|l| l.body == body.as_bytes() && l.reason.starts_with(reason)),
            "{body} dead-lettered with {reason}: {letters:?}"
        );
    }
    drop(access);
    service.terminate().await;
    setup.clean_up().await;
}

/// `broker.bind_tenant`: the broker's own addressing (the subject, the key, the user) names the
/// tenant, so a producer allowed to send for one tenant cannot schedule, nor cancel, another
/// tenant's timers: such commands are dead-lettered (`invalid_id`, naming the key) and the
/// ones of its own tenant are applied.
pub async fn a_bound_broker_takes_commands_of_its_tenant_only(case: Arc<BrokerCase>) {
    let own = case.traits.bound_tenant;
    let setup = Setup::new(&case).with_broker_key("bind_tenant", json!(true));
    let client = setup.client().await;
    let service = setup.start().await;
    let far = now_ms() + 3_600_000;
    let (status, v) = service
        .post("/v1/timers", schedule("victim", "kept", far))
        .await;
    assert_eq!(status, 201, "{v}");
    let cancel = json!({"type": "CancelTimer", "tenantId": "victim", "serviceCallId": "kept"});
    let bodies = [
        schedule("victim", "planted", now_ms()),
        cancel.to_string(),
        schedule(own, "mine", now_ms()),
    ];
    let bodies: Vec<Vec<u8>> = bodies.iter().map(|b| b.clone().into_bytes()).collect();
    client.send_commands(&bodies).await.expect("send");
    let fired = wait_for(WAIT, || async {
        let events = client.events().await.ok()?;
        events
            .iter()
            .map(envelope)
            .find(|v| v["aggregateId"] == "mine")
    })
    .await
    .unwrap_or_else(|| service.fail("the command of its own tenant fired"));
    assert_eq!(fired["tenantId"], own);
    let letters = wait_for(WAIT, || async {
        client.dead_letters().await.ok().filter(|l| l.len() >= 2)
    })
    .await
    .unwrap_or_else(|| service.fail("both commands of another tenant are dead-lettered"));
    for letter in &letters {
        assert!(
            letter.reason.starts_with("tenantId (invalid_id)")
                && letter.reason.contains("broker.bind_tenant"),
            "{}",
            letter.reason
        );
    }
    let (_, kept) = service.get("/v1/tenants/victim/timers/kept").await;
    assert_eq!(kept["state"], "Scheduled", "not cancelled: {kept}");
    let (status, _) = service.get("/v1/tenants/victim/timers/planted").await;
    assert_eq!(status, 404, "not scheduled");
    service.terminate().await;
    setup.clean_up().await;
}

/// A tenant flooding the broker at 10 times its rate limit is slowed, not refused: its commands
/// are held back and applied at its rate, every one in the end, and the broker is not asked to
/// deliver them again meanwhile. Another tenant under the same limit, sending steadily
/// meanwhile, is not held behind them: its timers fire on time (lateness p99 at most 50 ms).
/// The timers are kept in the memory store, so that the disk's latency is not measured.
pub async fn a_flooding_tenant_is_slowed_and_the_others_are_not(case: Arc<BrokerCase>) {
    const RATE: usize = 50;
    /// 10 × RATE within a second: 100 rounds of 5 sent together, one round every 10 ms.
    const FLOOD: usize = 10 * RATE;
    const ROUND: usize = 5;
    /// One every 50 ms (20/s, under RATE) while the flood drains (about 9 s).
    const STEADY: usize = 180;
    // What is measured is the engine keeping tenants apart, not the disk: on SQLite, a busy
    // disk alone (another process writing 7.5 GB, as a build's writeback does on a fresh CI
    // machine) made steady fires 650 ms late with a sync per commit and 280 ms without (writes
    // into a full page cache wait too); on the memory store 3 ms under the same load.
    let case = BrokerCase {
        store: timer_stores::PLUGINS
            .get("memory")
            .expect("the conformance crate builds the memory store"),
        ..(*case).clone()
    };
    let setup = Setup::with_sections(
        &case,
        json!({ "limits": { "rate": { "schedules_per_second": RATE, "burst": RATE } } }),
    );
    let client = setup.client_if_served(case.plugin).await;
    let service = setup.start().await;
    let access = Access::of(client, &service).await;
    let to = &access;
    let flood = async {
        let started = now_ms();
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        for round in 0..FLOOD / ROUND {
            tick.tick().await;
            let sends = (0..ROUND).map(|i| {
                let id = format!("f{:04}", round * ROUND + i);
                async move { to.send(&schedule("flooder", &id, now_ms())).await }
            });
            futures::future::join_all(sends).await;
        }
        now_ms() - started
    };
    let steady = async {
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        for i in 0..STEADY {
            tick.tick().await;
            let body = schedule("steady", &format!("s{i:04}"), now_ms() + 250);
            to.send(&body).await;
        }
    };
    let (flood_ms, ()) = tokio::join!(flood, steady);
    let all = wait_for(WAIT, || async {
        let events = access.events().await?;
        (timers(&events).len() >= FLOOD + STEADY).then_some(events)
    })
    .await;
    let Some(events) = all else {
        let fired = access.events().await.map_or(0, |e| timers(&e).len());
        service.fail(format_args!(
            "every command of both tenants fired: {fired} of {}",
            FLOOD + STEADY
        ))
    };
    // The first event of each timer: its fire time and lateness.
    let mut first: HashMap<String, Value> = HashMap::new();
    for event in &events {
        let v = envelope(event);
        first.entry(crate::e2e::timer_of(&v)).or_insert(v);
    }
    let of = |tenant: &str| -> Vec<&Value> {
        first.values().filter(|v| v["tenantId"] == tenant).collect()
    };
    let steady = of("steady");
    let (p50, p99, max) = percentiles(steady.iter().map(|v| lateness_ms(v)).collect());
    let fired_at: Vec<i64> = of("flooder")
        .iter()
        .filter_map(|v| v["timestampMs"].as_i64())
        .collect();
    let span = fired_at.iter().max().unwrap_or(&0) - fired_at.iter().min().unwrap_or(&0);
    let metrics = service.text("/metrics").await;
    let received = metric(&metrics, "timer_commands_received");
    let throttled = metric(&metrics, "timer_commands_throttled{path=\"broker\"}");
    eprintln!(
        "{}: flood of {FLOOD} sent in {flood_ms} ms, its fires spread over {span} ms; \
         steady tenant lateness p50 {p50} ms, p99 {p99} ms, max {max} ms; {throttled} held, \
         {received} received",
        case.plugin.kind
    );
    assert!(
        p99 <= 50,
        "the steady tenant's timers fire on time while the flood is held back: p99 {p99} ms"
    );
    // 500 schedules at 50/s with a burst of 50 take at least 9 s to get through.
    assert!(
        span >= 7_000,
        "the flooding tenant is held to its rate: its {FLOOD} timers fired within {span} ms"
    );
    assert!(
        throttled >= (FLOOD / 2) as f64,
        "most of the flood was held back: {throttled}"
    );
    assert_eq!(
        received,
        (FLOOD + STEADY) as f64,
        "no held command was delivered again (the broker was asked to keep them)"
    );
    drop(access);
    service.terminate().await;
    setup.clean_up().await;
}

/// A `PauseTimer` on the broker holds its timer back while a neighbour due at the same time
/// fires; a `ResumeTimer` lets it fire at once (its due time passed); its history shows each
/// step.
pub async fn pause_and_resume_commands_hold_a_timer_back_and_let_it_go(case: Arc<BrokerCase>) {
    let setup = Setup::new(&case);
    let client = setup.client_if_served(case.plugin).await;
    let service = setup.start().await;
    let access = Access::of(client, &service).await;
    let fired = |id: &'static str| {
        let access = &access;
        move || async move {
            access
                .events()
                .await
                .filter(|events| events.iter().any(|e| envelope(e)["aggregateId"] == id))
        }
    };
    // Commands travel in order: the pause comes right after its timer, long before it is due.
    let due = now_ms() + 3_000;
    access.send(&schedule("t", "held", due)).await;
    access
        .send(r#"{"type":"PauseTimer","tenantId":"t","serviceCallId":"held"}"#)
        .await;
    access.send(&schedule("t", "neighbour", due)).await;
    let events = wait_for(WAIT, fired("neighbour"))
        .await
        .unwrap_or_else(|| service.fail("the neighbour fired"));
    assert!(
        !events.iter().any(|e| envelope(e)["aggregateId"] == "held"),
        "a paused timer does not fire"
    );
    let (_, held) = service.get("/v1/tenants/t/timers/held").await;
    assert_eq!(held["state"], "Paused", "{held}");
    access
        .send(r#"{"type":"ResumeTimer","tenantId":"t","serviceCallId":"held"}"#)
        .await;
    wait_for(WAIT, fired("held"))
        .await
        .unwrap_or_else(|| service.fail("the resumed timer fired"));
    // The history records the fire when it is settled, just after the broker confirmed it.
    let want = ["created", "paused", "resumed", "fired"];
    let history = wait_for(WAIT, || async {
        let (_, history) = service.get("/v1/tenants/t/timers/held/history").await;
        let types: Vec<String> = history["history"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e["type"].as_str().map(str::to_owned))
            .collect();
        (types == want).then_some(())
    })
    .await;
    if history.is_none() {
        let (_, history) = service.get("/v1/tenants/t/timers/held/history").await;
        service.fail(format!("the history is {want:?}: {history}"));
    }
    drop(access);
    service.terminate().await;
    setup.clean_up().await;
}

/// A history entry's time, epoch ms.
fn at_ms(entry: &Value) -> i64 {
    entry["at"]
        .as_str()
        .and_then(|at| chrono::DateTime::parse_from_rfc3339(at).ok())
        .map(|at| at.timestamp_millis())
        .unwrap_or_else(|| panic!("a history entry has its time: {entry}"))
}

/// A `*/1 * * * * *` series with `overlap: skip` whose consumer completes each occurrence 2.5 s
/// after its event (a `TimerCompleted` on the broker; the second one through `POST
/// …/complete`): every fire waits for the previous one's completion, so the series fires every
/// third second and skips the two occurrences between. Checked exactly against the history: each
/// fire is the first occurrence after the previous completion, and every occurrence between is
/// a `skipped` entry with reason `overlap`.
pub async fn an_overlap_skip_series_fires_after_each_completion(case: Arc<BrokerCase>) {
    const FIRES: i64 = 4;
    const WORK_MS: i64 = 2_500;
    let setup = Setup::new(&case);
    let client = setup.client_if_served(case.plugin).await;
    let service = setup.start().await;
    let access = Access::of(client, &service).await;
    let schedule = json!({"tenantId": "t", "serviceCallId": "work", "cron": "*/1 * * * * *",
                          "overlap": "skip", "completionTimeout": "30s"});
    access.send(&schedule.to_string()).await;
    let mut fires: Vec<Value> = Vec::new();
    for n in 1..=FIRES {
        let fire = wait_for(WAIT, || async {
            access
                .events()
                .await?
                .iter()
                .map(envelope)
                .find(|e| e["aggregateId"] == "work" && e["payload"]["occurrence"] == n)
        })
        .await
        .unwrap_or_else(|| service.fail(format!("occurrence {n} fired")));
        if n == FIRES {
            fires.push(fire);
            break;
        }
        // The consumer's work takes 2.5 s from the fire (the scenario, not a wait for a
        // condition).
        let done_at = fire["timestampMs"].as_i64().unwrap_or_else(now_ms) + WORK_MS;
        let left = u64::try_from(done_at - now_ms()).unwrap_or(0);
        tokio::time::sleep(Duration::from_millis(left)).await;
        if n == 2 {
            let body = json!({"occurrence": n, "outcome": "succeeded", "message": "by http"});
            let (status, answer) = service
                .post("/v1/tenants/t/timers/work/complete", body.to_string())
                .await;
            assert_eq!(status, 200, "{answer}");
            assert_eq!(answer["outcome"], "completed", "{answer}");
        } else {
            let completed = json!({"type": "TimerCompleted", "tenantId": "t",
                                   "serviceCallId": "work", "occurrence": n});
            access.send(&completed.to_string()).await;
        }
        fires.push(fire);
    }
    let (_, timer) = service.get("/v1/tenants/t/timers/work").await;
    let (status, cancelled) = service.delete("/v1/tenants/t/timers/work").await;
    assert_eq!(status, 200, "{cancelled}");
    let (_, history) = service
        .get("/v1/tenants/t/timers/work/history?limit=1000")
        .await;
    let history: Vec<Value> = history["history"].as_array().cloned().unwrap_or_default();
    drop(access);
    service.terminate().await;

    // Between two fires: the completion of the first, and one `skipped` entry per occurrence
    // that came due before it.
    let fired: Vec<usize> = (0..history.len())
        .filter(|i| history[*i]["type"] == "fired")
        .collect();
    assert!(
        fired.len() >= FIRES as usize,
        "{FIRES} fires in the history: {history:?}"
    );
    let dues: Vec<i64> = fires.iter().map(due_ms).collect();
    let mut skipped_total = 0;
    for (k, pair) in fired.windows(2).take(FIRES as usize - 1).enumerate() {
        let between = &history[pair[0] + 1..pair[1]];
        let completions: Vec<&Value> = between
            .iter()
            .filter(|e| e["type"] == "completed")
            .collect();
        assert_eq!(
            completions.len(),
            1,
            "one completion between fires: {between:?}"
        );
        let completion = completions[0];
        assert_eq!(completion["occurrence"], k + 1, "{completion}");
        let took = completion["durationMs"].as_i64().unwrap_or(0);
        assert!(took >= WORK_MS, "the work took 2.5 s or more: {completion}");
        let completed_at = at_ms(completion);
        // The first occurrence (a whole second) after the completion fires next.
        let expected = (completed_at / 1_000 + 1) * 1_000;
        assert_eq!(
            dues[k + 1],
            expected,
            "occurrence {} is the first one after the completion at {completed_at}: {between:?}",
            k + 2
        );
        let skips: Vec<&Value> = between.iter().filter(|e| e["type"] == "skipped").collect();
        let skipped: i64 = skips.iter().map(|e| e["count"].as_i64().unwrap_or(0)).sum();
        assert!(
            skips.iter().all(|e| e["reason"] == "overlap"),
            "skipped for overlap: {skips:?}"
        );
        assert_eq!(
            skipped,
            (dues[k + 1] - dues[k]) / 1_000 - 1,
            "every occurrence between two fires is skipped: {between:?}"
        );
        skipped_total += skipped;
    }
    let counts = &timer["work"]["counts"];
    assert_eq!(counts["skippedOverlap"], skipped_total, "{timer}");
    assert_eq!(counts["completed"], FIRES - 1, "{timer}");
    assert_eq!(timer["work"]["awaiting"]["occurrence"], FIRES, "{timer}");
    assert_eq!(timer["policy"]["overlap"], "skip", "{timer}");
    assert_eq!(timer["policy"]["completionTimeoutMs"], 30_000, "{timer}");
    let gaps: Vec<i64> = dues.windows(2).map(|d| d[1] - d[0]).collect();
    println!(
        "overlap skip, work 2.5 s: fires {gaps:?} ms apart, {skipped_total} occurrences skipped"
    );
    setup.clean_up().await;
}

/// `run` against a server nobody listens on exits 1 with one line naming the address, never
/// its password.
pub async fn an_unreachable_server_is_a_one_line_error(case: Arc<BrokerCase>) {
    let kind = case.plugin.kind;
    let (broker, expected) = case.traits.unreachable.as_ref().unwrap_or_else(|| {
        panic!("no unreachable-server settings for the {kind} broker in its BrokerTraits")
    });
    let port = free_addr().port().to_string();
    let broker: Value = serde_json::from_str(&broker.to_string().replace("{port}", &port))
        .expect("the section with the port");
    let expected = expected.replace("{port}", &port);
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write_config(
        dir.path(),
        &json!({ "store": { "kind": "memory" }, "broker": broker }),
    );
    let exit = refused_to_run(
        &case.bin,
        &["run"],
        dir.path(),
        &[("TIMER_CONFIG", config.display().to_string())],
    )
    .await;
    let err = &exit.stderr;
    assert!(exit.last_line().starts_with(&expected), "{err}");
    assert!(!err.contains("secret"), "no password in the output: {err}");
}

/// kill -9 of the service while it ingests: commands it had not acknowledged come back from
/// the broker after the restart; every acknowledged one was committed first.
pub async fn service_killed_during_ingest_loses_no_command(case: Arc<BrokerCase>) {
    const N: usize = 10_000;
    let setup = Setup::new(&case);
    let store = setup.store().await;
    let client = setup.client().await;
    let service = setup.start().await;
    let bodies = commands("i", N, 1, now_ms() + 20_000, 2_000);
    // Sent while the kill is prepared: ingest keeps pace with sending on some brokers.
    let sending = {
        let client = client.clone();
        tokio::spawn(async move { client.send_commands(&bodies).await })
    };
    let mid = stored(store.as_ref(), 1)
        .await
        .unwrap_or_else(|| service.fail("ingest started"));
    service.kill9().await;
    let stored_at_kill = store.scheduled_count().await.expect("pending");
    println!(
        "killed the service ({} store) during ingest: {mid} stored when seen, {stored_at_kill} \
         after the kill",
        case.store.kind
    );
    assert!(
        stored_at_kill < N as u64,
        "the kill came before ingest finished"
    );
    sending.await.expect("send task").expect("send");
    let service = setup.start().await;
    if stored(store.as_ref(), N).await.is_none() {
        service.fail("every command stored after the restart");
    }
    let fired = wait_for(Duration::from_secs(90), || async {
        client.events().await.ok().filter(|e| timers(e).len() >= N)
    })
    .await;
    assert!(fired.is_some(), "every timer fired");
    service.terminate().await;
    setup.clean_up().await;
}

/// 10,000 timers: the service is stopped (SIGTERM) while it stores the first half and started
/// again after the second half was sent, so it resumes from what it acknowledged; then the
/// server goes down and comes back while they fire. Every timer fires; an event that arrives
/// twice carries the same id.
pub async fn ten_thousand_timers_survive_a_service_restart_and_a_server_outage(
    case: Arc<BrokerCase>,
) {
    const N: usize = 10_000;
    let setup = Setup::new(&case);
    let store = setup.store().await;
    let client = setup.client().await;
    // Far enough out that two service starts and all sends come first on a slow box.
    let all = commands("n", N, 7, now_ms() + 30_000, 6_000);
    let service = setup.start().await;
    client.send_commands(&all[..N / 2]).await.expect("send");
    if stored(store.as_ref(), 1).await.is_none() {
        service.fail("ingest started");
    }
    assert_eq!(service.terminate().await, Some(0), "a clean stop");
    let stored_at_stop = store.scheduled_count().await.expect("pending");
    let acknowledged = match case.traits.acknowledged {
        Some(acknowledged) => {
            let n = acknowledged(setup.broker.config.as_ref()).await;
            assert!(
                n > 0 && n <= stored_at_stop,
                "acknowledged commands ({n}) are stored ones only ({stored_at_stop} stored)"
            );
            n.to_string()
        }
        None => "not told".to_owned(),
    };
    // The second half while it is down; it resumes from what it acknowledged.
    client.send_commands(&all[N / 2..]).await.expect("send");
    let service = setup.start().await;
    if stored(store.as_ref(), N).await.is_none() {
        service.fail(format!(
            "every command stored after the restart ({} of {N}, {stored_at_stop} at the stop)",
            match store.scheduled_count().await {
                Ok(n) => n.to_string(),
                Err(e) => e.to_string(),
            }
        ));
    }
    println!(
        "service stopped with {stored_at_stop} of {N} stored ({acknowledged} acknowledged); \
         after the restart all {N}"
    );

    // The server goes down once firing is well under way (3,000 fired), and comes back on the
    // same files.
    let unfired = wait_for(Duration::from_secs(90), || async {
        let pending = store.scheduled_count().await.ok()?;
        (pending <= (N - 3_000) as u64).then_some(pending)
    })
    .await
    .unwrap_or_else(|| service.fail("firing started"));
    let server = case
        .plugin
        .test_server
        .as_ref()
        .map(ScriptedServer::of)
        .expect("a broker with a test server")
        .expect("its server");
    let guard = server.restart_guard();
    match case.traits.outage {
        Outage::Kill => server.kill9().await,
        Outage::Stop => server.run("stop").await,
    }
    server.run("start").await;
    drop(guard);
    println!(
        "{:?} of the {} server with {} of {N} timers fired; started again",
        case.traits.outage,
        case.plugin.kind,
        N as u64 - unfired
    );
    assert!(
        unfired > 0,
        "the outage came while timers were still firing"
    );

    // The events wait on the broker; read them with a client of its own after the outage
    // (RabbitMQ's connection closes with the server).
    let client = setup.client().await;
    let read = wait_for(Duration::from_secs(180), || async {
        client.events().await.ok().filter(|e| timers(e).len() >= N)
    })
    .await
    .unwrap_or_else(|| service.fail("not every timer fired"));
    let mut ids_by_timer: HashMap<String, Vec<String>> = HashMap::new();
    let mut late = Vec::new();
    for e in &read {
        let v = envelope(e);
        let id = v["id"].as_str().unwrap_or_default().to_owned();
        assert_eq!(id, e.id.to_string(), "the broker carries the envelope id");
        ids_by_timer
            .entry(crate::e2e::timer_of(&v))
            .or_default()
            .push(id);
        late.push(crate::e2e::lateness_ms(&v));
    }
    assert_eq!(ids_by_timer.len(), N, "every timer fired");
    for (timer, ids) in &ids_by_timer {
        assert!(
            ids.iter().all(|id| *id == ids[0]),
            "{timer}: repeats only with the same id: {ids:?}"
        );
    }
    let repeated = ids_by_timer.values().filter(|ids| ids.len() > 1).count();
    let (p50, p99, max) = percentiles(late);
    println!(
        "{N} timers through {} with a service restart and a server outage: {} events read, \
         {repeated} timers delivered more than once (same id); lateness ms p50 {p50} p99 {p99} \
         max {max}",
        case.plugin.kind,
        read.len()
    );
    if let Some(bound) = case.traits.max_repeated {
        assert!(
            repeated <= bound,
            "{repeated} timers delivered twice, at most {bound} for {}",
            case.plugin.kind
        );
    }
    assert!(
        service.ready_again(Duration::from_secs(30)).await,
        "the service is ready again"
    );
    assert_eq!(service.terminate().await, Some(0));
    setup.clean_up().await;
}
