//! The configuration reference, generated: every section's keys with their defaults and doc
//! comments, read from the config structs' JSON Schema (`schemars`), so the struct doc comments
//! are the one place a key is described. From it come the reference in `config/README.md` and
//! the example file `config/timer-service.example.toml`; the metrics table in
//! `docs/src/operations/metrics.md` comes from the engine's metric list. The `docs` tests fail
//! when a checked-in copy differs from what the code generates, and rewrite it when run with
//! `UPDATE_DOCS=1`.

use std::fmt::Write as _;

use schemars::{JsonSchema, Schema};
use serde_json::Value;
use timer_core::config::{FireRateLimits, RateLimits, TargetRules};
use timer_core::engine::metric;
use timer_core::plugin::Registry;
use timer_core::{EngineConfig, Limits};

use crate::config::{HttpConfig, LogConfig, TelemetryConfig, DEFAULT_BROKER_KIND};

/// One config section as documented: `[engine]`, or `[store]` of one kind.
pub struct Section {
    /// The TOML table: `store`, `broker`, `engine`, `limits`, `limits.rate`, `targets`,
    /// `webhooks`, `http`, `log`, `telemetry`.
    pub table: &'static str,
    /// For `store` and `broker`: the plugin kind this section is read as.
    pub kind: Option<&'static str>,
    /// The struct's doc comment.
    pub doc: String,
    pub keys: Vec<Key>,
}

/// One key of a section.
pub struct Key {
    pub name: String,
    /// The default as TOML text; `None` when the key is unset by default.
    pub default: Option<String>,
    /// The field's doc comment, as one paragraph.
    pub doc: String,
}

impl Section {
    fn new(table: &'static str, kind: Option<&'static str>, schema: &Schema) -> Section {
        let mut keys: Vec<Key> = schema
            .get("properties")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
            // `kind` picks the section's plugin; it is documented once, above the sections.
            .filter(|(name, _)| !(kind.is_some() && name.as_str() == "kind"))
            .map(|(name, property)| Key {
                name: name.clone(),
                default: property.get("default").and_then(toml_text),
                doc: paragraph(property.get("description")),
            })
            .collect();
        keys.sort_by(|a, b| a.name.cmp(&b.name));
        Section {
            table,
            kind,
            doc: paragraph(schema.get("description")),
            keys,
        }
    }

    /// The heading: `engine`, `store: sqlite`. Its anchor is `engine`, `store-sqlite`.
    pub fn heading(&self) -> String {
        match self.kind {
            Some(kind) => format!("{}: {kind}", self.table),
            None => self.table.to_owned(),
        }
    }
}

/// Every section of every plugin this build has, in the order of the example file: store,
/// broker, engine, limits, limits.rate, limits.fire_rate, targets, webhooks, http, log,
/// telemetry.
pub fn sections() -> Vec<Section> {
    fn plugin_sections<P>(
        table: &'static str,
        registry: &Registry<P>,
        schema: impl Fn(&P) -> (&'static str, Schema),
    ) -> Vec<Section> {
        registry
            .iter()
            .map(|plugin| {
                let (kind, schema) = schema(plugin);
                Section::new(table, Some(kind), &schema)
            })
            .collect()
    }
    fn plain<C: JsonSchema>(table: &'static str) -> Section {
        Section::new(table, None, &schemars::schema_for!(C))
    }
    let mut sections = plugin_sections("store", &timer_stores::PLUGINS, |p| (p.kind, (p.schema)()));
    sections.extend(plugin_sections("broker", &timer_brokers::PLUGINS, |p| {
        (p.kind, (p.schema)())
    }));
    sections.push(plain::<EngineConfig>("engine"));
    let mut limits = plain::<Limits>("limits");
    // Tables of their own, after the plain limits.
    limits
        .keys
        .retain(|key| key.name != "rate" && key.name != "fire_rate");
    sections.push(limits);
    sections.push(plain::<RateLimits>("limits.rate"));
    sections.push(plain::<FireRateLimits>("limits.fire_rate"));
    sections.push(plain::<TargetRules>("targets"));
    #[cfg(feature = "webhook")]
    sections.push(plain::<timer_brokers::webhook::WebhookConfig>("webhooks"));
    sections.push(plain::<HttpConfig>("http"));
    sections.push(plain::<LogConfig>("log"));
    sections.push(plain::<TelemetryConfig>("telemetry"));
    sections
}

/// The reference as Markdown: the kinds, then a table per section.
pub fn markdown(sections: &[Section]) -> String {
    let mut out = String::new();
    let kinds = |table: &str| {
        let kinds: Vec<String> = sections
            .iter()
            .filter(|s| s.table == table)
            .filter_map(|s| s.kind)
            .map(|k| format!("[`{k}`](#{table}-{k})"))
            .collect();
        kinds.join(", ")
    };
    let _ = writeln!(
        out,
        "`store.kind` picks the store, one of {} (default `{:?}`), and `broker.kind` the broker, \
         one of {} (default `{:?}`). The rest of `[store]` and `[broker]` is read as the chosen \
         kind's section below; a key of another kind is an error.",
        kinds("store"),
        crate::config::default_store_kind(),
        kinds("broker"),
        DEFAULT_BROKER_KIND,
    );
    for section in sections {
        let _ = write!(out, "\n### {}\n\n", section.heading());
        if !section.doc.is_empty() {
            let _ = writeln!(out, "{}", section.doc);
        }
        if let Some(kind) = section.kind {
            let folder = format!("{}s/src/{kind}", section.table);
            let _ = write!(
                out,
                "Set `{}.kind = {kind:?}`; cargo feature `{kind}`; operations: \
                 [{folder}/README.md](../{folder}/README.md).\n\n",
                section.table
            );
        } else if !section.doc.is_empty() {
            out.push('\n');
        }
        if section.keys.is_empty() {
            let _ = writeln!(out, "No keys besides `kind`.");
            continue;
        }
        out.push_str("| key | default | meaning |\n|---|---|---|\n");
        for key in &section.keys {
            let default = match &key.default {
                Some(text) => format!("`{text}`"),
                None => "not set".to_owned(),
            };
            let _ = writeln!(
                out,
                "| `{}.{}` | {} | {} |",
                section.table,
                key.name,
                default.replace('|', "\\|"),
                key.doc.replace('|', "\\|")
            );
        }
    }
    out
}

/// The example config file: the default store and broker, then engine, limits, http and log,
/// every key at its default with its doc comment above it.
pub fn example_toml(sections: &[Section]) -> String {
    let mut out = String::from(
        "# timer-service configuration: every key at its default, with what it does.\n\
         # Generated from the config structs' doc comments (bin/src/reference.rs); the reference,\n\
         # with the keys of every store and broker, is config/README.md. Copy this file to\n\
         # config/timer-service.toml (read when present) or pass it with --config FILE.\n",
    );
    let chosen = |s: &&Section| match s.table {
        "store" => s.kind == Some(crate::config::default_store_kind()),
        "broker" => s.kind == Some(DEFAULT_BROKER_KIND),
        _ => true,
    };
    for section in sections.iter().filter(chosen) {
        let _ = write!(out, "\n[{}]\n", section.table);
        if let Some(kind) = section.kind {
            comment(&mut out, &section.doc);
            comment(
                &mut out,
                "The other kinds and their keys: config/README.md.",
            );
            let _ = writeln!(out, "kind = {kind:?}");
        }
        for key in &section.keys {
            out.push('\n');
            comment(&mut out, &key.doc);
            match &key.default {
                Some(text) => {
                    let _ = writeln!(out, "{} = {text}", key.name);
                }
                None => {
                    let _ = writeln!(out, "# {} is not set by default.", key.name);
                }
            }
        }
    }
    out
}

/// The metrics table of `docs/src/operations/metrics.md`, from the engine's metric list.
pub fn metrics_markdown() -> String {
    let mut out = String::from("| Prometheus name | type | meaning |\n|---|---|---|\n");
    #[cfg(feature = "webhook")]
    let all = metric::ALL
        .iter()
        .chain(timer_brokers::webhook::metric::ALL);
    #[cfg(not(feature = "webhook"))]
    let all = metric::ALL.iter();
    for (name, kind, help) in all {
        let kind = match kind {
            metric::Kind::Counter => "counter",
            metric::Kind::Gauge => "gauge",
            metric::Kind::Histogram => "histogram, seconds",
        };
        let _ = writeln!(
            out,
            "| `{}` | {kind} | {} |",
            name.replace('.', "_"),
            help.replace('|', "\\|")
        );
    }
    out
}

/// `text` as `# ` lines of at most 100 characters.
fn comment(out: &mut String, text: &str) {
    let mut line = String::from("#");
    for word in text.split_whitespace() {
        if line.len() + 1 + word.len() > 100 && line.len() > 1 {
            out.push_str(&line);
            out.push('\n');
            line = String::from("#");
        }
        line.push(' ');
        line.push_str(word);
    }
    if line.len() > 1 {
        out.push_str(&line);
        out.push('\n');
    }
}

/// A doc comment as one paragraph (its lines joined with spaces).
fn paragraph(description: Option<&Value>) -> String {
    let text = description.and_then(Value::as_str).unwrap_or_default();
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A JSON default as TOML text; `None` for `null` (unset).
fn toml_text(value: &Value) -> Option<String> {
    match value {
        Value::Null => None,
        Value::Object(map) if map.is_empty() => Some("{}".to_owned()),
        other => toml::Value::try_from(other)
            .ok()
            .map(|v| v.to_string())
            .or_else(|| Some(other.to_string())),
    }
}

#[cfg(test)]
mod tests;
