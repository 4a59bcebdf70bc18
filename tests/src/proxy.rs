//! A TCP proxy on 127.0.0.1 that a test puts between the service and a server, to cut the
//! network without touching either: [`Proxy::cut`] stops every byte in both directions on every
//! connection (what a partition does: nothing arrives, nothing fails, data waits in the
//! senders), new connections are accepted but not carried on until [`Proxy::heal`]; and
//! [`Proxy::reset`] closes every connection at once with a TCP reset (what a restarted
//! middlebox or a killed peer does). A cut that heals delivers what was held back, as TCP
//! retransmission does after a short partition.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Whether bytes flow, and which generation of connections is alive (a reset starts a new one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct State {
    flowing: bool,
    generation: u64,
}

/// A running proxy; it stops (closing every connection) when dropped.
pub struct Proxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    state: Arc<watch::Sender<State>>,
    stop: CancellationToken,
}

impl Proxy {
    /// Listens on a free port of 127.0.0.1 and carries every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy's port");
        let addr = listener.local_addr().expect("the proxy's address");
        let (state, _) = watch::channel(State {
            flowing: true,
            generation: 0,
        });
        let state = Arc::new(state);
        let stop = CancellationToken::new();
        tokio::spawn(accept(listener, upstream, state.clone(), stop.clone()));
        Proxy {
            addr,
            upstream,
            state,
            stop,
        }
    }

    /// A proxy in front of the server a URL names (`postgres://u:p@127.0.0.1:5432/db`,
    /// `nats://127.0.0.1:4222`); its port, or `default_port` when it names none.
    pub async fn in_front_of(url: &str, default_port: u16) -> Proxy {
        let parsed = url::Url::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"));
        let host = parsed
            .host_str()
            .unwrap_or_else(|| panic!("{url} names no host"));
        let upstream = format!("{host}:{}", parsed.port().unwrap_or(default_port))
            .parse()
            .unwrap_or_else(|e| panic!("{url}: the proxy needs an IP address: {e}"));
        Proxy::start(upstream).await
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server it carries connections to.
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// `url` (or `host:port`) with the upstream's address replaced by the proxy's; panics when
    /// `url` does not name the upstream.
    pub fn rewrite(&self, url: &str) -> String {
        let upstream = self.upstream.to_string();
        assert!(
            url.contains(&upstream),
            "{url} does not name the proxied server {upstream}"
        );
        url.replace(&upstream, &self.addr.to_string())
    }

    /// The partition: nothing passes in either direction until [`heal`](Self::heal).
    pub fn cut(&self) {
        self.state.send_modify(|s| s.flowing = false);
    }

    /// Ends a cut: what was held back is delivered, new connections are carried on.
    pub fn heal(&self) {
        self.state.send_modify(|s| s.flowing = true);
    }

    /// Closes every open connection with a TCP reset (both sides see it); later connections
    /// are carried as before.
    pub fn reset(&self) {
        self.state.send_modify(|s| s.generation += 1);
    }

    /// The server is gone: the proxy stops listening and closes every connection, as when it
    /// is dropped.
    pub fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn accept(
    listener: TcpListener,
    upstream: SocketAddr,
    state: Arc<watch::Sender<State>>,
    stop: CancellationToken,
) {
    loop {
        let client = tokio::select! {
            _ = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => client,
                Err(_) => {
                    // Out of file descriptors, say: try again in a moment, not in a hot loop.
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        tokio::spawn(carry(
            client,
            upstream,
            state.subscribe(),
            stop.child_token(),
        ));
    }
}

/// How one direction of a connection ended.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// Its sender closed; the close was passed on (the other direction goes on: a half-close).
    Closed,
    /// A reset, the proxy's stop, or an error on either side: both sockets are to be reset.
    Reset,
}

/// One connection: connects upstream once bytes flow, then pumps both ways until both sides
/// closed, or resets both (a reset, the proxy's stop, an error on either side).
async fn carry(
    mut client: TcpStream,
    upstream: SocketAddr,
    mut state: watch::Receiver<State>,
    gone: CancellationToken,
) {
    let generation = state.borrow().generation;
    if flowing(&mut state, generation, &gone).await == Some(Ended::Reset) {
        return reset_now(client);
    }
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return reset_now(client);
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let ended = {
        let (client_read, client_write) = client.split();
        let (server_read, server_write) = server.split();
        let (a, b) = tokio::join!(
            pump(client_read, server_write, state.clone(), generation, &gone),
            pump(server_read, client_write, state, generation, &gone),
        );
        if a == Ended::Reset || b == Ended::Reset {
            Ended::Reset
        } else {
            Ended::Closed
        }
    };
    if ended == Ended::Reset {
        reset_now(client);
        reset_now(server);
    }
}

/// Waits until bytes flow in `generation`: `None` then, `Some(Reset)` when a reset or `gone`
/// came first.
async fn flowing(
    state: &mut watch::Receiver<State>,
    generation: u64,
    gone: &CancellationToken,
) -> Option<Ended> {
    let wait = state.wait_for(|s| s.flowing || s.generation != generation);
    let now = tokio::select! {
        _ = gone.cancelled() => return Some(Ended::Reset),
        now = wait => match now {
            Ok(now) => *now,
            Err(_) => return Some(Ended::Reset),
        },
    };
    (now.generation != generation).then_some(Ended::Reset)
}

/// Returns when `generation` has been reset (or the proxy is gone).
async fn reset(state: &mut watch::Receiver<State>, generation: u64) {
    let _ = state.wait_for(|s| s.generation != generation).await;
}

/// Copies `from` into `to` while bytes flow; bytes read just before a cut are held until it
/// heals, and so is a close. Cancels `gone` when it ends with a reset, so the other direction
/// ends too.
async fn pump(
    mut from: ReadHalf<'_>,
    mut to: WriteHalf<'_>,
    mut state: watch::Receiver<State>,
    generation: u64,
    gone: &CancellationToken,
) -> Ended {
    let ended = copy(&mut from, &mut to, &mut state, generation, gone).await;
    if ended == Ended::Reset {
        gone.cancel();
    }
    ended
}

async fn copy(
    from: &mut ReadHalf<'_>,
    to: &mut WriteHalf<'_>,
    state: &mut watch::Receiver<State>,
    generation: u64,
    gone: &CancellationToken,
) -> Ended {
    let mut buf = vec![0u8; 64 * 1024];
    let mut resets = state.clone();
    loop {
        if let Some(ended) = flowing(state, generation, gone).await {
            return ended;
        }
        let n = tokio::select! {
            _ = gone.cancelled() => return Ended::Reset,
            _ = reset(&mut resets, generation) => return Ended::Reset,
            read = from.read(&mut buf) => match read {
                Ok(n) => n,
                Err(_) => return Ended::Reset,
            },
        };
        if let Some(ended) = flowing(state, generation, gone).await {
            return ended;
        }
        if n == 0 {
            let _ = to.shutdown().await;
            return Ended::Closed;
        }
        let wrote = tokio::select! {
            _ = gone.cancelled() => return Ended::Reset,
            _ = reset(&mut resets, generation) => return Ended::Reset,
            wrote = to.write_all(&buf[..n]) => wrote,
        };
        if wrote.is_err() {
            return Ended::Reset;
        }
    }
}

/// Closes `stream` with a TCP reset (SO_LINGER 0).
fn reset_now(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}
