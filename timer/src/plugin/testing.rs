//! What tests and the bench use a plugin with: its test server ([`TestServer`]), configs on
//! isolated resources ([`Isolated`], [`fresh_name`]) and an independent client of a broker
//! ([`TestClient`]).

use std::any::Any;
use std::collections::BTreeMap;

use async_trait::async_trait;
use uuid::Uuid;

use crate::broker::Broker;
use crate::error::{Error, Result};
use crate::outbound::Target;

/// A config on isolated resources, with whatever keeps them alive (a temp dir) until dropped.
pub struct Isolated<C: ?Sized> {
    pub config: Box<C>,
    pub guard: Box<dyn Any + Send + Sync>,
}

impl<C: ?Sized> Isolated<C> {
    /// A config whose resources need nothing kept alive.
    pub fn new(config: Box<C>) -> Self {
        Isolated {
            config,
            guard: Box::new(()),
        }
    }
}

/// An event as an independent consumer read it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadEvent {
    /// The de-duplication id the broker carried (header, message id).
    pub id: Uuid,
    pub body: Vec<u8>,
    /// Every header as it arrived (its trace context among them).
    pub headers: BTreeMap<String, String>,
}

/// A dead letter as an independent consumer read it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadDeadLetter {
    pub body: Vec<u8>,
    pub reason: String,
}

/// A message as an independent consumer read it at a target ([`TestClient::read_target`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadMessage {
    /// The de-duplication id the broker carried (header, message id), when it reads as one.
    pub id: Option<Uuid>,
    pub body: Vec<u8>,
    pub content_type: Option<String>,
    /// Every header as it arrived, the plugin's own among them.
    pub headers: BTreeMap<String, String>,
    /// The record key (Kafka) or routing key (RabbitMQ), where the broker has one.
    pub key: Option<Vec<u8>>,
    /// When it arrived, in epoch milliseconds, as the broker or the reader stamped it (NATS:
    /// the stream's timestamp; Kafka: the record's; RabbitMQ: when the test client's consumer
    /// received it); `None` where nothing stamps it.
    pub arrived_ms: Option<i64>,
}

/// A message for a broker's own delay ingress ([`TestClient::send_delayed`]), as a producer
/// that knows nothing of the service would send it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DelayedMessage {
    /// Where it is to go: a target [`TestClient::make_target`] made.
    pub target: Target,
    /// Its own id (the timer's `serviceCallId`); `None`: the service derives one.
    pub id: Option<String>,
    /// Its tenant header; `None`: the broker's `delay_tenant`.
    pub tenant: Option<String>,
    pub when: DelayedUntil,
    pub body: Vec<u8>,
    pub headers: BTreeMap<String, String>,
}

/// When a delayed message is to go: its delay header or its deliver-at header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DelayedUntil {
    /// Milliseconds from when the service reads it.
    DelayMs(i64),
    /// An epoch time in milliseconds.
    AtMs(i64),
}

/// An independent producer and reader on one broker config's resources.
#[async_trait]
pub trait TestClient: Send + Sync + 'static {
    /// A new connection of the plugin under test to these resources; dropping it disconnects.
    async fn connect(&self) -> Result<Box<dyn Broker>>;
    /// Sends a command as a producing service would, and waits until the broker has it.
    async fn send_command(&self, body: &[u8]) -> Result<()>;
    /// Sends a command with these headers, in the broker's own terms (NATS headers, AMQP
    /// headers, Kafka headers; for the memory broker, those of a `POST /v1/commands`), and
    /// waits until the broker has it.
    async fn send_command_with_headers(
        &self,
        body: &[u8],
        headers: &BTreeMap<String, String>,
    ) -> Result<()>;
    /// Sends many commands, all in flight together where the broker allows, and waits for all.
    async fn send_commands(&self, bodies: &[Vec<u8>]) -> Result<()> {
        for body in bodies {
            self.send_command(body).await?;
        }
        Ok(())
    }
    /// Every event published so far, as a consumer reads them.
    async fn events(&self) -> Result<Vec<ReadEvent>>;
    /// Every dead letter so far.
    async fn dead_letters(&self) -> Result<Vec<ReadDeadLetter>>;
    /// A destination of the broker's own, made for one check (`name` keeps checks apart: a
    /// subject a stream captures, a routing key on an exchange, a key on a topic; where the
    /// target has a key, `name` is it), as a timer's `target` names it. `None`: the plugin
    /// takes no targets.
    async fn make_target(&self, _name: &str) -> Result<Option<Target>> {
        Ok(None)
    }
    /// Sends `messages` through the broker's own delay ingress, all in flight together where the
    /// broker allows, and waits until the broker has every one. `Ok(false)`: the broker has no
    /// such ingress.
    async fn send_delayed(&self, _messages: &[DelayedMessage]) -> Result<bool> {
        Ok(false)
    }
    /// Every message that arrived so far at a target [`make_target`](Self::make_target) made.
    async fn read_target(&self, target: &Target) -> Result<Vec<ReadMessage>> {
        Err(Error::internal(format!(
            "this test client makes no targets ({})",
            target.to_json()
        )))
    }
    fn as_any(&self) -> &dyn Any;
}

/// A server the tests run a plugin against, started by `scripts/servers/<script>.sh` (which
/// `scripts/test.sh` calls) and reached through environment variables it prints.
#[derive(Debug, Clone, Copy)]
pub struct TestServer {
    /// The variable holding its address (URL or `host:port`), e.g. `TIMER_TEST_NATS_URL`.
    pub address_env: &'static str,
    /// The variable holding its data directory, for a test that stops and restarts it.
    pub dir_env: &'static str,
    /// `scripts/servers/<script>.sh` with `install`, `start DIR` and `stop DIR`.
    pub script: &'static str,
    /// The variable that script reads its port from (`NATS_PORT`).
    pub port_env: &'static str,
    /// Why a TCP proxy in front of the address cannot stand for the server, where it cannot
    /// (a Kafka client goes on to the addresses the cluster advertises); the checks that take
    /// the server away then run against a private server of their own, which `script` starts
    /// on a free port in a directory of its own.
    pub bypasses_proxies: Option<&'static str>,
    /// The file in its data directory holding the pid of the server itself, where the pid the
    /// script records is a launcher's (RabbitMQ: `rabbitmq-beam.pid`, the Erlang VM): a test
    /// that crashes the server kills that one.
    pub server_pid_file: Option<&'static str>,
    /// Why the tests do not take the server down while the service uses it, where they cannot
    /// (a limit of the test server, not of the plugin): the outage scenario and the chaos soak
    /// leave it out, saying so.
    pub not_restartable: Option<&'static str>,
}

impl TestServer {
    pub const fn new(
        address_env: &'static str,
        dir_env: &'static str,
        script: &'static str,
        port_env: &'static str,
    ) -> Self {
        TestServer {
            address_env,
            dir_env,
            script,
            port_env,
            bypasses_proxies: None,
            server_pid_file: None,
            not_restartable: None,
        }
    }

    /// This server, whose process is the one whose pid `file` holds
    /// ([`TestServer::server_pid_file`]).
    pub const fn with_server_pid_in(self, file: &'static str) -> Self {
        TestServer {
            server_pid_file: Some(file),
            ..self
        }
    }

    /// This server, saying why it is not taken down under load
    /// ([`TestServer::not_restartable`]).
    pub const fn not_restartable(self, why: &'static str) -> Self {
        TestServer {
            not_restartable: Some(why),
            ..self
        }
    }

    /// This server, saying why a proxy cannot stand for it ([`TestServer::bypasses_proxies`]).
    pub const fn bypassing_proxies(self, why: &'static str) -> Self {
        TestServer {
            bypasses_proxies: Some(why),
            ..self
        }
    }

    /// The server's address, or an error naming the variable and how to get a server.
    pub fn address(&self) -> Result<String> {
        std::env::var(self.address_env).map_err(|_| {
            Error::config(format!(
                "{} is not set (bash scripts/test.sh starts {})",
                self.address_env, self.script
            ))
        })
    }

    /// Why the server cannot be used, if it cannot.
    pub fn unavailable(&self) -> Option<String> {
        self.address().err().map(|e| e.to_string())
    }

    /// The port in the address (`scheme://user:pw@host:PORT/path` or `host:PORT`).
    pub fn port(&self) -> Option<u16> {
        let address = self.address().ok()?;
        let rest = address
            .split_once("://")
            .map_or(address.as_str(), |(_, r)| r);
        let authority = rest.split('/').next()?;
        let host_port = authority.rsplit('@').next()?;
        host_port.rsplit_once(':')?.1.parse().ok()
    }
}

/// A new resource name: `prefix` and 12 random hex digits (lowercase, so it is a valid name for
/// every server we run: schemas, streams, queues, topics).
pub fn fresh_name(prefix: &str) -> String {
    let id = Uuid::new_v4().simple().to_string();
    format!("{prefix}{}", &id[..12])
}
