//! One guest TCP connection: a smoltcp socket on the guest's side and a task that
//! pumps bytes to and from the upstream (a host TCP connection, or the stack's own DNS
//! server for port 53). Bounded channels between them carry backpressure both ways: a
//! slow upstream fills `to_upstream` and the socket stops reading (the guest's window
//! closes); a slow guest fills the socket and the pump stops reading upstream.

use crate::scan::{Form, Scanner};
use bytes::{Buf, Bytes};
use smoltcp::iface::{SocketHandle, SocketSet};
use smoltcp::socket::tcp;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, Notify};

/// Each direction's socket buffer: large enough for a few 64 KiB segments.
pub const SOCKET_BUFFER: usize = 256 * 1024;
/// A connection whose handshake the guest has not finished by then is dropped: a
/// raw-socket guest cannot keep half-open connections (or ones smoltcp never accepted,
/// a SYN with a wrong MAC or checksum) holding flow slots. Only the handshake has a
/// deadline: an established connection may idle (the flow cap bounds how many), and
/// while its VM is stopped for a snapshot the guest cannot answer anything.
pub const HANDSHAKE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);
/// Chunks queued each way between the socket and the pump.
const CHANNEL_CHUNKS: usize = 8;
const CHUNK: usize = 64 * 1024;

pub struct TcpFlow {
    pub handle: SocketHandle,
    to_upstream: Option<mpsc::Sender<Bytes>>,
    from_upstream: mpsc::Receiver<Bytes>,
    pending: Bytes,
    upstream_done: bool,
    closing: bool,
    opened: std::time::Instant,
    /// Scans what the guest sends for secrets' placeholders (when its rules name secrets).
    scanner: Option<Scanner>,
    /// The placeholder that ended the flow, for the stack to log.
    leaked: Option<Form>,
    /// Whether the guest has sent anything yet (a flow that starts as TLS is not scanned).
    sent_any: bool,
}

pub fn new_socket() -> tcp::Socket<'static> {
    let mut s = tcp::Socket::new(tcp::SocketBuffer::new(vec![0; SOCKET_BUFFER]), tcp::SocketBuffer::new(vec![0; SOCKET_BUFFER]));
    // The guest's own stack batches; hutch forwards what it has at once.
    s.set_nagle_enabled(false);
    s
}

/// A flow for `handle` and the pump task that serves `upstream`; `scan`: whether what
/// the guest sends is scanned for placeholders.
pub fn start<S>(handle: SocketHandle, upstream: S, scan: bool, wake: Arc<Notify>) -> (TcpFlow, impl std::future::Future<Output = ()> + Send)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (to_tx, to_rx) = mpsc::channel(CHANNEL_CHUNKS);
    let (from_tx, from_rx) = mpsc::channel(CHANNEL_CHUNKS);
    let flow = TcpFlow {
        handle,
        to_upstream: Some(to_tx),
        from_upstream: from_rx,
        pending: Bytes::new(),
        upstream_done: false,
        closing: false,
        opened: std::time::Instant::now(),
        scanner: scan.then(Scanner::default),
        leaked: None,
        sent_any: false,
    };
    (flow, pump(upstream, to_rx, from_tx, wake))
}

async fn pump<S>(upstream: S, mut to_rx: mpsc::Receiver<Bytes>, from_tx: mpsc::Sender<Bytes>, wake: Arc<Notify>)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut rd, mut wr) = tokio::io::split(upstream);
    let down = {
        let wake = wake.clone();
        async move {
            let mut buf = vec![0; CHUNK];
            loop {
                match rd.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if from_tx.send(Bytes::copy_from_slice(&buf[..n])).await.is_err() {
                            break;
                        }
                        wake.notify_one();
                    }
                }
            }
            drop(from_tx);
            wake.notify_one();
        }
    };
    let up = async move {
        while let Some(chunk) = to_rx.recv().await {
            if wr.write_all(&chunk).await.is_err() {
                break;
            }
            // The socket may have stopped reading for want of room in the channel.
            wake.notify_one();
        }
        let _ = wr.shutdown().await;
    };
    tokio::join!(down, up);
}

impl TcpFlow {
    /// The placeholder that ended the flow, once.
    pub fn take_leak(&mut self) -> Option<Form> {
        self.leaked.take()
    }

    /// Moves what can move between the socket and the pump; whether anything did.
    /// Returns false for `alive` once the connection is over and the socket can go.
    pub fn service(&mut self, sockets: &mut SocketSet<'_>) -> (bool, bool) {
        let socket = sockets.get_mut::<tcp::Socket>(self.handle);
        let mut moved = false;
        // Until the handshake is done the socket neither sends nor receives, which is
        // not the guest closing.
        let handshaking = matches!(socket.state(), tcp::State::Listen | tcp::State::SynReceived);
        if handshaking && self.opened.elapsed() > HANDSHAKE_DEADLINE {
            socket.abort();
            return (true, false);
        }
        // Guest → upstream.
        while socket.can_recv() {
            let Some(tx) = &self.to_upstream else { break };
            let Ok(permit) = tx.try_reserve() else { break };
            let chunk = socket.recv(|buf| {
                let n = buf.len().min(CHUNK);
                (n, Bytes::copy_from_slice(&buf[..n]))
            });
            match chunk {
                Ok(c) if !c.is_empty() => {
                    if self.scanner.is_some() && !self.sent_any && crate::scan::starts_tls(&c) {
                        self.scanner = None;
                    }
                    self.sent_any = true;
                    if let Some(form) = self.scanner.as_mut().and_then(|s| s.feed(&c)) {
                        // Not sent: the guest's connection is reset, the upstream's closed.
                        drop(permit);
                        self.leaked = Some(form);
                        self.to_upstream = None;
                        socket.abort();
                        return (true, true);
                    }
                    permit.send(c);
                    moved = true;
                }
                _ => break,
            }
        }
        // The guest half-closed: so does the upstream, once its data is through.
        if !handshaking && self.to_upstream.is_some() && !socket.may_recv() && socket.recv_queue() == 0 {
            self.to_upstream = None;
            moved = true;
        }
        // Upstream → guest (a server may speak first: its bytes wait for the handshake).
        if !handshaking {
            loop {
                if self.pending.is_empty() {
                    match self.from_upstream.try_recv() {
                        Ok(c) => self.pending = c,
                        Err(mpsc::error::TryRecvError::Empty) => break,
                        Err(mpsc::error::TryRecvError::Disconnected) => {
                            self.upstream_done = true;
                            break;
                        }
                    }
                }
                if !socket.may_send() {
                    // The guest is gone: nothing more can reach it.
                    self.pending.clear();
                    break;
                }
                match socket.send_slice(&self.pending) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        self.pending.advance(n);
                        moved = true;
                    }
                }
            }
        }
        if self.upstream_done && self.pending.is_empty() && !self.closing {
            socket.close();
            self.closing = true;
            moved = true;
        }
        let alive = !matches!(socket.state(), tcp::State::Closed | tcp::State::TimeWait);
        (moved, alive)
    }
}
