//! The effective configuration as TOML, secrets redacted (`check-config`).

use serde::Serialize;
use timer_core::{redact, Error};

use super::Config;

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
    table.insert("targets".into(), toml(&config.limits.targets)?);
    #[cfg(feature = "webhook")]
    table.insert("webhooks".into(), toml(&config.webhooks)?);
    table.insert("log".into(), toml(&config.log)?);
    let mut telemetry = toml(&config.telemetry)?;
    // Export headers carry a backend's credentials, whatever their names.
    if let Some(toml::Value::Table(headers)) = telemetry.get_mut("headers") {
        for (_, value) in headers.iter_mut() {
            *value = toml::Value::String("***".into());
        }
    }
    table.insert("telemetry".into(), telemetry);
    Ok(toml::Value::Table(table))
}

/// Replaces secret-looking values and the password inside URLs, recursively.
pub(super) fn redact(value: &mut toml::Value, key: &str) {
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
