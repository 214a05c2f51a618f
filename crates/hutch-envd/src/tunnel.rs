//! A byte stream to a TCP port in the guest, over the agent connection (see the agent's
//! `/tunnel/{port}`): writes become the request body, the response body is what we read.

use crate::client::AgentClient;
use crate::error::AgentError;
use bytes::Bytes;
use futures::StreamExt;
use http::{Method, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;
use tokio_util::sync::PollSender;

/// How long the guest may take to accept a tunnel.
const TUNNEL_OPEN: std::time::Duration = std::time::Duration::from_secs(30);

/// Chunks in flight towards the guest before writers wait.
const WRITE_QUEUE: usize = 16;

type Reader = tokio_util::io::StreamReader<futures::stream::BoxStream<'static, io::Result<Bytes>>, Bytes>;

pub struct Tunnel {
    reader: Reader,
    writer: PollSender<Bytes>,
}

impl AgentClient {
    /// Opens a stream to `port` inside the guest; `NotFound`-like errors when nothing
    /// listens there.
    pub async fn tunnel(&self, port: u16) -> Result<Tunnel, AgentError> {
        let (tx, rx) = mpsc::channel::<Bytes>(WRITE_QUEUE);
        let frames = tokio_stream::wrappers::ReceiverStream::new(rx).map(|b| Ok::<_, crate::error::BoxError>(Frame::data(b)));
        let req = self
            .request(Method::POST, &format!("/tunnel/{port}"))
            .body(StreamBody::new(frames).boxed_unsync())
            .map_err(|e| AgentError::Protocol(e.to_string()))?;
        let resp = tokio::time::timeout(TUNNEL_OPEN, self.send(req))
            .await
            .map_err(|_| AgentError::Timeout { what: format!("opening a tunnel to port {port}"), secs: TUNNEL_OPEN.as_secs() })??;
        if resp.status() != StatusCode::OK {
            let status = resp.status();
            return Err(crate::error::error_reply(status, resp.into_body()).await);
        }
        let data = resp
            .into_body()
            .into_data_stream()
            .map(|r| r.map_err(io::Error::other))
            .boxed();
        Ok(Tunnel { reader: tokio_util::io::StreamReader::new(data), writer: PollSender::new(tx) })
    }
}

impl AsyncRead for Tunnel {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.reader).poll_read(cx, buf)
    }
}

impl AsyncWrite for Tunnel {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        match self.writer.poll_reserve(cx) {
            Poll::Ready(Ok(())) => {}
            Poll::Ready(Err(_)) => return Poll::Ready(Err(io::Error::from(io::ErrorKind::BrokenPipe))),
            Poll::Pending => return Poll::Pending,
        }
        let n = data.len().min(64 * 1024);
        match self.writer.send_item(Bytes::copy_from_slice(&data[..n])) {
            Ok(()) => Poll::Ready(Ok(n)),
            Err(_) => Poll::Ready(Err(io::Error::from(io::ErrorKind::BrokenPipe))),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.writer.close();
        Poll::Ready(Ok(()))
    }
}
