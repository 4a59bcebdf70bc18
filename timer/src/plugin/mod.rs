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
//! - with the `testing` feature, what tests and the bench use: `test_server`, the server they
//!   run it against (`TestServer`), if any, and `isolated`, a config naming fresh resources on
//!   that server (a temp file, a new schema, new streams or topics), so runs never share state,
//!   with `BrokerConfig::test_client` for an independent producer and reader on them.

mod config;
#[cfg(feature = "testing")]
mod testing;

pub use config::{to_value, BrokerConfig, ConfigSection, PluginConfig, Section, StoreConfig};
#[cfg(feature = "testing")]
pub use testing::{
    fresh_name, DelayedMessage, DelayedUntil, Isolated, ReadDeadLetter, ReadEvent, ReadMessage,
    TestClient, TestServer,
};

use crate::error::Result;

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
    #[cfg(feature = "testing")]
    pub test_server: Option<TestServer>,
    /// A config on fresh, isolated resources (a temp file, a schema, streams, queues, topics,
    /// a consumer group) for one test or bench run; `prefix` starts the names it makes (`t`,
    /// `bench`). Fails with [`ErrorKind::Config`](crate::ErrorKind) naming the variable when
    /// the test server is not configured.
    #[cfg(feature = "testing")]
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
            #[cfg(feature = "testing")]
            test_server: C::TEST_SERVER,
            #[cfg(feature = "testing")]
            isolated: |prefix| test_config::<C>()?.isolate(prefix),
            schema: || schemars::schema_for!(C),
        }
    }

    /// Why this plugin's test server cannot be used, if it cannot.
    #[cfg(feature = "testing")]
    pub fn unavailable(&self) -> Option<String> {
        self.test_server.as_ref().and_then(TestServer::unavailable)
    }
}

/// A config of the plugin family whose trait object is `D` (`dyn StoreConfig`,
/// `dyn BrokerConfig`): what [`Plugin::of`] needs to make a descriptor of it.
pub trait Family<D: ?Sized> {
    fn boxed(self) -> Box<D>;
    #[cfg(feature = "testing")]
    fn isolate(&self, prefix: &str) -> Result<Isolated<D>>;
}

impl<C: StoreConfig> Family<dyn StoreConfig> for C {
    fn boxed(self) -> Box<dyn StoreConfig> {
        Box::new(self)
    }
    #[cfg(feature = "testing")]
    fn isolate(&self, prefix: &str) -> Result<Isolated<dyn StoreConfig>> {
        self.isolated(prefix)
    }
}

impl<C: BrokerConfig> Family<dyn BrokerConfig> for C {
    fn boxed(self) -> Box<dyn BrokerConfig> {
        Box::new(self)
    }
    #[cfg(feature = "testing")]
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

/// The section of `C`, checked; its `kind`, when given, must be `C`'s.
fn load_section<C: Section>(section: &ConfigSection) -> Result<C> {
    let config: C = section.parse_as(C::KIND)?;
    config.validate()?;
    Ok(config)
}

/// `C` for its test server, or its defaults when it has none.
#[cfg(feature = "testing")]
fn test_config<C: Section>() -> Result<C> {
    match C::TEST_SERVER {
        Some(server) => Ok(C::for_test_server(server.address()?)),
        None => Ok(C::default()),
    }
}

#[cfg(all(test, feature = "testing"))]
mod tests;
