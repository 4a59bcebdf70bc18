//! Connecting to NATS: the URL's and the config's credentials, TLS, and an error naming the
//! server (its URL without credentials) when it cannot connect.

use timer_core::redact::hide_userinfo;
use timer_core::{Error, Result};

use super::{unavailable, NatsConfig};

/// Where and how to connect: the URL without credentials, and the user/password to use (from
/// the config keys, else from the URL's userinfo, which async-nats would ignore).
struct Endpoint {
    url: String,
    user_password: Option<(String, String)>,
    token: Option<String>,
}

fn connect_target(config: &NatsConfig) -> Result<Endpoint> {
    let mut url = url::Url::parse(&config.url).map_err(|e| {
        Error::config(format!(
            "broker.url {:?} is not a URL",
            hide_userinfo(&config.url)
        ))
        .with_source(e)
    })?;
    // `nats://user:password@host` is user and password; `nats://TOKEN@host` is a token.
    let (from_url, token_from_url) = match (url.username(), url.password()) {
        ("", _) => (None, None),
        (user, Some(password)) => (Some((percent_decode(user), percent_decode(password))), None),
        (token, None) => (None, Some(percent_decode(token))),
    };
    let _ = url.set_username("");
    let _ = url.set_password(None);
    let user_password = match (&config.user, &config.password) {
        (Some(user), Some(password)) => Some((user.clone(), password.clone())),
        (None, None) => from_url,
        _ => return Err(Error::config("broker.user and broker.password go together")),
    };
    if config.tls_client_cert.is_some() != config.tls_client_key.is_some() {
        return Err(Error::config(
            "broker.tls_client_cert and broker.tls_client_key go together",
        ));
    }
    Ok(Endpoint {
        url: url.to_string(),
        user_password,
        token: config.token.clone().or(token_from_url),
    })
}

/// Whether `config` names a server and credentials a client can be made of (`broker.url` a
/// URL, the credential keys that go together given together).
pub(super) fn check_endpoint(config: &NatsConfig) -> Result<()> {
    connect_target(config).map(|_| ())
}

fn percent_decode(text: &str) -> String {
    // form decoding reads `+` as a space; in userinfo it is a literal plus.
    url::form_urlencoded::parse(format!("x={}", text.replace('+', "%2B")).as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default()
}

/// The client, with the configured credentials and TLS; a one-line error naming the server and
/// the cause when it cannot connect.
pub async fn connect_client(config: &NatsConfig) -> Result<async_nats::Client> {
    let target = connect_target(config)?;
    let mut options = async_nats::ConnectOptions::new()
        .name("timer-service")
        .connection_timeout(config.connect_timeout)
        .require_tls(config.tls_required);
    if let Some((user, password)) = target.user_password {
        options = options.user_and_password(user, password);
    }
    if let Some(token) = target.token {
        options = options.token(token);
    }
    if let Some(seed) = &config.nkey {
        options = options.nkey(seed.clone());
    }
    if let Some(path) = &config.credentials_file {
        options = options.credentials_file(path).await.map_err(|e| {
            Error::config(format!("broker.credentials_file {}", path.display())).with_source(e)
        })?;
    }
    if let Some(path) = &config.tls_root_cert {
        options = options.add_root_certificates(path.clone());
    }
    if let (Some(cert), Some(key)) = (&config.tls_client_cert, &config.tls_client_key) {
        options = options.add_client_certificate(cert.clone(), key.clone());
    }
    async_nats::connect_with_options(target.url.as_str(), options)
        .await
        .map_err(|e| {
            unavailable(
                &format!("cannot connect to {}", hide_userinfo(&config.url)),
                e,
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_the_url_are_used_and_removed() {
        let config = NatsConfig {
            url: "nats://app:p%40ss@127.0.0.1:4222".into(),
            ..NatsConfig::default()
        };
        let target = connect_target(&config).unwrap();
        assert_eq!(target.url, "nats://127.0.0.1:4222");
        assert_eq!(target.user_password, Some(("app".into(), "p@ss".into())));
        let keys = NatsConfig {
            user: Some("k".into()),
            password: Some("v".into()),
            ..config.clone()
        };
        assert_eq!(
            connect_target(&keys).unwrap().user_password,
            Some(("k".into(), "v".into()))
        );
        let half = NatsConfig {
            user: Some("k".into()),
            ..NatsConfig::default()
        };
        assert!(connect_target(&half).is_err());
        let not_url = NatsConfig {
            url: "nats://a:1,nats://b:2".into(),
            ..NatsConfig::default()
        };
        assert!(connect_target(&not_url).is_err());
    }
}
