//! Accepting connections with limits, so that anyone who can reach the port cannot
//! take the server down by holding connections open: a cap on open connections, a
//! deadline for a request's headers (it also closes idle keep-alive connections), and
//! HTTP/2 pings that drop dead peers.

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// hyper's header deadline is also how long an idle keep-alive connection lives. The
/// official E2B SDK keeps pooled connections 300 s (`E2B_KEEPALIVE_EXPIRY`): a server
/// that closes them sooner races the client's next request on them (the client sees a
/// reset and has to retry). So idle connections outlive the SDK's pool; the cap on open
/// connections, not this deadline, is what bounds a slow client's hold.
const IDLE_KEEP_ALIVE: Duration = Duration::from_secs(330);

#[derive(Debug, Clone)]
pub struct Limits {
    /// Open connections at most; more wait in the kernel's backlog.
    pub max_connections: usize,
    /// How long a client may take to send a request's headers (and how long an idle
    /// keep-alive connection stays open).
    pub header_read_timeout: Duration,
    /// How long in-flight requests get to finish once shutdown starts.
    pub drain: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_connections: 1024, header_read_timeout: IDLE_KEEP_ALIVE, drain: Duration::from_secs(10) }
    }
}

/// Serves `app` on `listener` until `shutdown` completes, then lets open requests
/// finish for `limits.drain`.
pub async fn serve(listener: TcpListener, app: Router, limits: Limits, shutdown: impl Future<Output = ()>) -> std::io::Result<()> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(20));
    let builder = Arc::new(builder);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
            _ = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let service = TowerToHyperService::new(app.clone());
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service).into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, "connection ended: {e}");
            }
            drop(permit);
        });
    }
    drop(listener);
    if tokio::time::timeout(limits.drain, graceful.shutdown()).await.is_err() {
        tracing::info!("requests still open after {} s of shutdown were cut", limits.drain.as_secs());
    }
    Ok(())
}
