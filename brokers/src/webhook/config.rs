//! The `[webhooks]` table: how HTTP targets are called and signed.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine as _;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use timer_core::config::duration;
use timer_core::Error;

/// How the service calls HTTP targets (`"target": {"url": …}`) and signs what it sends, per the
/// Standard Webhooks spec (`webhook-id`, `webhook-timestamp`, `webhook-signature`). Which URLs a
/// tenant may call is `targets.allow` (URL prefixes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct WebhookConfig {
    /// The secret every tenant's calls are signed with, unless the tenant has its own:
    /// `whsec_` and the key in base64 (24 to 64 bytes). Without one (and none of the tenant's),
    /// calls carry `webhook-id` and `webhook-timestamp` but no signature.
    pub secret: Option<String>,
    /// Tenants with secrets of their own: `acme = { secrets = ["whsec_new", "whsec_old"] }`.
    /// The first signs; every one is sent as a signature, so a receiver that knows any of them
    /// verifies (rotation: add the new one first, remove the old one once receivers moved).
    pub tenants: BTreeMap<String, TenantWebhooks>,
    /// Whether URLs may reach loopback, private, link-local (cloud metadata) and other
    /// non-public addresses. Off: such a literal address is refused at schedule time, and a name
    /// is resolved at each call and only its public addresses are connected to (so a name that
    /// changes its answer cannot reach inside).
    pub allow_private_networks: bool,
    /// The longest one call may take, answer included; then it is retried. Also the longest a
    /// call waits for its turn (`per_host_concurrency`, `concurrency`); then it is handed back.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub timeout: Duration,
    /// The longest connecting may take.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub connect_timeout: Duration,
    /// Calls at once, over all destinations.
    pub concurrency: usize,
    /// Calls at once to one host (`host:port`): a slow host fills only its own. When one ends,
    /// its turn goes to the next tenant waiting for that host (round robin).
    pub per_host_concurrency: usize,
    /// Calls that may wait for one host's turn beside those running; when that many do, a fire
    /// for the host is handed back (no attempt counted) until its tenant's line there may have
    /// moved (its calls' rounds at the host's recent pace, 1 s to 60 s), unless its tenant has
    /// fewer than an even share of the host's calls (running or waiting; one at least): so a
    /// host that answers slowly holds a bounded number of claims (at most twice
    /// `per_host_concurrency + per_host_waiting`), a big backlog is not claimed again every
    /// second, and one tenant's backlog there keeps no other tenant out.
    pub per_host_waiting: usize,
    /// Calls that may wait for a turn beside those running, over all hosts; a fire beyond it is
    /// handed back for a second (no attempt counted).
    pub max_waiting: usize,
    /// How much of an answer is read (the rest is dropped); its start goes into the timer's
    /// `lastError` when the call failed.
    pub max_answer_bytes: usize,
}

impl Default for WebhookConfig {
    fn default() -> Self {
        WebhookConfig {
            secret: None,
            tenants: BTreeMap::new(),
            allow_private_networks: false,
            timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            concurrency: 256,
            per_host_concurrency: 16,
            per_host_waiting: 256,
            max_waiting: 4096,
            max_answer_bytes: 4096,
        }
    }
}

/// One tenant's own secrets (`webhooks.tenants.<tenant>`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TenantWebhooks {
    /// `whsec_` secrets: the first signs, all are sent as signatures.
    pub secrets: Vec<String>,
}

impl WebhookConfig {
    /// Refuses what cannot work, naming the key (never a secret's value).
    pub fn check(&self) -> Result<(), Error> {
        if let Some(secret) = &self.secret {
            secret_key("webhooks.secret", secret)?;
        }
        for (tenant, own) in &self.tenants {
            let key = format!("webhooks.tenants.{tenant}.secrets");
            if own.secrets.is_empty() {
                return Err(Error::config(format!(
                    "{key}: empty; give at least one secret, or leave the tenant out"
                )));
            }
            for secret in &own.secrets {
                secret_key(&key, secret)?;
            }
        }
        for (key, value) in [
            ("webhooks.concurrency", self.concurrency),
            ("webhooks.per_host_concurrency", self.per_host_concurrency),
            ("webhooks.max_answer_bytes", self.max_answer_bytes),
        ] {
            if value == 0 {
                return Err(Error::config(format!("{key}: must be at least 1")));
            }
        }
        for (key, value) in [
            ("webhooks.timeout", self.timeout),
            ("webhooks.connect_timeout", self.connect_timeout),
        ] {
            if value.is_zero() {
                return Err(Error::config(format!("{key}: must be above 0")));
            }
        }
        Ok(())
    }

    /// The keys `tenant`'s calls are signed with, first the one that signs.
    pub(super) fn keys_of(&self, tenant: &str) -> Vec<Vec<u8>> {
        let secrets: Vec<&String> = match self.tenants.get(tenant) {
            Some(own) => own.secrets.iter().collect(),
            None => self.secret.iter().collect(),
        };
        // Checked at start-up (`check`): each one reads.
        secrets
            .into_iter()
            .filter_map(|s| secret_key("", s).ok())
            .collect()
    }
}

/// The key of a `whsec_` secret; the error names `key`, never the value.
fn secret_key(key: &str, secret: &str) -> Result<Vec<u8>, Error> {
    let Some(encoded) = secret.strip_prefix("whsec_") else {
        return Err(Error::config(format!(
            "{key}: a secret starts with `whsec_` followed by the key in base64 (Standard Webhooks)"
        )));
    };
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|_| {
            Error::config(format!(
                "{key}: the part after `whsec_` is not base64 (Standard Webhooks)"
            ))
        })?;
    if !(24..=64).contains(&bytes.len()) {
        return Err(Error::config(format!(
            "{key}: the key is {} bytes; Standard Webhooks keys are 24 to 64 bytes",
            bytes.len()
        )));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_checked_without_showing_them() {
        let good = format!(
            "whsec_{}",
            base64::engine::general_purpose::STANDARD.encode([7u8; 32])
        );
        let mut config = WebhookConfig {
            secret: Some(good.clone()),
            ..WebhookConfig::default()
        };
        config.check().unwrap();
        assert_eq!(config.keys_of("anyone"), vec![vec![7u8; 32]]);

        config.secret = Some("hunter2hunter2".into());
        let e = config.check().unwrap_err().to_string();
        assert!(e.contains("webhooks.secret") && e.contains("whsec_"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");

        config.secret = Some("whsec_!!!hunter2".into());
        let e = config.check().unwrap_err().to_string();
        assert!(e.contains("not base64") && !e.contains("hunter2"), "{e}");

        config.secret = Some("whsec_AAAA".into());
        let e = config.check().unwrap_err().to_string();
        assert!(e.contains("3 bytes"), "{e}");

        config.secret = None;
        config.tenants.insert(
            "acme".into(),
            TenantWebhooks {
                secrets: vec![good.clone(), good],
            },
        );
        config.check().unwrap();
        assert_eq!(config.keys_of("acme").len(), 2);
        assert!(config.keys_of("other").is_empty());
        config
            .tenants
            .insert("empty".into(), TenantWebhooks::default());
        let e = config.check().unwrap_err().to_string();
        assert!(e.contains("webhooks.tenants.empty.secrets"), "{e}");
    }
}
