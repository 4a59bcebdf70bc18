//! The `TIMER_*` environment as a figment provider: `__` nests, names are case-insensitive
//! but for tenant ids, secrets stay text, and the variables Kubernetes gives a pod for its
//! namespace's Services are passed over.

use figment::providers::Env;
use figment::value::{Dict, Map, Value};
use figment::{Metadata, Profile, Provider};
use timer_core::redact;

/// Whether `key = value` (a `TIMER_` variable's name after the prefix, lowercase, without
/// `__`) is one of the variables Kubernetes gives a pod for each Service of its namespace
/// (`enableServiceLinks`, on by default): a Service named `timer-service` sets
/// `TIMER_SERVICE_SERVICE_HOST=10.0.0.7`, `TIMER_SERVICE_PORT=tcp://10.0.0.7:8080`,
/// `TIMER_SERVICE_PORT_8080_TCP_ADDR=10.0.0.7` and more; one named `timer`,
/// `TIMER_SERVICE_HOST`, `TIMER_PORT`, …. None of them can be a key (keys have `__`), and the
/// service must start beside such a Service: they are passed over, not refused as unknown keys.
/// Name and value must both have the shape Kubernetes gives them, so a typo of a key is still
/// refused.
fn service_link(key: &str, value: &str) -> bool {
    // The Service's name may be `timer` alone: the prefix is then part of the name.
    let name = format!("timer_{key}");
    let words: Vec<&str> = name.split('_').collect();
    let number = |w: &str| !w.is_empty() && w.bytes().all(|b| b.is_ascii_digit());
    let protocol = |w: &str| matches!(w, "tcp" | "udp" | "sctp");
    let address = || value.parse::<std::net::IpAddr>().is_ok();
    let url = || {
        ["tcp://", "udp://", "sctp://"]
            .iter()
            .any(|scheme| value.to_ascii_lowercase().starts_with(scheme))
    };
    // `<NAME>_SERVICE_PORT_<PORT NAME>`: a named port of the Service, whose name may have had
    // dashes (`http-api`: `…_SERVICE_PORT_HTTP_API`).
    let named_port = words
        .windows(2)
        .skip(1)
        .any(|pair| pair == ["service", "port"]);
    if named_port && number(value) {
        return true;
    }
    match words.as_slice() {
        [_, .., "service", "host"] => address(),
        [_, .., "port", p, proto, "port"] => number(p) && protocol(proto) && number(value),
        [_, .., "port", p, proto, "proto"] => {
            number(p) && protocol(proto) && protocol(&value.to_ascii_lowercase())
        }
        [_, .., "port", p, proto, "addr"] => number(p) && protocol(proto) && address(),
        [_, .., "port", p, proto] if number(p) && protocol(proto) => url(),
        [_, .., "port"] => url(),
        _ => false,
    }
}

/// The key path of a `TIMER_` variable's name after the prefix: `__` nests, and names are
/// case-insensitive (lowercased), but for the tenant ids of per-tenant tables, which are case
/// sensitive (`TIMER_LIMITS__RATE__TENANTS__Acme__SCHEDULES_PER_SECOND` sets tenant `Acme`'s).
fn key_path(name: &str) -> String {
    let mut path: Vec<String> = Vec::new();
    for segment in name.split("__") {
        let tenant = path.last().is_some_and(|p| p == "tenants");
        path.push(if tenant {
            segment.to_owned()
        } else {
            segment.to_ascii_lowercase()
        });
    }
    path.join(".")
}

/// The `TIMER_*` environment as figment reads it (a value as TOML reads a bare one: `5` a
/// number, `true` a boolean, `[a, b]` an array), except that a secret (`http.token`,
/// `broker.password`, …) of digits only, or `true`/`false`, stays the text it is: a password
/// `123456` is a password, not a number refused as one (with its value in the error).
pub(super) struct Environment(Env);

impl Environment {
    /// `TIMER_*` but for `skip` (names after the prefix, lowercase), `TIMER_TEST_*` (the test
    /// suite's) and `TIMER_CONFIG` (`--config`).
    pub(super) fn timer(skip: Vec<String>) -> Self {
        let env = Env::prefixed("TIMER_")
            .filter(move |key| {
                let key = key.as_str().to_ascii_lowercase();
                !key.starts_with("test_") && key != "config" && !skip.contains(&key)
            })
            .map(|key| key_path(key.as_str()).into())
            // Last: figment's filter and map set it back to true.
            .lowercase(false);
        Environment(env)
    }
}

impl Provider for Environment {
    fn metadata(&self) -> Metadata {
        self.0.metadata()
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        let mut dict = Dict::new();
        for (key, text) in self.0.iter() {
            if !key.as_str().contains('.') && service_link(key.as_str(), &text) {
                continue;
            }
            let path: Vec<&str> = key.as_str().split('.').collect();
            let secret = path.last().is_some_and(|k| redact::is_secret_key(k));
            let value = match text.parse::<Value>() {
                Ok(Value::Num(..) | Value::Bool(..)) if secret => Value::from(text),
                Ok(value) => value,
                Err(never) => match never {},
            };
            insert(&mut dict, &path, value);
        }
        Ok(self.0.profile.collect(dict))
    }
}

/// Puts `value` at `path` in `dict`, making the tables on the way (as figment's own `Env` does
/// with `util::nest` and a merge of tables that figment keeps private).
fn insert(dict: &mut Dict, path: &[&str], value: Value) {
    let Some((first, rest)) = path.split_first() else {
        return;
    };
    if rest.is_empty() {
        dict.insert((*first).to_owned(), value);
        return;
    }
    let entry = dict
        .entry((*first).to_owned())
        .or_insert_with(|| Value::from(Dict::new()));
    if !matches!(entry, Value::Dict(..)) {
        *entry = Value::from(Dict::new());
    }
    if let Value::Dict(_, inner) = entry {
        insert(inner, rest, value);
    }
}
