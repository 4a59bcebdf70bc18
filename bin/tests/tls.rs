//! TLS settings are honoured, against servers with a certificate from a throwaway CA
//! (`scripts/servers/tls.sh`):
//! - PostgreSQL (the test server has TLS on): `store.ssl_mode = "verify-full"` with
//!   `store.ssl_root_cert` = that CA connects over TLS (seen in `pg_stat_ssl`); with another CA
//!   the service refuses to start, naming the certificate problem.
//! - NATS: a nats-server with TLS and JetStream started by this test; `tls://` with
//!   `broker.tls_root_cert` connects, without it (the CA is not a public one) it does not.
//! - RabbitMQ (the test server listens for amqps on its AMQP port + 1): `amqps://` with
//!   `broker.tls_root_cert` connects and works, without it it does not.
//!
//! Not covered: Kafka. tansu 0.6.0 has `--cert`/`--key` options, but the service's TLS for Kafka
//! is librdkafka's (`broker.properties`), which this project does not test against a server.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use libtest_mimic::Arguments;
use sqlx::Connection;
use timer_brokers::nats::{NatsBroker, NatsConfig};
use timer_brokers::rabbitmq::{RabbitmqBroker, RabbitmqConfig};
use timer_conformance::e2e::{free_addr, missing_var, refused_to_run, run_ok, Service};
use timer_conformance::{server_trial, wait_for};
use timer_core::plugin::BrokerConfig;
use timer_core::Broker;
use timer_stores::postgres::TEST_SERVER as POSTGRES;

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");
const CA_VAR: &str = "TIMER_TEST_POSTGRES_CA";

fn main() {
    let args = Arguments::from_args();
    let pg_missing = missing_var(
        &[POSTGRES.address_env, CA_VAR],
        "bash scripts/test.sh starts PostgreSQL with TLS",
    );
    let rabbit_missing = missing_var(
        &["TIMER_TEST_RABBITMQ_TLS_URL", "TIMER_TEST_RABBITMQ_CA"],
        "bash scripts/test.sh starts RabbitMQ with amqps",
    );
    let nats_missing = which("nats-server")
        .is_none()
        .then(|| "nats-server is not installed (bash scripts/test.sh installs it)".to_owned());
    let trials = vec![
        server_trial(
            "tls::postgres_verify_full_with_the_servers_ca_connects_over_tls",
            pg_missing.clone(),
            postgres_verify_full_connects_over_tls,
        ),
        server_trial(
            "tls::postgres_with_a_ca_that_did_not_sign_the_server_refuses_to_start",
            pg_missing,
            postgres_with_another_ca_refuses,
        ),
        server_trial(
            "tls::nats_tls_with_the_root_cert_connects_and_without_it_does_not",
            nats_missing,
            nats_tls_is_honoured,
        ),
        server_trial(
            "tls::rabbitmq_amqps_with_the_root_cert_connects_and_without_it_does_not",
            rabbit_missing,
            rabbitmq_tls_is_honoured,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|p| p.is_file())
    })
}

/// `config` on fresh resources of its own (streams, queues) on the same server.
fn isolated<C: BrokerConfig + Clone>(config: C) -> C {
    let fresh = config.isolated("tls").expect("fresh names");
    fresh
        .config
        .as_any()
        .downcast_ref::<C>()
        .expect("the same kind of config")
        .clone()
}

/// The error of a connect with a CA that did not sign the server's certificate.
fn refused<T>(connect: timer_core::Result<T>) -> timer_core::Error {
    match connect {
        Ok(_) => panic!("a certificate from an unknown CA must be refused"),
        Err(e) => e,
    }
}

/// A CA and a server certificate for 127.0.0.1 in `dir` (`scripts/servers/tls.sh`).
async fn make_certificates(dir: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/servers/tls.sh");
    let mut command = tokio::process::Command::new("bash");
    command.arg(script).arg(dir);
    run_ok(&mut command, "tls.sh").await;
}

fn postgres_env(schema: &str, root_cert: &Path) -> Vec<(&'static str, String)> {
    vec![
        ("TIMER_STORE__KIND", "postgres".into()),
        ("TIMER_STORE__URL", POSTGRES.address().unwrap_or_default()),
        ("TIMER_STORE__SCHEMA", schema.into()),
        ("TIMER_STORE__SSL_MODE", "verify-full".into()),
        (
            "TIMER_STORE__SSL_ROOT_CERT",
            root_cert.display().to_string(),
        ),
        ("TIMER_BROKER__KIND", "memory".into()),
    ]
}

/// TLS connections to the test database other than this one.
async fn tls_connections(admin: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
         WHERE s.ssl AND a.datname = current_database() AND s.pid <> pg_backend_pid()",
    )
    .fetch_one(admin)
    .await
    .expect("pg_stat_ssl")
}

async fn postgres_verify_full_connects_over_tls() {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = POSTGRES.address().expect("url");
    // This connection itself stays in plain text, so it does not count.
    let mut admin = sqlx::PgConnection::connect(&format!("{url}?sslmode=disable"))
        .await
        .expect("admin connection");
    let before = tls_connections(&mut admin).await;
    let ca = PathBuf::from(std::env::var(CA_VAR).expect("ca"));
    let schema = format!("tls_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let service = Service::start(Path::new(BIN), dir.path(), &postgres_env(&schema, &ca)).await;
    let (status, ready) = service.get("/readyz").await;
    assert_eq!(status, 200, "{ready}");
    let during = tls_connections(&mut admin).await;
    assert!(
        during > before,
        "the service's connections use TLS ({before} before, {during} with it running)"
    );
    println!("TLS connections to the test database: {before} before, {during} with the service");
    service.terminate().await;
    let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .execute(&mut admin)
        .await;
}

async fn postgres_with_another_ca_refuses() {
    let dir = tempfile::tempdir().expect("tempdir");
    let other = dir.path().join("other-ca");
    make_certificates(&other).await;
    let mut env = postgres_env("tls_refused", &other.join("ca.pem"));
    env.push(("TIMER_STORE__CONNECT_TIMEOUT", "5s".into()));
    let exit = refused_to_run(Path::new(BIN), &["run"], dir.path(), &env).await;
    let err = &exit.stderr;
    let last = exit.last_line().to_lowercase();
    assert!(
        last.starts_with("error: postgres store") && last.contains("certificate"),
        "names the certificate problem: {err}"
    );
    assert!(
        !err.contains(":postgres@"),
        "no password in the output: {err}"
    );
}

async fn nats_tls_is_honoured() {
    let dir = tempfile::tempdir().expect("tempdir");
    make_certificates(&dir.path().join("tls")).await;
    let tls = dir.path().join("tls");
    let port = free_addr().port();
    let mut server = tokio::process::Command::new("nats-server")
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(dir.path().join("js"))
        .arg("--tlscert")
        .arg(tls.join("server.pem"))
        .arg("--tlskey")
        .arg(tls.join("server-key.pem"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start nats-server with TLS");
    let up = wait_for(Duration::from_secs(30), || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()
            .map(|_| ())
    })
    .await;
    assert!(up.is_some(), "nats-server with TLS listens");
    let config: NatsConfig = isolated(NatsConfig {
        url: format!("tls://127.0.0.1:{port}"),
        tls_root_cert: Some(tls.join("ca.pem")),
        connect_timeout: Duration::from_secs(5),
        ..NatsConfig::default()
    });
    // JetStream may need a moment after the port opens; the first connect may retry.
    let broker = wait_for(Duration::from_secs(30), || async {
        NatsBroker::connect(&config).await.ok()
    })
    .await
    .expect("connects over TLS with the CA given");
    broker.health().await.expect("healthy over TLS");
    drop(broker);
    let without = NatsConfig {
        tls_root_cert: None,
        ..config.clone()
    };
    let err = refused(NatsBroker::connect(&without).await)
        .chain()
        .to_lowercase();
    assert!(
        err.contains("cannot connect") && (err.contains("certificate") || err.contains("tls")),
        "{err}"
    );
    println!("without the CA: {err}");
    let _ = server.start_kill();
    let _ = server.wait().await;
}

async fn rabbitmq_tls_is_honoured() {
    let config: RabbitmqConfig = isolated(RabbitmqConfig {
        url: std::env::var("TIMER_TEST_RABBITMQ_TLS_URL").expect("url"),
        tls_root_cert: Some(PathBuf::from(
            std::env::var("TIMER_TEST_RABBITMQ_CA").expect("ca"),
        )),
        ..RabbitmqConfig::default()
    });
    let broker = RabbitmqBroker::connect(&config)
        .await
        .expect("connects over amqps with the CA given");
    broker.health().await.expect("healthy over TLS");
    broker
        .dead_letter(b"over tls", "test")
        .await
        .expect("a confirmed publish over TLS");
    drop(broker);
    let without = RabbitmqConfig {
        tls_root_cert: None,
        ..config.clone()
    };
    let err = refused(RabbitmqBroker::connect(&without).await).chain();
    println!("without the CA: {err}");
    assert!(
        err.contains("cannot connect to amqps://***@127.0.0.1") && err.contains("UnknownIssuer"),
        "names the server, not the password: {err}"
    );
    assert!(!err.contains("guest:guest"), "{err}");
    let missing = RabbitmqConfig {
        tls_root_cert: Some(PathBuf::from("/nonexistent/ca.pem")),
        ..config.clone()
    };
    let err = match RabbitmqBroker::connect(&missing).await {
        Ok(_) => panic!("an unreadable CA file is an error"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("broker.tls_root_cert /nonexistent/ca.pem"),
        "{err}"
    );
    let _ = timer_brokers::rabbitmq::delete_topology(&config).await;
}
