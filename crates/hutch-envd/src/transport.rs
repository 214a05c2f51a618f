//! Connecting to the agent socket: the hello handshake, then HTTP/2.

use crate::error::Body;
use bytes::{Buf, Bytes};
use hutch_proto::agent::{find_hello, hello_line};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::UnixStream;

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("connecting to the agent socket")]
    Socket(#[source] io::Error),
    #[error("the agent did not answer the hello")]
    NoHello,
    #[error("HTTP/2 handshake with the agent")]
    Handshake(#[source] hyper::Error),
}

/// Ends one agent connection on the host's word.
pub struct Closer {
    stop: tokio::sync::Notify,
    /// The connection's socket (a second fd of it): shut down, it ends the connection
    /// at once. Dropping hyper's connection task alone does not: hyper keeps the
    /// connection open while a request or response body is still streaming (a
    /// command's output through the data proxy), and the guest would never see the
    /// host leave, so it could not be saved.
    socket: std::os::unix::net::UnixStream,
}

impl Closer {
    pub fn close(&self) {
        self.stop.notify_one();
        if let Err(e) = self.socket.shutdown(std::net::Shutdown::Both) {
            if e.kind() != io::ErrorKind::NotConnected {
                tracing::debug!("shutting down the agent socket: {e}");
            }
        }
    }
}

/// Stale guest output tolerated before the echoed hello.
const MAX_SKIP: usize = 1 << 20;

/// An HTTP/2 session to the agent, and what ends it.
pub(crate) type Session = (hyper::client::conn::http2::SendRequest<Body>, std::sync::Arc<Closer>);

/// Connects once (`crate::connect` wraps it in a client).
pub(crate) async fn open(socket: &Path) -> Result<Session, ConnectError> {
    let mut stream = UnixStream::connect(socket).await.map_err(ConnectError::Socket)?;
    let nonce: u64 = rand::random();
    stream.write_all(&hello_line(nonce)).await.map_err(ConnectError::Socket)?;
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let rest = loop {
        let n = stream.read(&mut buf).await.map_err(ConnectError::Socket)?;
        if n == 0 {
            return Err(ConnectError::NoHello);
        }
        seen.extend_from_slice(&buf[..n]);
        // Older sessions may have left output (and hellos) behind: only ours counts.
        while let Some((end, got)) = find_hello(&seen) {
            if got == nonce {
                break;
            }
            seen.drain(..end);
        }
        if let Some((end, _)) = find_hello(&seen) {
            break seen.split_off(end);
        }
        if seen.len() > MAX_SKIP {
            return Err(ConnectError::NoHello);
        }
    };
    let socket = std::os::unix::net::UnixStream::from(std::os::fd::AsFd::as_fd(&stream).try_clone_to_owned().map_err(ConnectError::Socket)?);
    let io = Prefixed { prefix: Bytes::from(rest), inner: stream };
    let mut builder = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
    builder.initial_stream_window_size(4 << 20).initial_connection_window_size(16 << 20).max_frame_size(1 << 20);
    let (sender, conn) = builder.handshake::<_, Body>(TokioIo::new(io)).await.map_err(ConnectError::Handshake)?;
    let closer = std::sync::Arc::new(Closer { stop: tokio::sync::Notify::new(), socket });
    let close = closer.clone();
    tokio::spawn(async move {
        tokio::select! {
            r = conn => if let Err(e) = r { tracing::debug!("agent connection ended: {e}") },
            _ = close.stop.notified() => tracing::debug!("agent connection closed by the host"),
        }
    });
    Ok((sender, closer))
}

/// How long an unanswered idle probe waits before the next, first and at most. A session
/// the agent has not yet left swallows a probe (and ends on it, as on any new host's
/// opening line), and a host that has just closed its session nearly always meets one:
/// the second probe is what a pause waits for (a fixed 500 ms was most of an idle
/// pause). The wait doubles from there, so an agent still busy (a booting guest, a
/// loaded host) is not sent a probe every few milliseconds. Probes answered late are
/// skipped by whichever host reads them (their nonce is not its own).
const PROBE_FIRST: std::time::Duration = std::time::Duration::from_millis(20);
const PROBE_MOST: std::time::Duration = std::time::Duration::from_millis(500);

/// Waits until the agent answers an idle probe: it serves the channel and is between
/// sessions (`hutch_proto::agent::IDLE_PROBE_PREFIX`). Returns once answered, leaving
/// the agent waiting for its next host; the caller bounds the wait.
pub async fn wait_idle(socket: &Path) -> Result<(), ConnectError> {
    use hutch_proto::agent::{find_line, idle_probe, IDLE_REPLY_PREFIX};
    let mut stream = UnixStream::connect(socket).await.map_err(ConnectError::Socket)?;
    let nonce: u64 = rand::random();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let mut again = PROBE_FIRST;
    loop {
        stream.write_all(&idle_probe(nonce)).await.map_err(ConnectError::Socket)?;
        let deadline = tokio::time::Instant::now() + again;
        again = (again * 2).min(PROBE_MOST);
        while let Ok(read) = tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            let n = read.map_err(ConnectError::Socket)?;
            if n == 0 {
                return Err(ConnectError::NoHello);
            }
            seen.extend_from_slice(&buf[..n]);
            // Stale output and other hosts' replies are skipped: only our nonce counts.
            while let Some((_, end, got)) = find_line(&seen, IDLE_REPLY_PREFIX) {
                if got == nonce {
                    return Ok(());
                }
                seen.drain(..end);
            }
            if seen.len() > MAX_SKIP {
                seen.drain(..seen.len() - IDLE_REPLY_PREFIX.len() - 17);
            }
        }
    }
}

/// The socket, with bytes read past the hello served first.
struct Prefixed {
    prefix: Bytes,
    inner: UnixStream,
}

impl AsyncRead for Prefixed {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if self.prefix.has_remaining() {
            let n = buf.remaining().min(self.prefix.len());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Prefixed {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
