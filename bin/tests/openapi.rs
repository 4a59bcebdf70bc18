//! The OpenAPI document (`GET /v1/openapi.json`) against the running service and its README:
//! every route is in the document and in the README's route table, every route answers, and
//! every answer has a status the document lists and a body its schema accepts.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use reqwest::Method;
use serde_json::{json, Value};
use timer_conformance::e2e::{now_ms, schedule, Service};
use timer_conformance::wait_for;

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");

/// The document, with the service it came from.
struct Documented {
    service: Service,
    document: Value,
}

impl Documented {
    async fn start(dir: &Path) -> Documented {
        let env = [
            ("TIMER_STORE__KIND", "sqlite".to_string()),
            (
                "TIMER_STORE__URL",
                format!("sqlite://{}", dir.join("timers.db").display()),
            ),
            ("TIMER_BROKER__KIND", "memory".to_string()),
        ];
        let service = Service::start(Path::new(BIN), dir, &env).await;
        let (status, document) = service.get("/v1/openapi.json").await;
        assert_eq!(status, 200, "GET /v1/openapi.json: {document}");
        Documented { service, document }
    }

    /// `(METHOD, path)` of every operation in the document.
    fn operations(&self) -> BTreeSet<(String, String)> {
        let mut operations = BTreeSet::new();
        for (path, item) in self.document["paths"].as_object().expect("paths") {
            for method in item.as_object().expect("a path item").keys() {
                operations.insert((method.to_ascii_uppercase(), path.clone()));
            }
        }
        operations
    }

    /// The documented route (`/v1/tenants/{tenant}/timers/{id}`) that `method path` goes to:
    /// its `{…}` segments match any segment, and of several, the one with the most literal
    /// segments wins (`…/timers/bulk` over `…/timers/{id}`).
    fn route_of(&self, method: &Method, path: &str) -> String {
        let method = method.as_str().to_ascii_lowercase();
        let path = path.split('?').next().unwrap_or(path);
        let segments: Vec<&str> = path.split('/').collect();
        let paths = self.document["paths"].as_object().expect("paths");
        paths
            .iter()
            .filter(|(_, item)| item.get(&method).is_some())
            .filter_map(|(route, _)| {
                let parts: Vec<&str> = route.split('/').collect();
                let fits = parts.len() == segments.len()
                    && parts
                        .iter()
                        .zip(&segments)
                        .all(|(part, segment)| part.starts_with('{') || part == segment);
                let literal = parts.iter().filter(|p| !p.starts_with('{')).count();
                fits.then_some((literal, route))
            })
            .max_by_key(|(literal, _)| *literal)
            .map(|(_, route)| route.clone())
            .unwrap_or_else(|| panic!("{method} {path} is not in the document"))
    }

    /// Sends a request and checks the answer against the document: its status is one the
    /// operation lists, and a JSON body is valid under that response's schema. Gives the status
    /// and the body.
    async fn call(&self, method: Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let route = self.route_of(&method, path);
        let route = route.as_str();
        let response = self
            .service
            .respond(method.clone(), path, None, body.as_ref())
            .await;
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let operation = &self.document["paths"][route][method.as_str().to_ascii_lowercase()];
        assert!(
            operation.is_object(),
            "{method} {route} is not in the document"
        );
        let documented = &operation["responses"][status.to_string()];
        assert!(
            documented.is_object(),
            "{method} {path} answered {status}, which the document does not list for it: {}",
            operation["responses"]
        );
        let media = documented["content"]
            .as_object()
            .and_then(|content| content.keys().next().cloned())
            .unwrap_or_default();
        assert!(
            content_type.starts_with(&media),
            "{method} {path} {status}: content-type {content_type:?}, documented {media:?}"
        );
        if media != "application/json" {
            return (status, Value::Null);
        }
        let body: Value = response
            .json()
            .await
            .unwrap_or_else(|e| panic!("{method} {path} {status}: not JSON: {e}"));
        let schema = json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$ref": "#/$defs/response",
            "$defs": { "response": documented["content"][&media]["schema"] },
            "components": self.document["components"],
        });
        let validator = jsonschema::validator_for(&schema)
            .unwrap_or_else(|e| panic!("{method} {route} {status}: a bad schema: {e}"));
        let errors: Vec<String> = validator
            .iter_errors(&body)
            .map(|e| format!("{} at {}", e, e.instance_path()))
            .collect();
        assert!(
            errors.is_empty(),
            "{method} {path} {status}: the body does not match the document: {errors:?}\n{body}"
        );
        (status, body)
    }
}

/// The routes of the README's route table (`| \`METHOD /path\` | ...`).
fn readme_routes() -> BTreeSet<(String, String)> {
    let readme = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/src/api/README.md"),
    )
    .expect("read docs/src/api/README.md");
    readme
        .lines()
        .filter_map(|line| line.strip_prefix("| `"))
        .filter_map(|rest| rest.split_once('`').map(|(route, _)| route))
        .filter_map(|route| route.split_once(' '))
        .filter(|(method, path)| {
            ["GET", "POST", "PUT", "DELETE", "PATCH"].contains(method) && path.starts_with('/')
        })
        .map(|(method, path)| (method.to_owned(), path.to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_is_documented_and_answers_as_documented() {
    let dir = tempfile::tempdir().expect("tempdir");
    let api = Documented::start(dir.path()).await;
    let version = api.document["openapi"].as_str().unwrap_or("");
    assert!(
        version.starts_with("3.1"),
        "an OpenAPI 3.1 document: {version}"
    );

    // The check below can fail: a body that breaks its schema is caught.
    let wrong = json!({ "outcome": 5, "timer": { "tenantId": "acme" } });
    let schema = json!({
        "$ref": "#/components/schemas/TimerOutcome",
        "components": api.document["components"],
    });
    let validator = jsonschema::validator_for(&schema).expect("a schema");
    assert!(
        !validator.is_valid(&wrong),
        "a wrong body passed the schema check"
    );

    let documented = api.operations();
    assert_eq!(
        documented,
        readme_routes(),
        "the document's routes (left) and docs/src/api/README.md's route table (right) differ"
    );

    // Something to read and act on: a series, a one-shot timer and a refused command.
    let due = now_ms() + 3_600_000;
    let series = json!({
        "tenantId": "acme", "serviceCallId": "series", "cron": "0 9 * * *",
        "timeZone": "Europe/Berlin", "payload": {"k": 1},
    });
    let (status, _) = api.call(Method::POST, "/v1/timers", Some(series)).await;
    assert_eq!(status, 201);
    let one = serde_json::from_str::<Value>(&schedule("acme", "one", due)).expect("json");
    let (status, _) = api
        .call(Method::POST, "/v1/timers", Some(one.clone()))
        .await;
    assert_eq!(status, 201);
    let (status, _) = api.call(Method::POST, "/v1/timers", Some(one)).await;
    assert_eq!(status, 200, "the same command again updates");
    let probe = serde_json::from_str::<Value>(&schedule("acme", "probe", due)).expect("json");
    api.call(Method::POST, "/v1/timers", Some(probe)).await;
    let bad = json!({ "tenantId": "acme", "serviceCallId": "bad", "dueAt": "tomorrow" });
    let batch = json!({ "commands": [bad, serde_json::from_str::<Value>(&schedule("acme", "b", due)).expect("json")] });
    let (status, body) = api
        .call(Method::POST, "/v1/timers/batch", Some(batch))
        .await;
    assert_eq!(
        (status, body["rejected"][0]["index"].clone()),
        (400, json!(0))
    );
    let batch = json!({ "commands": [serde_json::from_str::<Value>(&schedule("acme", "b", due)).expect("json")] });
    let (status, _) = api
        .call(Method::POST, "/v1/timers/batch", Some(batch))
        .await;
    assert_eq!(status, 200);

    // Every documented route answers: once without a body, on a timer of its own.
    for (method, route) in &documented {
        if route == "/v1/events" {
            continue; // an endless stream: checked below
        }
        let path = route.replace("{tenant}", "acme").replace("{id}", "probe");
        let method = Method::from_bytes(method.as_bytes()).expect("a method");
        let (status, _) = api.call(method.clone(), &path, None).await;
        assert_ne!(status, 405, "{method} {path}");
    }
    let events = api
        .service
        .http
        .get(format!("{}/v1/events?tenant=acme", api.service.base))
        .send()
        .await
        .expect("GET /v1/events");
    assert_eq!(events.status().as_u16(), 200);
    drop(events);

    // The richer answers, each checked against its schema.
    let (_, view) = api
        .call(Method::GET, "/v1/tenants/acme/timers/one?next=3", None)
        .await;
    assert_eq!(view["nextOccurrences"].as_array().map(Vec::len), Some(1));
    let (status, body) = api
        .call(
            Method::POST,
            "/v1/tenants/acme/timers/one/pause",
            Some(json!({ "note": "hold" })),
        )
        .await;
    assert_eq!((status, body["outcome"].as_str()), (200, Some("paused")));
    let (status, _) = api
        .call(
            Method::POST,
            "/v1/tenants/acme/timers/one/pause",
            Some(json!({ "note": "x".repeat(2000) })),
        )
        .await;
    assert_eq!(status, 400);
    api.call(Method::POST, "/v1/tenants/acme/timers/series/pause", None)
        .await;
    let (status, body) = api
        .call(Method::POST, "/v1/tenants/acme/timers/series/trigger", None)
        .await;
    assert_eq!(
        (status, body["outcome"].as_str()),
        (200, Some("triggered")),
        "{body}"
    );
    // A series with policies shows them; a completion of an occurrence it never fired is
    // acknowledged, a bad outcome refused naming the field.
    let policies = json!({
        "tenantId": "acme", "serviceCallId": "policies", "cron": "0 9 * * *",
        "timeZone": "Europe/Berlin", "overlap": "skip", "completionTimeout": "10m",
        "catchUp": "all", "catchUpLimit": 3, "jitter": "1m",
    });
    let (status, body) = api.call(Method::POST, "/v1/timers", Some(policies)).await;
    assert_eq!(status, 201, "{body}");
    let policy = &body["timer"]["policy"];
    assert_eq!(
        (
            policy["overlap"].as_str(),
            policy["completionTimeoutMs"].as_u64(),
            policy["catchUp"].as_str(),
            policy["catchUpLimit"].as_u64(),
            policy["jitterMs"].as_u64(),
        ),
        (
            Some("skip"),
            Some(600_000),
            Some("all"),
            Some(3),
            Some(60_000)
        ),
        "{body}"
    );
    let (status, body) = api
        .call(
            Method::POST,
            "/v1/tenants/acme/timers/policies/complete",
            Some(json!({ "occurrence": 1, "outcome": "succeeded" })),
        )
        .await;
    assert_eq!(
        (status, body["outcome"].as_str()),
        (200, Some("unknown_occurrence")),
        "{body}"
    );
    let (status, body) = api
        .call(
            Method::POST,
            "/v1/tenants/acme/timers/policies/complete",
            Some(json!({ "outcome": "maybe" })),
        )
        .await;
    assert_eq!(
        (status, body["error"]["field"].as_str()),
        (400, Some("outcome")),
        "{body}"
    );
    let (status, _) = api
        .call(Method::POST, "/v1/tenants/acme/timers/nope/complete", None)
        .await;
    assert_eq!(status, 404);
    let (_, page) = api
        .call(
            Method::GET,
            "/v1/tenants/acme/timers/one/history?limit=2",
            None,
        )
        .await;
    assert!(
        page["nextCursor"].is_string(),
        "created, rescheduled, paused: {page}"
    );
    let (_, page) = api
        .call(Method::GET, "/v1/tenants/acme/timers/series/history", None)
        .await;
    let types: Vec<&str> = page["history"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["type"].as_str())
        .collect();
    assert!(
        types.contains(&"triggered") && types.contains(&"paused"),
        "{types:?}"
    );
    let (_, page) = api
        .call(
            Method::GET,
            "/v1/tenants/acme/timers?state=paused&limit=1",
            None,
        )
        .await;
    assert_eq!(page["timers"].as_array().map(Vec::len), Some(1), "{page}");
    let (status, _) = api
        .call(Method::GET, "/v1/tenants/acme/timers?state=bogus", None)
        .await;
    assert_eq!(status, 400);
    let (status, body) = api
        .call(
            Method::POST,
            "/v1/tenants/acme/timers/bulk",
            Some(json!({ "action": "resume", "filter": { "state": ["paused"] } })),
        )
        .await;
    assert_eq!((status, body["changed"].as_u64()), (200, Some(2)), "{body}");
    let (status, _) = api
        .call(Method::DELETE, "/v1/tenants/acme/timers/b", None)
        .await;
    assert_eq!(status, 200);
    // Retry: only a Failed timer changes; the others answer what they are.
    let (status, body) = api
        .call(Method::POST, "/v1/tenants/acme/timers/one/retry", None)
        .await;
    assert_eq!(
        (status, body["outcome"].as_str()),
        (200, Some("not_failed")),
        "{body}"
    );
    let (status, body) = api
        .call(Method::POST, "/v1/tenants/acme/timers/b/retry", None)
        .await;
    assert_eq!(
        (status, body["outcome"].as_str()),
        (409, Some("already_cancelled")),
        "{body}"
    );
    let (status, _) = api
        .call(Method::POST, "/v1/tenants/acme/timers/nobody/retry", None)
        .await;
    assert_eq!(status, 404);
    let (status, page) = api
        .call(Method::GET, "/v1/tenants/acme/timers?retrying=true", None)
        .await;
    assert_eq!(
        (status, page["timers"].as_array().map(Vec::len)),
        (200, Some(0)),
        "{page}"
    );
    let (_, summary) = api
        .call(Method::GET, "/v1/tenants/acme/summary", None)
        .await;
    assert_eq!(summary["counts"]["cancelled"], 2, "probe and b: {summary}");
    api.call(Method::GET, "/v1/summary?limit=1", None).await;
    let command = json!({ "type": "PauseTimer", "tenantId": "acme", "serviceCallId": "one" });
    let (status, _) = api.call(Method::POST, "/v1/commands", Some(command)).await;
    assert_eq!(status, 202);
    let paused = wait_for(Duration::from_secs(10), || async {
        let (_, timer) = api.service.get("/v1/tenants/acme/timers/one").await;
        (timer["state"] == "Paused").then_some(())
    })
    .await;
    assert!(
        paused.is_some(),
        "the PauseTimer through /v1/commands paused it"
    );
    // The status shares its counts for up to `http.counts_max_age` (5 s): the pause shows
    // once the count is taken again.
    let counted = wait_for(Duration::from_secs(15), || async {
        let (_, status) = api.call(Method::GET, "/v1/status", None).await;
        (status["timers"]["paused"] == 1).then_some(())
    })
    .await;
    let (_, status) = api.call(Method::GET, "/v1/status", None).await;
    assert!(
        counted.is_some(),
        "the status never counted the pause: {status}"
    );
}

/// A schema with its `$ref` followed, and of `oneOf: [X, null]`, X.
fn resolved<'a>(document: &'a Value, schema: &'a Value) -> &'a Value {
    if let Some(reference) = schema["$ref"].as_str() {
        let name = reference.trim_start_matches("#/components/schemas/");
        return resolved(document, &document["components"]["schemas"][name]);
    }
    if let Some(options) = schema["oneOf"].as_array() {
        if let Some(other) = options.iter().find(|o| o["type"] != "null") {
            return resolved(document, other);
        }
    }
    schema
}

/// Values at each bound of `schema` and just past it: `(bound, at, past)`. Strings are made of
/// `1`s, which every documented pattern takes (ids, times as epoch milliseconds).
fn bounds(schema: &Value, item: &dyn Fn(usize) -> Value) -> Vec<(String, Value, Value)> {
    let mut cases = Vec::new();
    let ones = |n: u64| Value::from("1".repeat(n as usize));
    if let Some(min) = schema["minimum"].as_i64() {
        cases.push((format!("minimum {min}"), json!(min), json!(min - 1)));
    }
    if let Some(max) = schema["maximum"].as_i64() {
        cases.push((format!("maximum {max}"), json!(max), json!(max + 1)));
    }
    if let Some(min) = schema["minLength"].as_u64().filter(|n| *n > 0) {
        cases.push((format!("minLength {min}"), ones(min), ones(min - 1)));
    }
    if let Some(max) = schema["maxLength"].as_u64() {
        cases.push((format!("maxLength {max}"), ones(max), ones(max + 1)));
    }
    if let Some(min) = schema["minItems"].as_u64().filter(|n| *n > 0) {
        // Items of the array's own words where it has some (states), `item`'s otherwise.
        let word = schema["items"]["enum"].as_array().and_then(|w| w.first());
        let items = |n: u64| {
            Value::from(
                (0..n as usize)
                    .map(|i| word.cloned().unwrap_or_else(|| item(i)))
                    .collect::<Vec<_>>(),
            )
        };
        cases.push((format!("minItems {min}"), items(min), items(min - 1)));
    }
    if let Some(max) = schema["maxItems"].as_u64() {
        let items = |n: u64| Value::from((0..n as usize).map(item).collect::<Vec<_>>());
        cases.push((format!("maxItems {max}"), items(max), items(max + 1)));
    }
    let word = |w: &Value| match &schema["type"] {
        t if t == "array" || t.as_array().is_some_and(|t| t.contains(&json!("array"))) => {
            json!([w])
        }
        _ => w.clone(),
    };
    let words = schema["enum"]
        .as_array()
        .or_else(|| schema["items"]["enum"].as_array());
    for w in words.into_iter().flatten() {
        cases.push((format!("enum {w}"), word(w), word(&json!("not-a-word"))));
    }
    cases
}

/// Every bound the document gives a parameter or a body property is the server's: a request at
/// the bound is taken (any answer but 400), one just past it is refused (400). Empty path
/// segments are left out: no router matches `/v1/tenants//timers`, so they never reach a check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_bound_is_enforced() {
    let dir = tempfile::tempdir().expect("tempdir");
    let api = Documented::start(dir.path()).await;
    let due = now_ms() + 3_600_000;
    let probe = serde_json::from_str::<Value>(&schedule("acme", "probe", due)).expect("json");
    let (status, _) = api.call(Method::POST, "/v1/timers", Some(probe)).await;
    assert_eq!(status, 201);
    // A body the route takes, to change one property of at a time.
    let base = |method: &str, route: &str| -> Value {
        match (method, route) {
            // A series catching up on all it missed, so that its fields (maxOccurrences,
            // catchUpLimit) are taken too.
            ("POST", "/v1/timers") => json!({
                "tenantId": "acme", "serviceCallId": "bound", "cron": "0 9 * * *",
                "catchUp": "all",
            }),
            ("POST", "/v1/timers/batch") => json!({ "commands": [] }),
            ("POST", "/v1/tenants/{tenant}/timers/bulk") => {
                json!({ "action": "pause", "filter": { "prefix": "no-such-timer-" } })
            }
            ("POST", "/v1/commands") => {
                serde_json::from_str(&schedule("acme", "command", due)).expect("json")
            }
            _ => json!({}),
        }
    };
    let item = |i: usize| -> Value {
        serde_json::from_str(&schedule("acme", &format!("batch-{i}"), due)).expect("json")
    };
    let mut checked: BTreeSet<String> = BTreeSet::new();
    let mut wrong = Vec::new();
    for (method, route) in api.operations() {
        let operation = &api.document["paths"][&route][method.to_ascii_lowercase()];
        let verb = Method::from_bytes(method.as_bytes()).expect("a method");
        let path_of = |tenant: &str, id: &str| {
            route
                .replace(
                    "{tenant}",
                    &url::form_urlencoded::byte_serialize(tenant.as_bytes()).collect::<String>(),
                )
                .replace(
                    "{id}",
                    &url::form_urlencoded::byte_serialize(id.as_bytes()).collect::<String>(),
                )
        };
        let has_body = operation["requestBody"].is_object();
        let body = has_body.then(|| base(&method, &route));
        // (what, path, body, refused?)
        let mut tries: Vec<(String, String, Option<Value>, bool)> = Vec::new();
        for parameter in operation["parameters"].as_array().into_iter().flatten() {
            let name = parameter["name"].as_str().unwrap_or_default();
            let place = parameter["in"].as_str().unwrap_or_default();
            let schema = resolved(&api.document, &parameter["schema"]);
            for (bound, at, past) in bounds(schema, &item) {
                if place == "path" && bound == "minLength 1" {
                    continue;
                }
                let text = |v: &Value| match v {
                    Value::String(s) => s.clone(),
                    Value::Array(items) => items
                        .iter()
                        .map(|i| {
                            i.as_str()
                                .map(str::to_owned)
                                .unwrap_or_else(|| i.to_string())
                        })
                        .collect::<Vec<_>>()
                        .join(","),
                    other => other.to_string(),
                };
                let (at, past) = (text(&at), text(&past));
                let request = |value: &str| match place {
                    "path" if name == "tenant" => path_of(value, "probe"),
                    "path" => path_of("acme", value),
                    _ => format!(
                        "{}?{name}={}",
                        path_of("acme", "probe"),
                        url::form_urlencoded::byte_serialize(value.as_bytes()).collect::<String>()
                    ),
                };
                tries.push((format!("{name} {bound}"), request(&at), body.clone(), false));
                tries.push((
                    format!("{name} {bound}"),
                    request(&past),
                    body.clone(),
                    true,
                ));
            }
        }
        // Body properties, and the properties of an object property (`filter.state`).
        let mut properties: Vec<(Vec<String>, &Value)> = Vec::new();
        if has_body {
            let schema = resolved(
                &api.document,
                &operation["requestBody"]["content"]["application/json"]["schema"],
            );
            for (name, property) in schema["properties"].as_object().into_iter().flatten() {
                let property = resolved(&api.document, property);
                properties.push((vec![name.clone()], property));
                for (inner, schema) in property["properties"].as_object().into_iter().flatten() {
                    let schema = resolved(&api.document, schema);
                    properties.push((vec![name.clone(), inner.clone()], schema));
                }
            }
        }
        for (names, schema) in properties {
            for (bound, at, past) in bounds(schema, &item) {
                let with = |value: Value| {
                    let mut body = body.clone().unwrap_or_else(|| json!({}));
                    let mut at = &mut body;
                    for name in &names[..names.len() - 1] {
                        if !at[name.as_str()].is_object() {
                            at[name.as_str()] = json!({});
                        }
                        at = &mut at[name.as_str()];
                    }
                    at[names[names.len() - 1].as_str()] = value;
                    body
                };
                let path = path_of("acme", "probe");
                let what = format!("{} {bound}", names.join("."));
                tries.push((what.clone(), path.clone(), Some(with(at)), false));
                tries.push((what, path, Some(with(past)), true));
            }
        }
        for (what, path, body, expect_refused) in tries {
            let (status, answer) = api.call(verb.clone(), &path, body).await;
            checked.insert(format!("{method} {route} {what}"));
            if (status == 400) != expect_refused {
                wrong.push(format!(
                    "{method} {path} ({what}, {}): {status} {answer}",
                    if expect_refused {
                        "past the bound"
                    } else {
                        "at the bound"
                    }
                ));
            }
        }
    }
    // A path segment that is not UTF-8 is no id either, answered with the JSON error body.
    let (status, body) = api.call(Method::GET, "/v1/tenants/%FF/timers", None).await;
    assert_eq!(
        (status, body["error"]["reason"].as_str()),
        (400, Some("invalid_id")),
        "{body}"
    );
    assert!(
        wrong.is_empty(),
        "answers that break the document:\n{}",
        wrong.join("\n")
    );
    // The walk found the bounds the handlers check (a document without them would pass it).
    for expected in [
        "GET /v1/tenants/{tenant}/timers limit maximum 1000",
        "GET /v1/tenants/{tenant}/timers/{id} next minimum 1",
        "GET /v1/tenants/{tenant}/timers state enum \"failed\"",
        "GET /v1/tenants/{tenant}/timers dueAfter minLength 1",
        "DELETE /v1/tenants/{tenant}/timers/{id} id maxLength 128",
        "POST /v1/timers tenantId maxLength 128",
        "POST /v1/timers catchUpLimit maximum 10000",
        "POST /v1/timers overlap enum \"bufferOne\"",
        "POST /v1/timers/batch commands maxItems 1000",
        "POST /v1/tenants/{tenant}/timers/{id}/pause note maxLength 1024",
        "POST /v1/tenants/{tenant}/timers/bulk filter.state enum \"paused\"",
        "POST /v1/tenants/{tenant}/timers/bulk filter.state minItems 1",
        "POST /v1/tenants/{tenant}/timers/bulk filter.prefix minLength 1",
        "POST /v1/tenants/{tenant}/timers/{id}/complete outcome enum \"failed\"",
    ] {
        assert!(
            checked.contains(expected),
            "{expected} was not checked; checked: {checked:#?}"
        );
    }
}
