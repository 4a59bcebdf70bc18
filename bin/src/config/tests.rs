//! Loading: defaults, files, environment names, and the errors that name what is wrong.

// figment's Jail closures return figment::Error, which is large; that is its API.
#![allow(clippy::result_large_err)]

use super::render::redact;
use super::*;
use figment::Jail;

fn load_in_jail(toml: Option<&str>) -> Result<Config, Error> {
    let figment = match toml {
        Some(_) => figment(Some(Path::new("test.toml")))?,
        None => figment(None)?,
    };
    load(&figment)
}

/// The error `load` gives with these environment variables set (and nothing else).
fn refused_with(env: &[(&str, &str)]) -> String {
    let mut error = String::new();
    Jail::expect_with(|jail| {
        for (name, value) in env {
            jail.set_env(name, value);
        }
        error = match load_in_jail(None) {
            Ok(_) => "loaded without an error".into(),
            Err(e) => e.to_string(),
        };
        Ok(())
    });
    error
}

#[test]
fn defaults_are_the_embedded_setup() {
    Jail::expect_with(|_| {
        let c = load_in_jail(None).map_err(|e| e.to_string())?;
        assert_eq!(c.broker.kind(), "memory");
        #[cfg(feature = "sqlite")]
        assert_eq!(c.store.kind(), "sqlite");
        assert_eq!(c.http.addr.to_string(), "127.0.0.1:8080");
        assert_eq!(c.engine.poll_interval, Duration::from_secs(5));
        Ok(())
    });
}

#[test]
fn env_overrides_file_and_nests_with_double_underscore() {
    Jail::expect_with(|jail| {
        jail.create_file(
            "test.toml",
            "[engine]\nbatch_size = 7\npoll_interval = \"2s\"\n[http]\naddr = \"127.0.0.1:9000\"\n",
        )?;
        jail.set_env("TIMER_HTTP__ADDR", "127.0.0.1:9100");
        jail.set_env("TIMER_TEST_REQUIRE", "1");
        let c = load_in_jail(Some("")).map_err(|e| e.to_string())?;
        assert_eq!(c.engine.batch_size, 7);
        assert_eq!(c.engine.poll_interval, Duration::from_secs(2));
        assert_eq!(c.http.addr.to_string(), "127.0.0.1:9100");
        Ok(())
    });
}

#[test]
fn seed_environment_names_work() {
    Jail::expect_with(|jail| {
        jail.set_env("TIMER_POLLING_INTERVAL", "250");
        jail.set_env("TIMER_BATCH_SIZE", "42");
        // The seed's store name is the SQLite file: a build without SQLite has no such key.
        #[cfg(feature = "sqlite")]
        jail.set_env("TIMER_DB_PATH", "/tmp/x/event_service.db");
        let c = load_in_jail(None).map_err(|e| e.to_string())?;
        assert_eq!(c.engine.poll_interval, Duration::from_millis(250));
        assert_eq!(c.engine.batch_size, 42);
        #[cfg(feature = "sqlite")]
        match c
            .store
            .as_any()
            .downcast_ref::<timer_stores::sqlite::SqliteConfig>()
        {
            Some(s) => assert_eq!(s.path(), "/tmp/x/event_service.db"),
            None => panic!("{:?}", c.store),
        }
        Ok(())
    });
}

#[test]
fn unknown_kind_lists_the_known_ones() {
    let e = refused_with(&[("TIMER_STORE__KIND", "nope")]);
    assert!(e.contains("store.kind = \"nope\""), "{e}");
    assert!(e.contains("known: memory, sqlite, postgres"), "{e}");
    assert!(e.contains("TIMER_"), "names the source: {e}");
}

#[test]
fn kind_not_compiled_in_names_the_feature() {
    // A registry of its own: with --all-features every real kind is compiled in.
    use timer_core::plugin::{BrokerPlugin, Known};
    static LINES: &[Known<BrokerPlugin>] = &[
        Known {
            kind: "memory",
            plugin: Some(&timer_brokers::memory::PLUGIN),
        },
        Known {
            kind: "kafka",
            plugin: None,
        },
    ];
    Jail::expect_with(|jail| {
        jail.set_env("TIMER_BROKER__KIND", "kafka");
        let figment = figment(None).map_err(|e| e.to_string())?;
        let Err(e) = plugin_of(&figment, "broker", &Registry(LINES), "memory") else {
            panic!("kafka is not compiled into this registry");
        };
        assert_eq!(e.kind(), timer_core::ErrorKind::Unsupported);
        let e = e.to_string();
        assert!(
            e.contains("broker \"kafka\" is not compiled in; rebuild with --features kafka"),
            "{e}"
        );
        assert!(e.contains("compiled in: memory"), "{e}");
        assert!(e.contains("TIMER_"), "names the source: {e}");
        Ok(())
    });
}

#[cfg(feature = "kafka")]
#[test]
fn kafka_publish_timeout_must_stay_below_the_engines() {
    Jail::expect_with(|jail| {
        jail.set_env("TIMER_BROKER__KIND", "kafka");
        jail.set_env("TIMER_BROKER__PUBLISH_TIMEOUT", "20s");
        let e = load_in_jail(None).unwrap_err().to_string();
        assert!(
            e.contains("broker.publish_timeout") && e.contains("engine.publish_timeout"),
            "{e}"
        );
        jail.set_env("TIMER_BROKER__PUBLISH_TIMEOUT", "10s");
        assert!(load_in_jail(None).is_ok());
        Ok(())
    });
}

/// Every file in `config/` loads through the real loader, and one named after a plugin
/// (`config/nats.toml`) configures that plugin.
#[cfg(all(
    feature = "sqlite",
    feature = "postgres",
    feature = "nats",
    feature = "kafka",
    feature = "rabbitmq"
))]
#[test]
fn every_config_file_loads() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("the config directory")
        .map(|entry| entry.expect("a config directory entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 2,
        "config files in {}: {files:?}",
        dir.display()
    );
    Jail::expect_with(|_| {
        for file in &files {
            let c = figment(Some(file))
                .and_then(|f| load(&f))
                .map_err(|e| format!("{}: {}", file.display(), e.chain()))?;
            let stem = file
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or_default();
            if timer_stores::PLUGINS.known(stem).is_some() {
                assert_eq!(c.store.kind(), stem, "{}", file.display());
            } else if timer_brokers::PLUGINS.known(stem).is_some() {
                assert_eq!(c.broker.kind(), stem, "{}", file.display());
            }
        }
        Ok(())
    });
}

#[test]
fn engine_settings_that_would_spin_are_refused() {
    let e = refused_with(&[("TIMER_ENGINE__PURGE_INTERVAL", "0s")]);
    assert!(e.contains("engine.purge_interval"), "{e}");
    // 0 is not "no cap": every retry and restart would come at once.
    let e = refused_with(&[("TIMER_ENGINE__RETRY_MAX", "0s")]);
    assert!(e.contains("engine.retry_max must be at least"), "{e}");
    let e = refused_with(&[("TIMER_ENGINE__RETRY_BASE", "0s")]);
    assert!(e.contains("engine.retry_base must be above 0"), "{e}");
}

/// Kubernetes gives a pod variables for every Service of its namespace: those of a Service
/// named `timer-service` (or `timer`) start with `TIMER_` and are passed over; a variable of
/// that shape with a value Kubernetes would not give is still an unknown key.
#[test]
fn kubernetes_service_links_are_not_keys() {
    Jail::expect_with(|jail| {
        for (name, value) in [
            ("TIMER_SERVICE_SERVICE_HOST", "10.96.0.12"),
            ("TIMER_SERVICE_SERVICE_PORT", "8080"),
            ("TIMER_SERVICE_SERVICE_PORT_HTTP", "8080"),
            ("TIMER_SERVICE_SERVICE_PORT_HTTP_API", "8081"),
            ("TIMER_SERVICE_PORT", "tcp://10.96.0.12:8080"),
            ("TIMER_SERVICE_PORT_8080_TCP", "tcp://10.96.0.12:8080"),
            ("TIMER_SERVICE_PORT_8080_TCP_PROTO", "tcp"),
            ("TIMER_SERVICE_PORT_8080_TCP_PORT", "8080"),
            ("TIMER_SERVICE_PORT_8080_TCP_ADDR", "10.96.0.12"),
            // A Service named `timer`.
            ("TIMER_SERVICE_HOST", "10.96.0.13"),
            ("TIMER_PORT", "tcp://10.96.0.13:80"),
            ("TIMER_PORT_80_TCP_ADDR", "10.96.0.13"),
        ] {
            jail.set_env(name, value);
        }
        load_in_jail(None).map_err(|e| e.to_string())?;
        Ok(())
    });
    let e = refused_with(&[("TIMER_SERVICE_PORT", "soon")]);
    assert!(e.contains("service_port"), "{e}");
}

/// Tenant ids are case sensitive, also where the environment names them.
#[test]
fn a_tenant_named_in_the_environment_keeps_its_case() {
    Jail::expect_with(|jail| {
        jail.set_env(
            "TIMER_LIMITS__RATE__TENANTS__Acme__SCHEDULES_PER_SECOND",
            "5",
        );
        let c = load_in_jail(None).map_err(|e| e.to_string())?;
        let tenants: Vec<&String> = c.limits.rate.tenants.keys().collect();
        assert_eq!(tenants, ["Acme"]);
        Ok(())
    });
}

/// A secret of digits only is text, as given; a secret that cannot be read is refused without
/// its value in the error.
#[test]
fn secrets_are_text_and_never_in_an_error() {
    Jail::expect_with(|jail| {
        jail.set_env("TIMER_HTTP__TOKEN", "031415926535");
        let c = load_in_jail(None).map_err(|e| e.to_string())?;
        assert_eq!(c.http.token.as_deref(), Some("031415926535"));
        jail.create_file("test.toml", "[http]\ntoken = 271828182845\n")?;
        jail.clear_env();
        let e = load_in_jail(Some("")).unwrap_err().to_string();
        assert!(e.contains("http.token") && e.contains("test.toml"), "{e}");
        assert!(
            !e.contains("271828182845"),
            "the secret is in the error: {e}"
        );
        Ok(())
    });
}

/// A log filter that would silence the service is refused, naming the levels.
#[test]
fn a_log_level_that_is_not_one_is_refused() {
    let e = refused_with(&[("TIMER_LOG__LEVEL", "warning")]);
    assert!(e.contains(r#"log.level: "warning" is not a level"#), "{e}");
    let e = refused_with(&[("TIMER_LOG__LEVEL", "")]);
    assert!(e.contains("log.level is empty"), "{e}");
    Jail::expect_with(|jail| {
        jail.set_env("TIMER_LOG__LEVEL", "timer_core=debug,warn");
        load_in_jail(None).map_err(|e| e.to_string())?;
        Ok(())
    });
}

#[test]
fn typo_in_a_key_is_an_error_naming_key_and_file() {
    Jail::expect_with(|jail| {
        jail.create_file("test.toml", "[engine]\npoll_intervall = \"1s\"\n")?;
        let e = load_in_jail(Some("")).unwrap_err().to_string();
        assert!(e.contains("poll_intervall"), "{e}");
        assert!(e.contains("test.toml"), "{e}");
        jail.create_file("test.toml", "[store]\nkind = \"memory\"\nurl = \"x\"\n")?;
        let e = load_in_jail(Some("")).unwrap_err().to_string();
        assert!(
            e.contains("url"),
            "plugin sections reject unknown keys too: {e}"
        );
        Ok(())
    });
}

#[test]
fn bad_values_are_errors() {
    let e = refused_with(&[("TIMER_ENGINE__POLL_INTERVAL", "soon")]).to_lowercase();
    assert!(
        e.contains("soon") && e.contains("engine.poll_interval"),
        "{e}"
    );
    let e = refused_with(&[("TIMER_HTTP__TOKEN", " ")]);
    assert!(e.contains("http.token is empty"), "{e}");
    let e = refused_with(&[("TIMER_ENGINE__BATCH_SIZE", "0")]);
    assert!(e.contains("engine.batch_size"), "{e}");
    // Values that would leave the API answering every request with an error.
    for (name, value, says) in [
        (
            "TIMER_HTTP__REQUEST_TIMEOUT",
            "0s",
            "http.request_timeout must be more than 0s",
        ),
        (
            "TIMER_HTTP__MAX_EVENT_STREAMS",
            "0",
            "http.max_event_streams must be at least 1",
        ),
        (
            "TIMER_HTTP__EVENT_STREAM_BUFFER",
            "65535",
            "http.event_stream_buffer is 65535 bytes",
        ),
        // Streams held open would leave no connection for /healthz.
        (
            "TIMER_HTTP__MAX_CONNECTIONS",
            "256",
            "http.max_event_streams (256) must be less than http.max_connections (256)",
        ),
    ] {
        let e = refused_with(&[(name, value)]);
        assert!(e.contains(says), "{name}={value}: {e}");
    }
    Jail::expect_with(|_| {
        let e = figment(Some(Path::new("missing.toml")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing.toml"), "{e}");
        Ok(())
    });
}

#[test]
fn redaction_hides_secrets() {
    assert_eq!(
        timer_core::redact::redact_url("postgres://app:hunter2@db:5432/timers"),
        "postgres://app:***@db:5432/timers"
    );
    assert_eq!(
        timer_core::redact::redact_url("sqlite://timer-service.db"),
        "sqlite://timer-service.db"
    );
    let mut v: toml::Value = toml::from_str("[broker]\nurl = \"nats://u:pw@h:4222\"\ntoken = \"abc\"\n[x]\nsasl_password = \"p\"\nname = \"ok\"").unwrap();
    redact(&mut v, "");
    let text = toml::to_string(&v).unwrap();
    assert!(
        !text.contains("pw@") && !text.contains("abc") && !text.contains("\"p\""),
        "{text}"
    );
    assert!(text.contains("name = \"ok\""));
    // librdkafka properties as written in [broker.properties].
    let mut v: toml::Value = toml::from_str(
        "[broker.properties]\n\"sasl.password\" = \"s1\"\n\"ssl.key.pem\" = \"s2\"\n\
         \"sasl.oauthbearer.client.secret\" = \"s3\"\n\"ssl.keystore.password\" = \"s4\"\n\
         \"sasl.mechanisms\" = \"PLAIN\"",
    )
    .unwrap();
    redact(&mut v, "");
    let text = toml::to_string(&v).unwrap();
    for secret in ["s1", "s2", "s3", "s4"] {
        assert!(!text.contains(secret), "{secret} shown: {text}");
    }
    assert!(text.contains("PLAIN"), "{text}");
}

#[test]
fn telemetry_values_are_checked_naming_the_key() {
    let e = refused_with(&[("TIMER_TELEMETRY__SAMPLING_RATIO", "1.5")]);
    assert!(e.contains("telemetry.sampling_ratio is 1.5"), "{e}");
    let e = refused_with(&[("TIMER_TELEMETRY__OTLP_ENDPOINT", "collector:4317")]);
    assert!(e.contains("telemetry.otlp_endpoint"), "{e}");
    let e = refused_with(&[("TIMER_TELEMETRY__OTLP_ENDPOINT", "ftp://collector")]);
    assert!(e.contains("http:// or https://"), "{e}");
    let e = refused_with(&[("TIMER_TELEMETRY__TRACE_URL", "https://tempo.example/")]);
    assert!(
        e.contains("telemetry.trace_url") && e.contains("{traceId}"),
        "{e}"
    );
    let e = refused_with(&[("TIMER_TELEMETRY__MAX_QUEUED_SPANS", "0")]);
    assert!(e.contains("telemetry.max_queued_spans"), "{e}");
    let e = refused_with(&[("TIMER_TELEMETRY__PROTOCOL", "thrift")]);
    assert!(e.contains("thrift"), "{e}");
}

#[test]
fn telemetry_headers_are_shown_redacted() {
    Jail::expect_with(|jail| {
        jail.set_env(
            "TIMER_TELEMETRY__OTLP_ENDPOINT",
            "https://otlp.example:4317",
        );
        jail.set_env("TIMER_TELEMETRY__HEADERS__X_HONEYCOMB_TEAM", "k3y");
        let config = load_in_jail(None).expect("a config with telemetry");
        assert_eq!(
            config
                .telemetry
                .headers
                .get("x_honeycomb_team")
                .map(String::as_str),
            Some("k3y")
        );
        let text = render_redacted(&config).expect("rendered");
        assert!(!text.contains("k3y") && text.contains("***"), "{text}");
        assert!(text.contains("https://otlp.example:4317"), "{text}");
        Ok(())
    });
}

#[test]
fn an_unreadable_telemetry_ca_is_found_before_serving() {
    Jail::expect_with(|jail| {
        jail.set_env("TIMER_TELEMETRY__TLS_CA", "no-such-ca.pem");
        let config = load_in_jail(None).expect("values alone are fine");
        let e = crate::server::prepare(&config).err().map(|e| e.to_string());
        assert!(
            e.as_deref()
                .is_some_and(|e| e.contains("telemetry.tls_ca no-such-ca.pem")),
            "{e:?}"
        );
        jail.create_file("not-a-ca.pem", "hello")?;
        jail.set_env("TIMER_TELEMETRY__TLS_CA", "not-a-ca.pem");
        let config = load_in_jail(None).expect("values alone are fine");
        let e = crate::server::prepare(&config).err().map(|e| e.to_string());
        assert!(
            e.as_deref()
                .is_some_and(|e| e.contains("holds no PEM certificate")),
            "{e:?}"
        );
        Ok(())
    });
}
