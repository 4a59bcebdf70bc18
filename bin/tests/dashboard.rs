//! The web dashboard (`/ui/`) in a real browser: Debian's Chromium, headless, driven over
//! WebDriver (ChromeDriver at `TIMER_TEST_WEBDRIVER_URL`, which `bash scripts/test.sh` starts).
//! On SQLite and, with its server, PostgreSQL: sign in (a wrong token refused), see counts
//! change as timers fire, filter and page the list, open a timer, pause, resume and trigger it,
//! cancel one that another instance is firing and see `firing`; nothing loads from elsewhere.
//! Screenshots of every page at 1280×800 and 390×844 go to
//! `$TMPDIR/timer-service-dashboard/<store>/` (printed).

use std::path::{Path, PathBuf};
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use libtest_mimic::Arguments;
use serde_json::{json, Value};
use timer_conformance::e2e::{now_ms, Service};
use timer_conformance::{server_trial, wait_for};
use timer_core::{Lease, Settlement, Store, Timestamp};

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");
const TOKEN: &str = "dashboard-test-token";
/// A key of `[[http.keys]]` that may read tenant `other` only.
const OTHER_KEY: &str = "dashboard-other-team-key";
const WAIT: Duration = Duration::from_secs(20);

fn main() {
    let args = Arguments::from_args();
    let driver = std::env::var("TIMER_TEST_WEBDRIVER_URL").ok();
    let no_driver = driver
        .is_none()
        .then(|| "TIMER_TEST_WEBDRIVER_URL is not set (chromedriver)".to_owned());
    let mut trials = vec![
        server_trial("dashboard::sqlite", no_driver.clone(), || async {
            let dir = tempfile::tempdir().expect("tempdir");
            let url = format!("sqlite://{}", dir.path().join("timers.db").display());
            let env = vec![
                ("TIMER_STORE__KIND", "sqlite".to_owned()),
                ("TIMER_STORE__URL", url.clone()),
            ];
            let store = timer_stores::sqlite::SqliteConfig {
                url,
                ..Default::default()
            };
            let store = timer_stores::sqlite::SqliteStore::attach(&store)
                .await
                .expect("open the service's SQLite file");
            walk_through("sqlite", dir.path(), env, &store).await;
        }),
        server_trial("dashboard::off_when_http_ui_is_false", None, || async {
            let dir = tempfile::tempdir().expect("tempdir");
            let service = Service::start(
                Path::new(BIN),
                dir.path(),
                &[
                    ("TIMER_HTTP__UI", "false".to_owned()),
                    ("TIMER_BROKER__KIND", "memory".to_owned()),
                ],
            )
            .await;
            let status = service
                .http
                .get(format!("{}/ui/", service.base))
                .send()
                .await
                .expect("GET /ui/")
                .status();
            assert_eq!(status, 404, "http.ui = false leaves /ui/ unrouted");
        }),
    ];
    #[cfg(feature = "postgres")]
    {
        use timer_stores::postgres::{PostgresConfig, PostgresStore, PLUGIN, TEST_SERVER};
        let missing = no_driver.or_else(|| PLUGIN.unavailable());
        trials.push(server_trial("dashboard::postgres", missing, || async {
            let dir = tempfile::tempdir().expect("tempdir");
            let config = PostgresConfig {
                url: TEST_SERVER
                    .address()
                    .expect("TIMER_TEST_POSTGRES_URL is set"),
                schema: timer_core::plugin::fresh_name("ui_"),
                ..PostgresConfig::default()
            };
            let store = PostgresStore::open(&config)
                .await
                .expect("open the test schema");
            let env = vec![
                ("TIMER_STORE__KIND", "postgres".to_owned()),
                ("TIMER_STORE__URL", config.url.clone()),
                ("TIMER_STORE__SCHEMA", config.schema.clone()),
            ];
            walk_through("postgres", dir.path(), env, &store).await;
        }));
    }
    libtest_mimic::run(&args, trials).exit();
}

/// The browser session and where its screenshots go.
struct Browser {
    client: Client,
    base: String,
    shots: PathBuf,
}

impl Browser {
    async fn start(base: &str, store: &str) -> Browser {
        let driver = std::env::var("TIMER_TEST_WEBDRIVER_URL").expect("checked in main");
        let chromium =
            std::env::var("TIMER_TEST_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
        let mut capabilities = serde_json::Map::new();
        capabilities.insert("browserName".into(), json!("chrome"));
        capabilities.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--hide-scrollbars",
                         "--window-size=1280,800", "--lang=en-US"],
            }),
        );
        let client = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(capabilities)
            .connect(&driver)
            .await
            .unwrap_or_else(|e| panic!("a Chromium session from ChromeDriver at {driver}: {e}"));
        let shots = std::env::temp_dir()
            .join("timer-service-dashboard")
            .join(store);
        std::fs::create_dir_all(&shots).expect("screenshot dir");
        eprintln!("dashboard screenshots ({store}): {}", shots.display());
        Browser {
            client,
            base: base.to_owned(),
            shots,
        }
    }

    async fn open(&self, hash: &str) {
        self.client
            .goto(&format!("{}/ui/{hash}", self.base))
            .await
            .expect("navigate");
    }

    /// What `script` returns, run in the page with `args` as `arguments`.
    async fn run(&self, script: &str, args: Vec<Value>) -> Value {
        self.client
            .execute(script, args)
            .await
            .unwrap_or_else(|e| panic!("run a script in the page ({script}): {e}"))
    }

    /// The text of the first element matching `css`; `None` when there is none.
    async fn text(&self, css: &str) -> Option<String> {
        let script =
            "const e = document.querySelector(arguments[0]); return e ? e.textContent : null;";
        let v = self.run(script, vec![json!(css)]).await;
        v.as_str().map(str::to_owned)
    }

    async fn count(&self, css: &str) -> usize {
        let script = "return document.querySelectorAll(arguments[0]).length;";
        let v = self.run(script, vec![json!(css)]).await;
        v.as_u64().unwrap_or(0) as usize
    }

    /// Waits until the element's text contains `wanted`; on timeout, a screenshot and the text.
    async fn wait_text(&self, css: &str, wanted: &str) -> String {
        let found = wait_for(WAIT, || async {
            self.text(css).await.filter(|t| t.contains(wanted))
        })
        .await;
        match found {
            Some(text) => text,
            None => {
                self.shot("failure").await;
                panic!(
                    "{css} never showed {wanted:?}; it shows {:?} (screenshot failure-*.png in {})",
                    self.text(css).await,
                    self.shots.display()
                )
            }
        }
    }

    async fn wait_count(&self, css: &str, n: usize) {
        if wait_for(WAIT, || async {
            (self.count(css).await == n).then_some(())
        })
        .await
        .is_none()
        {
            self.shot("failure").await;
            panic!("expected {n} of {css}, saw {}", self.count(css).await);
        }
    }

    async fn click(&self, css: &str) {
        self.client
            .wait()
            .at_most(WAIT)
            .for_element(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("{css}: {e}"))
            .click()
            .await
            .unwrap_or_else(|e| panic!("click {css}: {e}"));
    }

    async fn type_into(&self, css: &str, text: &str) {
        let field = self
            .client
            .wait()
            .at_most(WAIT)
            .for_element(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("{css}: {e}"));
        field.clear().await.expect("clear");
        field.send_keys(text).await.expect("type");
    }

    /// Answers the confirmation dialog, with `note` in its field when given.
    async fn confirm(&self, note: Option<&str>) {
        self.wait_count("dialog#confirm[open]", 1).await;
        if let Some(note) = note {
            self.type_into("#confirm-input", note).await;
        }
        self.click("#confirm-ok").await;
        self.wait_count("dialog#confirm[open]", 0).await;
    }

    /// `name-1280x800.png` and `name-390x844.png` of the page as it is.
    async fn shot(&self, name: &str) {
        for (w, h) in [(1280, 800), (390, 844)] {
            self.client
                .set_window_size(w, h)
                .await
                .expect("resize the window");
            let png = self.client.screenshot().await.expect("screenshot");
            std::fs::write(self.shots.join(format!("{name}-{w}x{h}.png")), png)
                .expect("save the screenshot");
        }
        self.client
            .set_window_size(1280, 800)
            .await
            .expect("resize the window");
    }
}

async fn send(service: &Service, method: reqwest::Method, path: &str, body: Value) -> (u16, Value) {
    let response = service
        .respond(method, path, Some(TOKEN), Some(&body))
        .await;
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// `TIMER_TEST_DASHBOARD_BIG=n` gives tenant `big` `n` timers before the walk-through, which
/// then prints how long the overview and that tenant's pages take to show. Not set in CI: a
/// million timers take minutes to load; the times are printed, not asserted (BENCHMARKS.md).
fn big_tenant() -> usize {
    std::env::var("TIMER_TEST_DASHBOARD_BIG")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// `n` timers in tenant `big`, due in 10 days (after every timer of the walk-through), in
/// batches of 1,000, four at a time.
async fn load_big_tenant(service: &Service, n: usize) {
    use futures::StreamExt as _;
    let due = now_ms() + 10 * 86_400_000;
    let started = std::time::Instant::now();
    let batches = (0..n).step_by(1_000).map(|first| {
        let commands: Vec<Value> = (first..n.min(first + 1_000))
            .map(|i| json!({"tenantId": "big", "serviceCallId": format!("b{i:08}"), "dueTimeMs": due + i as i64}))
            .collect();
        async move {
            let (status, body) = send(
                service,
                reqwest::Method::POST,
                "/v1/timers/batch",
                json!({ "commands": commands }),
            )
            .await;
            assert_eq!(status, 200, "{body}");
        }
    });
    futures::stream::iter(batches)
        .buffer_unordered(4)
        .collect::<Vec<()>>()
        .await;
    eprintln!(
        "big tenant: {n} timers loaded in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// Prints how long the overview takes to list tenant `big` (the first time, when the service
/// counts, and again once it shares a count) and how long its pages of timers take to show.
async fn time_big_tenant(browser: &Browser, n: usize) {
    let mut shown = Vec::new();
    for visit in ["first", "second", "third"] {
        let started = std::time::Instant::now();
        browser.open("#/timers").await;
        browser.wait_count("#f-tenant", 1).await;
        browser.open("").await;
        browser
            .wait_text("#tenants tr[data-tenant=big] td:nth-child(2)", &group(n))
            .await;
        shown.push(format!("{visit} {} ms", started.elapsed().as_millis()));
    }
    let started = std::time::Instant::now();
    browser.open("#/timers?tenant=big&state=scheduled").await;
    browser.wait_count("#timer-list tbody tr", 100).await;
    let first = started.elapsed().as_millis();
    let started = std::time::Instant::now();
    browser.click("#next-page").await;
    browser
        .wait_text("#timer-list tbody tr:first-child td a", "b00000100")
        .await;
    let next = started.elapsed().as_millis();
    browser.shot("big-timers").await;
    let started = std::time::Instant::now();
    browser.open("#/failed?tenant=big").await;
    browser.wait_text("#failed-list", "No failed timers").await;
    browser
        .wait_text("#retrying-list", "no publish is failing")
        .await;
    let failed = started.elapsed().as_millis();
    eprintln!(
        "big tenant of {n}: overview shown {}; timers page {first} ms, next page {next} ms, \
         failed page {failed} ms",
        shown.join(", ")
    );
    browser.open("").await;
}

/// `n` as the dashboard writes counts (`1,000,000`).
fn group(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

async fn walk_through(name: &str, dir: &Path, mut env: Vec<(&str, String)>, store: &dyn Store) {
    env.push(("TIMER_BROKER__KIND", "memory".to_owned()));
    env.push(("TIMER_HTTP__TOKEN", TOKEN.to_owned()));
    env.push((
        "TIMER_TELEMETRY__TRACE_URL",
        "https://tempo.example/trace/{traceId}".to_owned(),
    ));
    // A key that may only read tenant `other` (which has no timers).
    let keys = dir.join("keys.toml");
    let hash: String = sha2::Digest::finalize(sha2::Digest::chain_update(
        <sha2::Sha256 as sha2::Digest>::new(),
        OTHER_KEY,
    ))
    .iter()
    .map(|b| format!("{b:02x}"))
    .collect();
    let text = format!(
        "[[http.keys]]\nname = \"other-team\"\nsha256 = \"{hash}\"\ntenants = [\"other\"]\nscopes = [\"read\"]\n"
    );
    std::fs::write(&keys, text).expect("write keys.toml");
    env.push(("TIMER_CONFIG", keys.display().to_string()));
    let service = Service::start(Path::new(BIN), dir, &env).await;
    let big = big_tenant();
    if big > 0 {
        load_big_tenant(&service, big).await;
    }
    let browser = Browser::start(&service.base, name).await;

    // The page and its files carry the policy that keeps everything inside the service.
    let page = service
        .http
        .get(format!("{}/ui/", service.base))
        .send()
        .await
        .expect("GET /ui/");
    let csp = page
        .headers()
        .get("content-security-policy")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(
        csp.contains("default-src 'none'") && csp.contains("connect-src 'self'"),
        "{csp}"
    );

    // Signing in: a wrong token is refused, the right one opens the overview.
    browser.open("").await;
    browser.type_into("#token", "not-the-token").await;
    browser.shot("sign-in").await;
    browser.click("#sign-in").await;
    browser.wait_text("#sign-in-error", "refused").await;
    browser.type_into("#token", TOKEN).await;
    browser.click("#sign-in").await;
    browser.wait_text("#card-store", "healthy").await;
    browser.wait_text("#card-broker", "memory healthy").await;
    // The instance list: this instance, the release and revision it runs, the leases it holds.
    browser
        .wait_text("#instances", env!("CARGO_PKG_VERSION"))
        .await;
    let instances = browser.text("#instances").await.unwrap_or_default();
    assert!(
        instances.contains("(this one)") && instances.lines().count() == 1,
        "one live instance, this one: {instances}"
    );
    browser
        .run(
            "document.getElementById('instances').scrollIntoView(); return null;",
            vec![],
        )
        .await;
    browser.shot("instances").await;
    browser
        .run("window.scrollTo(0, 0); return null;", vec![])
        .await;
    if big > 0 {
        time_big_tenant(&browser, big).await;
    }

    // Counts change as timers fire, without a reload of the page.
    browser
        .run("window.stillThisPage = true; return null;", vec![])
        .await;
    let soon = now_ms() + 1_500;
    for id in ["a-1", "a-2", "a-3"] {
        let (status, body) = send(
            &service,
            reqwest::Method::POST,
            "/v1/timers",
            json!({"tenantId": "acme", "serviceCallId": id, "dueTimeMs": soon}),
        )
        .await;
        assert_eq!(status, 201, "{body}");
    }
    browser
        .wait_text("#tenants tr[data-tenant=acme] td:nth-child(5)", "3")
        .await;
    let same_page = browser
        .run("return window.stillThisPage === true;", vec![])
        .await;
    assert_eq!(same_page, json!(true), "the overview updated in place");
    browser.wait_text("#card-lateness", "ms").await;
    // Who waits: nothing is due now; acme's three fires of the last minute, with their lateness.
    browser
        .wait_text("#waiting tr[data-tenant=acme] td:nth-child(4)", "3")
        .await;
    let acme = browser
        .text("#waiting tr[data-tenant=acme]")
        .await
        .unwrap_or_default();
    assert!(acme.contains(" ms"), "acme's lateness is shown: {acme}");

    // One timer another instance is firing right now.
    let busy_due = now_ms() + 3_600_000;
    let (status, body) = send(
        &service,
        reqwest::Method::POST,
        "/v1/timers",
        json!({"tenantId": "acme", "serviceCallId": "busy", "dueTimeMs": busy_due}),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    // Another instance claims it (its clock an hour ahead, its lease long): it is firing.
    let lease = Lease {
        owner: "another-instance".into(),
        until: Timestamp::from_millis(busy_due + 3_600_000),
    };
    let claimed = store
        .claim_due(Timestamp::from_millis(busy_due + 1).into(), 1, &lease)
        .await
        .expect("claim as another instance");
    assert_eq!(claimed.len(), 1, "the busy timer is claimed");
    assert_eq!(claimed[0].key.service_call_id, "busy");
    // An action on it is refused with the body the document gives a 409: the outcome, the
    // timer as it is, and why.
    let (status, body) = send(
        &service,
        reqwest::Method::POST,
        "/v1/tenants/acme/timers/busy/pause",
        json!({}),
    )
    .await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["outcome"], "firing", "{body}");
    assert_eq!(body["timer"]["state"], "Scheduled", "{body}");
    assert_eq!(body["error"]["reason"], "firing", "{body}");
    // A command the broker could not take, for the dead letters.
    let (status, body) = send(
        &service,
        reqwest::Method::POST,
        "/v1/commands",
        json!({"type": "ScheduleTimer", "tenantId": "acme"}),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    // Two timers another instance could not publish: one failed for good, one waits for its
    // next attempt.
    let trouble_due = now_ms() + 1_800_000;
    for (i, id) in ["broken", "flaky"].into_iter().enumerate() {
        let (status, body) = send(
            &service,
            reqwest::Method::POST,
            "/v1/timers",
            json!({"tenantId": "acme", "serviceCallId": id, "dueTimeMs": trouble_due + i as i64}),
        )
        .await;
        assert_eq!(status, 201, "{body}");
    }
    let lease = Lease {
        owner: "another-instance".into(),
        until: Timestamp::from_millis(trouble_due + 60_000),
    };
    let claimed = store
        .claim_due(Timestamp::from_millis(trouble_due + 1).into(), 2, &lease)
        .await
        .expect("claim as another instance");
    let ids: Vec<&str> = claimed
        .iter()
        .map(|c| c.key.service_call_id.as_str())
        .collect();
    assert_eq!(ids, ["broken", "flaky"]);
    let next_attempt = Settlement::Retry {
        at: Timestamp::from_millis(trouble_due + 3_600_000),
        error: Some("the broker timed out".into()),
    };
    let settled = [
        (
            claimed[0].clone(),
            Settlement::Failed("no route to the broker".into()),
        ),
        (claimed[1].clone(), next_attempt),
    ];
    let n = store
        .settle(
            &settled,
            "another-instance",
            Timestamp::from_millis(trouble_due + 2),
        )
        .await
        .expect("settle as another instance");
    assert_eq!(n, 2);
    // 250 timers far ahead and one recurring, scheduled after the claims above: the series'
    // next occurrence may be within the hour, and must not be what another instance claims.
    let later = now_ms() + 86_400_000;
    let mut commands: Vec<Value> = (0..250)
        .map(|i| json!({"tenantId": "acme", "serviceCallId": format!("page-{i:03}"), "dueTimeMs": later + i}))
        .collect();
    commands.push(
        json!({"tenantId": "acme", "serviceCallId": "nightly", "cron": "0 3 * * *",
        "timeZone": "Europe/Berlin", "payload": {"report": "sales", "rows": [1, 2]}}),
    );
    let (status, body) = send(
        &service,
        reqwest::Method::POST,
        "/v1/timers/batch",
        json!({ "commands": commands }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    // 250 pages, the series, busy and flaky are Scheduled; broken failed.
    browser
        .wait_text("#tenants tr[data-tenant=acme] td:nth-child(2)", "253")
        .await;
    browser
        .wait_text("#tenants tr[data-tenant=acme] td:nth-child(4)", "1")
        .await;
    browser.wait_text("#counted-at", "UTC").await;
    browser.wait_count("#next-due tr", 10).await;
    browser.shot("overview").await;

    // The list: filters from the form land in the URL, pages follow the cursor.
    browser.open("#/timers").await;
    browser.type_into("#f-tenant", "acme").await;
    browser.click("#f-state-scheduled").await;
    browser.type_into("#f-prefix", "page-").await;
    browser.click("#apply").await;
    browser.wait_count("#timer-list tbody tr", 100).await;
    let url = browser.client.current_url().await.expect("url");
    let fragment = url.fragment().unwrap_or_default();
    assert!(
        fragment.contains("tenant=acme")
            && fragment.contains("state=scheduled")
            && fragment.contains("prefix=page-"),
        "the filters are in the URL: {url}"
    );
    assert_eq!(
        browser.text("#timer-list tbody tr td a").await.as_deref(),
        Some("page-000")
    );
    browser.shot("timers").await;
    browser.click("#next-page").await;
    browser
        .wait_text("#timer-list tbody tr:first-child td a", "page-100")
        .await;
    browser.click("#next-page").await;
    browser.wait_count("#timer-list tbody tr", 50).await;
    assert_eq!(browser.count("#next-page").await, 0, "the last page");
    // A shared URL opens the same page; a bad filter is a clear error from the API.
    browser
        .open("#/timers?tenant=acme&state=scheduled&prefix=page-&dueBefore=nonsense")
        .await;
    browser.wait_text("#list-error", "dueBefore").await;

    // One timer: pause with a note, resume, trigger, each confirmed and answered.
    browser.open("#/timer?tenant=acme&id=page-000").await;
    browser.wait_text("#timer-state", "Scheduled").await;
    browser.click("#do-pause").await;
    browser.confirm(Some("supplier outage")).await;
    browser.wait_text("#answer", "200 paused").await;
    browser.wait_text("#timer-state", "Paused").await;
    browser.wait_text("#history", "supplier outage").await;
    browser.click("#do-resume").await;
    browser.confirm(None).await;
    browser.wait_text("#answer", "200 resumed").await;
    browser.wait_text("#timer-state", "Scheduled").await;
    browser.click("#do-trigger-now").await;
    browser.confirm(None).await;
    browser.wait_text("#answer", "200 triggered").await;
    browser.wait_text("#history", "triggered by hand").await;
    browser.shot("timer").await;

    // A series: its pattern, zone and next occurrences, the payload pretty-printed.
    browser.open("#/timer?tenant=acme&id=nightly").await;
    browser.wait_text("#recurrence", "Europe/Berlin").await;
    browser.wait_count("#next-occurrences tbody tr", 5).await;
    browser.wait_text("#payload", "\"report\": \"sales\"").await;
    browser.shot("series").await;
    // Its trace: the id, linked to the tracing UI of telemetry.trace_url.
    let (status, nightly) = send(
        &service,
        reqwest::Method::GET,
        "/v1/tenants/acme/timers/nightly",
        Value::Null,
    )
    .await;
    assert_eq!(status, 200, "{nightly}");
    let trace_id = nightly["traceId"].as_str().expect("a trace id").to_owned();
    browser.wait_text("#fields", &trace_id).await;
    let href = browser
        .run(
            "const a = document.querySelector('#fields a[href^=\"https://tempo\"]'); \
             return a ? a.href : null;",
            vec![],
        )
        .await;
    assert_eq!(
        href,
        json!(format!("https://tempo.example/trace/{trace_id}"))
    );

    // A timer with its own target and message: both shown (the body is not); a reschedule
    // from the page keeps them (it sends the message again, body included), and its completion
    // timeout and trace context.
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let delayed = json!({"tenantId": "acme", "serviceCallId": "delayed", "dueTimeMs": later,
        "target": {"queue": "acme.orders"}, "completionTimeout": "30s",
        "traceparent": traceparent, "tracestate": "vendor=abc",
        "message": {"bodyBase64": "AAEC/w==", "contentType": "application/octet-stream",
                    "headers": {"x-order": "42"}}});
    let (status, body) = send(&service, reqwest::Method::POST, "/v1/timers", delayed).await;
    assert_eq!(status, 201, "{body}");
    browser.open("#/timer?tenant=acme&id=delayed").await;
    browser.wait_text("#fields", "acme.orders").await;
    browser
        .wait_text("#fields", "4 bytes, application/octet-stream, 1 header")
        .await;
    browser.click("#do-reschedule").await;
    browser.confirm(None).await;
    browser.wait_text("#answer", "200").await;
    let (status, kept) = send(
        &service,
        reqwest::Method::GET,
        "/v1/tenants/acme/timers/delayed?body=true",
        Value::Null,
    )
    .await;
    assert_eq!(status, 200, "{kept}");
    assert_eq!(kept["target"], json!({"queue": "acme.orders"}), "{kept}");
    assert_eq!(kept["message"]["bodyBase64"], "AAEC/w==", "{kept}");
    assert_eq!(kept["message"]["headers"]["x-order"], "42", "{kept}");
    assert_eq!(kept["policy"]["completionTimeoutMs"], 30_000, "{kept}");
    assert_eq!(kept["traceparent"], traceparent, "{kept}");
    assert_eq!(kept["tracestate"], "vendor=abc", "{kept}");

    // Cancelling a timer another instance is firing: the API's `firing` answer, shown.
    browser.open("#/timer?tenant=acme&id=busy").await;
    browser.wait_text("#timer-state", "Scheduled").await;
    browser.click("#do-cancel").await;
    browser.confirm(None).await;
    browser.wait_text("#answer", "409 firing").await;
    browser.shot("firing").await;

    // Failed: the tenants with failed timers, and the dead letter; in a tenant, its failed
    // timers to retry and the ones whose publish is being retried, to cancel.
    browser.open("#/failed").await;
    browser.wait_text("#failed-list", "acme").await;
    browser.wait_text("#dead-letters", "ScheduleTimer").await;
    browser.open("#/failed?tenant=acme").await;
    browser
        .wait_text("#failed-list", "no route to the broker")
        .await;
    browser
        .wait_text("#retrying-list", "the broker timed out")
        .await;
    browser.shot("failed").await;
    browser
        .click("#failed-list button[data-retry=broken]")
        .await;
    browser.confirm(None).await;
    browser.wait_text("#answer", "200 retried").await;
    browser.wait_text("#failed-list", "No failed timers").await;
    browser
        .click("#retrying-list button[data-cancel=flaky]")
        .await;
    browser.confirm(None).await;
    browser.wait_text("#answer", "200 cancelled").await;
    browser
        .wait_text("#retrying-list", "no publish is failing")
        .await;
    browser.open("#/timer?tenant=acme&id=broken").await;
    browser.wait_text("#history", "retried by hand").await;

    // A series with policies, fired and awaiting its completion: the page shows both, and
    // says why it does not fire at its due time.
    let (status, body) = send(
        &service,
        reqwest::Method::POST,
        "/v1/timers",
        json!({"tenantId": "acme", "serviceCallId": "guarded", "cron": "* * * * * *",
               "timeZone": "UTC", "overlap": "skip", "completionTimeout": "1h"}),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    browser.open("#/timer?tenant=acme&id=guarded").await;
    browser.wait_text("#fields", "overlap skip").await;
    browser.wait_text("#fields", "completion timeout 1 h").await;
    browser
        .wait_text("#fields", "awaiting the completion of occurrence 1")
        .await;
    browser.shot("policy").await;

    // Nothing came from anywhere but the service.
    let origins = browser
        .run(
            "return performance.getEntriesByType('resource').map(e => new URL(e.name).origin);",
            vec![],
        )
        .await;
    let ours = service.base.clone();
    for origin in origins.as_array().into_iter().flatten() {
        assert_eq!(
            origin.as_str(),
            Some(ours.as_str()),
            "loaded from elsewhere"
        );
    }

    // Signing out forgets the token.
    browser.click("#sign-out").await;
    browser.wait_count("#token", 1).await;
    let kept = browser
        .run(
            "return sessionStorage.getItem('timer-service-token');",
            vec![],
        )
        .await;
    assert_eq!(kept, Value::Null);

    // A key for another tenant sees that tenant only, and not the service's own figures; the
    // page it was on (a timer of acme) says 403.
    browser.type_into("#token", OTHER_KEY).await;
    browser.click("#sign-in").await;
    browser.wait_text(".error", "may not use tenant").await;
    browser.open("#/").await;
    browser
        .wait_text("#overview-restricted", "its own tenants")
        .await;
    browser
        .wait_count("#tenants tr[data-tenant=other]", 1)
        .await;
    browser.wait_count("#tenants tr[data-tenant=acme]", 0).await;
    browser.wait_text("#waiting", "Needs the admin scope").await;
    browser.shot("overview-tenant-key").await;
    browser
        .client
        .close()
        .await
        .expect("end the browser session");
}
