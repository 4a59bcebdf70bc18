//! Settings the engine and the wire decoder take, with their defaults, plus the serde form of
//! durations used by every config section (`"250ms"`, `"5s"`, or a bare number of milliseconds).

use std::collections::BTreeMap;
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::broker::routing_token;

/// Limits applied to every command, on the broker path and the HTTP API alike. A command over
/// a limit is refused with a reason code (see the wire contract's rejections).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Largest command, in bytes (reason `too_large`). An HTTP request body larger than this
    /// plus 1 KiB is answered 413 before it is read. 0 (the default): room for a `message` of
    /// `limits.max_message_bytes` in base64 and 64 KiB for the rest of the command (415,064
    /// bytes with the default `limits.max_message_bytes`).
    pub max_command_bytes: usize,
    /// Largest `message` a timer may carry (the producer's own message, delivered in place of
    /// the event), in bytes of its body (reason `payload_too_large`, field `message`). This key
    /// once limited the whole command, as `limits.max_command_bytes` does now; a config that
    /// set it then limits messages with it, and commands with the limit derived from it. At
    /// least 1.
    pub max_message_bytes: usize,
    /// Longest `tenantId`, `serviceCallId`, `correlationId`, `cron` and `timeZone`, in bytes.
    /// At least 1.
    pub max_id_bytes: usize,
    /// Largest opaque `payload`, in bytes of JSON text (reason `payload_too_large`).
    pub max_payload_bytes: usize,
    /// How far in the future a due time, or a recurring timer's first occurrence, may lie
    /// (reason `too_far`).
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub max_horizon: Duration,
    /// Most commands in one `POST /v1/timers/batch`. At least 1.
    pub max_batch: usize,
    /// Largest `POST /v1/timers/batch` body, in bytes; a larger one is answered 413 before it
    /// is read. Each command in it is also held to `limits.max_command_bytes`.
    pub max_batch_bytes: usize,
    /// Most Scheduled or Paused timers one tenant may have (a paused timer keeps its row as
    /// long as a scheduled one); 0 sets no limit. A new timer over it is refused with reason
    /// `tenant_limit` (HTTP 429; on the broker path a dead letter, and the command is
    /// acknowledged); rescheduling an existing Scheduled or Paused timer stays allowed, and
    /// other tenants are not affected. Finished timers are kept for `engine.retention` and not
    /// counted: what they hold is bounded by `limits.rate` times the retention. Checking costs a count of the tenant's timers for every
    /// batch that names the tenant, which is why it is off unless set; several instances check
    /// independently and may together overshoot by up to one batch each.
    pub max_pending_per_tenant: u64,
    /// How fast each tenant may schedule timers: `limits.rate`.
    pub rate: RateLimits,
    /// How fast each tenant's timers may fire: `limits.fire_rate` (off unless set).
    pub fire_rate: FireRateLimits,
    /// Who may send where: the top-level `[targets]` table, which the service copies here.
    #[serde(skip)]
    #[schemars(skip)]
    pub targets: TargetRules,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_command_bytes: 0,
            max_message_bytes: 256 * 1024,
            max_id_bytes: 128,
            max_payload_bytes: 64 * 1024,
            // Ten years of 365.25 days (prints as "10years").
            max_horizon: Duration::from_secs(315_576_000),
            max_batch: 1_000,
            max_batch_bytes: 16 * 1024 * 1024,
            max_pending_per_tenant: 0,
            rate: RateLimits::default(),
            fire_rate: FireRateLimits::default(),
            targets: TargetRules::default(),
        }
    }
}

impl Limits {
    /// The largest command taken, in bytes: `limits.max_command_bytes`, or when that is 0, room
    /// for a `message` body of `limits.max_message_bytes` in base64 (4 bytes for every 3) plus
    /// 64 KiB for the rest of the command (its ids, headers, payload and policy).
    pub fn command_bytes(&self) -> usize {
        match self.max_command_bytes {
            0 => self
                .max_message_bytes
                .div_ceil(3)
                .saturating_mul(4)
                .saturating_add(64 * 1024),
            n => n,
        }
    }
}

/// Per-tenant rate limits on schedules: every `ScheduleTimer`, from a broker or HTTP, and every
/// command of a `POST /v1/timers/batch`, takes one from its tenant's allowance, which refills at
/// `schedules_per_second` up to `burst`. Over it, HTTP answers 429 with `Retry-After`, and the
/// broker path holds the tenant's commands back (unacknowledged) until they fit: slower, never
/// dropped, and without holding up other tenants' commands. Cancels, pauses and resumes take
/// nothing, but on the broker path wait behind their tenant's held schedules, so a tenant's
/// commands keep their order. Each instance keeps its own allowances (with N instances a tenant
/// may schedule up to N times the rate) unless `limits.rate.shared` keeps them in the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RateLimits {
    /// Schedules per second each tenant may send; 0 (the default) sets no limit, except for the
    /// tenants of `limits.rate.tenants`.
    pub schedules_per_second: u32,
    /// How many schedules a tenant may send at once after a quiet spell; 0 means one second's
    /// worth (`schedules_per_second`). A `POST /v1/timers/batch` with more of one tenant's
    /// commands than this is refused (429 without `Retry-After`: it would never fit).
    pub burst: u32,
    /// Tenants with a limit of their own, by tenant id:
    /// `acme = { schedules_per_second = 500, burst = 1000 }`; `schedules_per_second = 0` there
    /// sets no limit for that tenant.
    pub tenants: BTreeMap<String, TenantRate>,
    /// Most commands the broker path holds back at once, over all tenants. When that many are
    /// held, the instance reads no more commands until some are released, and then every
    /// tenant's commands wait: keep the broker's own window of unacknowledged commands
    /// (`broker.max_ack_pending` on NATS, `broker.prefetch` on RabbitMQ) above it. At least 1.
    pub max_held: usize,
    /// Most of them one tenant may have, so that a tenant flooding far over its rate cannot
    /// fill `limits.rate.max_held` and stop every other tenant's commands: a command of a
    /// tenant holding this many is refused (reason `tenant_limit`: a dead letter, and the
    /// command is acknowledged). 0 sets no share but `limits.rate.max_held`.
    pub max_held_per_tenant: usize,
    /// Keep the allowances (these and `limits.fire_rate`) in the store, so every instance on it
    /// takes from one budget per tenant instead of each keeping its own: N instances then
    /// enforce the rate once, not N times. PostgreSQL keeps them (a row per tenant, one upsert
    /// per checked batch); SQLite and memory are used by one instance, whose own allowances are
    /// the only ones. While the store cannot be reached each instance limits alone.
    pub shared: bool,
}

impl Default for RateLimits {
    fn default() -> Self {
        RateLimits {
            schedules_per_second: 0,
            burst: 0,
            tenants: BTreeMap::new(),
            max_held: 10_000,
            max_held_per_tenant: 1_000,
            shared: false,
        }
    }
}

/// One tenant's own rate limit (`limits.rate.tenants.<tenant>`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TenantRate {
    /// Schedules per second this tenant may send; 0 sets no limit.
    pub schedules_per_second: u32,
    /// How many at once after a quiet spell; 0 means `schedules_per_second`.
    pub burst: u32,
}

impl RateLimits {
    /// Checks settings that cannot mean what they say; names the key.
    pub fn check(&self) -> crate::Result<()> {
        let bad = |key: String, why: &str| Err(crate::Error::config(format!("{key} {why}")));
        if self.max_held == 0 {
            return bad("limits.rate.max_held".into(), "must be at least 1");
        }
        check_bursts(
            "limits.rate",
            "schedules_per_second",
            (self.schedules_per_second, self.burst),
            self.tenants
                .iter()
                .map(|(t, rate)| (t, rate.schedules_per_second, rate.burst)),
        )
    }
}

/// Per-tenant limits on fires (`limits.fire_rate`), off by default: a tenant's fires go out at
/// most `fires_per_second`, after a burst of `burst`; the rest of a herd is spread over the
/// following seconds instead of flooding its consumers at once. A claimed timer over its
/// tenant's rate is handed back, with its attempts and its due time unchanged, to be claimed at
/// the moment its turn comes (counted in `timer_fires_paced_total` and
/// `timer_fire_pace_delay_seconds`, by tenant). Other tenants' timers are not held up. Each
/// instance paces the fires it claims (with N instances a tenant may fire up to N times the
/// rate) unless `limits.rate.shared` keeps the allowances in the store.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct FireRateLimits {
    /// Fires per second each tenant may have; 0 (the default) sets no limit, except for the
    /// tenants of `limits.fire_rate.tenants`.
    pub fires_per_second: u32,
    /// How many fires a tenant may have at once after a quiet spell; 0 means one second's worth
    /// (`fires_per_second`).
    pub burst: u32,
    /// Tenants with a limit of their own, by tenant id:
    /// `acme = { fires_per_second = 100, burst = 200 }`; `fires_per_second = 0` there sets no
    /// limit for that tenant.
    pub tenants: BTreeMap<String, TenantFireRate>,
}

/// One tenant's own fire rate (`limits.fire_rate.tenants.<tenant>`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TenantFireRate {
    /// Fires per second this tenant may have; 0 sets no limit.
    pub fires_per_second: u32,
    /// How many at once after a quiet spell; 0 means `fires_per_second`.
    pub burst: u32,
}

/// Who may send where (the `[targets]` table): the destinations a timer's own `target` may
/// name. A target is allowed when its destination, as the broker names it (the NATS subject,
/// the RabbitMQ `<exchange>/<routingKey>`, the Kafka topic, the memory queue, an HTTP target's
/// URL), matches a pattern of `targets.allow` or of its tenant's `targets.tenants.<tenant>.allow`;
/// anything else is refused (reason `invalid_target`). A pattern that starts with `http://` or
/// `https://` is a URL prefix and allows URLs only: `https://hooks.acme.com` allows every URL of
/// that host (and port), `https://hooks.acme.com/timers/` those under that path (end it with `/`:
/// `…/timers` would allow `…/timers-admin` too); `*` is not allowed in it. In a pattern, `*` stands for any run of
/// characters and `{tenant}` for the timer's tenant id as one routing token (letters, digits,
/// `-` and `_` as they are, every other byte as `%XX`), so no tenant's pattern reaches another
/// tenant's names; in a URL's host, where names are lowercased and `%XX` decoded, it stands
/// only for tenant ids of lowercase letters, digits and `-` that start with a letter (another
/// tenant gets nothing of such a pattern). The service's own command, event and dead-letter
/// destinations are never targets, whatever the patterns say, nor the broker's own (NATS
/// subjects starting with `$` or `_INBOX.`, Kafka topics starting with `__`). A timer's target
/// is checked when the timer is taken and again at each fire: after the patterns were narrowed,
/// a stored timer whose target they refuse is given up at its due time (Failed, with a
/// `TimerFailed` whose reason is `invalid_target: …`) instead of sent, and a manual trigger of
/// it answers 400; `POST …/retry` fires it once the patterns allow it again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TargetRules {
    /// Patterns every tenant may send to. The default, `["{tenant}.*"]`, lets each tenant send
    /// to destinations named after itself (`acme.orders` for tenant `acme`) and nowhere else;
    /// `[]` allows only what `targets.tenants` allows.
    pub allow: Vec<String>,
    /// Tenants with patterns of their own, besides `targets.allow`:
    /// `acme = { allow = ["orders.*"] }`.
    pub tenants: BTreeMap<String, TenantTargets>,
}

impl Default for TargetRules {
    fn default() -> Self {
        TargetRules {
            allow: vec!["{tenant}.*".into()],
            tenants: BTreeMap::new(),
        }
    }
}

/// One tenant's own patterns (`targets.tenants.<tenant>`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TenantTargets {
    /// Patterns this tenant may send to, besides `targets.allow`.
    pub allow: Vec<String>,
}

impl TargetRules {
    /// Whether `tenant` may send to the destination `name`.
    pub fn allows(&self, tenant: &str, name: &str) -> bool {
        let own = self.tenants.get(tenant).map(|t| t.allow.as_slice());
        let token = routing_token(tenant);
        // `.` and `..` are dot segments in a URL's path: parsing removes them, so a URL pattern
        // `https://hooks.example.com/{tenant}/` would be the whole host for them.
        let dot_segment = token.eq_ignore_ascii_case("%2E") || token.eq_ignore_ascii_case("%2E%2E");
        // In a URL's host, parsing lowercases names and decodes `%XX` (then maps Unicode to
        // ASCII): `ACME` and `ａｃｍｅ` would name `acme`'s host; and reads a last label of
        // digits (`5`, `05`, `0x5`) as part of an IPv4 address. Only a token a host keeps as
        // written, starting with a letter, stands there.
        let host_label = token.as_bytes().first().is_some_and(u8::is_ascii_lowercase)
            && token
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        self.allow
            .iter()
            .chain(own.unwrap_or_default())
            .any(|pattern| {
                let named = pattern.contains("{tenant}");
                let in_host = named && authority(pattern).contains("{tenant}");
                let pattern = pattern.replace("{tenant}", &token);
                match url_prefix(&pattern) {
                    // Such a tenant gets nothing of a URL pattern that names it.
                    Some(_) if named && dot_segment => false,
                    Some(_) if in_host && !host_label => false,
                    // A URL (an HTTP target) matches URL patterns only, by prefix.
                    Some(prefix) => is_url(name) && name.starts_with(&prefix),
                    None => !is_url(name) && matches_pattern(&pattern, name),
                }
            })
    }

    /// Refuses an empty pattern, naming its key.
    pub fn check(&self) -> crate::Result<()> {
        let own = self.tenants.iter().flat_map(|(tenant, t)| {
            t.allow
                .iter()
                .map(move |p| (format!("targets.tenants.{tenant}.allow"), p))
        });
        let all = self
            .allow
            .iter()
            .map(|p| ("targets.allow".to_owned(), p))
            .chain(own);
        for (key, pattern) in all {
            if pattern.is_empty() {
                return Err(crate::Error::config(format!(
                    "{key}: an empty pattern allows nothing; leave it out"
                )));
            }
            if is_url(pattern) {
                if pattern.contains('*') {
                    return Err(crate::Error::config(format!(
                        "{key}: {pattern:?}: a URL pattern is a prefix (scheme, host, port, \
                         path); `*` is not allowed in it"
                    )));
                }
                if let Err(e) = url::Url::parse(&pattern.replace("{tenant}", "t")) {
                    return Err(crate::Error::config(format!(
                        "{key}: {pattern:?} is not a URL: {e}"
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Whether `name` is a URL (an HTTP target's destination).
fn is_url(name: &str) -> bool {
    name.starts_with("http://") || name.starts_with("https://")
}

/// The authority of a URL pattern (user, host, port): from after `://` to the path, query or
/// fragment.
fn authority(pattern: &str) -> &str {
    let rest = pattern.split_once("://").map_or(pattern, |(_, rest)| rest);
    rest.split(['/', '?', '#']).next().unwrap_or(rest)
}

/// A URL pattern as the prefix it allows, written as the URLs it is compared with are (host in
/// lower case, no default port, a path of at least `/`): `https://Hooks.Acme.com:443` allows
/// `https://hooks.acme.com/…`, not `https://hooks.acme.com.evil.net/`; with a path, the URLs
/// that start with it. `None` for a pattern that is not a URL.
fn url_prefix(pattern: &str) -> Option<String> {
    if !is_url(pattern) {
        return None;
    }
    // One that does not parse was refused by `check`; as it is, it matches as text.
    Some(
        url::Url::parse(pattern)
            .map(String::from)
            .unwrap_or_else(|_| pattern.to_owned()),
    )
}

/// Whether `name` matches `pattern`, where `*` stands for any run of characters (none too).
fn matches_pattern(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    let Some(first) = parts.next() else {
        return false;
    };
    let Some(mut rest) = name.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        // No `*`: the whole name.
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

/// A burst without a rate cannot mean what it says: for `table` (`limits.rate`) and each of its
/// tenants, refuses a `burst` where `per_second` (named `rate_key`) is 0, naming the key.
fn check_bursts<'a>(
    table: &str,
    rate_key: &str,
    (per_second, burst): (u32, u32),
    tenants: impl Iterator<Item = (&'a String, u32, u32)>,
) -> crate::Result<()> {
    let rates = std::iter::once((table.to_owned(), per_second, burst)).chain(tenants.map(
        |(tenant, per_second, burst)| (format!("{table}.tenants.{tenant:?}"), per_second, burst),
    ));
    for (key, per_second, burst) in rates {
        if per_second == 0 && burst > 0 {
            return Err(crate::Error::config(format!(
                "{key}.burst is set, but {rate_key} is 0 (no limit): set both"
            )));
        }
    }
    Ok(())
}

impl FireRateLimits {
    /// Checks settings that cannot mean what they say; names the key.
    pub fn check(&self) -> crate::Result<()> {
        check_bursts(
            "limits.fire_rate",
            "fires_per_second",
            (self.fires_per_second, self.burst),
            self.tenants
                .iter()
                .map(|(t, rate)| (t, rate.fires_per_second, rate.burst)),
        )
    }

    /// `tenant`'s rate as (fires per second, burst), burst at least 1; `None`: no limit.
    pub fn of(&self, tenant: &str) -> Option<(u32, u32)> {
        let (per_second, burst) = match self.tenants.get(tenant) {
            Some(own) => (own.fires_per_second, own.burst),
            None => (self.fires_per_second, self.burst),
        };
        (per_second > 0).then_some((per_second, if burst == 0 { per_second } else { burst }))
    }
}

/// How the engine runs: the firing task (claim, publish, settle), retries after failures, the
/// purge of finished timers, and shutdown.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// The longest the firing task sleeps without asking the store. Above 0. Timers fire on time
    /// without it (the task sleeps until the next due time and is woken by new timers); it is
    /// the safety net, and how an instance finds timers other instances inserted when the store
    /// sends no wake-ups (`sqlite`, `memory`, `postgres` with `store.notify = false`).
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub poll_interval: Duration,
    /// Most timers claimed, and most commands read, in one batch. At least 1.
    pub batch_size: usize,
    /// How long before its due time a timer may be claimed: the firing task holds it until
    /// then, so a claim's cost (a store round trip, a wait for the store's write lock behind
    /// other writes) is paid before the due time instead of after it. Only a timer's first due
    /// time is claimed ahead (not a retry's or a paced turn's). Meanwhile the timer counts as
    /// firing: a cancel answers `firing`, and a reschedule in the last `claim_ahead` before
    /// the due time (up to eight times that or a fifth of `engine.lease` while more timers are
    /// due within that time than a claim takes: the guarantees' fair firing) may no longer stop
    /// that fire. 0 claims at the due time. At most 1s, and under a fifth of `engine.lease`.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub claim_ahead: Duration,
    /// How long a claim holds a timer without being renewed. At least 1s. While a publish
    /// runs its leases are renewed every third of it, so a publish may take longer; a cancel
    /// is refused (`firing`) while a lease is live. A dead instance's timers come back when its
    /// leases run out, unless the store knows sooner (PostgreSQL: within about a second;
    /// SQLite: when the service starts again).
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub lease: Duration,
    /// How long the firing task waits for the broker to confirm a batch of events before it
    /// counts the publish as failed (and for a manual trigger's event, and a `TimerFailed`).
    /// Above 0.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub publish_timeout: Duration,
    /// Longest one call of the engine's tasks to the store may take (a claim, a settlement, an
    /// ingested batch's write, a purge) before it counts as failed and is retried. A connection
    /// that hangs without a reset (a server gone behind a firewall) would otherwise hold the
    /// task until the OS gives up on it, for many minutes. A claim or settlement cut off this
    /// way fires again when its lease ends (a duplicate, never a loss). Above 0.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub store_timeout: Duration,
    /// First retry delay after a failed publish, doubled per attempt up to `engine.retry_max`.
    /// Also the first pause of a task whose store or broker call failed. Above 0.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub retry_base: Duration,
    /// Cap on the retry delay after failed publishes, and on the pause between tries of a
    /// failed store or broker call (which `engine.poll_interval` caps too). At least
    /// `engine.retry_base`.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub retry_max: Duration,
    /// Each retry delay is shortened by a random share of up to this many percent, so timers
    /// that failed together do not retry at once. 0 turns it off; at most 100.
    pub retry_jitter_percent: u32,
    /// Failed publishes after which a timer is given up: it becomes Failed and a `TimerFailed`
    /// goes to the dead-letter destination. 0 retries forever, so an outage of any length loses
    /// nothing; above 0, a long outage of event publishing turns timers into Failed timers.
    pub max_attempts: u32,
    /// How long Reached, Cancelled and Failed timers are kept after they finished; then the
    /// purge task deletes them, `GET` answers 404 and the key is free for a new timer. 0 keeps
    /// them forever. Keep it longer than any command can come back (a broker's retention of
    /// commands, a replay).
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub retention: Duration,
    /// How often the purge task looks for timers older than `engine.retention`. Above 0 while
    /// `engine.retention` is set.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub purge_interval: Duration,
    /// Most timers the purge task deletes in one statement (small, so firing never waits long
    /// for it); it repeats until fewer are left. At least 1.
    pub purge_batch: usize,
    /// How long shutdown waits for an in-flight publish before it releases its claims.
    #[serde(with = "duration")]
    #[schemars(with = "String")]
    pub shutdown_grace: Duration,
    /// This instance's name in leases. Empty means `<pid>-<8 random hex digits>`; when you set
    /// it, give every instance its own: on PostgreSQL a second running instance with a name in
    /// use on the same schema refuses to start. A name kept across restarts (one per
    /// StatefulSet pod) lets a restarted instance release its predecessor's leases at once.
    pub instance_id: String,
    /// Most history entries kept per timer (`GET /v1/tenants/{tenant}/timers/{id}/history`);
    /// the oldest are dropped as new ones come. 0 records no history.
    pub history_per_timer: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            poll_interval: Duration::from_secs(5),
            batch_size: 500,
            claim_ahead: Duration::from_millis(50),
            lease: Duration::from_secs(10),
            publish_timeout: Duration::from_secs(15),
            store_timeout: Duration::from_secs(30),
            retry_base: Duration::from_millis(500),
            retry_max: Duration::from_secs(60),
            retry_jitter_percent: 20,
            max_attempts: 0,
            retention: Duration::from_secs(7 * 24 * 3600),
            purge_interval: Duration::from_secs(60),
            purge_batch: 1_000,
            shutdown_grace: Duration::from_secs(5),
            instance_id: String::new(),
            history_per_timer: crate::control::DEFAULT_HISTORY,
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
                "must be at least 100ms (it is renewed every third of it)",
            );
        }
        if self.claim_ahead > Duration::from_secs(1) || self.claim_ahead * 5 >= self.lease {
            return bad(
                "claim_ahead",
                "must be at most 1s and under a fifth of engine.lease (a timer held until its due \
                 time keeps the lease of its claim)",
            );
        }
        if self.store_timeout.is_zero() {
            return bad("store_timeout", "must be above 0");
        }
        if self.publish_timeout.is_zero() {
            return bad("publish_timeout", "must be above 0");
        }
        if self.poll_interval.is_zero() {
            return bad("poll_interval", "must be above 0");
        }
        if self.retry_base.is_zero() {
            return bad(
                "retry_base",
                "must be above 0 (failed publishes, store retries and task restarts would repeat \
                 without a pause)",
            );
        }
        if self.retry_max < self.retry_base {
            return bad(
                "retry_max",
                "must be at least engine.retry_base (it caps the backoff that starts there; 0 is \
                 not 'no cap')",
            );
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
mod tests;
