//! Keeping secrets out of what is shown: config values, URLs in error messages and logs.

/// Keys whose values are secrets (matched as substrings of the lowercased key).
pub const SECRET_KEYS: &[&str] = &[
    "password",
    "passwd",
    "token",
    "secret",
    "credential",
    "private_key",
    "api_key",
    "nkey",
    // The hash of an API key (`http.keys`) would let a guess be checked offline.
    "sha256",
    // librdkafka: an inline private key, and OAUTHBEARER settings that may hold a secret.
    "key.pem",
    "oauthbearer.config",
];

/// What a config error says of a secret's value in place of the value, which its parser's
/// error would quote.
pub const NOT_SHOWN: &str = "not a value this key takes (the value is a secret, not shown)";

/// Whether the value of `key` is a secret ([`SECRET_KEYS`]).
pub fn is_secret_key(key: &str) -> bool {
    let lower = key.to_ascii_lowercase();
    SECRET_KEYS.iter().any(|k| lower.contains(k))
}

/// `postgres://app:hunter2@db/timers` → `postgres://app:***@db/timers`, and secret query
/// parameters (`?password=...`) likewise; other text unchanged.
pub fn redact_url(text: &str) -> String {
    let Ok(mut url) = url::Url::parse(text) else {
        return text.to_owned();
    };
    let mut changed = false;
    if url.password().is_some() {
        let _ = url.set_password(Some("***"));
        changed = true;
    } else if matches!(url.scheme(), "nats" | "tls") && !url.username().is_empty() {
        // `nats://TOKEN@host`: the user part is a token.
        let _ = url.set_username("***");
        changed = true;
    }
    if url.query_pairs().any(|(k, _)| is_secret_key(&k)) {
        let pairs: Vec<(String, String)> = url
            .query_pairs()
            .map(|(k, v)| {
                let v = if is_secret_key(&k) {
                    "***".to_owned()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        url.query_pairs_mut().clear().extend_pairs(pairs);
        changed = true;
    }
    if changed {
        url.to_string()
    } else {
        text.to_owned()
    }
}

/// A server's URL for messages: the whole userinfo (user and password, or a token) becomes
/// `***`: `amqp://u:p@host:5672/%2f` → `amqp://***@host:5672/%2f`. Works on text that is not
/// a single URL too (server lists).
pub fn hide_userinfo(url: &str) -> String {
    match url.rsplit_once('@') {
        Some((before, host)) => match before.split_once("://") {
            Some((scheme, _)) => format!("{scheme}://***@{host}"),
            None => format!("***@{host}"),
        },
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(f: fn(&str) -> String, cases: &[(&str, &str)]) {
        for (input, expected) in cases {
            assert_eq!(f(input), *expected, "{input}");
        }
    }

    #[test]
    fn urls_lose_their_password() {
        check(
            redact_url,
            &[
                (
                    "postgres://app:hunter2@db:5432/timers",
                    "postgres://app:***@db:5432/timers",
                ),
                ("sqlite://timer-service.db", "sqlite://timer-service.db"),
                ("nats://s3cr3t@h:4222", "nats://***@h:4222"),
                (
                    "postgres://db/t?sslmode=require&password=pw",
                    "postgres://db/t?sslmode=require&password=***",
                ),
                ("not a url", "not a url"),
            ],
        );
    }

    #[test]
    fn urls_lose_their_credentials_in_messages() {
        check(
            hide_userinfo,
            &[
                ("nats://u:p@host:4222", "nats://***@host:4222"),
                ("nats://host:4222", "nats://host:4222"),
                ("amqp://u:p@host:5672/%2f", "amqp://***@host:5672/%2f"),
                ("amqp://host", "amqp://host"),
                ("u:p@host:4222", "***@host:4222"),
            ],
        );
    }

    #[test]
    fn secret_keys_are_found_in_any_case() {
        for key in [
            "password",
            "sasl.password",
            "ssl.key.pem",
            "API_KEY",
            "token",
        ] {
            assert!(is_secret_key(key), "{key}");
        }
        for key in ["url", "name", "sasl.mechanisms"] {
            assert!(!is_secret_key(key), "{key}");
        }
    }
}
