//! Unit tests of config sections, registries, config values and test servers.

use super::*;

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Demo {
    kind: String,
    url: String,
    size: u32,
}

#[test]
fn sections_parse_with_defaults_and_name_bad_keys() {
    let locate = |key: &str| format!(" (at {key})");
    let section = |value| ConfigSection {
        name: "store",
        value,
        locate: &locate,
    };
    let d: Demo = section(serde_json::Value::Null).parse().unwrap();
    assert_eq!(d.size, 0);
    let d: Demo = section(serde_json::json!({"kind": "x", "url": "u"}))
        .parse()
        .unwrap();
    assert_eq!((d.kind.as_str(), d.url.as_str()), ("x", "u"));
    let e = section(serde_json::json!({"size": "big"}))
        .parse::<Demo>()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("store.size: invalid type") && e.ends_with("(at store.size)"),
        "{e}"
    );
    let e = section(serde_json::json!({"urll": "u"}))
        .parse::<Demo>()
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown field `urll`"), "{e}");
    let d: Demo = section(serde_json::json!({"kind": "x"}))
        .parse_as("x")
        .unwrap();
    assert_eq!(d.kind, "x");
    let e = section(serde_json::json!({"kind": "y"}))
        .parse_as::<Demo>("x")
        .unwrap_err()
        .to_string();
    assert!(e.contains("store.kind = \"y\" (at store.kind)"), "{e}");
}

#[test]
fn registries_tell_compiled_from_known_kinds() {
    struct Demo;
    static DEMO: Demo = Demo;
    static LINES: &[Known<Demo>] = &[
        Known {
            kind: "a",
            plugin: Some(&DEMO),
        },
        Known {
            kind: "b",
            plugin: None,
        },
    ];
    let registry = Registry(LINES);
    assert_eq!(registry.kinds().collect::<Vec<_>>(), ["a", "b"]);
    assert_eq!(registry.compiled_kinds().collect::<Vec<_>>(), ["a"]);
    assert_eq!(registry.iter().count(), 1);
    assert!(registry.get("a").is_some() && registry.get("b").is_none());
    assert!(registry.known("b").is_some() && registry.known("c").is_none());
}

#[test]
fn values_leave_unset_options_out() {
    #[derive(serde::Serialize)]
    struct Options {
        kind: &'static str,
        token: Option<String>,
        inner: Vec<Option<u8>>,
    }
    let v = to_value(&Options {
        kind: "x",
        token: None,
        inner: vec![Some(1)],
    })
    .unwrap();
    assert_eq!(v, serde_json::json!({"kind": "x", "inner": [1]}));
}

#[test]
fn ports_come_from_urls_and_addresses() {
    let server = |var| TestServer::new(var, "UNUSED", "demo", "DEMO_PORT");
    // Variables of this test only; nothing else reads them.
    std::env::set_var(
        "TIMER_PLUGIN_TEST_URL",
        "amqp://guest:guest@127.0.0.1:16572/%2f",
    );
    std::env::set_var("TIMER_PLUGIN_TEST_ADDR", "127.0.0.1:19092");
    assert_eq!(server("TIMER_PLUGIN_TEST_URL").port(), Some(16572));
    assert_eq!(server("TIMER_PLUGIN_TEST_ADDR").port(), Some(19092));
    let missing = server("TIMER_PLUGIN_TEST_MISSING");
    assert_eq!(missing.port(), None);
    let why = missing.unavailable().unwrap();
    assert!(
        why.contains("TIMER_PLUGIN_TEST_MISSING is not set"),
        "{why}"
    );
    assert!(fresh_name("t").starts_with('t') && fresh_name("t").len() == 13);
}
