//! The config's checks, defaults and target patterns.

use super::*;

#[test]
fn target_patterns_match_whole_names_with_stars_for_any_run() {
    for (pattern, name, matches) in [
        ("orders.due", "orders.due", true),
        ("orders.due", "orders.due.eu", false),
        ("orders.*", "orders.due.eu", true),
        ("orders.*", "orders.", true),
        ("orders.*", "orders", false),
        ("*.later/*", "e2e1.events.later/k", true),
        ("*.later/*", "e2e1.events.later", false),
        ("a*b*c", "abc", true),
        ("a*b*c", "aXbYbZc", true),
        ("a*b*c", "acb", false),
        ("*", "", true),
        ("ab*ba", "aba", false),
    ] {
        assert_eq!(
            matches_pattern(pattern, name),
            matches,
            "{pattern} ~ {name}"
        );
    }
}

#[test]
fn each_tenant_reaches_its_own_names_and_what_it_is_given() {
    let mut rules = TargetRules::default();
    assert!(rules.allows("acme", "acme.orders"));
    assert!(!rules.allows("acme", "globex.orders"));
    assert!(!rules.allows("acme", "acme"), "only below its name");
    // A tenant whose id holds a dot is one token: it cannot reach `acme.`'s names, nor
    // `acme` its.
    assert!(!rules.allows("acme.eu", "acme.eu.orders"));
    assert!(rules.allows("acme.eu", "acme%2Eeu.orders"));
    assert!(!rules.allows("acme", "acme%2Eeu.orders"));
    rules.allow.clear();
    assert!(
        !rules.allows("acme", "acme.orders"),
        "[] allows nothing by itself"
    );
    rules.tenants.insert(
        "acme".into(),
        TenantTargets {
            allow: vec!["orders/*".into()],
        },
    );
    assert!(rules.allows("acme", "orders/due.eu"));
    assert!(!rules.allows("globex", "orders/due.eu"), "acme's own only");

    // URL patterns are prefixes, of URLs only; a bare host stops at its end.
    let urls = TargetRules {
        allow: vec![
            "*".into(),
            "https://Hooks.Acme.com:443".into(),
            "http://127.0.0.1:8080/{tenant}/".into(),
        ],
        tenants: BTreeMap::new(),
    };
    urls.check().unwrap();
    assert!(urls.allows("a", "https://hooks.acme.com/"));
    assert!(urls.allows("a", "https://hooks.acme.com/x/y?z=1"));
    assert!(!urls.allows("a", "https://hooks.acme.com.evil.net/"));
    assert!(
        !urls.allows("a", "http://hooks.acme.com/"),
        "another scheme"
    );
    assert!(urls.allows("acme", "http://127.0.0.1:8080/acme/due"));
    assert!(!urls.allows("acme", "http://127.0.0.1:8080/globex/due"));
    assert!(
        !urls.allows("acme", "http://127.0.0.1:8080/acme"),
        "below the path"
    );
    // The tenants `.` and `..` would be dot segments, which parsing removes (the pattern would
    // be the host's root, every tenant's URLs below it): a pattern naming them allows nothing.
    for tenant in [".", ".."] {
        assert!(
            !urls.allows(tenant, "http://127.0.0.1:8080/acme/due"),
            "{tenant}"
        );
        assert!(
            !urls.allows(tenant, "http://127.0.0.1:8080/%2E/due"),
            "{tenant}"
        );
        assert!(
            urls.allows(tenant, "https://hooks.acme.com/x"),
            "{tenant}: no {{tenant}}"
        );
    }
    assert!(urls.allows("...", "http://127.0.0.1:8080/%2E%2E%2E/due"));
    // In a host, names are lowercased and `%XX` decoded and mapped: only a tenant id a host
    // keeps as written gets a host of its own, so `ACME` and `ａｃｍｅ` never reach `acme`'s.
    let hosts = TargetRules {
        allow: vec!["https://{tenant}.hooks.example.com/".into()],
        tenants: BTreeMap::new(),
    };
    hosts.check().unwrap();
    assert!(hosts.allows("acme", "https://acme.hooks.example.com/due"));
    assert!(hosts.allows("eu-1", "https://eu-1.hooks.example.com/due"));
    let last = TargetRules {
        allow: vec!["https://10.0.0.{tenant}/".into()],
        tenants: BTreeMap::new(),
    };
    // `5`, `05` and `0x5` would all be 10.0.0.5.
    for tenant in ["5", "05", "0x5"] {
        assert!(!last.allows(tenant, "https://10.0.0.5/due"), "{tenant}");
    }
    for tenant in [
        "ACME",
        "\u{ff41}\u{ff43}\u{ff4d}\u{ff45}",
        "a_b",
        "a.b",
        "5",
        "0x5",
    ] {
        for url in [
            "https://acme.hooks.example.com/due",
            "https://a_b.hooks.example.com/due",
            "https://a.b.hooks.example.com/due",
        ] {
            assert!(!hosts.allows(tenant, url), "{tenant} {url}");
        }
    }
    // In the path, the token stands as written (case kept, `%XX` not decoded).
    assert!(urls.allows("ACME", "http://127.0.0.1:8080/ACME/due"));
    assert!(!urls.allows("ACME", "http://127.0.0.1:8080/acme/due"));
    assert!(
        !urls.allows("a", "https://x.com/"),
        "`*` allows names, not URLs"
    );
    assert!(urls.allows("a", "orders"));
    for (pattern, says) in [
        ("https://*.acme.com", "`*` is not allowed"),
        ("https://acme.com/*", "`*` is not allowed"),
        ("http://", "not a URL"),
    ] {
        let rules = TargetRules {
            allow: vec![pattern.into()],
            tenants: BTreeMap::new(),
        };
        let e = rules.check().unwrap_err().to_string();
        assert!(e.contains("targets.allow") && e.contains(says), "{e}");
    }
    rules.tenants.insert(
        "globex".into(),
        TenantTargets {
            allow: vec![String::new()],
        },
    );
    let e = rules.check().unwrap_err();
    assert!(
        e.to_string().contains("targets.tenants.globex.allow"),
        "{e}"
    );
}

#[test]
fn fire_rate_check_names_the_key_and_a_tenant_overrides_the_default() {
    assert!(FireRateLimits::default().check().is_ok());
    assert_eq!(FireRateLimits::default().of("acme"), None);
    let mut limits = FireRateLimits {
        fires_per_second: 0,
        burst: 10,
        tenants: BTreeMap::new(),
    };
    let e = limits.check().unwrap_err().to_string();
    assert!(
        e.contains("limits.fire_rate.burst is set, but fires_per_second is 0"),
        "{e}"
    );
    limits.fires_per_second = 100;
    limits.burst = 0;
    limits.tenants.insert(
        "slow".into(),
        TenantFireRate {
            fires_per_second: 5,
            burst: 0,
        },
    );
    limits
        .tenants
        .insert("free".into(), TenantFireRate::default());
    assert!(limits.check().is_ok());
    // A burst of 0 is one second's worth; a tenant of its own, or none.
    assert_eq!(limits.of("acme"), Some((100, 100)));
    assert_eq!(limits.of("slow"), Some((5, 5)));
    assert_eq!(limits.of("free"), None);
}

#[test]
fn rate_check_names_the_key() {
    assert!(RateLimits::default().check().is_ok());
    let burst_alone = RateLimits {
        burst: 10,
        ..RateLimits::default()
    };
    let e = burst_alone.check().unwrap_err().to_string();
    assert!(e.contains("limits.rate.burst is set"), "{e}");
    let mut tenant = RateLimits::default();
    tenant.tenants.insert(
        "a.b".into(),
        TenantRate {
            schedules_per_second: 0,
            burst: 5,
        },
    );
    let e = tenant.check().unwrap_err().to_string();
    assert!(e.contains(r#"limits.rate.tenants."a.b".burst"#), "{e}");
    let none_held = RateLimits {
        max_held: 0,
        ..RateLimits::default()
    };
    let e = none_held.check().unwrap_err().to_string();
    assert!(e.contains("limits.rate.max_held"), "{e}");
}

#[test]
fn engine_check_names_the_key() {
    assert!(EngineConfig::default().check().is_ok());
    type Change = fn(&mut EngineConfig);
    let cases: [(Change, &str); 6] = [
        (
            |c| c.claim_ahead = Duration::from_millis(1_001),
            "engine.claim_ahead",
        ),
        (
            |c| {
                c.lease = Duration::from_millis(500);
                c.claim_ahead = Duration::from_millis(100);
            },
            "engine.claim_ahead",
        ),
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
