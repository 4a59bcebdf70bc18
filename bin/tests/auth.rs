//! Tenant isolation and API security on the built binary (SQLite on a temp file, the in-process
//! broker): scoped API keys on every route, JWT bearer tokens, HTTPS (with client certificates),
//! the audit log, and no secret in logs, `check-config` output or errors.

use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use reqwest::Method;
use serde_json::{json, Value};
use timer_conformance::e2e::{now_ms, run_ok, run_to_end, write_config, EventLog, Service};
use timer_conformance::wait_for;

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");

/// No environment added to a CLI run.
const NO_ENV: &[(&str, &str)] = &[];

/// The keys of the tests; `tenants` and `scopes` as in `[[http.keys]]`.
const OPS: &str = "ops-key-4c1e0f6a9d2b";
const TEAM_A: &str = "team-a-key-77b3c2d1e5f9";
const TEAM_A_READ: &str = "team-a-read-key-0aa9f3c4";
const LEGACY: &str = "legacy-token-e2d4b6a8c0f1";
const JWT_SECRET: &str = "jwt-secret-that-is-long-enough-0123456789";

fn sha256(key: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The config of a service with the test's keys, `http.token` and `extra_http` merged into
/// `[http]`.
fn config(dir: &Path, extra_http: Value) -> PathBuf {
    let mut http = json!({
        "token": LEGACY,
        "keys": [
            { "name": "ops", "sha256": sha256(OPS), "tenants": ["*"], "scopes": ["read", "write", "admin"] },
            { "name": "team-a", "sha256": sha256(TEAM_A), "tenants": ["alpha", "alpha-eu"], "scopes": ["read", "write"] },
            { "name": "team-a-read", "sha256": sha256(TEAM_A_READ), "tenants": ["alpha"], "scopes": ["read"] },
        ],
    });
    if let (Some(http), Value::Object(extra)) = (http.as_object_mut(), extra_http) {
        http.extend(extra);
    }
    write_config(
        dir,
        &json!({
            "store": { "kind": "sqlite", "url": format!("sqlite://{}", dir.join("timers.db").display()) },
            "broker": { "kind": "memory" },
            "http": http,
        }),
    )
}

async fn start(dir: &Path, extra_http: Value) -> Service {
    let file = config(dir, extra_http);
    Service::start(
        Path::new(BIN),
        dir,
        &[("TIMER_CONFIG", file.display().to_string())],
    )
    .await
}

/// `method path` with `Authorization: Bearer key` (none when `key` is empty).
async fn call(
    service: &Service,
    key: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let key = Some(key).filter(|k| !k.is_empty());
    let response = service.respond(method, path, key, body.as_ref()).await;
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

fn timer(tenant: &str, id: &str, due_ms: i64) -> Value {
    json!({ "tenantId": tenant, "serviceCallId": id, "dueTimeMs": due_ms })
}

/// A far due time: nothing fires during the test unless asked.
fn far() -> i64 {
    now_ms() + 3_600_000
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_for_some_tenants_cannot_touch_another_on_any_route() {
    let dir = tempfile::tempdir().expect("tempdir");
    let service = start(dir.path(), json!({})).await;
    for (tenant, id) in [("bravo", "b-1"), ("alpha", "a-1")] {
        let (status, body) = call(
            &service,
            OPS,
            Method::POST,
            "/v1/timers",
            Some(timer(tenant, id, far())),
        )
        .await;
        assert_eq!(status, 201, "{body}");
    }

    // Every route that names tenant bravo, once for a timer that exists and once for one that
    // does not: both refused alike, so the answer tells nothing about bravo's timers.
    let b = "/v1/tenants/bravo/timers";
    let pairs: Vec<(Method, String, Option<Value>)> = ["b-1", "nope"]
        .iter()
        .flat_map(|id| {
            [
                (Method::GET, format!("{b}/{id}"), None),
                (Method::GET, format!("{b}/{id}?next=3"), None),
                (Method::DELETE, format!("{b}/{id}"), None),
                (
                    Method::POST,
                    format!("{b}/{id}/pause"),
                    Some(json!({"note": "x"})),
                ),
                (Method::POST, format!("{b}/{id}/resume"), None),
                (Method::POST, format!("{b}/{id}/retry"), None),
                (Method::POST, format!("{b}/{id}/trigger"), None),
                (
                    Method::POST,
                    format!("{b}/{id}/complete"),
                    Some(json!({"occurrence": 1})),
                ),
                (Method::GET, format!("{b}/{id}/history"), None),
            ]
        })
        .collect();
    let (half, _) = pairs.split_at(pairs.len() / 2);
    for (i, (method, path, body)) in half.iter().enumerate() {
        let (status, existing) = call(&service, TEAM_A, method.clone(), path, body.clone()).await;
        assert_eq!(status, 403, "{method} {path}: {existing}");
        let (other_method, other_path, other_body) = &pairs[i + half.len()];
        let (status, missing) = call(
            &service,
            TEAM_A,
            other_method.clone(),
            other_path,
            other_body.clone(),
        )
        .await;
        assert_eq!(status, 403, "{other_method} {other_path}: {missing}");
        assert_eq!(
            existing, missing,
            "{method} {path}: the refusal differs for a timer that exists and one that does not"
        );
        assert_eq!(existing["error"]["reason"], "forbidden", "{existing}");
    }
    let refused: Vec<(Method, &str, Option<Value>)> = vec![
        (Method::GET, "/v1/tenants/bravo/timers", None),
        (
            Method::GET,
            "/v1/tenants/bravo/timers?state=scheduled",
            None,
        ),
        (Method::GET, "/v1/tenants/bravo/summary", None),
        (
            Method::POST,
            "/v1/tenants/bravo/timers/bulk",
            Some(json!({"action": "cancel", "filter": {}})),
        ),
        (
            Method::POST,
            "/v1/timers",
            Some(timer("bravo", "b-2", far())),
        ),
        // Another tenant's command is refused for its tenant before it is checked: the answer
        // tells nothing of that tenant's rules (where it may send) or of the command.
        (
            Method::POST,
            "/v1/timers",
            Some(
                json!({"tenantId": "bravo", "serviceCallId": "b-6", "dueTimeMs": far(), "target": {"queue": "partners.orders"}}),
            ),
        ),
        (
            Method::POST,
            "/v1/timers",
            Some(json!({"tenantId": "bravo", "serviceCallId": ""})),
        ),
        // The same as an envelope: the tenant inside its payload, as the decoder reads it.
        (
            Method::POST,
            "/v1/timers",
            Some(
                json!({"type": "ScheduleTimer", "payload": {"tenantId": "bravo", "serviceCallId": "b-7", "dueTimeMs": far(), "target": {"queue": "partners.orders"}}}),
            ),
        ),
        (Method::GET, "/v1/events?tenant=bravo", None),
        (
            Method::POST,
            "/v1/commands",
            Some(
                json!({"type": "ScheduleTimer", "tenantId": "bravo", "serviceCallId": "b-3", "dueTimeMs": far()}),
            ),
        ),
        (
            Method::POST,
            "/v1/commands",
            Some(json!({"type": "ScheduleTimer", "serviceCallId": "b-4", "dueTimeMs": far()})),
        ),
        // Routes about the whole service need the admin scope.
        (Method::GET, "/v1/status", None),
        (Method::GET, "/v1/dead-letters", None),
    ];
    for (method, path, body) in refused {
        let (status, answer) = call(&service, TEAM_A, method.clone(), path, body).await;
        assert_eq!(status, 403, "{method} {path}: {answer}");
        assert_eq!(answer["error"]["reason"], "forbidden", "{answer}");
    }

    // A batch with one item of another tenant is refused whole, naming that item (also where
    // the item itself is refused: its tenant comes first).
    let bravo = json!({"type": "ScheduleTimer", "payload": {"tenantId": "bravo", "serviceCallId": "b-5", "dueTimeMs": far(), "target": {"queue": "partners.orders"}}});
    let batch = json!({"commands": [timer("alpha", "a-2", far()), bravo]});
    let (status, answer) = call(
        &service,
        TEAM_A,
        Method::POST,
        "/v1/timers/batch",
        Some(batch),
    )
    .await;
    assert_eq!(status, 403, "{answer}");
    assert_eq!(answer["rejected"][0]["index"], 1, "{answer}");
    assert_eq!(answer["error"]["field"], "commands[1].tenantId", "{answer}");
    let (status, _) = call(
        &service,
        OPS,
        Method::GET,
        "/v1/tenants/alpha/timers/a-2",
        None,
    )
    .await;
    assert_eq!(status, 404, "nothing of the refused batch was written");

    // Nothing of bravo changed: b-1 is Scheduled, unpaused, with only its creation in history.
    let (status, b1) = call(
        &service,
        OPS,
        Method::GET,
        "/v1/tenants/bravo/timers/b-1",
        None,
    )
    .await;
    assert_eq!(
        (status, b1["state"].as_str()),
        (200, Some("Scheduled")),
        "{b1}"
    );
    let (_, history) = call(
        &service,
        OPS,
        Method::GET,
        "/v1/tenants/bravo/timers/b-1/history",
        None,
    )
    .await;
    assert_eq!(
        history["history"].as_array().map(Vec::len),
        Some(1),
        "{history}"
    );
    for id in ["b-2", "b-3", "b-4", "b-5"] {
        let (status, _) = call(&service, OPS, Method::GET, &format!("{b}/{id}"), None).await;
        assert_eq!(status, 404, "bravo/{id} was not written");
    }

    // What team-a may do, it can.
    let (status, a1) = call(
        &service,
        TEAM_A,
        Method::GET,
        "/v1/tenants/alpha/timers/a-1",
        None,
    )
    .await;
    assert_eq!(status, 200, "{a1}");
    let (status, created) = call(
        &service,
        TEAM_A,
        Method::POST,
        "/v1/timers",
        Some(timer("alpha-eu", "e-1", far())),
    )
    .await;
    assert_eq!(status, 201, "{created}");
    // The summary lists its own tenants only (alpha-eu without timers shows zero counts).
    let (status, summary) = call(&service, TEAM_A, Method::GET, "/v1/summary", None).await;
    assert_eq!(status, 200, "{summary}");
    let tenants: Vec<&str> = summary["tenants"]
        .as_array()
        .map(|t| t.iter().filter_map(|t| t["tenantId"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(tenants, ["alpha", "alpha-eu"], "{summary}");
    let (_, all) = call(&service, OPS, Method::GET, "/v1/summary", None).await;
    assert!(
        all.to_string().contains("\"bravo\""),
        "ops sees every tenant: {all}"
    );
    for path in ["/v1/status", "/v1/dead-letters"] {
        let (status, answer) = call(&service, OPS, Method::GET, path, None).await;
        assert_eq!(status, 200, "{path} with the admin scope: {answer}");
    }

    // A read-only key reads and cannot write.
    let (status, _) = call(
        &service,
        TEAM_A_READ,
        Method::GET,
        "/v1/tenants/alpha/timers/a-1",
        None,
    )
    .await;
    assert_eq!(status, 200);
    for (method, path, body) in [
        (
            Method::POST,
            "/v1/timers",
            Some(timer("alpha", "a-3", far())),
        ),
        (Method::DELETE, "/v1/tenants/alpha/timers/a-1", None),
        (Method::POST, "/v1/tenants/alpha/timers/a-1/trigger", None),
    ] {
        let (status, answer) = call(&service, TEAM_A_READ, method.clone(), path, body).await;
        assert_eq!(status, 403, "{method} {path}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("write scope"), "{message}");
    }

    // No token, a wrong one: 401. `http.token` is a key for everything.
    for key in ["", "not-a-key", &TEAM_A[1..]] {
        let (status, answer) = call(
            &service,
            key,
            Method::GET,
            "/v1/tenants/alpha/timers/a-1",
            None,
        )
        .await;
        assert_eq!(status, 401, "key {key:?}: {answer}");
    }
    let (status, _) = call(&service, LEGACY, Method::GET, "/v1/status", None).await;
    assert_eq!(status, 200, "http.token has every scope");

    // The event stream shows only the key's tenants.
    let team_a_events = service.events_as(Some(TEAM_A)).await;
    let ops_events = service.events_as(Some(OPS)).await;
    let now = now_ms();
    for (tenant, id, due) in [
        ("bravo", "b-soon", now + 300),
        ("alpha", "a-soon", now + 900),
    ] {
        let (status, answer) = call(
            &service,
            OPS,
            Method::POST,
            "/v1/timers",
            Some(timer(tenant, id, due)),
        )
        .await;
        assert_eq!(status, 201, "{answer}");
    }
    let seen = wait_for(Duration::from_secs(30), || async {
        let got = event_tenants(&ops_events);
        (got.len() >= 2).then_some(got)
    })
    .await
    .unwrap_or_else(|| service.fail("ops did not see both events"));
    assert!(seen.iter().any(|t| t == "bravo"), "{seen:?}");
    // bravo fired first; once alpha's event is there, a bravo event would have come before it.
    let seen = wait_for(Duration::from_secs(30), || async {
        let got = event_tenants(&team_a_events);
        got.iter().any(|t| t == "alpha").then_some(got)
    })
    .await
    .unwrap_or_else(|| service.fail("team-a did not see alpha's event"));
    assert_eq!(seen, ["alpha"], "team-a's stream shows alpha only");

    // Every write left an audit line: key name, tenant, action, outcome.
    let log = service.log_text();
    let audit = log
        .lines()
        .find(|l| l.contains("api write") && l.contains("team-a") && l.contains("cancel"))
        .unwrap_or_else(|| panic!("no audit line of team-a's cancel in:\n{log}"));
    assert!(
        audit.contains("bravo") && audit.contains("403") && audit.contains("forbidden"),
        "{audit}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("api write") && l.contains("ops") && l.contains("created")),
        "ops's schedule is audited:\n{log}"
    );
    // A refused schedule names the tenant and timer its body named.
    let refused = log
        .lines()
        .find(|l| l.contains("api write") && l.contains("team-a") && l.contains("b-2"))
        .unwrap_or_else(|| panic!("no audit line of team-a's schedule of b-2 in:\n{log}"));
    assert!(
        refused.contains("bravo") && refused.contains("schedule") && refused.contains("403"),
        "{refused}"
    );
}

/// The tenant of each event `log` received so far.
fn event_tenants(log: &EventLog) -> Vec<String> {
    log.snapshot()
        .iter()
        .map(|r| {
            r.envelope["tenantId"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect()
}

/// A JWT signed with `secret` (HS256) carrying `claims`.
fn jwt(claims: &Value, secret: &str) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        claims,
        &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()),
    )
    .expect("encode a JWT")
}

fn claims(extra: Value) -> Value {
    let now = now_ms() / 1000;
    let mut claims = json!({
        "sub": "svc-billing",
        "aud": "timer-service",
        "iss": "https://idp.test",
        "exp": now + 600,
        "nbf": now - 10,
        "tenants": ["alpha"],
        "scope": "openid read write",
    });
    if let (Some(claims), Value::Object(extra)) = (claims.as_object_mut(), extra) {
        claims.extend(extra);
    }
    claims
}

fn jwt_settings() -> Value {
    json!({
        "jwt": {
            "hs256_secret": JWT_SECRET,
            "audience": "timer-service",
            "issuer": "https://idp.test",
        }
    })
}

/// `token` (tenants `["alpha"]`) schedules timer `id` of alpha, and gets 403 on bravo's.
async fn writes_its_tenant_only(service: &Service, token: &str, id: &str) {
    let (status, answer) = call(
        service,
        token,
        Method::POST,
        "/v1/timers",
        Some(timer("alpha", id, far())),
    )
    .await;
    assert_eq!(status, 201, "{answer}");
    let path = format!("/v1/tenants/bravo/timers/{id}");
    let (status, answer) = call(service, token, Method::GET, &path, None).await;
    assert_eq!(status, 403, "the tenants claim holds: {answer}");
}

/// A JWT signed with `key` (ES256) carrying `claims`, naming `kid` in its header.
fn es256_jwt(claims: &Value, key: &p256::SecretKey, kid: &str) -> String {
    use p256::pkcs8::EncodePrivateKey;
    let der = key.to_pkcs8_der().expect("a PKCS#8 document");
    let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256);
    header.kid = Some(kid.to_owned());
    jsonwebtoken::encode(
        &header,
        claims,
        &jsonwebtoken::EncodingKey::from_ec_der(der.as_bytes()),
    )
    .expect("encode a JWT")
}

/// `http.jwt.jwks_file` with a P-256 key: a JWT it signed is verified by its `kid` (ES256); one
/// signed by another key under the same `kid`, one naming a `kid` the file lacks and an HS256 one
/// are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwts_of_a_jwks_file_are_checked_with_its_es256_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let key = p256::SecretKey::from_slice(&[7; 32]).expect("a P-256 key");
    let stranger = p256::SecretKey::from_slice(&[9; 32]).expect("a P-256 key");
    let mut jwk: Value =
        serde_json::from_str(&key.public_key().to_jwk_string()).expect("the JWK is JSON");
    jwk["kid"] = json!("idp-2026");
    jwk["alg"] = json!("ES256");
    jwk["use"] = json!("sig");
    let jwks = dir.path().join("jwks.json");
    std::fs::write(&jwks, json!({ "keys": [jwk] }).to_string()).expect("write the JWKS");
    let settings = json!({ "jwt": {
        "jwks_file": jwks.display().to_string(),
        "audience": "timer-service",
        "issuer": "https://idp.test",
    } });
    let service = start(dir.path(), settings).await;
    let good = es256_jwt(&claims(json!({})), &key, "idp-2026");
    writes_its_tenant_only(&service, &good, "es-1").await;
    let refused = [
        (
            "another key, same kid",
            es256_jwt(&claims(json!({})), &stranger, "idp-2026"),
        ),
        (
            "a kid not in the file",
            es256_jwt(&claims(json!({})), &key, "idp-1999"),
        ),
        ("HS256", jwt(&claims(json!({})), JWT_SECRET)),
    ];
    for (what, token) in refused {
        let (status, answer) = call(
            &service,
            &token,
            Method::GET,
            "/v1/tenants/alpha/timers/es-1",
            None,
        )
        .await;
        assert_eq!(status, 401, "{what}: {answer}");
    }
    service.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwts_are_checked_for_signature_time_audience_issuer_and_claims() {
    let dir = tempfile::tempdir().expect("tempdir");
    let service = start(dir.path(), jwt_settings()).await;
    let good = jwt(&claims(json!({})), JWT_SECRET);
    writes_its_tenant_only(&service, &good, "j-1").await;
    let (status, answer) = call(&service, &good, Method::GET, "/v1/status", None).await;
    assert_eq!(status, 403, "no admin in the scope claim: {answer}");
    let everything = jwt(
        &claims(json!({"tenants": "*", "scope": ["read", "admin"]})),
        JWT_SECRET,
    );
    let (status, answer) = call(
        &service,
        &everything,
        Method::GET,
        "/v1/tenants/bravo/timers/j-1",
        None,
    )
    .await;
    assert_eq!(status, 404, "tenants \"*\" may read bravo: {answer}");
    let (status, _) = call(&service, &everything, Method::GET, "/v1/status", None).await;
    assert_eq!(status, 200, "scopes as a list");

    let now = now_ms() / 1000;
    let header_none = URL_SAFE_NO_PAD.encode(br#"{"alg":"none","typ":"JWT"}"#);
    let payload = URL_SAFE_NO_PAD.encode(claims(json!({})).to_string());
    let refused = [
        (
            "expired",
            jwt(&claims(json!({"exp": now - 3600})), JWT_SECRET),
            "expired",
        ),
        (
            "not yet valid",
            jwt(&claims(json!({"nbf": now + 3600})), JWT_SECRET),
            "not valid yet",
        ),
        (
            "wrong audience",
            jwt(&claims(json!({"aud": "another-service"})), JWT_SECRET),
            "audience",
        ),
        (
            "wrong issuer",
            jwt(&claims(json!({"iss": "https://evil.test"})), JWT_SECRET),
            "issuer",
        ),
        (
            "wrong signature",
            jwt(
                &claims(json!({})),
                "another-secret-that-is-long-enough-000000",
            ),
            "signature",
        ),
        ("alg none", format!("{header_none}.{payload}."), "JWT"),
        (
            "no tenants",
            jwt(&claims(json!({"tenants": null})), JWT_SECRET),
            "tenants",
        ),
        (
            "no subject",
            jwt(&claims(json!({"sub": null})), JWT_SECRET),
            "sub",
        ),
        (
            "an empty subject",
            jwt(&claims(json!({"sub": ""})), JWT_SECRET),
            "sub",
        ),
        (
            "tampered",
            {
                let mut parts: Vec<String> = good.split('.').map(str::to_owned).collect();
                parts[1] = URL_SAFE_NO_PAD.encode(claims(json!({"tenants": "*"})).to_string());
                parts.join(".")
            },
            "signature",
        ),
    ];
    for (what, token, says) in refused {
        let (status, answer) = call(
            &service,
            &token,
            Method::GET,
            "/v1/tenants/alpha/timers/j-1",
            None,
        )
        .await;
        assert_eq!(status, 401, "{what}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{what}: {message}");
        assert!(
            !message.contains(&token),
            "{what}: the answer repeats the token"
        );
    }
    let log = service.log_text();
    assert!(
        log.contains("jwt:svc-billing"),
        "the JWT's subject names it in the audit log:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_key_hash_or_token_shows_in_logs_check_config_or_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let service = start(dir.path(), jwt_settings()).await;
    let good_jwt = jwt(&claims(json!({})), JWT_SECRET);
    let bad_jwt = jwt(&claims(json!({"aud": "x"})), JWT_SECRET);
    let mut answers = String::new();
    for key in [
        OPS,
        TEAM_A,
        LEGACY,
        &good_jwt,
        &bad_jwt,
        "wrong-key",
        &sha256(OPS),
    ] {
        for (method, path, body) in [
            (Method::GET, "/v1/tenants/alpha/timers/x", None),
            (
                Method::POST,
                "/v1/timers",
                Some(timer("bravo", "s-1", far())),
            ),
            (Method::DELETE, "/v1/tenants/bravo/timers/s-1", None),
            (Method::GET, "/v1/status", None),
        ] {
            let (_, answer) = call(&service, key, method, path, body).await;
            answers.push_str(&answer.to_string());
        }
    }
    let log = service.log_text();
    let config_file = dir.path().join("timer-service.toml");
    let config_arg = config_file.display().to_string();
    let checked = run_to_end(
        Path::new(BIN),
        dir.path(),
        &["check-config", "--config", &config_arg],
        &[("RUST_LOG", "debug")],
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(checked.code, Some(0), "{}", checked.stderr);
    assert!(
        checked.stdout.contains("[[http.keys]]"),
        "{}",
        checked.stdout
    );
    // Wrong settings: a key's plain value where its hash belongs, a short JWT secret.
    let broken = dir.path().join("broken");
    std::fs::create_dir_all(&broken).expect("mkdir");
    let broken_config = write_config(
        &broken,
        &json!({
            "http": {
                "token": LEGACY,
                "keys": [{ "name": "ops", "sha256": OPS, "tenants": ["*"], "scopes": ["read"] }],
            }
        }),
    );
    let refused = run_to_end(
        Path::new(BIN),
        &broken,
        &[
            "check-config",
            "--config",
            &broken_config.display().to_string(),
        ],
        &[("RUST_LOG", "debug")],
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(refused.code, Some(1), "{}", refused.stdout);
    assert!(
        refused.stderr.contains("http.keys[0].sha256"),
        "{}",
        refused.stderr
    );
    let short = write_config(
        &broken,
        &json!({ "http": { "jwt": { "hs256_secret": &JWT_SECRET[..20], "audience": "a" } } }),
    );
    let short_refused = run_to_end(
        Path::new(BIN),
        &broken,
        &["check-config", "--config", &short.display().to_string()],
        &[("RUST_LOG", "debug")],
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(short_refused.code, Some(1));
    assert!(
        short_refused.stderr.contains("hs256_secret"),
        "{}",
        short_refused.stderr
    );
    let everything = [
        ("the service's log", log),
        ("the API's answers", answers),
        (
            "check-config",
            format!("{}{}", checked.stdout, checked.stderr),
        ),
        (
            "check-config refusing a key",
            format!("{}{}", refused.stdout, refused.stderr),
        ),
        (
            "check-config refusing a secret",
            format!("{}{}", short_refused.stdout, short_refused.stderr),
        ),
    ];
    let secrets = [
        ("ops key", OPS.to_owned()),
        ("team-a key", TEAM_A.to_owned()),
        ("read key", TEAM_A_READ.to_owned()),
        ("http.token", LEGACY.to_owned()),
        ("JWT secret", JWT_SECRET.to_owned()),
        ("part of the JWT secret", JWT_SECRET[..20].to_owned()),
        ("ops hash", sha256(OPS)),
        ("team-a hash", sha256(TEAM_A)),
        ("read hash", sha256(TEAM_A_READ)),
        ("a JWT", good_jwt.clone()),
        (
            "a JWT's signature",
            good_jwt.rsplit('.').next().unwrap_or_default().to_owned(),
        ),
        ("a refused JWT", bad_jwt.clone()),
    ];
    for (where_, text) in &everything {
        assert!(!text.is_empty(), "{where_} is empty");
        for (what, secret) in &secrets {
            assert!(
                !text.contains(secret.as_str()),
                "{what} appears in {where_}:\n{text}"
            );
        }
    }
}

/// A CA, a server certificate for 127.0.0.1 and a client certificate (`scripts/servers/tls.sh`).
async fn certificates(dir: &Path) -> PathBuf {
    let tls = dir.join("tls");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/servers/tls.sh");
    let mut command = tokio::process::Command::new("bash");
    command.arg(script).arg(&tls);
    run_ok(&mut command, "tls.sh").await;
    tls
}

fn trusting(ca: &Path, identity: Option<&Path>) -> reqwest::Client {
    let pem = std::fs::read(ca.join("ca.pem")).expect("read ca.pem");
    let mut builder = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(&pem).expect("a CA certificate"));
    if let Some(dir) = identity {
        let mut pem = std::fs::read(dir.join("client.pem")).expect("client.pem");
        pem.extend(std::fs::read(dir.join("client-key.pem")).expect("client-key.pem"));
        builder = builder.identity(reqwest::Identity::from_pem(&pem).expect("a client identity"));
    }
    builder.build().expect("a client")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_serves_the_api_and_plain_http_is_told_so() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tls = certificates(dir.path()).await;
    let file = config(
        dir.path(),
        json!({
            "tls_cert": tls.join("server.pem"),
            "tls_key": tls.join("server-key.pem"),
        }),
    );
    let env = [("TIMER_CONFIG", file.display().to_string())];
    let service = Service::start_with(
        Path::new(BIN),
        dir.path(),
        &env,
        "https",
        trusting(&tls, None),
    )
    .await;
    let (status, answer) = call(
        &service,
        OPS,
        Method::POST,
        "/v1/timers",
        Some(timer("alpha", "h-1", far())),
    )
    .await;
    assert_eq!(status, 201, "over HTTPS: {answer}");

    // Plain HTTP to the HTTPS address: a 400 saying what to do.
    let plain = reqwest::Client::new()
        .get(format!("http://{}/v1/status", service.addr))
        .send()
        .await
        .expect("an answer to plain HTTP");
    assert_eq!(plain.status(), 400);
    let text = plain.text().await.unwrap_or_default();
    assert!(text.contains("speaks HTTPS"), "{text}");

    // The CLI: with the CA file it reaches the API; without it, it names the certificate.
    let url = service.base.clone();
    let ca = tls.join("ca.pem").display().to_string();
    let get = [
        "get", "--url", &url, "--token", OPS, "--tenant", "alpha", "--id", "h-1",
    ];
    let with_ca = run_to_end(
        Path::new(BIN),
        dir.path(),
        &[&get[..], &["--ca-file", &ca]].concat(),
        NO_ENV,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(with_ca.code, Some(0), "{}", with_ca.stderr);
    assert!(with_ca.stdout.contains("\"h-1\""), "{}", with_ca.stdout);
    let without = run_to_end(
        Path::new(BIN),
        dir.path(),
        &get,
        NO_ENV,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(without.code, Some(1), "{}", without.stdout);
    assert!(
        without.stderr.to_lowercase().contains("certificate"),
        "{}",
        without.stderr
    );
    drop(service);

    // With http.tls_client_ca, a client needs a certificate of that CA.
    let mtls_dir = dir.path().join("mtls");
    std::fs::create_dir_all(&mtls_dir).expect("mkdir");
    let file = config(
        &mtls_dir,
        json!({
            "tls_cert": tls.join("server.pem"),
            "tls_key": tls.join("server-key.pem"),
            "tls_client_ca": tls.join("ca.pem"),
        }),
    );
    let env = [("TIMER_CONFIG", file.display().to_string())];
    let service = Service::start_with(
        Path::new(BIN),
        &mtls_dir,
        &env,
        "https",
        trusting(&tls, Some(&tls)),
    )
    .await;
    let (status, _) = call(&service, OPS, Method::GET, "/v1/status", None).await;
    assert_eq!(status, 200, "with a client certificate");
    let refused = trusting(&tls, None)
        .get(format!("{}/v1/status", service.base))
        .bearer_auth(OPS)
        .send()
        .await;
    assert!(
        refused.is_err(),
        "without a client certificate: {refused:?}"
    );
    let client_cert = tls.join("client.pem").display().to_string();
    let client_key = tls.join("client-key.pem").display().to_string();
    let url = service.base.clone();
    let status_args = ["status", "--url", &url, "--token", OPS, "--ca-file", &ca];
    let cli = run_to_end(
        Path::new(BIN),
        &mtls_dir,
        &[
            &status_args[..],
            &["--client-cert", &client_cert, "--client-key", &client_key],
        ]
        .concat(),
        NO_ENV,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(cli.code, Some(0), "{}", cli.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hash_token_prints_the_sha256_a_key_entry_holds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let given = run_to_end(
        Path::new(BIN),
        dir.path(),
        &["hash-token", TEAM_A],
        NO_ENV,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(given.code, Some(0), "{}", given.stderr);
    assert_eq!(given.stdout.trim(), sha256(TEAM_A));
}

/// An event stream ends when the JWT that opened it expires (it was checked once, when the
/// stream began); one whose `exp` is too far for the clock to hold just stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_stream_ends_when_its_jwt_expires() {
    let dir = tempfile::tempdir().expect("tempdir");
    let service = start(dir.path(), jwt_settings()).await;
    let now = now_ms() / 1000;
    let api = &service;
    let open = |token: String| async move {
        let response = api
            .respond(Method::GET, "/v1/events", Some(&token), None)
            .await;
        assert_eq!(response.status(), 200, "open the event stream");
        response
    };
    let soon = open(jwt(&claims(json!({"exp": now + 2})), JWT_SECRET)).await;
    let never = open(jwt(&claims(json!({"exp": u64::MAX / 2})), JWT_SECRET)).await;
    let ended = tokio::time::timeout(Duration::from_secs(20), soon.bytes()).await;
    assert!(
        ended.is_ok_and(|body| body.is_ok()),
        "the stream of the expiring JWT ended"
    );
    let mut stream = never.bytes_stream();
    let still = tokio::time::timeout(
        Duration::from_millis(500),
        futures::StreamExt::next(&mut stream),
    )
    .await;
    assert!(
        still.is_err() || still.is_ok_and(|item| item.is_some()),
        "the other stream is still open"
    );
    let (status, _) = service.get("/healthz").await;
    assert_eq!(status, 200, "the service did not fall over a far exp");
    service.terminate().await;
}

/// One key cannot take every event stream: past `http.max_event_streams_per_key` its next one
/// is 503 naming the key, while another key's opens; closing one makes room again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_cannot_take_every_event_stream() {
    let dir = tempfile::tempdir().expect("tempdir");
    let limits = json!({"max_event_streams": 8, "max_event_streams_per_key": 2});
    let service = start(dir.path(), limits).await;
    let open = |key: &'static str| {
        let api = &service;
        async move {
            api.respond(Method::GET, "/v1/events?tenant=alpha", Some(key), None)
                .await
        }
    };
    let first = open(TEAM_A).await;
    let second = open(TEAM_A).await;
    assert_eq!(
        (first.status().as_u16(), second.status().as_u16()),
        (200, 200)
    );
    let third = open(TEAM_A).await;
    assert_eq!(third.status(), 503);
    let answer: Value = third.json().await.unwrap_or_default();
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("of key team-a") && message.contains("max_event_streams_per_key"),
        "{answer}"
    );
    let other = open(OPS).await;
    assert_eq!(other.status(), 200, "another key's stream opens");
    drop(first);
    let again = wait_for(Duration::from_secs(10), || async {
        let response = open(TEAM_A).await;
        (response.status() == 200).then_some(response)
    })
    .await;
    assert!(again.is_some(), "a closed stream makes room for the key");
    drop((second, other, again));
    service.terminate().await;
}
