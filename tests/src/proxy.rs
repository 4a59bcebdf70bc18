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
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
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

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
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
                Err(_) => continue,
            },
        };
        tokio::spawn(carry(client, upstream, state.subscribe(), stop.clone()));
    }
}

/// One connection: connects upstream once bytes flow, then pumps both ways until either side
/// closes, a reset, or the proxy stops.
async fn carry(
    client: TcpStream,
    upstream: SocketAddr,
    mut state: watch::Receiver<State>,
    stop: CancellationToken,
) {
    let generation = state.borrow().generation;
    let Some(()) = flowing(&mut state, generation, &stop).await else {
        return reset_now(client);
    };
    let Ok(server) = TcpStream::connect(upstream).await else {
        return reset_now(client);
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let ended = CancellationToken::new();
    let to_server = pump(
        client_read,
        server_write,
        state.clone(),
        generation,
        stop.clone(),
        ended.clone(),
    );
    let to_client = pump(
        server_read,
        client_write,
        state,
        generation,
        stop,
        ended.clone(),
    );
    let (a, b) = tokio::join!(to_server, to_client);
    // A reset: both sockets closed with RST rather than FIN.
    if let (Some((r1, w1)), Some((r2, w2))) = (a, b) {
        if let (Ok(s1), Ok(s2)) = (r1.reunite(w2), r2.reunite(w1)) {
            reset_now(s1);
            reset_now(s2);
        }
    }
}

/// Waits until bytes flow in `generation`; None when a reset or the stop came first.
async fn flowing(
    state: &mut watch::Receiver<State>,
    generation: u64,
    stop: &CancellationToken,
) -> Option<()> {
    loop {
        let now = *state.borrow_and_update();
        if now.generation != generation || stop.is_cancelled() {
            return None;
        }
        if now.flowing {
            return Some(());
        }
        tokio::select! {
            _ = stop.cancelled() => return None,
            changed = state.changed() => changed.ok()?,
        }
    }
}

/// Copies `from` into `to` while bytes flow. Returns both halves when the connection is to
/// be reset (a new generation or the proxy's stop), None when a side closed (the close is
/// passed on to the other).
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut state: watch::Receiver<State>,
    generation: u64,
    stop: CancellationToken,
    ended: CancellationToken,
) -> Option<(OwnedReadHalf, OwnedWriteHalf)> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if flowing(&mut state, generation, &stop).await.is_none() {
            return Some((from, to));
        }
        let n = tokio::select! {
            _ = ended.cancelled() => 0,
            _ = stop.cancelled() => return Some((from, to)),
            changed = state.changed() => {
                if changed.is_err() {
                    return Some((from, to));
                }
                if state.borrow().generation != generation {
                    return Some((from, to));
                }
                continue;
            }
            read = from.read(&mut buf) => read.unwrap_or(0),
        };
        if n == 0 {
            let _ = to.shutdown().await;
            ended.cancel();
            return None;
        }
        // Bytes read during a flow are held while a cut lasts, then written.
        if flowing(&mut state, generation, &stop).await.is_none() {
            return Some((from, to));
        }
        if to.write_all(&buf[..n]).await.is_err() {
            ended.cancel();
            return None;
        }
    }
}

/// Closes `stream` with a TCP reset (SO_LINGER 0).
fn reset_now(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}
