//! The agent channel: a virtio-serial port carrying HTTP/2 from the host.
//!
//! There is no udev in the guest, so the port is found by name in sysfs. While no host
//! is connected, reads return EOF at once. The port is never closed between sessions:
//! closing it discards whatever the host already sent, and a host that connects while
//! the guest closes and reopens would lose its HTTP/2 preface and hang. Instead the agent
//! keeps the port open, polls until the first bytes of a session arrive, serves that
//! session until EOF (the host disconnected), and waits for the next one.

use hutch_proto::agent::{find_hello, hello_line, HELLO_PREFIX};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use nix::fcntl::OFlag;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// How often an idle agent looks for a host connecting.
const IDLE_POLL: Duration = Duration::from_millis(10);
/// Bytes kept while looking for a hello line.
const MAX_GARBAGE: usize = 4096;

/// Finds `/dev/vportNpM` whose sysfs name is `name`; the name appears shortly after the
/// driver loads, so this polls.
pub fn find_port(name: &str, limit: Duration) -> Option<PathBuf> {
    let start = Instant::now();
    loop {
        if let Ok(dir) = std::fs::read_dir("/sys/class/virtio-ports") {
            for port in dir.flatten() {
                let port_name = std::fs::read_to_string(port.path().join("name")).unwrap_or_default();
                if port_name.trim() == name {
                    return Some(PathBuf::from("/dev").join(port.file_name()));
                }
            }
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub struct Port {
    fd: AsyncFd<OwnedFd>,
}

impl Port {
    pub fn open(path: &PathBuf) -> io::Result<Port> {
        let fd = nix::fcntl::open(path, OFlag::O_RDWR | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC, nix::sys::stat::Mode::empty())?;
        // SAFETY: `open` just returned this fd and nothing else owns it.
        let owned = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        Ok(Port { fd: register(owned)? })
    }

    fn poll_read(&self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.fd.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|fd| nix::unistd::read(fd.as_raw_fd(), unfilled).map_err(io::Error::from)) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_write(&self, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.fd.poll_write_ready(cx))?;
            match guard.try_io(|fd| nix::unistd::write(fd.get_ref(), data).map_err(io::Error::from)) {
                Ok(result) => return Poll::Ready(result),
                Err(_would_block) => continue,
            }
        }
    }

    async fn read_some(&self, buf: &mut [u8]) -> io::Result<usize> {
        let mut rb = ReadBuf::new(buf);
        std::future::poll_fn(|cx| self.poll_read(cx, &mut rb)).await?;
        Ok(rb.filled().len())
    }

    async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let n = std::future::poll_fn(|cx| self.poll_write(cx, data)).await?;
            data = &data[n..];
        }
        Ok(())
    }

    /// Waits for a host's hello line, echoes it, and returns the bytes that followed it
    /// (the start of the HTTP/2 session). EOF means no host is connected yet.
    async fn accept(&self) -> io::Result<Vec<u8>> {
        let mut pending = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = self.read_some(&mut buf).await?;
            if n == 0 {
                pending.clear();
                tokio::time::sleep(IDLE_POLL).await;
                continue;
            }
            pending.extend_from_slice(&buf[..n]);
            if let Some((end, nonce)) = find_hello(&pending) {
                self.write_all(&hello_line(nonce)).await?;
                return Ok(pending.split_off(end));
            }
            if pending.len() > MAX_GARBAGE {
                pending.drain(..pending.len() - HELLO_PREFIX.len());
            }
        }
    }
}

/// One host session on the shared port: the bytes already read, then the port.
struct Session {
    port: Arc<Port>,
    prefix: Vec<u8>,
    offset: usize,
}

impl AsyncRead for Session {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if self.offset < self.prefix.len() {
            let n = buf.remaining().min(self.prefix.len() - self.offset);
            buf.put_slice(&self.prefix[self.offset..self.offset + n]);
            self.offset += n;
            return Poll::Ready(Ok(()));
        }
        self.port.poll_read(cx, buf)
    }
}

impl AsyncWrite for Session {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        self.port.poll_write(cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Registers an owned fd with the reactor.
pub fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an OwnedFd is a valid open descriptor that stays open, and always returns the
    // same raw fd, until the AsyncFd that owns it is dropped.
    unsafe { AsyncFd::register(fd) }.map_err(io::Error::from)
}

pub fn http2() -> hyper::server::conn::http2::Builder<TokioExecutor> {
    let mut b = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    b.initial_stream_window_size(4 << 20)
        .initial_connection_window_size(16 << 20)
        .max_frame_size(1 << 20)
        .max_concurrent_streams(1024);
    b
}

/// Serves the agent API on the port forever, one host session after another.
pub async fn serve(path: PathBuf, app: axum::Router) {
    loop {
        let port = match Port::open(&path) {
            Ok(p) => Arc::new(p),
            Err(e) => {
                tracing::warn!("opening {}: {e}", path.display());
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        loop {
            let prefix = match port.accept().await {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!("reading {}: {e}; reopening it", path.display());
                    break;
                }
            };
            let session = Session { port: port.clone(), prefix, offset: 0 };
            let service = TowerToHyperService::new(app.clone());
            if let Err(e) = http2().serve_connection(TokioIo::new(session), service).await {
                tracing::debug!("agent session ended: {e}");
            }
        }
    }
}
