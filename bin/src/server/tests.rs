//! The assembled router: `/readyz` on an engine whose firing task panics once, and how often
//! it asks the broker; the 409 `firing` of a cancel or a pause while a fire holds the timer.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use axum::body::Body;
use axum::http::Request;
use serde_json::Value;
use timer_brokers::memory::{MemoryBroker, MemoryConfig, MemoryHub};
use timer_core::{
    decode_schedule, Broker, Delivery, Engine, EngineConfig, Lease, Limits, ManualClock,
    OutboundEvent, Result, Store, SystemClock, TimerKey, Timestamp, Undelivered,
};
use timer_stores::memory::MemoryStore;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

use super::{app, Serving};

/// The memory broker, counting its health checks; with `panicked` false its first publish
/// panics (as an SDK that panics on input it should have refused).
struct Watched {
    inner: MemoryBroker,
    panicked: AtomicBool,
    health_checks: Arc<AtomicU32>,
}

impl Watched {
    fn new(inner: MemoryBroker, panics_once: bool) -> Self {
        Watched {
            inner,
            panicked: AtomicBool::new(!panics_once),
            health_checks: Arc::new(AtomicU32::new(0)),
        }
    }
}

#[async_trait]
impl Broker for Watched {
    fn name(&self) -> &'static str {
        "memory"
    }
    async fn receive(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>> {
        self.inner.receive(max, wait).await
    }
    async fn ack(&self, tags: &[u64]) -> Result<()> {
        self.inner.ack(tags).await
    }
    async fn publish(&self, events: &[OutboundEvent]) -> Result<Vec<Undelivered>> {
        if !self.panicked.swap(true, Ordering::SeqCst) {
            panic!("injected publish panic");
        }
        self.inner.publish(events).await
    }
    async fn dead_letter(&self, body: &[u8], reason: &str) -> Result<()> {
        self.inner.dead_letter(body, reason).await
    }
    async fn health(&self) -> Result<()> {
        self.health_checks.fetch_add(1, Ordering::SeqCst);
        self.inner.health().await
    }
}

/// The service's router with the default config, no auth and no metrics, on `engine`.
fn router(engine: &Engine, hub: MemoryHub, shutdown: CancellationToken) -> axum::Router {
    draining_router(engine, hub, shutdown, CancellationToken::new())
}

/// [`router`], draining once `draining` is cancelled.
fn draining_router(
    engine: &Engine,
    hub: MemoryHub,
    shutdown: CancellationToken,
    draining: CancellationToken,
) -> axum::Router {
    let config = crate::config::load(&figment::Figment::new()).expect("the defaults load");
    app(
        &config,
        Serving {
            engine: engine.clone(),
            auth: None,
            metrics: None,
            memory_hub: Some(hub),
            shutdown,
            draining,
            counts_max_age: config.http.counts_max_age,
        },
    )
}

async fn readyz(app: &axum::Router) -> (u16, Value) {
    call(app, "GET", "/readyz").await
}

/// While the firing task that panicked waits out its restart backoff, `/readyz` answers 503 with
/// the engine `unavailable` (and no error text); once it runs again, 200.
#[tokio::test]
async fn readyz_is_503_while_an_engine_task_is_down() {
    let hub = MemoryHub::new(MemoryConfig::default());
    let broker = Watched::new(hub.connect(), true);
    let engine = Engine::new(
        Arc::new(MemoryStore::new()),
        Arc::new(broker),
        Arc::new(SystemClock),
        EngineConfig {
            // Long enough to see the task down, short enough for a test.
            retry_base: Duration::from_secs(2),
            ..EngineConfig::default()
        },
        Limits::default(),
    );
    let shutdown = CancellationToken::new();
    let task = engine.start(shutdown.clone());
    let app = router(&engine, hub, shutdown.clone());
    let (status, ready) = readyz(&app).await;
    assert_eq!(
        (status, &ready["engine"]["status"]),
        (200, &Value::from("ok"))
    );

    let now = Timestamp::from_millis(chrono::Utc::now().timestamp_millis());
    let body = format!(
        r#"{{"tenantId":"t","serviceCallId":"panics","dueTimeMs":{}}}"#,
        now.as_millis()
    );
    let timer = decode_schedule(body.as_bytes(), &Limits::default(), now).expect("valid");
    engine.schedule(&[timer]).await.expect("schedule");
    let down = timer_conformance::wait_for(Duration::from_secs(10), || async {
        let (status, ready) = readyz(&app).await;
        (status == 503).then_some(ready)
    })
    .await
    .expect("/readyz answers 503 while the firing task is down");
    assert_eq!(down["engine"]["status"], "unavailable", "{down}");
    assert_eq!(down["store"]["status"], "ok", "{down}");
    assert_eq!(down["broker"]["status"], "ok", "{down}");
    let up = timer_conformance::wait_for(Duration::from_secs(10), || async {
        let (status, _) = readyz(&app).await;
        (status == 200).then_some(())
    })
    .await;
    assert!(up.is_some(), "200 again once the task was restarted");
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
}

/// Once the instance drains, `/readyz` answers 503 `draining` though every part is `ok`.
#[tokio::test]
async fn readyz_is_503_while_the_instance_drains() {
    let hub = MemoryHub::new(MemoryConfig::default());
    let engine = Engine::new(
        Arc::new(MemoryStore::new()),
        Arc::new(hub.connect()),
        Arc::new(SystemClock),
        EngineConfig::default(),
        Limits::default(),
    );
    let (shutdown, draining) = (CancellationToken::new(), CancellationToken::new());
    let task = engine.start(shutdown.clone());
    let app = draining_router(&engine, hub, shutdown.clone(), draining.clone());
    let (status, ready) = readyz(&app).await;
    assert_eq!((status, &ready["draining"]), (200, &Value::from(false)));
    draining.cancel();
    let (status, ready) = readyz(&app).await;
    assert_eq!((status, &ready["draining"]), (503, &Value::from(true)));
    for part in ["store", "broker", "engine"] {
        assert_eq!(ready[part]["status"], "ok", "{ready}");
    }
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
}

/// The first signal's drain: `draining` at once, `shutdown` only once the delay has passed.
#[tokio::test(start_paused = true)]
async fn a_drain_stops_the_service_after_its_delay() {
    let (draining, shutdown) = (CancellationToken::new(), CancellationToken::new());
    let delay = Duration::from_secs(5);
    let drain = tokio::spawn(super::drain(draining.clone(), shutdown.clone(), delay));
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert!(draining.is_cancelled() && !shutdown.is_cancelled());
    tokio::time::sleep(delay - Duration::from_millis(2)).await;
    assert!(!shutdown.is_cancelled(), "stopped before the delay");
    tokio::time::sleep(Duration::from_millis(2)).await;
    drain.await.expect("the drain");
    assert!(shutdown.is_cancelled());
    // Without a delay, both at once.
    let (draining, shutdown) = (CancellationToken::new(), CancellationToken::new());
    super::drain(draining.clone(), shutdown.clone(), Duration::ZERO).await;
    assert!(draining.is_cancelled() && shutdown.is_cancelled());
}

/// However many ask at once or one after another, `/readyz` asks the store and the broker at
/// most once per `READY_MAX_AGE` (polling cannot make the service reconnect over and over).
#[tokio::test]
async fn readyz_asks_the_broker_at_most_once_a_second() {
    let hub = MemoryHub::new(MemoryConfig::default());
    let broker = Watched::new(hub.connect(), false);
    let health_checks = broker.health_checks.clone();
    let engine = Engine::new(
        Arc::new(MemoryStore::new()),
        Arc::new(broker),
        Arc::new(SystemClock),
        EngineConfig::default(),
        Limits::default(),
    );
    let shutdown = CancellationToken::new();
    let app = router(&engine, hub, shutdown.clone());
    let started = std::time::Instant::now();
    for _ in 0..5 {
        let answers = futures::future::join_all((0..20).map(|_| readyz(&app))).await;
        assert!(
            answers.iter().all(|(status, _)| *status == 200),
            "{answers:?}"
        );
    }
    let seconds =
        started.elapsed().as_secs_f64() / crate::http::health::READY_MAX_AGE.as_secs_f64();
    let checks = health_checks.load(Ordering::SeqCst);
    // One check per started max age, and one more for a refresh in flight at the end.
    assert!(
        f64::from(checks) <= seconds.ceil() + 1.0,
        "100 answers in {seconds:.2} max ages took {checks} broker health checks"
    );
    shutdown.cancel();
}

async fn call(app: &axum::Router, method: &str, uri: &str) -> (u16, Value) {
    let request = Request::builder()
        .method(method)
        .uri(uri)
        .body(Body::empty())
        .expect("a request");
    let response = app.clone().oneshot(request).await.expect("an answer");
    let status = response.status().as_u16();
    let body = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .expect("the body");
    (status, serde_json::from_slice(&body).expect("JSON"))
}

/// `DELETE` and `POST …/pause` of a timer whose event is being published (its fire holds the
/// lease) answer 409 `firing` and change nothing; once that lease ended (its instance died),
/// both go through.
#[tokio::test]
async fn cancel_and_pause_answer_409_firing_while_the_timer_fires() {
    const T0: Timestamp = Timestamp::from_millis(1_800_000_000_000);
    let hub = MemoryHub::new(MemoryConfig::default());
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let clock = Arc::new(ManualClock::new(T0));
    // Not started: the test holds the fire's lease itself, as another instance would.
    let engine = Engine::new(
        store.clone(),
        Arc::new(hub.connect()),
        clock.clone(),
        EngineConfig::default(),
        Limits::default(),
    );
    let app = router(&engine, hub, CancellationToken::new());
    let body = format!(
        r#"{{"tenantId":"t","serviceCallId":"busy","dueTimeMs":{}}}"#,
        T0.as_millis()
    );
    let timer = decode_schedule(body.as_bytes(), &Limits::default(), T0).expect("valid");
    engine.schedule(&[timer]).await.expect("schedule");
    let lease = Lease {
        owner: "another-instance".to_owned(),
        until: T0.saturating_add(Duration::from_secs(60)),
    };
    let claimed = store.claim_due(T0.into(), 10, &lease).await.expect("claim");
    assert_eq!(claimed.len(), 1);
    let key = TimerKey::new("t", "busy");
    let before = store.get(&key).await.expect("get");

    for (method, uri) in [
        ("DELETE", "/v1/tenants/t/timers/busy"),
        ("POST", "/v1/tenants/t/timers/busy/pause"),
    ] {
        let (status, answer) = call(&app, method, uri).await;
        assert_eq!(
            (status, &answer["error"]["reason"]),
            (409, &Value::from("firing")),
            "{method} {uri}: {answer}"
        );
    }
    assert_eq!(
        store.get(&key).await.expect("get"),
        before,
        "nothing changed"
    );

    clock.advance(Duration::from_secs(61));
    let (status, answer) = call(&app, "POST", "/v1/tenants/t/timers/busy/pause").await;
    assert_eq!(
        (status, &answer["outcome"]),
        (200, &Value::from("paused")),
        "{answer}"
    );
    let (status, answer) = call(&app, "DELETE", "/v1/tenants/t/timers/busy").await;
    assert_eq!(
        (status, &answer["outcome"]),
        (200, &Value::from("cancelled")),
        "{answer}"
    );
}
