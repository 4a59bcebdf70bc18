//! One scenario's service and how a scenario reaches it: fresh resources written to a config file
//! ([`Setup`]), commands sent and events and dead letters read through a broker client or the HTTP
//! API (`Access`), and helpers on events and commands.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{json, Value};
use timer_core::plugin::{
    BrokerConfig, Isolated, ReadDeadLetter, ReadEvent, StoreConfig, TestClient,
};
use timer_core::{BrokerPlugin, Store};

use super::{BrokerCase, WAIT};
use crate::e2e::{run_to_end, schedule, write_config, EventLog, Exit, Service};
use crate::wait_for;

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

    /// Runs `timer-service args` on this setup's config to its end, which must come `within`
    /// that long.
    pub async fn run_to_end(&self, args: &[&str], within: std::time::Duration) -> Exit {
        run_to_end(&self.bin, self.dir.path(), args, &self.env, within).await
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

    /// Holds the write lock of the service's SQLite file (an open `BEGIN EXCLUSIVE`) until the
    /// connection is dropped: the service's writes wait `store.busy_timeout` and fail, as a store
    /// refusing writes does.
    #[cfg(feature = "sqlite")]
    pub async fn refuse_writes(&self) -> sqlx::SqliteConnection {
        use sqlx::Connection;
        let section = self.store.config.to_value().expect("the store section");
        assert_eq!(
            section["kind"], "sqlite",
            "writes are refused on a SQLite store"
        );
        let url = section["url"].as_str().expect("the file's URL");
        let mut lock = sqlx::SqliteConnection::connect(url)
            .await
            .unwrap_or_else(|e| panic!("opening {url} beside the service: {e}"));
        sqlx::query("BEGIN EXCLUSIVE")
            .execute(&mut lock)
            .await
            .unwrap_or_else(|e| panic!("locking {url}: {e}"));
        lock
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
pub(super) enum Access<'a> {
    Client(Arc<dyn TestClient>),
    Http(&'a Service, EventLog),
}

impl<'a> Access<'a> {
    /// Through `client` when the broker has a server ([`Setup::client_if_served`]), else
    /// through `service`'s HTTP API.
    pub(super) async fn of(
        client: Option<Arc<dyn TestClient>>,
        service: &'a Service,
    ) -> Access<'a> {
        match client {
            Some(client) => Access::Client(client),
            None => Access::Http(service, service.events().await),
        }
    }

    pub(super) async fn send(&self, body: &str) {
        match self {
            Access::Client(client) => client.send_command(body.as_bytes()).await.expect("send"),
            Access::Http(service, _) => {
                let (status, v) = service.post("/v1/commands", body).await;
                assert_eq!(status, 202, "{v}");
            }
        }
    }

    pub(super) async fn events(&self) -> Option<Vec<ReadEvent>> {
        match self {
            Access::Client(client) => client.events().await.ok(),
            Access::Http(_, log) => log
                .snapshot()
                .into_iter()
                .map(|e| {
                    Some(ReadEvent {
                        id: e.envelope["id"].as_str()?.parse().ok()?,
                        body: e.envelope.to_string().into_bytes(),
                        // The event stream carries envelopes, not a broker's headers.
                        headers: Default::default(),
                    })
                })
                .collect(),
        }
    }

    pub(super) async fn dead_letters(&self) -> Option<Vec<ReadDeadLetter>> {
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

/// Sends a command through `client` for timer `t/id`, due now, and waits for its event (30 s);
/// `when` says in the failure when it was sent.
pub async fn fires(client: &dyn TestClient, service: &Service, id: &str, when: &str) {
    let command = json!({"tenantId": "t", "serviceCallId": id, "dueTimeMs": crate::e2e::now_ms()});
    client
        .send_command(command.to_string().as_bytes())
        .await
        .unwrap_or_else(|e| service.fail(format!("sending a command {when}: {e}")));
    let fired = wait_for(std::time::Duration::from_secs(30), || async {
        let events = client.events().await.ok()?;
        timers(&events).contains(&format!("t/{id}")).then_some(())
    })
    .await;
    if fired.is_none() {
        service.fail(format!("a command sent {when} fired within 30 s"));
    }
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
pub(super) async fn stored(store: &dyn Store, n: usize) -> Option<u64> {
    wait_for(WAIT, || async {
        let pending = store.scheduled_count().await.ok()?;
        (pending >= n as u64).then_some(pending)
    })
    .await
}
