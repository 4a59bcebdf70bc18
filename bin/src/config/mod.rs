//! Configuration: built-in defaults ← TOML file (`--config`, else `config/timer-service.toml` if
//! present) ← the seed's environment names ← `TIMER_*` environment (`__` nests:
//! `TIMER_STORE__URL`). Each plugin section is loaded by the plugin its `kind` names, found in
//! the plugin crate's registry (`timer_stores::PLUGINS`, `timer_brokers::PLUGINS`), after the
//! kind was checked against what is known and what is compiled in.

pub mod auth;
mod environment;
mod render;
mod sections;

use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::providers::{Env, Format, Toml};
use figment::Figment;
use serde::Deserialize;
use timer_core::config::TargetRules;
use timer_core::plugin::{BrokerConfig, ConfigSection, Registry, StoreConfig};
use timer_core::{redact, EngineConfig, Error, Limits};

use environment::Environment;
pub use render::render_redacted;
pub use sections::{HttpConfig, LogConfig, LogFormat, OtlpProtocol, TelemetryConfig};

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

/// The top level as read; plugin sections are checked separately by kind.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct TopLevel {
    store: Option<figment::value::Value>,
    broker: Option<figment::value::Value>,
    engine: EngineConfig,
    http: HttpConfig,
    limits: Limits,
    targets: TargetRules,
    #[cfg(feature = "webhook")]
    webhooks: timer_brokers::webhook::WebhookConfig,
    log: LogConfig,
    telemetry: TelemetryConfig,
}

/// The effective configuration.
#[derive(Debug)]
pub struct Config {
    pub store: Box<dyn StoreConfig>,
    pub broker: Box<dyn BrokerConfig>,
    pub engine: EngineConfig,
    pub http: HttpConfig,
    pub limits: Limits,
    /// How HTTP targets are called and signed (`[webhooks]`).
    #[cfg(feature = "webhook")]
    pub webhooks: timer_brokers::webhook::WebhookConfig,
    pub log: LogConfig,
    /// Span export over OTLP (`[telemetry]`).
    pub telemetry: TelemetryConfig,
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
    Ok(figment.merge(Environment::timer(seed_names)))
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
        limits: Limits {
            targets: top.targets,
            ..top.limits
        },
        #[cfg(feature = "webhook")]
        webhooks: top.webhooks,
        log: top.log,
        telemetry: top.telemetry,
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

/// The least `http.event_stream_buffer`: room for a few events with large payloads.
const MIN_EVENT_STREAM_BUFFER: usize = 64 * 1024;

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
    if http.max_connections == 0 {
        return Err(Error::config("http.max_connections must be at least 1"));
    }
    if http.header_read_timeout.is_zero() {
        return Err(Error::config(
            "http.header_read_timeout must be more than 0s (no request could be read)",
        ));
    }
    if http.request_timeout.is_zero() {
        return Err(Error::config(
            "http.request_timeout must be more than 0s (every request would be answered 408)",
        ));
    }
    if http.max_event_streams == 0 {
        return Err(Error::config(
            "http.max_event_streams must be at least 1 (every GET /v1/events would be answered \
             503); to keep a key from the event stream, leave it without the read scope",
        ));
    }
    if http.max_event_streams_per_key == 0 {
        return Err(Error::config(
            "http.max_event_streams_per_key must be at least 1; to keep a key from the event \
             stream, leave it without the read scope",
        ));
    }
    if http.max_event_streams >= http.max_connections {
        return Err(Error::config(format!(
            "http.max_event_streams ({}) must be less than http.max_connections ({}): event \
             streams held open would take every connection, /healthz and /readyz included",
            http.max_event_streams, http.max_connections
        )));
    }
    if http.event_stream_buffer < MIN_EVENT_STREAM_BUFFER {
        return Err(Error::config(format!(
            "http.event_stream_buffer is {} bytes, less than {MIN_EVENT_STREAM_BUFFER}: a stream \
             would be closed as lagging at its first large events",
            http.event_stream_buffer
        )));
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
    log_filter("log.level", &config.log.level)?;
    config.limits.rate.check()?;
    config.limits.targets.check()?;
    config.limits.fire_rate.check()?;
    config.telemetry.check()?;
    #[cfg(feature = "webhook")]
    config.webhooks.check()?;
    Ok(())
}

/// The log filter `filter` (`log.level`, or `RUST_LOG` when set, as `name` says): a level, or
/// `target=level` directives separated by commas. A bare word that is not a level (`warning`)
/// would be read as a target logged at every level, leaving every other target's lines out:
/// refused, with the levels named.
pub fn log_filter(name: &str, filter: &str) -> Result<tracing_subscriber::EnvFilter, Error> {
    use tracing_subscriber::filter::LevelFilter;
    if filter.trim().is_empty() {
        return Err(Error::config(format!(
            "{name} is empty: give a level (trace, debug, info, warn, error, off)"
        )));
    }
    for directive in filter.split(',').map(str::trim) {
        let target_only = !directive.contains('=') && !directive.contains('[');
        if target_only && directive.parse::<LevelFilter>().is_err() {
            return Err(Error::config(format!(
                "{name}: {directive:?} is not a level (trace, debug, info, warn, error, off); a \
                 level for one target is written target=level"
            )));
        }
    }
    tracing_subscriber::EnvFilter::builder()
        .parse(filter)
        .map_err(|e| Error::config(format!("{name} {filter:?}: {e}")))
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
        return format!("{}{from}", e.kind);
    }
    if path.last().is_some_and(|k| redact::is_secret_key(k)) {
        // The error would quote the value: a secret, never printed.
        let expected = match &e.kind {
            figment::error::Kind::InvalidType(_, expected) => format!(": expected {expected}"),
            _ => String::new(),
        };
        return format!("{key}: {}{expected}{from}", redact::NOT_SHOWN);
    }
    format!("{key}: {}{from}", e.kind)
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

#[cfg(test)]
mod tests;
