//! Configuration: built-in defaults ← TOML file (`--config`, else `config/timer-service.toml` if
//! present) ← the seed's environment names ← `TIMER_*` environment (`__` nests:
//! `TIMER_STORE__URL`). Each plugin section is loaded by the plugin its `kind` names, found in
//! the plugin crate's registry (`timer_stores::PLUGINS`, `timer_brokers::PLUGINS`), after the
//! kind was checked against what is known and what is compiled in.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::providers::{Env, Format, Toml};
use figment::Figment;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use timer_core::config::duration;
use timer_core::plugin::{BrokerConfig, ConfigSection, Registry, StoreConfig};
use timer_core::redact;
use timer_core::{EngineConfig, Error, Limits};

/// Where the service looks for a config file when `--config` is not given.
pub const DEFAULT_CONFIG_FILE: &str = "config/timer-service.toml";

/// `broker.kind` when none is given.
pub const DEFAULT_BROKER_KIND: &str = "memory";

/// Environment names of the original timer service, kept working, and the keys they set.
const SEED_ENV: &[(&str, &str)] = &[
    ("TIMER_POLLING_INTERVAL", "engine.poll_interval"),
    ("TIMER_BATCH_SIZE", "engine.batch_size"),
    ("TIMER_DB_PATH", "store.url"),
    ("TIMER_BROKER_URL", "broker.url"),
];

/// The HTTP API, with health and metrics on the same address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// Address of the API, health and metrics. Without `http.token`, `http.keys` or `http.jwt`
    /// the API has no authentication: bind it to a private address, or set one.
    #[schemars(with = "String")]
    pub addr: SocketAddr,
    /// Longest a request may take (not the event stream); a slower one is answered 408.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub request_timeout: Duration,
    /// When set, every `/v1/...` request (the event stream too) needs `Authorization: Bearer
    /// <token>` (or a key of `http.keys`, or a JWT of `http.jwt`), and is answered 401 without
    /// it; `/healthz`, `/readyz` and `/metrics` stay open. This token may use every tenant with
    /// every scope (audit name `token`). The CLI client sends it (`--token`, by default this
    /// key). Must not be empty. `check-config` shows `***`.
    pub token: Option<String>,
    /// API keys, each with a name, the SHA-256 of the key (`timer-service hash-token KEY`),
    /// the tenants it may use (or `["*"]`) and its scopes (`read`, `write`, `admin`). Any key,
    /// `http.token` or `http.jwt` turns authentication on.
    pub keys: Vec<crate::auth::ApiKey>,
    /// JWT bearer tokens from an identity provider: `hs256_secret` or `jwks_file`, `audience`,
    /// `issuer`, `tenants_claim` (default `tenants`), `scopes_claim` (default `scope`).
    pub jwt: Option<crate::auth::JwtConfig>,
    /// Serve HTTPS with this certificate chain (PEM); needs `http.tls_key`.
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of `http.tls_cert`.
    pub tls_key: Option<PathBuf>,
    /// With HTTPS: require a client certificate signed by a CA of this file (PEM).
    pub tls_client_ca: Option<PathBuf>,
    /// Serve the web dashboard at `/ui/` (its files are in the binary; it reads and steers
    /// timers through the API, with the same token). `false` leaves `/ui/` unrouted (404).
    pub ui: bool,
    /// How old the counts in `GET /v1/status` and in the first page of `GET /v1/summary` may
    /// be. Counting reads every timer of a tenant, so the counts are shared by every reader
    /// and counted again in the background once half this old (`countedAt` in the answers
    /// says when); `0s` counts for every request.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub counts_max_age: Duration,
    /// Most connections served at once (the event streams count); further clients wait in the
    /// listen backlog until one closes, so slow or idle clients cannot take every task and
    /// file descriptor. At least 1.
    pub max_connections: usize,
    /// How long a client may take to send a request's headers before its connection is closed
    /// (a client that trickles them in, byte by byte, would hold a connection for ever).
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub header_read_timeout: Duration,
    /// Most `GET /v1/events` streams open at once; one more is answered 503.
    pub max_event_streams: usize,
    /// How many bytes of events one event stream may have waiting for its client. A client
    /// that reads slower than its events come is sent `lagged` (how many of its events it
    /// missed) and its stream is closed; it connects again to go on. No reader, however slow,
    /// makes the service keep more than this for it.
    pub event_stream_buffer: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            addr: SocketAddr::from(([127, 0, 0, 1], 8080)),
            request_timeout: Duration::from_secs(10),
            token: None,
            keys: Vec::new(),
            jwt: None,
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
            ui: true,
            counts_max_age: Duration::from_secs(5),
            max_connections: 1_024,
            header_read_timeout: Duration::from_secs(10),
            max_event_streams: 256,
            event_stream_buffer: 1024 * 1024,
        }
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// For people.
    Text,
    /// One JSON object per line, for log shippers.
    Json,
}

/// Logging. Logs go to stderr.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// `text` for people, `json` (one object per line) for log shippers.
    pub format: LogFormat,
    /// A tracing filter such as `info` or `timer_core=debug,info`. The `RUST_LOG` environment
    /// variable overrides it.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::Text,
            level: "info".into(),
        }
    }
}

/// The top level as read; plugin sections are checked separately by kind.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct TopLevel {
    store: Option<figment::value::Value>,
    broker: Option<figment::value::Value>,
    engine: EngineConfig,
    http: HttpConfig,
    limits: Limits,
    log: LogConfig,
}

/// The effective configuration.
#[derive(Debug)]
pub struct Config {
    pub store: Box<dyn StoreConfig>,
    pub broker: Box<dyn BrokerConfig>,
    pub engine: EngineConfig,
    pub http: HttpConfig,
    pub limits: Limits,
    pub log: LogConfig,
}

/// The layered sources, highest last. `path` is `--config`; it must exist when given.
pub fn figment(path: Option<&Path>) -> Result<Figment, Error> {
    let mut figment = Figment::new();
    match path {
        Some(p) if !p.is_file() => {
            return Err(Error::config(format!(
                "config file {} does not exist or is not a file",
                p.display()
            )))
        }
        Some(p) => figment = figment.merge(Toml::file_exact(p)),
        None => {
            let default = PathBuf::from(DEFAULT_CONFIG_FILE);
            if default.is_file() {
                figment = figment.merge(Toml::file_exact(default));
            }
        }
    }
    for (var, key) in SEED_ENV {
        figment = figment.merge(Env::raw().only(&[var]).map(move |_| (*key).into()));
    }
    let seed_names: Vec<String> = SEED_ENV
        .iter()
        .map(|(var, _)| var.trim_start_matches("TIMER_").to_ascii_lowercase())
        .collect();
    let env = Env::prefixed("TIMER_")
        .filter(move |key| {
            let key = key.as_str().to_ascii_lowercase();
            // TIMER_TEST_* belongs to the test suite and TIMER_CONFIG to `--config`.
            !key.starts_with("test_") && key != "config" && !seed_names.contains(&key)
        })
        .split("__");
    Ok(figment.merge(env))
}

/// Reads and checks the whole configuration.
pub fn load(figment: &Figment) -> Result<Config, Error> {
    let top: TopLevel = figment.extract().map_err(|e| figment_err(e, None))?;
    let locate = |key: &str| locate(figment, key);
    let store = plugin_of(
        figment,
        "store",
        &timer_stores::PLUGINS,
        default_store_kind(),
    )?;
    let store = (store.load)(&section(figment, "store", &locate)?)?;
    let broker = plugin_of(
        figment,
        "broker",
        &timer_brokers::PLUGINS,
        DEFAULT_BROKER_KIND,
    )?;
    let broker = (broker.load)(&section(figment, "broker", &locate)?)?;
    let _ = (top.store, top.broker);
    let config = Config {
        store,
        broker,
        engine: top.engine,
        http: top.http,
        limits: top.limits,
        log: top.log,
    };
    validate(&config)?;
    Ok(config)
}

/// `store.kind` when none is given: `sqlite`, or `memory` in a build without SQLite.
pub fn default_store_kind() -> &'static str {
    if cfg!(feature = "sqlite") {
        "sqlite"
    } else {
        "memory"
    }
}

fn validate(config: &Config) -> Result<(), Error> {
    let e = &config.engine;
    e.check()?;
    if e.lease < Duration::from_secs(1) {
        return Err(Error::config(
            "engine.lease must be at least 1s (it is renewed every third of it while a publish runs)",
        ));
    }
    config.store.check(e)?;
    config.broker.check(e)?;
    if config
        .http
        .token
        .as_deref()
        .is_some_and(|t| t.trim().is_empty())
    {
        return Err(Error::config(
            "http.token is empty; leave it out to disable authentication",
        ));
    }
    crate::auth::Auth::from_config(&config.http)?;
    let http = &config.http;
    if http.tls_cert.is_some() != http.tls_key.is_some() {
        return Err(Error::config(
            "http.tls_cert and http.tls_key go together (HTTPS needs both)",
        ));
    }
    if http.tls_client_ca.is_some() && http.tls_cert.is_none() {
        return Err(Error::config(
            "http.tls_client_ca needs HTTPS (http.tls_cert and http.tls_key)",
        ));
    }
    crate::https::server_config(http)?;
    if http.max_connections == 0 {
        return Err(Error::config("http.max_connections must be at least 1"));
    }
    if http.header_read_timeout.is_zero() {
        return Err(Error::config(
            "http.header_read_timeout must be more than 0s (no request could be read)",
        ));
    }
    if config.limits.max_id_bytes == 0 || config.limits.max_message_bytes == 0 {
        return Err(Error::config(
            "limits.max_id_bytes and limits.max_message_bytes must be at least 1",
        ));
    }
    if config.limits.max_batch == 0 || config.limits.max_batch_bytes == 0 {
        return Err(Error::config(
            "limits.max_batch and limits.max_batch_bytes must be at least 1",
        ));
    }
    config.limits.rate.check()?;
    Ok(())
}

/// Reads `<section>.kind`, checks it against the kinds the registry knows and the ones compiled
/// in, and gives that plugin's descriptor.
fn plugin_of<P>(
    figment: &Figment,
    section: &str,
    registry: &Registry<P>,
    default: &str,
) -> Result<&'static P, Error> {
    let key = format!("{section}.kind");
    let given: Option<String> = figment.extract_inner(&key).ok();
    let given = given.as_deref().unwrap_or(default);
    let source = source_of(figment, &key);
    let list = |kinds: &mut dyn Iterator<Item = &str>| kinds.collect::<Vec<_>>().join(", ");
    let Some(known) = registry.known(given) else {
        return Err(Error::config(format!(
            "{key} = {given:?}{source}: unknown {section} kind (known: {})",
            list(&mut registry.kinds())
        )));
    };
    known.plugin.ok_or_else(|| {
        Error::unsupported(format!(
            "{key} = {given:?}{source}: {section} \"{}\" is not compiled in; rebuild with \
             --features {} (compiled in: {})",
            known.kind,
            known.kind,
            list(&mut registry.compiled_kinds())
        ))
    })
}

/// The `name` section as its plugin reads it: the merged keys of every source.
fn section<'a>(
    figment: &Figment,
    name: &'a str,
    locate: &'a dyn Fn(&str) -> String,
) -> Result<ConfigSection<'a>, Error> {
    let value = match figment.find_value(name) {
        Ok(value) => value
            .deserialize::<serde_json::Value>()
            .map_err(|e| figment_err(e, Some(name)))?,
        Err(_) => serde_json::Value::Null,
    };
    Ok(ConfigSection {
        name,
        value,
        locate,
    })
}

/// Where `key` was set, as ` (environment variable TIMER_STORE__URL)` or
/// ` (in TOML file x.toml)`; empty when figment does not know.
fn locate(figment: &Figment, key: &str) -> String {
    figment
        .find_metadata(key)
        .map(|m| from(m, key))
        .unwrap_or_default()
}

/// " (from <source>)" for a key, when figment knows where it came from.
fn source_of(figment: &Figment, key: &str) -> String {
    figment
        .find_metadata(key)
        .map(|m| match &m.source {
            Some(source) => format!(" (from {} {})", m.name, source),
            None => format!(" (from {})", m.name),
        })
        .unwrap_or_default()
}

fn figment_err(e: figment::Error, section: Option<&str>) -> Error {
    let messages: Vec<String> = e.into_iter().map(|e| describe(&e, section)).collect();
    Error::config(format!("invalid configuration: {}", messages.join("; ")))
}

/// One figment error as `key: problem (where it came from)`.
fn describe(e: &figment::Error, section: Option<&str>) -> String {
    let mut path: Vec<&str> = e.path.iter().map(String::as_str).collect();
    if let Some(section) = section {
        // extract_inner reports the section after the field ("url.store"); put it first.
        if path.last() == Some(&section) {
            path.pop();
        }
        if path.first() != Some(&section) {
            path.insert(0, section);
        }
    }
    let key = path.join(".");
    let from = e
        .metadata
        .as_ref()
        .map(|m| from(m, &key))
        .unwrap_or_default();
    if key.is_empty() {
        format!("{}{from}", e.kind)
    } else {
        format!("{key}: {}{from}", e.kind)
    }
}

/// ` (environment variable X)`, ` (in TOML file x.toml)` or ` (from <provider>)` for `key` set
/// by the source `m` describes.
fn from(m: &figment::Metadata, key: &str) -> String {
    if m.name.contains("environment") {
        return format!(" (environment variable {})", env_name(key));
    }
    match &m.source {
        Some(source) => format!(" (in {} {source})", m.name),
        None => format!(" (from {})", m.name),
    }
}

/// The environment variable that sets `key`: a seed name when that one is set, else `TIMER_…`.
fn env_name(key: &str) -> String {
    SEED_ENV
        .iter()
        .find(|(var, k)| *k == key && std::env::var_os(var).is_some())
        .map(|(var, _)| (*var).to_owned())
        .unwrap_or_else(|| format!("TIMER_{}", key.to_ascii_uppercase().replace('.', "__")))
}

/// The effective config as TOML, with secrets replaced by `***`.
pub fn render_redacted(config: &Config) -> Result<String, Error> {
    let mut value = to_toml(config)?;
    redact(&mut value, "");
    toml::to_string_pretty(&value)
        .map_err(|e| Error::internal("cannot render the config").with_source(e))
}

/// The effective config as a TOML value: every section, plugin sections as their plugins render
/// them; keys left unset (`None`) are left out.
fn to_toml(config: &Config) -> Result<toml::Value, Error> {
    fn toml(value: impl Serialize) -> Result<toml::Value, Error> {
        toml::Value::try_from(value)
            .map_err(|e| Error::internal("cannot render the config").with_source(e))
    }
    let mut table = toml::Table::new();
    table.insert("store".into(), toml(config.store.to_value()?)?);
    table.insert("broker".into(), toml(config.broker.to_value()?)?);
    table.insert("engine".into(), toml(&config.engine)?);
    table.insert("http".into(), toml(&config.http)?);
    table.insert("limits".into(), toml(&config.limits)?);
    table.insert("log".into(), toml(&config.log)?);
    Ok(toml::Value::Table(table))
}

/// Replaces secret-looking values and the password inside URLs, recursively.
pub fn redact(value: &mut toml::Value, key: &str) {
    match value {
        toml::Value::Table(table) => {
            for (k, v) in table.iter_mut() {
                redact(v, k);
            }
        }
        toml::Value::Array(items) => items.iter_mut().for_each(|v| redact(v, key)),
        toml::Value::String(s) => {
            if !s.is_empty() && redact::is_secret_key(key) {
                *s = "***".into();
            } else {
                *s = redact::redact_url(s);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
// figment's Jail closures return figment::Error, which is large; that is its API.
#[allow(clippy::result_large_err)]
mod tests {
    use super::*;
    use figment::Jail;

    fn load_in_jail(toml: Option<&str>) -> Result<Config, Error> {
        let figment = match toml {
            Some(_) => figment(Some(Path::new("test.toml")))?,
            None => figment(None)?,
        };
        load(&figment)
    }

    /// The error `load` gives with these environment variables set (and nothing else).
    fn refused_with(env: &[(&str, &str)]) -> String {
        let mut error = String::new();
        Jail::expect_with(|jail| {
            for (name, value) in env {
                jail.set_env(name, value);
            }
            error = match load_in_jail(None) {
                Ok(_) => "loaded without an error".into(),
                Err(e) => e.to_string(),
            };
            Ok(())
        });
        error
    }

    #[test]
    fn defaults_are_the_embedded_setup() {
        Jail::expect_with(|_| {
            let c = load_in_jail(None).map_err(|e| e.to_string())?;
            assert_eq!(c.broker.kind(), "memory");
            #[cfg(feature = "sqlite")]
            assert_eq!(c.store.kind(), "sqlite");
            assert_eq!(c.http.addr.to_string(), "127.0.0.1:8080");
            assert_eq!(c.engine.poll_interval, Duration::from_secs(5));
            Ok(())
        });
    }

    #[test]
    fn env_overrides_file_and_nests_with_double_underscore() {
        Jail::expect_with(|jail| {
            jail.create_file("test.toml", "[engine]\nbatch_size = 7\npoll_interval = \"2s\"\n[http]\naddr = \"127.0.0.1:9000\"\n")?;
            jail.set_env("TIMER_HTTP__ADDR", "127.0.0.1:9100");
            jail.set_env("TIMER_TEST_REQUIRE", "1");
            let c = load_in_jail(Some("")).map_err(|e| e.to_string())?;
            assert_eq!(c.engine.batch_size, 7);
            assert_eq!(c.engine.poll_interval, Duration::from_secs(2));
            assert_eq!(c.http.addr.to_string(), "127.0.0.1:9100");
            Ok(())
        });
    }

    #[test]
    fn seed_environment_names_work() {
        Jail::expect_with(|jail| {
            jail.set_env("TIMER_POLLING_INTERVAL", "250");
            jail.set_env("TIMER_BATCH_SIZE", "42");
            // The seed's store name is the SQLite file: a build without SQLite has no such key.
            #[cfg(feature = "sqlite")]
            jail.set_env("TIMER_DB_PATH", "/tmp/x/event_service.db");
            let c = load_in_jail(None).map_err(|e| e.to_string())?;
            assert_eq!(c.engine.poll_interval, Duration::from_millis(250));
            assert_eq!(c.engine.batch_size, 42);
            #[cfg(feature = "sqlite")]
            match c
                .store
                .as_any()
                .downcast_ref::<timer_stores::sqlite::SqliteConfig>()
            {
                Some(s) => assert_eq!(s.path(), "/tmp/x/event_service.db"),
                None => panic!("{:?}", c.store),
            }
            Ok(())
        });
    }

    #[test]
    fn unknown_kind_lists_the_known_ones() {
        let e = refused_with(&[("TIMER_STORE__KIND", "nope")]);
        assert!(e.contains("store.kind = \"nope\""), "{e}");
        assert!(e.contains("known: memory, sqlite, postgres"), "{e}");
        assert!(e.contains("TIMER_"), "names the source: {e}");
    }

    #[test]
    fn kind_not_compiled_in_names_the_feature() {
        // A registry of its own: with --all-features every real kind is compiled in.
        use timer_core::plugin::{BrokerPlugin, Known};
        static LINES: &[Known<BrokerPlugin>] = &[
            Known {
                kind: "memory",
                plugin: Some(&timer_brokers::memory::PLUGIN),
            },
            Known {
                kind: "kafka",
                plugin: None,
            },
        ];
        Jail::expect_with(|jail| {
            jail.set_env("TIMER_BROKER__KIND", "kafka");
            let figment = figment(None).map_err(|e| e.to_string())?;
            let Err(e) = plugin_of(&figment, "broker", &Registry(LINES), "memory") else {
                panic!("kafka is not compiled into this registry");
            };
            assert_eq!(e.kind(), timer_core::ErrorKind::Unsupported);
            let e = e.to_string();
            assert!(
                e.contains("broker \"kafka\" is not compiled in; rebuild with --features kafka"),
                "{e}"
            );
            assert!(e.contains("compiled in: memory"), "{e}");
            assert!(e.contains("TIMER_"), "names the source: {e}");
            Ok(())
        });
    }

    #[cfg(feature = "kafka")]
    #[test]
    fn kafka_publish_timeout_must_stay_below_the_engines() {
        Jail::expect_with(|jail| {
            jail.set_env("TIMER_BROKER__KIND", "kafka");
            jail.set_env("TIMER_BROKER__PUBLISH_TIMEOUT", "20s");
            let e = load_in_jail(None).unwrap_err().to_string();
            assert!(
                e.contains("broker.publish_timeout") && e.contains("engine.publish_timeout"),
                "{e}"
            );
            jail.set_env("TIMER_BROKER__PUBLISH_TIMEOUT", "10s");
            assert!(load_in_jail(None).is_ok());
            Ok(())
        });
    }

    /// Every file in `config/` loads through the real loader, and one named after a plugin
    /// (`config/nats.toml`) configures that plugin.
    #[cfg(all(
        feature = "sqlite",
        feature = "postgres",
        feature = "nats",
        feature = "kafka",
        feature = "rabbitmq"
    ))]
    #[test]
    fn every_config_file_loads() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config");
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .expect("the config directory")
            .map(|entry| entry.expect("a config directory entry").path())
            .filter(|path| path.extension().is_some_and(|e| e == "toml"))
            .collect();
        files.sort();
        assert!(
            files.len() >= 2,
            "config files in {}: {files:?}",
            dir.display()
        );
        Jail::expect_with(|_| {
            for file in &files {
                let c = figment(Some(file))
                    .and_then(|f| load(&f))
                    .map_err(|e| format!("{}: {}", file.display(), e.chain()))?;
                let stem = file
                    .file_stem()
                    .and_then(|s| s.to_str())
                    .unwrap_or_default();
                if timer_stores::PLUGINS.known(stem).is_some() {
                    assert_eq!(c.store.kind(), stem, "{}", file.display());
                } else if timer_brokers::PLUGINS.known(stem).is_some() {
                    assert_eq!(c.broker.kind(), stem, "{}", file.display());
                }
            }
            Ok(())
        });
    }

    #[test]
    fn engine_settings_that_would_spin_are_refused() {
        let e = refused_with(&[("TIMER_ENGINE__PURGE_INTERVAL", "0s")]);
        assert!(e.contains("engine.purge_interval"), "{e}");
    }

    #[test]
    fn typo_in_a_key_is_an_error_naming_key_and_file() {
        Jail::expect_with(|jail| {
            jail.create_file("test.toml", "[engine]\npoll_intervall = \"1s\"\n")?;
            let e = load_in_jail(Some("")).unwrap_err().to_string();
            assert!(e.contains("poll_intervall"), "{e}");
            assert!(e.contains("test.toml"), "{e}");
            jail.create_file("test.toml", "[store]\nkind = \"memory\"\nurl = \"x\"\n")?;
            let e = load_in_jail(Some("")).unwrap_err().to_string();
            assert!(
                e.contains("url"),
                "plugin sections reject unknown keys too: {e}"
            );
            Ok(())
        });
    }

    #[test]
    fn bad_values_are_errors() {
        let e = refused_with(&[("TIMER_ENGINE__POLL_INTERVAL", "soon")]).to_lowercase();
        assert!(
            e.contains("soon") && e.contains("engine.poll_interval"),
            "{e}"
        );
        let e = refused_with(&[("TIMER_HTTP__TOKEN", " ")]);
        assert!(e.contains("http.token is empty"), "{e}");
        let e = refused_with(&[("TIMER_ENGINE__BATCH_SIZE", "0")]);
        assert!(e.contains("engine.batch_size"), "{e}");
        Jail::expect_with(|_| {
            let e = figment(Some(Path::new("missing.toml")))
                .unwrap_err()
                .to_string();
            assert!(e.contains("missing.toml"), "{e}");
            Ok(())
        });
    }

    #[test]
    fn redaction_hides_secrets() {
        assert_eq!(
            redact::redact_url("postgres://app:hunter2@db:5432/timers"),
            "postgres://app:***@db:5432/timers"
        );
        assert_eq!(
            redact::redact_url("sqlite://timer-service.db"),
            "sqlite://timer-service.db"
        );
        let mut v: toml::Value = toml::from_str("[broker]\nurl = \"nats://u:pw@h:4222\"\ntoken = \"abc\"\n[x]\nsasl_password = \"p\"\nname = \"ok\"").unwrap();
        redact(&mut v, "");
        let text = toml::to_string(&v).unwrap();
        assert!(
            !text.contains("pw@") && !text.contains("abc") && !text.contains("\"p\""),
            "{text}"
        );
        assert!(text.contains("name = \"ok\""));
        // librdkafka properties as written in [broker.properties].
        let mut v: toml::Value = toml::from_str(
            "[broker.properties]\n\"sasl.password\" = \"s1\"\n\"ssl.key.pem\" = \"s2\"\n\
             \"sasl.oauthbearer.client.secret\" = \"s3\"\n\"ssl.keystore.password\" = \"s4\"\n\
             \"sasl.mechanisms\" = \"PLAIN\"",
        )
        .unwrap();
        redact(&mut v, "");
        let text = toml::to_string(&v).unwrap();
        for secret in ["s1", "s2", "s3", "s4"] {
            assert!(!text.contains(secret), "{secret} shown: {text}");
        }
        assert!(text.contains("PLAIN"), "{text}");
    }
}
