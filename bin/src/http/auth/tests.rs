//! The rules of the routes and the hashing of keys.

use axum::http::Method;
use sha2::{Digest, Sha256};

use super::*;

#[test]
fn hashes_are_sha256_hex() {
    // SHA-256("test"), as `sha256sum` prints it.
    assert_eq!(
        hash_token("test"),
        "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    );
    assert_eq!(
        parse_hash(&hash_token("x")),
        Some(Sha256::digest(b"x").into())
    );
    assert_eq!(parse_hash("9f86"), None);
    assert_eq!(parse_hash(&"g".repeat(64)), None);
}

#[test]
fn tenant_routes_need_read_for_get_and_write_otherwise() {
    let get = Method::GET;
    let post = Method::POST;
    assert_eq!(
        rule(&get, "/v1/tenants/{tenant}/timers/{id}"),
        Some(Rule::Tenant(Scope::Read))
    );
    assert_eq!(
        rule(&Method::DELETE, "/v1/tenants/{tenant}/timers/{id}"),
        Some(Rule::Tenant(Scope::Write))
    );
    assert_eq!(
        rule(&post, "/v1/tenants/{tenant}/timers/bulk"),
        Some(Rule::Tenant(Scope::Write))
    );
    // HEAD is answered by the GET route's handler: a read.
    assert_eq!(
        rule(&Method::HEAD, "/v1/tenants/{tenant}/timers/{id}"),
        Some(Rule::Tenant(Scope::Read))
    );
    assert_eq!(
        rule(&Method::HEAD, "/v1/summary"),
        Some(Rule::Each(Scope::Read))
    );
    assert_eq!(rule(&get, "/v1/status"), Some(Rule::Each(Scope::Admin)));
    assert_eq!(rule(&get, "/v1/unknown"), None);
}

/// A route added without a rule would be refused to everyone; this names it first.
#[test]
fn every_route_of_the_api_has_a_rule() {
    let config = crate::config::load(&figment::Figment::new()).expect("the defaults load");
    let (_, document) = crate::http::routes(&config, None);
    let document = serde_json::to_value(&document).expect("the document serializes");
    let open = ["/healthz", "/readyz", "/metrics"];
    let paths = document["paths"].as_object().expect("paths");
    assert!(paths.len() > 10, "{paths:?}");
    for (path, item) in paths {
        for method in item.as_object().expect("a path item").keys() {
            let method: Method = method.to_uppercase().parse().expect("a method");
            let expected = !open.contains(&path.as_str());
            assert_eq!(rule(&method, path).is_some(), expected, "{method} {path}");
        }
    }
}
