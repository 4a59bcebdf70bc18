//! Settings the engine and the wire decoder take, with their defaults, plus the serde form of
//! durations used by every config section (`"250ms"`, `"5s"`, or a bare number of milliseconds).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Limits applied to every inbound command, on the broker path and the HTTP path alike.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Largest command accepted, in bytes.
    pub max_message_bytes: usize,
    /// Longest `tenantId`, `serviceCallId` or `correlationId`, in bytes.
    pub max_id_bytes: usize,
    /// Largest opaque `payload`, in bytes of JSON text.
    pub max_payload_bytes: usize,
    /// How far in the future a due time may lie.
    #[serde(with = "duration")]
    pub max_horizon: Duration,
    /// Most Scheduled timers one tenant may have; a new timer over it is refused with reason
    /// `tenant_limit` (rescheduling an existing one stays allowed). 0 (the default) sets no
    /// limit. Checking it counts the tenant's timers for every batch that names the tenant.
    pub max_pending_per_tenant: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_message_bytes: 256 * 1024,
            max_id_bytes: 128,
            max_payload_bytes: 64 * 1024,
            // Ten years of 365.25 days (prints as "10years").
            max_horizon: Duration::from_secs(315_576_000),
            max_pending_per_tenant: 0,
        }
    }
}

/// How the engine runs its ingest and firing tasks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// The longest the firing task sleeps without looking at the store. Exact wake-ups make
    /// timers fire on time regardless; polling finds timers other instances inserted.
    #[serde(with = "duration")]
    pub poll_interval: Duration,
    /// Most timers claimed (and commands read) in one batch.
    pub batch_size: usize,
    /// How long a claim holds a timer; a crashed instance's timers fire after it expires.
    #[serde(with = "duration")]
    pub lease: Duration,
    /// First retry delay after a failed publish; doubled per attempt up to `retry_max`.
    #[serde(with = "duration")]
    pub retry_base: Duration,
    #[serde(with = "duration")]
    pub retry_max: Duration,
    /// Random jitter on each retry delay, in percent: a delay is shortened by up to this much,
    /// so timers that failed together do not retry in lockstep. 0 turns it off.
    pub retry_jitter_percent: u32,
    /// Publish attempts before a timer is given up: it becomes `Failed` and a `TimerFailed`
    /// dead letter with the last error goes out. 0 (the default) retries forever, so a broker
    /// outage of any length loses nothing.
    pub max_attempts: u32,
    /// Reached, Cancelled and Failed timers are deleted this long after they finished; 0 keeps
    /// them forever.
    #[serde(with = "duration")]
    pub retention: Duration,
    /// How often the retention task runs, and how many rows it deletes per statement (small
    /// batches, so firing never waits long for it).
    #[serde(with = "duration")]
    pub purge_interval: Duration,
    pub purge_batch: usize,
    /// How long shutdown waits for an in-flight publish before releasing its claims.
    #[serde(with = "duration")]
    pub shutdown_grace: Duration,
    /// Name of this instance in leases; empty means `<pid>-<8 random hex digits>`.
    pub instance_id: String,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            poll_interval: Duration::from_secs(5),
            batch_size: 500,
            lease: Duration::from_secs(30),
            retry_base: Duration::from_millis(500),
            retry_max: Duration::from_secs(60),
            retry_jitter_percent: 20,
            max_attempts: 0,
            retention: Duration::from_secs(7 * 24 * 3600),
            purge_interval: Duration::from_secs(60),
            purge_batch: 1_000,
            shutdown_grace: Duration::from_secs(5),
            instance_id: String::new(),
        }
    }
}

impl EngineConfig {
    /// Checks settings that would make a task spin or a guarantee void; names the key.
    pub fn check(&self) -> crate::Result<()> {
        let bad = |key: &str, why: &str| Err(crate::Error::config(format!("engine.{key} {why}")));
        if self.batch_size == 0 {
            return bad("batch_size", "must be at least 1");
        }
        if self.lease < Duration::from_millis(100) {
            return bad(
                "lease",
                "must be at least 100ms (a publish may take half of it)",
            );
        }
        if self.poll_interval.is_zero() {
            return bad("poll_interval", "must be above 0");
        }
        if self.retry_jitter_percent > 100 {
            return bad("retry_jitter_percent", "must be between 0 and 100");
        }
        if !self.retention.is_zero() && self.purge_interval.is_zero() {
            return bad(
                "purge_interval",
                "must be above 0 while engine.retention is set (0 keeps timers forever)",
            );
        }
        if self.purge_batch == 0 {
            return bad("purge_batch", "must be at least 1");
        }
        Ok(())
    }
}

/// Serde form of a [`Duration`]: a humantime string (`"1m 30s"`, `"250ms"`) or an integer of
/// milliseconds (the seed's `TIMER_POLLING_INTERVAL=5000`). Serialized as a humantime string.
pub mod duration {
    use std::time::Duration;

    use serde::de::{self, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Duration;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a duration such as \"250ms\" or \"5s\", or a number of milliseconds")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Duration, E> {
                Ok(Duration::from_millis(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Duration, E> {
                u64::try_from(v)
                    .map(Duration::from_millis)
                    .map_err(|_| E::custom(format!("a duration cannot be negative: {v}")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
                let v = v.trim();
                if let Ok(ms) = v.parse::<u64>() {
                    return Ok(Duration::from_millis(ms));
                }
                humantime::parse_duration(v)
                    .map_err(|e| E::custom(format!("invalid duration {v:?}: {e}")))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_check_names_the_key() {
        assert!(EngineConfig::default().check().is_ok());
        type Change = fn(&mut EngineConfig);
        let cases: [(Change, &str); 4] = [
            (
                |c| c.purge_interval = Duration::ZERO,
                "engine.purge_interval",
            ),
            (
                |c| c.retry_jitter_percent = 101,
                "engine.retry_jitter_percent",
            ),
            (|c| c.batch_size = 0, "engine.batch_size"),
            (|c| c.purge_batch = 0, "engine.purge_batch"),
        ];
        for (change, key) in cases {
            let mut config = EngineConfig::default();
            change(&mut config);
            let e = config.check().unwrap_err().to_string();
            assert!(e.contains(key), "{key}: {e}");
        }
        // Retention off: the purge interval does not matter.
        let off = EngineConfig {
            retention: Duration::ZERO,
            purge_interval: Duration::ZERO,
            ..EngineConfig::default()
        };
        assert!(off.check().is_ok());
    }
}
