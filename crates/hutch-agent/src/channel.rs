//! The agent channel: a virtio-serial port carrying HTTP/2 from the host.
//!
//! There is no udev in the guest, so the port is found by name in sysfs. The port is
//! driven by two plain threads doing blocking reads and writes: non-blocking mode with
//! epoll lost wake-ups for writes on this driver (a reply would sit in the guest until
//! the next event). While no host is connected a read returns EOF at once.
//!
//! The port is never closed between sessions: closing it discards what the host already
//! sent. Each host session starts with a hello line (see `hutch_proto::agent`), which
//! the agent echoes before HTTP/2 starts, so leftovers of older sessions in either
//! direction cannot corrupt a new one.

use bytes::Bytes;
use hutch_proto::agent::{find_host_line, hello_line, idle_reply, opens_host_line, HostLine, HELLO_PREFIX};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

/// How often an idle agent looks for a host connecting.
const IDLE_POLL: Duration = Duration::from_millis(10);
/// Bytes kept while looking for a hello line.
const MAX_GARBAGE: usize = 4096;
/// Buffer between the port threads and HTTP/2.
const PIPE: usize = 1 << 20;

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

enum Inbound {
    Data(Bytes),
    /// A read saw EOF: no host is connected (any more).
    HostGone,
}

/// Starts the reader and writer threads of an open port.
fn start_port_threads(path: &PathBuf) -> std::io::Result<(mpsc::Receiver<Inbound>, mpsc::Sender<Bytes>)> {
    let mut reader = std::fs::OpenOptions::new().read(true).write(true).open(path)?;
    let mut writer = reader.try_clone()?;
    let (in_tx, in_rx) = mpsc::channel::<Inbound>(16);
    let (out_tx, mut out_rx) = mpsc::channel::<Bytes>(16);
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let msg = match reader.read(&mut buf) {
                Ok(0) => Inbound::HostGone,
                Ok(n) => Inbound::Data(Bytes::copy_from_slice(&buf[..n])),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    eprintln!("hutch-agent: reading the agent port: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            let idle = matches!(msg, Inbound::HostGone);
            if in_tx.blocking_send(msg).is_err() {
                return;
            }
            if idle {
                std::thread::sleep(IDLE_POLL);
            }
        }
    });
    std::thread::spawn(move || {
        while let Some(chunk) = out_rx.blocking_recv() {
            // Blocks while no host is connected; the hello protocol makes whatever
            // is delivered late harmless.
            if let Err(e) = writer.write_all(&chunk) {
                eprintln!("hutch-agent: writing the agent port: {e}");
            }
        }
    });
    Ok((in_rx, out_tx))
}

/// Waits for a host's hello (`carried`: bytes a session already read from the next
/// host), echoes it, and returns the bytes that followed it. Idle probes met on the
/// way are answered: this is the only place that answers them, so an answer tells the
/// host the agent is between sessions.
async fn accept(inbound: &mut mpsc::Receiver<Inbound>, outbound: &mpsc::Sender<Bytes>, carried: Option<Bytes>) -> Option<Vec<u8>> {
    let mut pending = carried.map(|b| b.to_vec()).unwrap_or_default();
    loop {
        if find_host_line(&pending).is_none() {
            match inbound.recv().await? {
                Inbound::HostGone => pending.clear(),
                Inbound::Data(d) => pending.extend_from_slice(&d),
            }
        }
        while let Some((end, line)) = find_host_line(&pending) {
            match line {
                HostLine::IdleProbe(nonce) => {
                    outbound.send(Bytes::from(idle_reply(nonce))).await.ok()?;
                    pending.drain(..end);
                }
                HostLine::Hello(nonce) => {
                    outbound.send(Bytes::from(hello_line(nonce))).await.ok()?;
                    return Some(pending.split_off(end));
                }
            }
        }
        if pending.len() > MAX_GARBAGE {
            pending.drain(..pending.len() - HELLO_PREFIX.len());
        }
    }
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
    let (mut inbound, outbound) = loop {
        match start_port_threads(&path) {
            Ok(t) => break t,
            Err(e) => {
                eprintln!("hutch-agent: opening {}: {e}", path.display());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let mut carried = None;
    while let Some(first) = accept(&mut inbound, &outbound, carried.take()).await {
        carried = session(first, &mut inbound, &outbound, app.clone()).await;
        eprintln!("{}", hutch_proto::agent::IDLE_LINE);
    }
}

/// How long a single "host gone" is checked before the session ends on it.
const GONE_CONFIRM: Duration = Duration::from_millis(100);

/// What the port brings a running session.
enum Next {
    Data(Bytes),
    /// The host left.
    Gone,
    /// The host left and a new one connected: these bytes start with its hello.
    NewHost(Bytes),
}

/// The next bytes from the host. A lone EOF can be stale: right after a snapshot
/// restore, the port replays the disconnect the guest saw before the save while the
/// new host is already connected. A host that left makes every read see EOF (a "gone"
/// each poll), so one is confirmed by a second within `GONE_CONFIRM`; silence means the
/// host is still there, and data after it is the same host's unless it opens with a
/// hello (a host that left and reconnected at once).
async fn next_data(inbound: &mut mpsc::Receiver<Inbound>) -> Next {
    loop {
        match inbound.recv().await {
            None => return Next::Gone,
            Some(Inbound::Data(d)) => return Next::Data(d),
            Some(Inbound::HostGone) => match tokio::time::timeout(GONE_CONFIRM, inbound.recv()).await {
                Ok(Some(Inbound::Data(d))) if opens_host_line(&d) => return Next::NewHost(d),
                Ok(Some(Inbound::Data(d))) => return Next::Data(d),
                Ok(Some(Inbound::HostGone)) | Ok(None) => return Next::Gone,
                Err(_) => tracing::debug!("a stale host-gone on the port; the session goes on"),
            },
        }
    }
}

/// One HTTP/2 session, until the host goes away or the session ends. Returns the
/// opening bytes of the next host when one connected right away.
async fn session(first: Vec<u8>, inbound: &mut mpsc::Receiver<Inbound>, outbound: &mpsc::Sender<Bytes>, app: axum::Router) -> Option<Bytes> {
    let (server_io, bridge) = tokio::io::duplex(PIPE);
    let (mut from_http, mut to_http) = tokio::io::split(bridge);
    let service = TowerToHyperService::new(app);
    let http = http2().serve_connection(TokioIo::new(server_io), service);
    tokio::pin!(http);
    let mut next_host = None;
    let into_http = async {
        if to_http.write_all(&first).await.is_ok() {
            loop {
                match next_data(inbound).await {
                    Next::Data(d) => {
                        if to_http.write_all(&d).await.is_err() {
                            break;
                        }
                    }
                    Next::Gone => break,
                    Next::NewHost(d) => {
                        next_host = Some(d);
                        break;
                    }
                }
            }
        }
        // The host left: HTTP/2 sees EOF and ends the session.
        let _ = to_http.shutdown().await;
    };
    let out_of_http = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from_http.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if outbound.send(Bytes::copy_from_slice(&buf[..n])).await.is_err() {
                        break;
                    }
                }
            }
        }
    };
    let started = Instant::now();
    tokio::select! {
        r = &mut http => if let Err(e) = r { tracing::debug!("agent session ended: {e}") },
        _ = async { tokio::join!(into_http, out_of_http) } => {
            let _ = tokio::time::timeout(Duration::from_secs(1), &mut http).await;
        }
    }
    tracing::debug!("agent session closed after {:?}", started.elapsed());
    next_host
}

#[cfg(test)]
mod tests {
    use super::*;
    use hutch_proto::agent::{find_line, idle_probe, IDLE_REPLY_PREFIX};

    fn port() -> (mpsc::Sender<Inbound>, mpsc::Receiver<Inbound>, mpsc::Sender<Bytes>, mpsc::Receiver<Bytes>) {
        let (in_tx, in_rx) = mpsc::channel(16);
        let (out_tx, out_rx) = mpsc::channel(16);
        (in_tx, in_rx, out_tx, out_rx)
    }

    #[tokio::test]
    async fn an_idle_agent_answers_probes_and_stays_waiting_for_a_hello() {
        let (host, mut inbound, outbound, mut to_host) = port();
        let waiting = tokio::spawn(async move { accept(&mut inbound, &outbound, None).await });
        host.send(Inbound::Data(Bytes::from(idle_probe(42)))).await.expect("port open");
        let reply = to_host.recv().await.expect("a reply");
        assert_eq!(find_line(&reply, IDLE_REPLY_PREFIX).map(|(_, _, n)| n), Some(42));
        assert!(!waiting.is_finished(), "a probe started a session");
        let mut hello = hello_line(7);
        hello.extend_from_slice(b"PRI *");
        host.send(Inbound::Data(Bytes::from(hello))).await.expect("port open");
        assert_eq!(to_host.recv().await.expect("a reply").as_ref(), hello_line(7).as_slice());
        assert_eq!(waiting.await.expect("accept ran").expect("a session"), b"PRI *");
    }

    #[tokio::test]
    async fn a_console_line_is_not_an_answer_and_a_session_does_not_answer_a_probe() {
        // The session ends on a probe (a new host's opening line) without answering it:
        // only `accept`, between sessions, does.
        let (host, mut inbound, outbound, mut to_host) = port();
        host.send(Inbound::HostGone).await.expect("port open");
        host.send(Inbound::Data(Bytes::from(idle_probe(9)))).await.expect("port open");
        let app = axum::Router::new();
        let carried = session(Vec::new(), &mut inbound, &outbound, app).await;
        assert_eq!(carried.as_deref(), Some(idle_probe(9).as_slice()));
        assert!(to_host.try_recv().map(|b| find_line(&b, IDLE_REPLY_PREFIX).is_none()).unwrap_or(true));
        let waiting = tokio::spawn(async move { accept(&mut inbound, &outbound, carried).await });
        let reply = to_host.recv().await.expect("a reply");
        assert_eq!(find_line(&reply, IDLE_REPLY_PREFIX).map(|(_, _, n)| n), Some(9));
        assert!(find_line(hutch_proto::agent::IDLE_LINE.as_bytes(), IDLE_REPLY_PREFIX).is_none());
        waiting.abort();
    }

    #[tokio::test]
    async fn a_session_ends_soon_after_its_host_leaves_even_with_a_stream_open() {
        // A response that never ends, like a command's output stream: a line every 10 ms.
        let ticks = || async {
            let ticks = futures::stream::unfold(0u64, |n| async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                Some((Ok::<_, std::io::Error>(Bytes::from(format!("tick {n}\n"))), n + 1))
            });
            axum::body::Body::from_stream(ticks)
        };
        let app = axum::Router::new().route("/stream", axum::routing::get(ticks));
        let (host, mut inbound, outbound, mut to_host) = port();
        let (client_io, bridge) = tokio::io::duplex(1 << 16);
        let (mut from_client, mut to_client) = tokio::io::split(bridge);
        // The port: the host's bytes go in until the host is cut off (its socket closes).
        let (cut, cut_off) = tokio::sync::oneshot::channel::<()>();
        let up = tokio::spawn(async move {
            let mut buf = vec![0u8; 1 << 16];
            let forward = async {
                while let Ok(n @ 1..) = from_client.read(&mut buf).await {
                    if host.send(Inbound::Data(Bytes::copy_from_slice(&buf[..n]))).await.is_err() {
                        break;
                    }
                }
            };
            tokio::select! {
                () = forward => {}
                _ = cut_off => {}
            }
            host
        });
        tokio::spawn(async move {
            while let Some(bytes) = to_host.recv().await {
                if to_client.write_all(&bytes).await.is_err() {
                    break;
                }
            }
        });
        let serving = tokio::spawn(async move { session(Vec::new(), &mut inbound, &outbound, app).await });
        let (mut sender, connection) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(client_io)).await.expect("handshake");
        let connection = tokio::spawn(connection);
        let request = hyper::Request::get("http://agent/stream").body(http_body_util::Empty::<Bytes>::new()).expect("request");
        let response = sender.send_request(request).await.expect("the stream's headers");
        assert!(response.status().is_success());
        // The host leaves with the stream open, without a word: the port reads EOF.
        let _ = cut.send(());
        let host = up.await.expect("bridge");
        for _ in 0..2 {
            host.send(Inbound::HostGone).await.expect("port open");
        }
        let ended = tokio::time::timeout(Duration::from_secs(5), serving).await;
        assert!(ended.is_ok(), "the session waited for the open stream instead of going back to accept");
        drop((sender, response, connection));
    }
}
