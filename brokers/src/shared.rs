//! Plumbing every SDK-backed broker needs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use timer_core::{Delivery, Error, Result, TraceHeaders};

/// The commands delivered and not yet acknowledged: the tag the engine sees → what the SDK
/// needs to acknowledge it (a message, a delivery tag, a partition and offset).
pub(crate) struct DeliveryTags<T> {
    broker: &'static str,
    next: AtomicU64,
    pending: Mutex<HashMap<u64, T>>,
}

impl<T> DeliveryTags<T> {
    /// `broker` names the broker in errors.
    pub(crate) fn new(broker: &'static str) -> Self {
        DeliveryTags {
            broker,
            next: AtomicU64::new(1),
            pending: Mutex::new(HashMap::new()),
        }
    }

    /// Keeps `handle` under a new tag; the delivery the engine gets carries that tag (and the
    /// tenant the broker binds it to, if any: [`Delivery::tenant`], and the trace context
    /// headers the message came with).
    pub(crate) fn remember(
        &self,
        handle: T,
        body: Vec<u8>,
        tenant: Option<String>,
        trace: TraceHeaders,
    ) -> Result<Delivery> {
        let tag = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock()?.insert(tag, handle);
        Ok(Delivery {
            tag,
            body,
            tenant,
            trace,
        })
    }

    /// The handles of `tags`, forgotten; tags not (or no longer) known are skipped.
    pub(crate) fn take(&self, tags: &[u64]) -> Result<Vec<T>> {
        let mut pending = self.lock()?;
        Ok(tags.iter().filter_map(|t| pending.remove(t)).collect())
    }

    /// Every handle, forgotten.
    #[cfg(feature = "nats")]
    pub(crate) fn take_all(&self) -> Result<Vec<T>> {
        Ok(self.lock()?.drain().map(|(_, handle)| handle).collect())
    }

    /// Copies of the handles of `tags`, still remembered; tags not known are skipped.
    #[cfg(feature = "nats")]
    pub(crate) fn get(&self, tags: &[u64]) -> Result<Vec<T>>
    where
        T: Clone,
    {
        let pending = self.lock()?;
        Ok(tags
            .iter()
            .filter_map(|t| pending.get(t).cloned())
            .collect())
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, HashMap<u64, T>>> {
        self.pending.lock().map_err(|_| {
            Error::internal(format!(
                "{} broker: a thread panicked while holding the delivery tags",
                self.broker
            ))
        })
    }
}

/// What a broker found out about a target destination (a topic exists, a stream captures a
/// subject, an exchange is missing), remembered for a while ([`LOOKUP_TTL`], one found missing
/// [`MISSING_TTL`]) so a batch of events for the same destinations does not ask the server
/// again: a destination that goes away meanwhile costs a failed attempt, retried, not a lost
/// message. At most [`LOOKUP_ENTRIES`] names are kept.
#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
pub(crate) struct Lookups<V> {
    entries: Mutex<HashMap<String, (std::time::Instant, V)>>,
}

/// How long a lookup of a destination is trusted.
#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
pub(crate) const LOOKUP_TTL: std::time::Duration = std::time::Duration::from_secs(10);
/// How long a destination found missing is taken as missing: one made meanwhile is used soon,
/// one that stays missing is not asked for again by every batch. (NATS publishes to a subject
/// no stream captures, plainly: it has no missing destinations.)
#[cfg(any(feature = "rabbitmq", feature = "kafka"))]
pub(crate) const MISSING_TTL: std::time::Duration = std::time::Duration::from_secs(2);
/// Most lookups one publish makes at once.
#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
pub(crate) const LOOKUPS_AT_ONCE: usize = 8;
/// Most destinations one publish looks up: the events for others not known yet are left for a
/// later publish (`Undelivered::deferred`: no attempt counted), so a tenant that names
/// thousands of destinations does not make every batch it shares with other tenants wait for
/// thousands of round trips.
#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
pub(crate) const LOOKUPS_PER_PUBLISH: usize = 64;
/// How many destinations' lookups are kept at most (past it, the stale ones go, then all).
#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
pub(crate) const LOOKUP_ENTRIES: usize = 10_000;

#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
impl<V: Clone> Lookups<V> {
    pub(crate) fn new() -> Self {
        Lookups {
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// What was found about `name`, while it is trusted.
    pub(crate) fn get(&self, name: &str) -> Option<V> {
        let entries = self.entries.lock().ok()?;
        let (until, value) = entries.get(name)?;
        (std::time::Instant::now() < *until).then(|| value.clone())
    }

    /// Remembers what was found about `name` now, trusted for `ttl`.
    pub(crate) fn put(&self, name: &str, value: V, ttl: std::time::Duration) {
        let Ok(mut entries) = self.entries.lock() else {
            return;
        };
        let now = std::time::Instant::now();
        if entries.len() >= LOOKUP_ENTRIES {
            entries.retain(|_, (until, _)| now < *until);
            if entries.len() >= LOOKUP_ENTRIES {
                entries.clear();
            }
        }
        entries.insert(name.to_owned(), (now + ttl, value));
    }

    /// What is known of each destination `wanted` names (with the tenant whose event names
    /// it): remembered, or looked up with `look` (at most [`LOOKUPS_AT_ONCE`] at a time,
    /// [`LOOKUPS_PER_PUBLISH`] in all, taken in turn from each tenant's so that one that names
    /// thousands does not hold back another's few; remembered for what `look` says). The names
    /// left over come back in [`Known::later`] (looked up by a later publish: those looked up
    /// now are remembered); the first error of a lookup is the whole call's.
    pub(crate) async fn known<'n, F, Fut>(
        &self,
        wanted: impl IntoIterator<Item = (&'n str, &'n str)>,
        look: F,
    ) -> timer_core::Result<Known<'n, V>>
    where
        F: Fn(&str) -> Fut,
        Fut: std::future::Future<Output = timer_core::Result<(V, std::time::Duration)>>,
    {
        let mut found = HashMap::new();
        let mut named = std::collections::HashSet::new();
        // Each tenant's destinations not known yet, in the order its events name them.
        let mut by_tenant: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
        for (tenant, name) in wanted {
            if !named.insert(name) {
                continue;
            }
            match self.get(name) {
                Some(value) => {
                    found.insert(name, value);
                }
                None => by_tenant.entry(tenant).or_default().push(name),
            }
        }
        let mut queues: Vec<_> = by_tenant.into_values().map(Vec::into_iter).collect();
        let (mut unknown, mut later) = (Vec::new(), Vec::new());
        while !queues.is_empty() {
            queues.retain_mut(|queue| match queue.next() {
                Some(name) if unknown.len() < LOOKUPS_PER_PUBLISH => {
                    unknown.push(name);
                    true
                }
                Some(name) => {
                    later.push(name);
                    true
                }
                None => false,
            });
        }
        for names in unknown.chunks(LOOKUPS_AT_ONCE) {
            let answers = futures::future::join_all(names.iter().map(|name| look(name))).await;
            for (name, answer) in names.iter().zip(answers) {
                let (value, ttl) = answer?;
                self.put(name, value.clone(), ttl);
                found.insert(*name, value);
            }
        }
        Ok(Known { found, later })
    }
}

/// What [`Lookups::known`] found: each name's value, and the names not looked up this time.
#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
pub(crate) struct Known<'n, V> {
    pub(crate) found: HashMap<&'n str, V>,
    pub(crate) later: Vec<&'n str>,
}

/// Why an event's destination is not used in this publish: one of [`Known::later`].
#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
pub(crate) fn not_looked_up() -> String {
    format!(
        "was not looked up in this publish (its batch named more than {LOOKUPS_PER_PUBLISH} \
         destinations not known yet)"
    )
}

/// Why the events for one destination are not sent in this publish.
#[cfg(any(feature = "rabbitmq", feature = "kafka"))]
pub(crate) enum Unusable {
    /// It is missing, or the server refused its lookup (the reason): each event a failed
    /// attempt, retried after its backoff.
    Refused(String),
    /// Not looked up in this publish (one of [`Known::later`]): nothing tried, sent later.
    NotLookedUp,
}

#[cfg(any(feature = "rabbitmq", feature = "kafka"))]
impl Unusable {
    /// The event at `index` as not sent, its error `what` the reason says.
    pub(crate) fn undelivered(
        &self,
        index: usize,
        what: impl FnOnce(&str) -> String,
    ) -> timer_core::Undelivered {
        match self {
            Unusable::Refused(why) => timer_core::Undelivered::new(
                index,
                Error::unavailable(format!("{}; it is retried", what(why))),
            ),
            Unusable::NotLookedUp => timer_core::Undelivered::deferred(
                index,
                Error::unavailable(format!("{}; it is sent later", what(&not_looked_up()))),
            ),
        }
    }
}

/// A message of a broker's own delay ingress (RabbitMQ's delay exchange, NATS's delay
/// subjects, Kafka's delay topic), as the parts of the `ScheduleTimer` it stands for.
#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
pub(crate) struct Delayed<'a> {
    pub(crate) tenant: String,
    /// The message's own id; without one, an id derived from `id_from` under `namespace`.
    pub(crate) id: Option<String>,
    pub(crate) namespace: uuid::Uuid,
    pub(crate) id_from: &'a [&'a [u8]],
    pub(crate) target: serde_json::Value,
    pub(crate) body: &'a [u8],
    pub(crate) content_type: Option<String>,
    pub(crate) headers: serde_json::Map<String, serde_json::Value>,
    /// The due field (`dueInMs`, `dueTimeMs`, `dueAt`) and its value; `None`: the message
    /// gives no time, and the engine refuses the command naming `dueAt`.
    pub(crate) due: Option<(&'static str, serde_json::Value)>,
}

#[cfg(any(feature = "nats", feature = "kafka"))]
impl Delayed<'_> {
    /// The due field of a message whose time headers are text: a delay in milliseconds
    /// (`dueInMs`; a negative one is none), else a time as epoch milliseconds (`dueTimeMs`) or
    /// RFC 3339 (`dueAt`). What does not parse goes along as it is, for the engine to name.
    pub(crate) fn due_of_text(
        delay: Option<String>,
        deliver_at: Option<String>,
    ) -> Option<(&'static str, serde_json::Value)> {
        use serde_json::Value;
        if let Some(delay) = delay {
            return Some(match delay.trim().parse::<i64>() {
                Ok(ms) => ("dueInMs", Value::from(ms.max(0))),
                Err(_) => ("dueInMs", Value::from(delay)),
            });
        }
        deliver_at.map(|at| match at.trim().parse::<i64>() {
            Ok(ms) => ("dueTimeMs", Value::from(ms)),
            Err(_) => ("dueAt", Value::from(at)),
        })
    }
}

#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
impl Delayed<'_> {
    /// The `ScheduleTimer` (JSON) the message stands for: its body in base64, its content type
    /// and headers as the timer's message. A derived id is a UUID (v5) of the length-prefixed
    /// `id_from` parts and the body: the same message sent twice is one timer.
    pub(crate) fn command(self) -> Vec<u8> {
        use base64::Engine as _;
        use serde_json::{json, Value};
        let id = self.id.unwrap_or_else(|| {
            let mut name = Vec::with_capacity(self.body.len() + 64);
            for part in self.id_from.iter().copied().chain([self.body]) {
                name.extend_from_slice(&(part.len() as u64).to_be_bytes());
                name.extend_from_slice(part);
            }
            uuid::Uuid::new_v5(&self.namespace, &name).to_string()
        });
        let mut message = json!({
            "bodyBase64": base64::engine::general_purpose::STANDARD.encode(self.body),
            "headers": self.headers,
        });
        if let Some(content_type) = self.content_type {
            message["contentType"] = Value::from(content_type);
        }
        let mut command = json!({
            "tenantId": self.tenant,
            "serviceCallId": id,
            "target": self.target,
            "message": message,
        });
        if let Some((field, value)) = self.due {
            command[field] = value;
        }
        command.to_string().into_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
    #[test]
    fn lookups_are_kept_and_bounded() {
        let lookups = Lookups::new();
        assert_eq!(lookups.get("a"), None);
        lookups.put("a", true, LOOKUP_TTL);
        assert_eq!(lookups.get("a"), Some(true));
        lookups.put("gone", true, std::time::Duration::ZERO);
        assert_eq!(lookups.get("gone"), None, "past its time");
        for i in 0..LOOKUP_ENTRIES {
            lookups.put(&i.to_string(), false, LOOKUP_TTL);
        }
        assert!(lookups.entries.lock().unwrap().len() <= LOOKUP_ENTRIES);
        assert_eq!(lookups.get(&(LOOKUP_ENTRIES - 1).to_string()), Some(false));
    }

    /// A publish looks up at most LOOKUPS_PER_PUBLISH destinations not known yet (the rest come
    /// back as later), taken in turn from each tenant's, remembers what it found, and fails
    /// with the first lookup that fails.
    #[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
    #[tokio::test]
    async fn a_publish_looks_up_a_bounded_number_of_destinations() {
        use std::sync::atomic::AtomicUsize;
        let lookups: Lookups<bool> = Lookups::new();
        let asked = AtomicUsize::new(0);
        // Tenant a names 99 destinations, tenant b one, named last.
        let names: Vec<String> = (0..100).map(|i| format!("d{i:03}")).collect();
        let all = || {
            names
                .iter()
                .enumerate()
                .map(|(i, n)| (if i == 99 { "b" } else { "a" }, n.as_str()))
                .collect::<Vec<_>>()
        };
        let look = |name: &str| {
            asked.fetch_add(1, Ordering::SeqCst);
            let found = name.ends_with('0');
            async move { Ok((found, LOOKUP_TTL)) }
        };
        let known = lookups.known(all(), look).await.unwrap();
        assert_eq!(known.found.len(), LOOKUPS_PER_PUBLISH);
        assert_eq!(known.later.len(), 100 - LOOKUPS_PER_PUBLISH);
        assert!(
            known.found.contains_key("d099"),
            "b's one is looked up at once"
        );
        assert!(known.found["d010"] && !known.found["d011"]);
        // The next one asks only for what it does not know yet.
        let known = lookups.known(all(), look).await.unwrap();
        assert_eq!(known.found.len(), 100);
        assert!(known.later.is_empty());
        assert_eq!(asked.load(Ordering::SeqCst), 100);
        let failing =
            |_: &str| async { Err::<(bool, std::time::Duration), _>(Error::unavailable("down")) };
        assert!(lookups.known([("a", "new")], failing).await.is_err());
    }

    #[test]
    fn tags_are_new_and_taken_once() {
        let tags = DeliveryTags::new("test");
        let a = tags
            .remember("a", b"1".to_vec(), None, TraceHeaders::default())
            .unwrap();
        let b = tags
            .remember(
                "b",
                b"2".to_vec(),
                Some("t".into()),
                TraceHeaders::default(),
            )
            .unwrap();
        assert_eq!(b.tenant.as_deref(), Some("t"));
        assert_ne!(a.tag, b.tag);
        assert_eq!(b.body, b"2");
        assert_eq!(tags.take(&[b.tag, 999, a.tag]).unwrap(), vec!["b", "a"]);
        assert!(tags.take(&[a.tag]).unwrap().is_empty());
    }
}
