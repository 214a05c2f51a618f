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

/// Aborts the upstream connection's task when the relay ends, however it ends.
pub struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
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
pub async fn connect<U>(upstream: U, speaks: Http, host: &str) -> Result<(Sender, AbortOnDrop), String>
where
    U: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let failed = |e: hyper::Error| format!("HTTP with {host} could not start: {e}");
    let io = TokioIo::new(upstream);
    Ok(match speaks {
        Http::H1 => {
            let (sender, connection) = hyper::client::conn::http1::Builder::new().preserve_header_case(true).max_buf_size(HEAD_MAX).handshake::<_, Scanned>(io).await.map_err(failed)?;
            (Sender::H1(tokio::sync::Mutex::new(sender)), AbortOnDrop(tokio::spawn(async move {
                let _ = connection.await;
            })))
        }
        Http::H2 => {
            let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .max_header_list_size(HEAD_MAX as u32)
                .handshake::<_, Scanned>(io)
                .await
                .map_err(failed)?;
            (Sender::H2(sender), AbortOnDrop(tokio::spawn(async move {
                let _ = connection.await;
            })))
        }
    })
}
