//! Serving the API: plain HTTP, or HTTPS (rustls) when `http.tls_cert` and `http.tls_key` are
//! set, optionally requiring client certificates (`http.tls_client_ca`).
//!
//! On an HTTPS address, a connection whose first byte is not a TLS handshake (someone speaking
//! plain HTTP to it) is answered `400` in plain HTTP saying so, instead of a reset that leaves the
//! client guessing.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use timer_core::Error;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::config::HttpConfig;

/// Longest a client may take to send its first byte and finish the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest open connections are waited for at shutdown.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// The first byte of a TLS record carrying a handshake.
const TLS_HANDSHAKE: u8 = 0x16;

/// What a plain HTTP request to the HTTPS address gets.
const PLAIN_HTTP_BODY: &str = "this address speaks HTTPS (http.tls_cert): use https:// instead\n";

fn plain_http_answer() -> String {
    format!(
        "HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n\
         Connection: close\r\nContent-Length: {}\r\n\r\n{PLAIN_HTTP_BODY}",
        PLAIN_HTTP_BODY.len()
    )
}

/// The rustls settings of `http`, or `None` for plain HTTP. Errors name the file and what is
/// wrong with it.
pub fn server_config(http: &HttpConfig) -> Result<Option<rustls::ServerConfig>, Error> {
    let (Some(cert), Some(key)) = (&http.tls_cert, &http.tls_key) else {
        return Ok(None);
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = certificates("http.tls_cert", cert)?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| {
        Error::config(format!(
            "http.tls_key {}: no private key read from it ({e})",
            key.display()
        ))
    })?;
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::config(format!("TLS: {e}")))?;
    let builder = match &http.tls_client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in certificates("http.tls_client_ca", ca)? {
                roots.add(cert).map_err(|e| {
                    Error::config(format!("http.tls_client_ca {}: {e}", ca.display()))
                })?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| Error::config(format!("http.tls_client_ca {}: {e}", ca.display())))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|e| {
        Error::config(format!(
            "http.tls_cert {} and http.tls_key do not make a certificate: {e}",
            cert.display()
        ))
    })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Some(config))
}

/// The certificates of a PEM file; at least one.
pub fn certificates(key: &str, file: &Path) -> Result<Vec<CertificateDer<'static>>, Error> {
    let at = || format!("{key} {}", file.display());
    let certs = CertificateDer::pem_file_iter(file)
        .map_err(|e| Error::config(format!("{}: cannot read it ({e})", at())))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::config(format!("{}: not PEM certificates ({e})", at())))?;
    if certs.is_empty() {
        return Err(Error::config(format!("{}: holds no certificate", at())));
    }
    Ok(certs)
}

/// Limits of the listener, whatever the scheme.
#[derive(Debug, Clone, Copy)]
pub struct Listening {
    /// `http.max_connections`: connections served at once; the next waits in the kernel's
    /// backlog until one closes.
    pub max_connections: usize,
    /// `http.header_read_timeout`: how long a connection may take to send a request's headers
    /// (the first, or the next on a kept-alive connection) before it is closed.
    pub header_read_timeout: Duration,
}

impl Listening {
    pub fn of(http: &HttpConfig) -> Self {
        Listening {
            max_connections: http.max_connections.max(1),
            header_read_timeout: http.header_read_timeout,
        }
    }
}

/// Serves `app` on `listener` until `shutdown`, then lets open requests finish for up to
/// [`DRAIN_TIMEOUT`]. Each connection is HTTP/1.1 (over TLS when `tls` is given) in a task of its
/// own; at most `max_connections` at once, and a client that does not send its headers within
/// `header_read_timeout` (a slow-loris) is cut off, so slow clients cannot take every task.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<rustls::ServerConfig>,
    limits: Listening,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let acceptor = tls.map(|tls| TlsAcceptor::from(Arc::new(tls)));
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    // When the cap was last logged: once a minute at most.
    let mut warned: Option<tokio::time::Instant> = None;
    loop {
        // A slot first: at the cap, connections wait in the backlog instead of taking tasks.
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                if warned.is_none_or(|at| at.elapsed() >= Duration::from_secs(60)) {
                    tracing::warn!(
                        max = limits.max_connections,
                        "as many HTTP connections open as http.max_connections allows; new ones wait"
                    );
                    warned = Some(tokio::time::Instant::now());
                }
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    slot = slots.clone().acquire_owned() => match slot {
                        Ok(slot) => slot,
                        Err(_) => break,
                    },
                }
            }
        };
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, or a connection reset before it was accepted.
                    tracing::warn!(error = %e, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let acceptor = acceptor.clone();
        let service = TowerToHyperService::new(app.clone());
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let _slot = slot;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout);
            let Some(acceptor) = acceptor else {
                let connection = builder.serve_connection(TokioIo::new(stream), service);
                // Server-sent events and the like hold a connection; upgrades are not used.
                if let Err(e) = watcher.watch(connection).await {
                    tracing::debug!(%peer, error = %e, "HTTP connection ended with an error");
                }
                return;
            };
            let mut stream = stream;
            let mut first = [0u8; 1];
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, stream.peek(&mut first)).await {
                Ok(Ok(1)) if first[0] == TLS_HANDSHAKE => {}
                Ok(Ok(1)) => {
                    tracing::debug!(%peer, "plain HTTP on the HTTPS address; answered 400");
                    let _ = stream.write_all(plain_http_answer().as_bytes()).await;
                    let _ = stream.shutdown().await;
                    return;
                }
                _ => return,
            }
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => return,
            };
            let connection = builder.serve_connection(TokioIo::new(tls), service);
            if let Err(e) = watcher.watch(connection).await {
                tracing::debug!(%peer, error = %e, "HTTPS connection ended with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(DRAIN_TIMEOUT, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("HTTP connections still open after {DRAIN_TIMEOUT:?}; closing them");
    }
    Ok(())
}
