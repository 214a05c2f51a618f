//! The client half of an inspected flow: one connection to the verified server, in the
//! HTTP version ALPN chose with it (HTTP/1.1 sends one request at a time, HTTP/2
//! multiplexes), whose task ends with the flow.

use super::scanned::Scanned;
use super::upstream::Http;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};

/// The largest request or response head either side may send.
pub const HEAD_MAX: usize = 64 * 1024;

pub enum Sender {
    H1(tokio::sync::Mutex<hyper::client::conn::http1::SendRequest<Scanned>>),
    H2(hyper::client::conn::http2::SendRequest<Scanned>),
}

/// The upstream connection's task: aborted when the relay ends, however it ends.
pub struct Upstream(tokio::task::JoinHandle<Result<(), hyper::Error>>);

impl Drop for Upstream {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Upstream {
    /// Returns when the server's connection has ended (closed, GOAWAY, an error): no
    /// request can be sent on it any more; with the error, if it ended in one. Awaited
    /// once.
    pub async fn ended(&mut self) -> Option<String> {
        match (&mut self.0).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(e) => Some(e.to_string()),
        }
    }
}

impl Sender {
    pub fn speaks(&self) -> Http {
        match self {
            Sender::H1(_) => Http::H1,
            Sender::H2(_) => Http::H2,
        }
    }

    pub async fn send(&self, req: Request<Scanned>) -> hyper::Result<Response<Incoming>> {
        match self {
            Sender::H1(sender) => {
                let mut sender = sender.lock().await;
                sender.ready().await?;
                sender.send_request(req).await
            }
            Sender::H2(sender) => {
                let mut sender = sender.clone();
                sender.ready().await?;
                sender.send_request(req).await
            }
        }
    }
}

/// Starts HTTP in version `speaks` on `upstream` (TLS to `host`, already verified).
pub async fn connect<U>(upstream: U, speaks: Http, host: &str) -> Result<(Sender, Upstream), String>
where
    U: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let failed = |e: hyper::Error| format!("HTTP with {host} could not start: {e}");
    let io = TokioIo::new(upstream);
    Ok(match speaks {
        Http::H1 => {
            let (sender, connection) = hyper::client::conn::http1::Builder::new().preserve_header_case(true).max_buf_size(HEAD_MAX).handshake::<_, Scanned>(io).await.map_err(failed)?;
            (Sender::H1(tokio::sync::Mutex::new(sender)), Upstream(tokio::spawn(async move {
                // A 101 hands the connection to the request's upgrade (`tunnel.rs`).
                connection.with_upgrades().await
            })))
        }
        Http::H2 => {
            // Small windows: what the server sends ahead of a guest that does not read
            // is what hutch holds.
            let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .max_header_list_size(HEAD_MAX as u32)
                .initial_stream_window_size(256 * 1024)
                .initial_connection_window_size(1024 * 1024)
                .max_send_buf_size(64 * 1024)
                .handshake::<_, Scanned>(io)
                .await
                .map_err(failed)?;
            (Sender::H2(sender), Upstream(tokio::spawn(connection)))
        }
    })
}
