//! How a plugin describes itself, so the binary, the bench and the test suites use every
//! compiled-in plugin without naming it.
//!
//! A plugin folder (`stores/src/<kind>/`, `brokers/src/<kind>/`) exports one [`StorePlugin`] or
//! [`BrokerPlugin`] constant; its crate lists those constants in one `PLUGINS` slice, a line per
//! plugin behind the plugin's cargo feature. Config loading, `check-config`, plugin assembly,
//! the bench, the conformance fixtures and the end-to-end matrix iterate that slice.
//!
//! The descriptor carries:
//! - `kind`: the value of `store.kind` / `broker.kind`, also the cargo feature and folder name;
//! - `load`: reads and checks the plugin's config section ([`ConfigSection`]) into a typed config
//!   behind [`StoreConfig`] / [`BrokerConfig`], which opens the store or connects the broker;
//! - `test_server`: the server the tests and the bench run it against ([`TestServer`]), if any;
//! - `isolated`: a config naming fresh resources on that server (a temp file, a new schema, new
//!   streams or topics), so runs never share state, and [`BrokerConfig::test_client`] for an
//!   independent producer and reader on them.

use std::any::Any;
use std::fmt::Debug;
use std::sync::Arc;

use async_trait::async_trait;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::Serialize;
use uuid::Uuid;

use crate::broker::Broker;
use crate::config::EngineConfig;
use crate::error::{Error, Result};
use crate::store::Store;

/// A plugin's descriptor; `C` is its family's config trait object. One `pub const PLUGIN` per
/// plugin folder, usually `StorePlugin::of::<Config>()` / `BrokerPlugin::of::<Config>()`.
pub struct Plugin<C: ?Sized + 'static> {
    /// `store.kind` / `broker.kind`, the cargo feature and the folder name: `memory`,
    /// `sqlite`, `postgres`, `nats`, `kafka`, `rabbitmq`.
    pub kind: &'static str,
    /// Reads the plugin's section (defaults for the keys left out) and checks what can be
    /// checked without a server.
    pub load: fn(&ConfigSection) -> Result<Box<C>>,
    /// The server its tests need; `None` when it runs in process or on a local file.
    pub test_server: Option<TestServer>,
    /// A config on fresh, isolated resources (a temp file, a schema, streams, queues, topics,
    /// a consumer group) for one test or bench run; `prefix` starts the names it makes (`t`,
    /// `bench`). Fails with [`ErrorKind::Config`](crate::ErrorKind) naming the variable when
    /// the test server is not configured.
    pub isolated: fn(prefix: &str) -> Result<Isolated<C>>,
    /// The JSON Schema of its config section: every key with its doc comment and default,
    /// from which the configuration reference and the example file are generated.
    pub schema: fn() -> schemars::Schema,
}

/// A store plugin's descriptor.
pub type StorePlugin = Plugin<dyn StoreConfig>;

/// A broker plugin's descriptor.
pub type BrokerPlugin = Plugin<dyn BrokerConfig>;

impl<D: ?Sized + 'static> Plugin<D> {
    /// The descriptor of the plugin whose config section is `C`.
    pub const fn of<C: Section + Family<D>>() -> Self {
        Plugin {
            kind: C::KIND,
            load: |section| Ok(load_section::<C>(section)?.boxed()),
            test_server: C::TEST_SERVER,
            isolated: |prefix| test_config::<C>()?.isolate(prefix),
            schema: || schemars::schema_for!(C),
        }
    }

    /// Why this plugin's test server cannot be used, if it cannot.
    pub fn unavailable(&self) -> Option<String> {
        self.test_server.as_ref().and_then(TestServer::unavailable)
    }
}

/// A config of the plugin family whose trait object is `D` (`dyn StoreConfig`,
/// `dyn BrokerConfig`): what [`Plugin::of`] needs to make a descriptor of it.
pub trait Family<D: ?Sized> {
    fn boxed(self) -> Box<D>;
    fn isolate(&self, prefix: &str) -> Result<Isolated<D>>;
}

impl<C: StoreConfig> Family<dyn StoreConfig> for C {
    fn boxed(self) -> Box<dyn StoreConfig> {
        Box::new(self)
    }
    fn isolate(&self, prefix: &str) -> Result<Isolated<dyn StoreConfig>> {
        self.isolated(prefix)
    }
}

impl<C: BrokerConfig> Family<dyn BrokerConfig> for C {
    fn boxed(self) -> Box<dyn BrokerConfig> {
        Box::new(self)
    }
    fn isolate(&self, prefix: &str) -> Result<Isolated<dyn BrokerConfig>> {
        self.isolated(prefix)
    }
}

/// One line of a plugin crate's registry: a kind the crate has, and its descriptor when the
/// kind's cargo feature is compiled in. Write it with [`known!`](crate::known).
pub struct Known<P: 'static> {
    pub kind: &'static str,
    pub plugin: Option<&'static P>,
}

/// `known!("sqlite", sqlite)`: the registry line of the plugin whose folder (module) is
/// `sqlite` and whose cargo feature and kind are `"sqlite"`; `plugin` is `None` when the
/// feature is off in the crate that writes the line.
#[macro_export]
macro_rules! known {
    ($kind:literal, $module:ident) => {{
        #[cfg(feature = $kind)]
        let plugin = Some(&$module::PLUGIN);
        #[cfg(not(feature = $kind))]
        let plugin = None;
        $crate::plugin::Known {
            kind: $kind,
            plugin,
        }
    }};
}

/// A plugin crate's registry, a line per plugin: `sqlite = "sqlite"` declares the folder
/// (module) `sqlite` behind the cargo feature `"sqlite"` and lists it in `PLUGINS`, in order.
///
/// ```text
/// timer_core::plugins! { StorePlugin:
///     memory = "memory",
///     sqlite = "sqlite",
/// }
/// ```
#[macro_export]
macro_rules! plugins {
    ($descriptor:ident: $($module:ident = $kind:literal),* $(,)?) => {
        $(
            #[cfg(feature = $kind)]
            pub mod $module;
        )*

        /// Every kind of this crate, with its descriptor when its cargo feature is compiled in.
        pub const PLUGINS: $crate::plugin::Registry<$crate::plugin::$descriptor> =
            $crate::plugin::Registry(&[$($crate::known!($kind, $module)),*]);
    };
}

/// The plugins of one crate: every kind it has, each with its descriptor when compiled in.
pub struct Registry<P: 'static>(pub &'static [Known<P>]);

impl<P> Registry<P> {
    /// The descriptors compiled into this build, in registry order.
    pub fn iter(&self) -> impl Iterator<Item = &'static P> {
        self.0.iter().filter_map(|k| k.plugin)
    }

    /// Every kind the crate has, compiled in or not.
    pub fn kinds(&self) -> impl Iterator<Item = &'static str> {
        self.0.iter().map(|k| k.kind)
    }

    /// The kinds compiled into this build.
    pub fn compiled_kinds(&self) -> impl Iterator<Item = &'static str> {
        self.0.iter().filter(|k| k.plugin.is_some()).map(|k| k.kind)
    }

    /// The registry line of `kind`, if the crate has that kind.
    pub fn known(&self, kind: &str) -> Option<&'static Known<P>> {
        self.0.iter().find(|k| k.kind == kind)
    }

    /// The descriptor of `kind`, if compiled in.
    pub fn get(&self, kind: &str) -> Option<&'static P> {
        self.known(kind).and_then(|k| k.plugin)
    }
}

/// What every plugin config tells of itself. Provided for every [`Section`] type; written by hand
/// only for a config that is more than its section (the memory broker's holds its hub).
pub trait PluginConfig: Debug + Send + Sync + 'static {
    /// `store.kind` / `broker.kind`.
    fn kind(&self) -> &'static str;
    /// The section as TOML would hold it, `kind` included (secrets too: redact before showing).
    fn to_value(&self) -> Result<serde_json::Value>;
    /// For a downcast to the plugin's own type (the memory broker's hub, a test's helpers).
    fn as_any(&self) -> &dyn Any;
}

/// A plugin's config section type. [`StorePlugin::of`] and [`BrokerPlugin::of`] make the
/// descriptor from it: `load` parses the section and runs [`validate`](Section::validate);
/// `isolated` applies [`StoreConfig::isolated`] / [`BrokerConfig::isolated`] to
/// [`for_test_server`](Section::for_test_server). Its doc comments are the configuration
/// reference (`JsonSchema`): document every key there, for operators.
pub trait Section:
    Serialize + DeserializeOwned + JsonSchema + Default + Debug + Send + Sync + 'static
{
    /// `store.kind` / `broker.kind`, also the cargo feature and the folder name.
    const KIND: &'static str;
    /// The server its tests need; `None` when it runs in process or on a local file.
    const TEST_SERVER: Option<TestServer> = None;
    /// What can be checked without a server; `load` runs it.
    fn validate(&self) -> Result<()> {
        Ok(())
    }
    /// The config reaching the test server at `address` (before isolation); only called when
    /// there is a [`TEST_SERVER`](Section::TEST_SERVER).
    fn for_test_server(_address: String) -> Self {
        Self::default()
    }
}

impl<C: Section> PluginConfig for C {
    fn kind(&self) -> &'static str {
        C::KIND
    }
    fn to_value(&self) -> Result<serde_json::Value> {
        let mut value = to_value(self)?;
        if let Some(section) = value.as_object_mut() {
            section.insert("kind".into(), C::KIND.into());
        }
        Ok(value)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The section of `C`, checked; its `kind`, when given, must be `C`'s.
fn load_section<C: Section>(section: &ConfigSection) -> Result<C> {
    let config: C = section.parse_as(C::KIND)?;
    config.validate()?;
    Ok(config)
}

/// `C` for its test server, or its defaults when it has none.
fn test_config<C: Section>() -> Result<C> {
    match C::TEST_SERVER {
        Some(server) => Ok(C::for_test_server(server.address()?)),
        None => Ok(C::default()),
    }
}

/// A typed store config, as loaded by its plugin.
#[async_trait]
pub trait StoreConfig: PluginConfig {
    /// Rules that involve the engine settings; the default has none.
    fn check(&self, _engine: &EngineConfig) -> Result<()> {
        Ok(())
    }
    async fn open(&self) -> Result<Arc<dyn Store>>;
    /// A handle on the store that a running service has open, for tests and tools that read
    /// or write beside it (counting, playing another instance). Not for running an engine on:
    /// the default is [`open`](StoreConfig::open); a store that one service owns at a time
    /// (SQLite) opens it without taking it over.
    async fn attach(&self) -> Result<Arc<dyn Store>> {
        self.open().await
    }
    /// Whether stores opened from this config share their timers, so several engines (as
    /// separate instances would) can run on one store; `false` for a store in process memory,
    /// and for one that a single service may open at a time (SQLite).
    fn shared(&self) -> bool {
        true
    }
    /// This config on fresh resources of the same server (a temp file, a new schema named
    /// `prefix`…); other settings kept. The bench runs on the configured server with it, and
    /// [`StorePlugin::isolated`] applies it to a config for the test server.
    fn isolated(&self, prefix: &str) -> Result<Isolated<dyn StoreConfig>>;
    /// Removes what an [`isolated`](StorePlugin::isolated) run created (a bench schema); a
    /// no-op where nothing outlives the run.
    async fn clean_up(&self) -> Result<()> {
        Ok(())
    }
}

/// A typed broker config, as loaded by its plugin.
#[async_trait]
pub trait BrokerConfig: PluginConfig {
    /// Rules that involve the engine settings (a publish must end within half the lease).
    fn check(&self, _engine: &EngineConfig) -> Result<()> {
        Ok(())
    }
    async fn connect(&self) -> Result<Arc<dyn Broker>>;
    /// An independent client on the resources this config names: produces commands and reads
    /// events and dead letters as a real service would. Creates the resources first when they
    /// are missing, so commands can be sent before the service starts.
    async fn test_client(&self) -> Result<Arc<dyn TestClient>>;
    /// This config on fresh resources of the same server (streams, queues, topics, consumer
    /// group named after `prefix`); other settings kept. The bench runs on the configured
    /// server with it, and [`BrokerPlugin::isolated`] applies it to a config for the test server.
    fn isolated(&self, prefix: &str) -> Result<Isolated<dyn BrokerConfig>>;
    /// Removes what an [`isolated`](BrokerPlugin::isolated) run created, where the server
    /// allows it safely; a no-op otherwise.
    async fn clean_up(&self) -> Result<()> {
        Ok(())
    }
}

/// A config on isolated resources, with whatever keeps them alive (a temp dir) until dropped.
pub struct Isolated<C: ?Sized> {
    pub config: Box<C>,
    pub guard: Box<dyn Any + Send + Sync>,
}

impl<C: ?Sized> Isolated<C> {
    /// A config whose resources need nothing kept alive.
    pub fn new(config: Box<C>) -> Self {
        Isolated {
            config,
            guard: Box::new(()),
        }
    }
}

/// An event as an independent consumer read it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadEvent {
    /// The de-duplication id the broker carried (header, message id).
    pub id: Uuid,
    pub body: Vec<u8>,
}

/// A dead letter as an independent consumer read it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadDeadLetter {
    pub body: Vec<u8>,
    pub reason: String,
}

/// An independent producer and reader on one broker config's resources.
#[async_trait]
pub trait TestClient: Send + Sync + 'static {
    /// A new connection of the plugin under test to these resources; dropping it disconnects.
    async fn connect(&self) -> Result<Box<dyn Broker>>;
    /// Sends a command as a producing service would, and waits until the broker has it.
    async fn send_command(&self, body: &[u8]) -> Result<()>;
    /// Sends many commands, all in flight together where the broker allows, and waits for all.
    async fn send_commands(&self, bodies: &[Vec<u8>]) -> Result<()> {
        for body in bodies {
            self.send_command(body).await?;
        }
        Ok(())
    }
    /// Every event published so far, as a consumer reads them.
    async fn events(&self) -> Result<Vec<ReadEvent>>;
    /// Every dead letter so far.
    async fn dead_letters(&self) -> Result<Vec<ReadDeadLetter>>;
    fn as_any(&self) -> &dyn Any;
}

/// A server the tests run a plugin against, started by `scripts/servers/<script>.sh` (which
/// `scripts/test.sh` calls) and reached through environment variables it prints.
#[derive(Debug, Clone, Copy)]
pub struct TestServer {
    /// The variable holding its address (URL or `host:port`), e.g. `TIMER_TEST_NATS_URL`.
    pub address_env: &'static str,
    /// The variable holding its data directory, for a test that stops and restarts it.
    pub dir_env: &'static str,
    /// `scripts/servers/<script>.sh` with `install`, `start DIR` and `stop DIR`.
    pub script: &'static str,
    /// The variable that script reads its port from (`NATS_PORT`).
    pub port_env: &'static str,
}

impl TestServer {
    pub const fn new(
        address_env: &'static str,
        dir_env: &'static str,
        script: &'static str,
        port_env: &'static str,
    ) -> Self {
        TestServer {
            address_env,
            dir_env,
            script,
            port_env,
        }
    }

    /// The server's address, or an error naming the variable and how to get a server.
    pub fn address(&self) -> Result<String> {
        std::env::var(self.address_env).map_err(|_| {
            Error::config(format!(
                "{} is not set (bash scripts/test.sh starts {})",
                self.address_env, self.script
            ))
        })
    }

    /// Why the server cannot be used, if it cannot.
    pub fn unavailable(&self) -> Option<String> {
        self.address().err().map(|e| e.to_string())
    }

    /// The port in the address (`scheme://user:pw@host:PORT/path` or `host:PORT`).
    pub fn port(&self) -> Option<u16> {
        let address = self.address().ok()?;
        let rest = address
            .split_once("://")
            .map_or(address.as_str(), |(_, r)| r);
        let authority = rest.split('/').next()?;
        let host_port = authority.rsplit('@').next()?;
        host_port.rsplit_once(':')?.1.parse().ok()
    }
}

/// A new resource name: `prefix` and 12 random hex digits (lowercase, so it is a valid name for
/// every server we run: schemas, streams, queues, topics).
pub fn fresh_name(prefix: &str) -> String {
    let id = Uuid::new_v4().simple().to_string();
    format!("{prefix}{}", &id[..12])
}

/// A plugin's config section as the binary read it, with where each key came from.
pub struct ConfigSection<'a> {
    /// `store` or `broker`.
    pub name: &'a str,
    /// The section's keys and values (`kind` included); `Null` when the section is absent.
    pub value: serde_json::Value,
    /// Where a key (`store.url`) was set, as ` (in TOML file x.toml)`; empty when unknown.
    pub locate: &'a dyn Fn(&str) -> String,
}

impl ConfigSection<'_> {
    /// The section as `T`; keys left out take `T::default()`. An unknown key or a wrong value
    /// is a config error naming the key and where it was set.
    pub fn parse<T: DeserializeOwned + Default>(&self) -> Result<T> {
        if self.value.is_null() {
            return Ok(T::default());
        }
        serde_path_to_error::deserialize(&self.value).map_err(|e| {
            let inner = e.path().to_string();
            let key = if inner == "." {
                self.name.to_owned()
            } else {
                format!("{}.{inner}", self.name)
            };
            Error::config(format!(
                "invalid configuration: {key}: {}{}",
                e.inner(),
                (self.locate)(&key)
            ))
        })
    }

    /// [`parse`](Self::parse) for the loader of plugin `kind`: a `kind` key in the section
    /// must name it.
    pub fn parse_as<T: DeserializeOwned + Default>(&self, kind: &str) -> Result<T> {
        match self.value.get("kind") {
            Some(given) if given.as_str() != Some(kind) => {
                let key = format!("{}.kind", self.name);
                Err(Error::config(format!(
                    "invalid configuration: {key} = {given}{}: the {kind} plugin cannot load it",
                    (self.locate)(&key)
                )))
            }
            _ => self.parse(),
        }
    }
}

/// A typed config as the value [`PluginConfig::to_value`] returns:
/// as TOML would hold it, so unset options (`None`, `null`) are left out.
pub fn to_value(config: &impl Serialize) -> Result<serde_json::Value> {
    let mut value = serde_json::to_value(config)
        .map_err(|e| Error::internal("cannot render a plugin config").with_source(e))?;
    drop_nulls(&mut value);
    Ok(value)
}

fn drop_nulls(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            map.retain(|_, v| !v.is_null());
            map.values_mut().for_each(drop_nulls);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(drop_nulls),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default, serde::Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct Demo {
        kind: String,
        url: String,
        size: u32,
    }

    #[test]
    fn sections_parse_with_defaults_and_name_bad_keys() {
        let locate = |key: &str| format!(" (at {key})");
        let section = |value| ConfigSection {
            name: "store",
            value,
            locate: &locate,
        };
        let d: Demo = section(serde_json::Value::Null).parse().unwrap();
        assert_eq!(d.size, 0);
        let d: Demo = section(serde_json::json!({"kind": "x", "url": "u"}))
            .parse()
            .unwrap();
        assert_eq!((d.kind.as_str(), d.url.as_str()), ("x", "u"));
        let e = section(serde_json::json!({"size": "big"}))
            .parse::<Demo>()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("store.size: invalid type") && e.ends_with("(at store.size)"),
            "{e}"
        );
        let e = section(serde_json::json!({"urll": "u"}))
            .parse::<Demo>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `urll`"), "{e}");
        let d: Demo = section(serde_json::json!({"kind": "x"}))
            .parse_as("x")
            .unwrap();
        assert_eq!(d.kind, "x");
        let e = section(serde_json::json!({"kind": "y"}))
            .parse_as::<Demo>("x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("store.kind = \"y\" (at store.kind)"), "{e}");
    }

    #[test]
    fn registries_tell_compiled_from_known_kinds() {
        struct Demo;
        static DEMO: Demo = Demo;
        static LINES: &[Known<Demo>] = &[
            Known {
                kind: "a",
                plugin: Some(&DEMO),
            },
            Known {
                kind: "b",
                plugin: None,
            },
        ];
        let registry = Registry(LINES);
        assert_eq!(registry.kinds().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(registry.compiled_kinds().collect::<Vec<_>>(), ["a"]);
        assert_eq!(registry.iter().count(), 1);
        assert!(registry.get("a").is_some() && registry.get("b").is_none());
        assert!(registry.known("b").is_some() && registry.known("c").is_none());
    }

    #[test]
    fn values_leave_unset_options_out() {
        #[derive(serde::Serialize)]
        struct Options {
            kind: &'static str,
            token: Option<String>,
            inner: Vec<Option<u8>>,
        }
        let v = to_value(&Options {
            kind: "x",
            token: None,
            inner: vec![Some(1)],
        })
        .unwrap();
        assert_eq!(v, serde_json::json!({"kind": "x", "inner": [1]}));
    }

    #[test]
    fn ports_come_from_urls_and_addresses() {
        let server = |var| TestServer {
            address_env: var,
            dir_env: "UNUSED",
            script: "demo",
            port_env: "DEMO_PORT",
        };
        // Variables of this test only; nothing else reads them.
        std::env::set_var(
            "TIMER_PLUGIN_TEST_URL",
            "amqp://guest:guest@127.0.0.1:16572/%2f",
        );
        std::env::set_var("TIMER_PLUGIN_TEST_ADDR", "127.0.0.1:19092");
        assert_eq!(server("TIMER_PLUGIN_TEST_URL").port(), Some(16572));
        assert_eq!(server("TIMER_PLUGIN_TEST_ADDR").port(), Some(19092));
        let missing = server("TIMER_PLUGIN_TEST_MISSING");
        assert_eq!(missing.port(), None);
        let why = missing.unavailable().unwrap();
        assert!(
            why.contains("TIMER_PLUGIN_TEST_MISSING is not set"),
            "{why}"
        );
        assert!(fresh_name("t").starts_with('t') && fresh_name("t").len() == 13);
    }
}
