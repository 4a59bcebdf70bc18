//! The chaos soak (#23), in the spirit of Jepsen: three `timer-service` instances on one
//! PostgreSQL schema and one broker take a steady load of `ScheduleTimer` commands while a
//! nemesis, one fault at a time, kills an instance with SIGKILL (and starts it again), restarts
//! the broker (SIGKILL of its server) or PostgreSQL (fast shutdown), cuts one instance off from
//! the database or the broker (a proxy between them), or resets its connections. Afterwards a
//! checker reads every event from the stream and every timer from the database and reports:
//! timers lost (must be 0), fired twice (each with one event id), fired early (must be 0),
//! lateness outside the fault windows, and per fault how long after it ended everything due
//! meanwhile had fired.
//!
//! Every kind of fault comes once per round of six, in an order drawn from the seed; between
//! faults the nemesis waits 4 to 10 s, and before the next it waits until every instance is
//! ready again. One soak per broker (NATS, RabbitMQ), both at the same time: each restarts its
//! own broker's shared server and a PostgreSQL of its own (the shared one is left alone). A test
//! binary of its own, since it restarts shared servers. `TIMER_TEST_CHAOS_SECS` sets how long
//! the load and the faults last (default 120), `TIMER_TEST_CHAOS_SEED` the nemesis's seed
//! (printed either way, to replay a run; each soak draws its faults from it and its broker's
//! name). Needs `TIMER_TEST_POSTGRES_URL`/`_DIR` (PostgreSQL installed) and the broker's
//! `TIMER_TEST_<BROKER>_URL`/`_DIR` (bash scripts/test.sh sets them). Kafka is not in it: tansu
//! 0.6.0, its test server, panics when restarted under an idempotent producer
//! (`brokers/src/kafka/README.md`).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use libtest_mimic::Arguments;
use serde_json::{json, Value};
use timer_conformance::e2e::{
    not_reached_within, now_ms, percentiles, schedule, timer_of, write_config, PrivateServer,
    ScriptedServer, Service, ON_TIME_P99_MS,
};
use timer_conformance::lanes::Lane;
use timer_conformance::proxy::Proxy;
use timer_conformance::scenarios::envelope;
use timer_conformance::{server_trial_in, wait_for, TRIAL_LIMIT};
use timer_core::plugin::{fresh_name, BrokerConfig, BrokerPlugin, Isolated, TestClient};
use timer_core::TimerKey;
use timer_stores::postgres::{PostgresConfig, PostgresStore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");
const INSTANCES: usize = 3;
/// Commands sent per second.
const RATE: u64 = 25;
/// Timers are due this far after they are sent (uniformly).
const DUE_IN_MS: (i64, i64) = (500, 5_000);
/// How far around a fault a timer's due time counts as inside it.
const WINDOW_MARGIN_MS: i64 = 2_000;

/// A broker the soak runs against: its plugin and the port its URLs default to. The nemesis
/// crashes its server as the plugin's test server says ([`ScriptedServer::crash`]).
#[derive(Clone, Copy)]
struct ChaosBroker {
    plugin: &'static BrokerPlugin,
    default_port: u16,
}

/// The brokers built in whose servers survive a restart under load (not Kafka's tansu: its
/// `TestServer::not_restartable` says why).
fn brokers() -> Vec<ChaosBroker> {
    vec![
        #[cfg(feature = "nats")]
        ChaosBroker {
            plugin: &timer_brokers::nats::PLUGIN,
            default_port: 4222,
        },
        #[cfg(feature = "rabbitmq")]
        ChaosBroker {
            plugin: &timer_brokers::rabbitmq::PLUGIN,
            default_port: 5672,
        },
    ]
}

fn main() {
    let mut args = Arguments::from_args();
    let trials: Vec<_> = brokers()
        .into_iter()
        .map(|broker| {
            let missing = ScriptedServer::of(&timer_stores::postgres::TEST_SERVER)
                .err()
                .or_else(|| {
                    let server = broker.plugin.test_server.expect("a broker with a server");
                    ScriptedServer::of(&server).err()
                });
            server_trial_in(
                &format!(
                    "chaos::three_instances_postgres_{}_under_faults",
                    broker.plugin.kind
                ),
                missing,
                // Beside the other broker's soak: it restarts its own servers only. (Its
                // lateness bound holds beside it: p99 5-7 ms, 2 ms alone, 500 ms allowed.)
                Some(Lane::Of(broker.plugin.kind)),
                TRIAL_LIMIT + Duration::from_secs(soak_secs()),
                move || soak(broker),
            )
        })
        .collect();
    args.test_threads.get_or_insert(trials.len().max(1));
    libtest_mimic::run(&args, trials).exit();
}

/// One instance: its proxies to the database and the broker, its config, and the process.
struct Instance {
    name: String,
    dir: tempfile::TempDir,
    env: Vec<(&'static str, String)>,
    store_proxy: Proxy,
    broker_proxy: Proxy,
    service: Option<Service>,
}

impl Instance {
    async fn start(&mut self) {
        self.service = Some(Service::start(Path::new(BIN), self.dir.path(), &self.env).await);
    }

    fn service(&self) -> &Service {
        self.service.as_ref().expect("the instance runs")
    }
}

/// A fault the nemesis brings about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Fault {
    KillInstance,
    RestartBroker,
    RestartDatabase,
    CutFromDatabase,
    CutFromBroker,
    ResetConnections,
}

const FAULTS: [Fault; 6] = [
    Fault::KillInstance,
    Fault::RestartBroker,
    Fault::RestartDatabase,
    Fault::CutFromDatabase,
    Fault::CutFromBroker,
    Fault::ResetConnections,
];

/// One fault as it happened (epoch ms): from `start` to `end` (healed, restarted), and when
/// every instance answered ready again.
#[derive(Debug, Clone)]
struct Happened {
    fault: Fault,
    instance: Option<usize>,
    start: i64,
    end: i64,
    ready: i64,
}

/// A command the load sent, and whether the broker acknowledged it.
struct Sent {
    key: TimerKey,
    due: i64,
    acknowledged: bool,
}

/// How long the load and the faults last: `TIMER_TEST_CHAOS_SECS`, 120 unless set.
fn soak_secs() -> u64 {
    std::env::var("TIMER_TEST_CHAOS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(120)
}

async fn soak(chaos: ChaosBroker) {
    let kind = chaos.plugin.kind;
    let secs = soak_secs();
    let seed: u64 = std::env::var("TIMER_TEST_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| now_ms() as u64);
    println!(
        "chaos on {kind}: {secs} s, seed {seed} (TIMER_TEST_CHAOS_SEED={seed} replays the nemesis)"
    );
    // Drawn from the seed and the broker's name: both soaks start in the same millisecond at
    // times, and should not meet their faults in the same order.
    let mut rng = fastrand::Rng::with_seed(kind.bytes().fold(seed, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    }));

    // A PostgreSQL of its own, which only this soak restarts (stopped when dropped).
    let private_pg = PrivateServer::start("postgres", "PG_PORT").await;
    let pg_server = private_pg.server();
    let broker_server = ScriptedServer::of_plugin(chaos.plugin);
    let _broker_restart = broker_server.restart_guard();

    let pg = PostgresConfig {
        url: private_pg.exported("TIMER_TEST_POSTGRES_URL").to_owned(),
        schema: fresh_name("chaos_"),
        ..PostgresConfig::default()
    };
    let store = PostgresStore::open(&pg).await.expect("open the database");
    let Isolated {
        config: broker,
        guard,
    } = (chaos.plugin.isolated)("chaos").expect("isolated resources");
    let broker: Arc<dyn BrokerConfig> = Arc::from(broker);
    let section = broker.to_value().expect("the broker section");
    let broker_url = section["url"].as_str().expect("a broker url").to_owned();
    let client = broker.test_client().await.expect("a broker client");

    let mut instances = Vec::new();
    for i in 0..INSTANCES {
        let store_proxy = Proxy::in_front_of(&pg.url, 5432).await;
        let broker_proxy = Proxy::in_front_of(&broker_url, chaos.default_port).await;
        let mut broker_section = section.clone();
        broker_section["url"] = json!(broker_proxy.rewrite(&broker_url));
        let config = json!({
            "store": {
                "kind": "postgres",
                "url": store_proxy.rewrite(&pg.url),
                "schema": pg.schema,
                "connect_timeout": "2s",
            },
            "broker": broker_section,
            "engine": { "instance_id": format!("chaos-{i}"), "poll_interval": "1s" },
        });
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write_config(dir.path(), &config);
        let mut instance = Instance {
            name: format!("chaos-{i}"),
            env: vec![("TIMER_CONFIG", path.display().to_string())],
            dir,
            store_proxy,
            broker_proxy,
            service: None,
        };
        instance.start().await;
        instances.push(instance);
    }

    // The load: RATE commands a second through the broker (not through the proxies).
    let sent: Arc<Mutex<Vec<Sent>>> = Arc::default();
    let stop_load = CancellationToken::new();
    let load = tokio::spawn(send_steadily(
        broker.clone(),
        client,
        sent.clone(),
        stop_load.clone(),
    ));

    // The nemesis: quiet for 4 to 10 s, then one fault; every kind once per round, in an
    // order of the seed's.
    let end = Instant::now() + Duration::from_secs(secs);
    let mut happened: Vec<Happened> = Vec::new();
    let mut round: Vec<Fault> = Vec::new();
    loop {
        let quiet = Duration::from_millis(rng.u64(4_000..10_000));
        if Instant::now() + quiet >= end {
            break;
        }
        tokio::time::sleep(quiet).await;
        if round.is_empty() {
            round = FAULTS.to_vec();
            rng.shuffle(&mut round);
        }
        let fault = round.pop().expect("a fault of the round");
        let target = rng.usize(..INSTANCES);
        let cut = Duration::from_millis(rng.u64(3_000..10_000));
        let start = now_ms();
        let mut instance = None;
        match fault {
            Fault::KillInstance => {
                instance = Some(target);
                let victim = instances[target].service.take().expect("running");
                victim.kill9().await;
                instances[target].start().await;
            }
            Fault::RestartBroker => {
                broker_server.crash().await;
                broker_server.run("start").await;
            }
            Fault::RestartDatabase => {
                pg_server.run("stop").await;
                pg_server.run("start").await;
            }
            Fault::CutFromDatabase | Fault::CutFromBroker => {
                instance = Some(target);
                let proxy = match fault {
                    Fault::CutFromDatabase => &instances[target].store_proxy,
                    _ => &instances[target].broker_proxy,
                };
                proxy.cut();
                tokio::time::sleep(cut).await;
                proxy.heal();
            }
            Fault::ResetConnections => {
                instance = Some(target);
                instances[target].store_proxy.reset();
                instances[target].broker_proxy.reset();
            }
        }
        let ended = now_ms();
        for i in &instances {
            if !i.service().ready_again(Duration::from_secs(120)).await {
                i.service()
                    .fail(format!("{} ready again after {fault:?}", i.name));
            }
        }
        let h = Happened {
            fault,
            instance,
            start,
            end: ended,
            ready: now_ms(),
        };
        println!(
            "{:>7} ms {fault:?}{}: {} ms, ready again {} ms after",
            start - happened.first().map_or(start, |f: &Happened| f.start),
            instance.map_or(String::new(), |i| format!(" (chaos-{i})")),
            h.end - h.start,
            h.ready - h.end
        );
        happened.push(h);
    }
    stop_load.cancel();
    load.await.expect("the load");

    // Everything acknowledged fires: wait for the stream and the database to show it.
    let (acknowledged, unacknowledged): (Vec<_>, Vec<_>) = {
        let sent = sent.lock().expect("sent");
        let (a, u): (Vec<&Sent>, Vec<&Sent>) = sent.iter().partition(|s| s.acknowledged);
        (
            a.iter().map(|s| (s.key.clone(), s.due)).collect(),
            u.iter().map(|s| s.key.clone()).collect(),
        )
    };
    let due: HashMap<String, i64> = acknowledged
        .iter()
        .map(|(k, due)| (k.to_string(), *due))
        .collect();
    // A client of its own: a RabbitMQ connection ends with its server's restart.
    let client = broker.test_client().await.expect("a broker client");
    let events = wait_for(Duration::from_secs(180), || async {
        let events = client.events().await.ok()?;
        let fired: std::collections::HashSet<String> =
            events.iter().map(|e| timer_of(&envelope(e))).collect();
        due.keys().all(|k| fired.contains(k)).then_some(events)
    })
    .await;
    let events = match events {
        Some(events) => events,
        None => client.events().await.expect("read the events"),
    };

    // The checker.
    let mut fires: HashMap<String, Vec<(String, i64)>> = HashMap::new();
    for e in &events {
        let v: Value = envelope(e);
        fires.entry(timer_of(&v)).or_default().push((
            v["id"].as_str().unwrap_or_default().to_owned(),
            v["timestampMs"].as_i64().unwrap_or(0),
        ));
    }
    let lost: Vec<&String> = due.keys().filter(|k| !fires.contains_key(*k)).collect();
    // A mark may still be on its way when the event is read.
    let keys: Vec<TimerKey> = acknowledged.iter().map(|(k, _)| k.clone()).collect();
    let not_reached = not_reached_within(&store, &keys, Duration::from_secs(60)).await;
    let early: Vec<String> = fires
        .iter()
        .filter_map(|(k, f)| {
            let due = due.get(k)?;
            f.iter()
                .any(|(_, at)| at < due)
                .then(|| format!("{k} due {due}"))
        })
        .collect();
    let mixed_ids: Vec<&String> = fires
        .iter()
        .filter(|(_, f)| f.iter().any(|(id, _)| *id != f[0].0))
        .map(|(k, _)| k)
        .collect();
    let first_fire = |k: &str| fires.get(k).and_then(|f| f.iter().map(|(_, at)| *at).min());
    let window_of = |at: i64| {
        happened
            .iter()
            .position(|h| at >= h.start - WINDOW_MARGIN_MS && at <= h.ready + WINDOW_MARGIN_MS)
    };

    // Lateness of timers due away from every fault.
    let quiet_lateness: Vec<i64> = due
        .iter()
        .filter(|(_, due)| window_of(**due).is_none())
        .filter_map(|(k, due)| Some(first_fire(k)? - due))
        .collect();
    let quiet_count = quiet_lateness.len();
    let (q50, q99, qmax) = percentiles(quiet_lateness);

    // Timers fired twice, by the fault window their due time falls in (None: none).
    let mut twice_in: HashMap<Option<usize>, usize> = HashMap::new();
    for (k, f) in &fires {
        if let (true, Some(due)) = (f.len() > 1, due.get(k)) {
            *twice_in.entry(window_of(*due)).or_default() += 1;
        }
    }
    // Per fault: the timers due from its start until every instance was ready again, and how
    // long after the later of its due time and the fault's end the last of them fired.
    println!("\nper fault: timers due during it; the most any fired after its due time or the fault's end, whichever is later; fired twice");
    let mut recovery: HashMap<Fault, Vec<i64>> = HashMap::new();
    let mut duplicates: HashMap<Fault, usize> = HashMap::new();
    for (n, h) in happened.iter().enumerate() {
        let affected: Vec<i64> = due
            .iter()
            .filter(|(_, due)| **due >= h.start && **due <= h.ready)
            .filter_map(|(k, due)| Some(first_fire(k)? - (*due).max(h.end)))
            .collect();
        let twice = twice_in.get(&Some(n)).copied().unwrap_or(0);
        *duplicates.entry(h.fault).or_default() += twice;
        let recovered = affected.iter().max().map(|late| (*late).max(0));
        if let Some(recovered) = recovered {
            recovery.entry(h.fault).or_default().push(recovered);
        }
        println!(
            "  {:?}{} lasting {} ms: {} due, {}, {twice} twice",
            h.fault,
            h.instance
                .map_or(String::new(), |i| format!(" (chaos-{i})")),
            h.end - h.start,
            affected.len(),
            recovered.map_or("none to fire".to_owned(), |ms| format!(
                "fired by {ms} ms after"
            ))
        );
    }
    println!("\nper kind of fault: count, recovery ms median / max (faults with timers due), fired twice");
    for fault in FAULTS {
        let count = happened.iter().filter(|h| h.fault == fault).count();
        let mut times = recovery.remove(&fault).unwrap_or_default();
        times.sort_unstable();
        let figures = match times.len() {
            0 => "no timers due".to_owned(),
            n => format!(
                "recovered in {} / {} ms",
                (times[(n - 1) / 2] + times[n / 2]) / 2,
                times[n - 1]
            ),
        };
        println!(
            "  {fault:?}: {count} faults, {figures}, {} fired twice",
            duplicates.get(&fault).copied().unwrap_or(0)
        );
    }
    let twice_total: usize = twice_in.values().sum();
    println!(
        "\nchaos report ({secs} s, seed {seed}, {INSTANCES} instances, PostgreSQL + {kind}): {} \
         commands acknowledged ({} not acknowledged by the broker), {} events; lost {}, not \
         Reached in the store {}, fired early {}, fired twice {twice_total} (outside fault \
         windows {}), with differing ids {}; {} faults; lateness of the {quiet_count} timers \
         due outside fault windows p50 {q50} / p99 {q99} / max {qmax} ms",
        acknowledged.len(),
        unacknowledged.len(),
        events.len(),
        lost.len(),
        not_reached.len(),
        early.len(),
        twice_in.get(&None).copied().unwrap_or(0),
        mixed_ids.len(),
        happened.len(),
    );

    for i in instances.iter_mut() {
        if let Some(service) = i.service.take() {
            assert_eq!(
                service.terminate().await,
                Some(0),
                "{} stops cleanly",
                i.name
            );
        }
    }
    assert!(lost.is_empty(), "lost: {:?}", &lost[..lost.len().min(10)]);
    assert!(
        not_reached.is_empty(),
        "not Reached: {:?}",
        &not_reached[..not_reached.len().min(10)]
    );
    assert!(early.is_empty(), "fired early: {early:?}");
    assert!(
        mixed_ids.is_empty(),
        "a timer fired twice keeps its event id: {mixed_ids:?}"
    );
    assert!(!happened.is_empty(), "the nemesis brought about faults");
    // Away from the faults the service is on time (from the event's own fire time: the events
    // are read from the stream after the run; a poll of `engine.poll_interval` = 1 s fails it).
    assert!(
        q99 <= ON_TIME_P99_MS,
        "the {quiet_count} timers due away from every fault: lateness p99 {q99} ms (p50 {q50}, \
         max {qmax}) above {ON_TIME_P99_MS} ms"
    );
    let _ = broker.clean_up().await;
    drop(guard);
}

/// Sends a `ScheduleTimer` every 1/RATE s until `stop`; a command the broker does not take
/// (it is restarting) is sent again, and counted as acknowledged only once it took it. A client
/// whose send failed is replaced by a new one of `broker` (a RabbitMQ connection does not outlive
/// its server's restart; a NATS client would reconnect by itself).
async fn send_steadily(
    broker: Arc<dyn BrokerConfig>,
    mut client: Arc<dyn TestClient>,
    sent: Arc<Mutex<Vec<Sent>>>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(1_000 / RATE));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut n = 0u64;
    let mut rng = fastrand::Rng::new();
    while !stop.is_cancelled() {
        tick.tick().await;
        let tenant = format!("tenant-{}", n % 5);
        let id = format!("c{n:07}");
        n += 1;
        let due = now_ms() + rng.i64(DUE_IN_MS.0..DUE_IN_MS.1);
        let body = schedule(&tenant, &id, due);
        // Sent again for up to 30 s (a restart of the server takes about 10), a pause between
        // tries where the server refuses at once.
        let mut acknowledged = false;
        let give_up = Instant::now() + Duration::from_secs(30);
        while Instant::now() < give_up && !stop.is_cancelled() {
            let send = client.send_command(body.as_bytes());
            if let Ok(Ok(())) = tokio::time::timeout(Duration::from_secs(2), send).await {
                acknowledged = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
            if let Ok(Ok(new)) =
                tokio::time::timeout(Duration::from_secs(2), broker.test_client()).await
            {
                client = new;
            }
        }
        if let Ok(mut sent) = sent.lock() {
            sent.push(Sent {
                key: TimerKey::new(&tenant, &id),
                due,
                acknowledged,
            });
        }
    }
}
