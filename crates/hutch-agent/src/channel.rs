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
    /// A read saw EOF: the driver thinks no host is connected (it can lag behind a
    /// connect; see `next_data`).
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

/// What the port brings a running session.
enum Next {
    Data(Bytes),
    /// The port threads ended.
    Closed,
    /// A new host connected: these bytes start with its opening line.
    NewHost(Bytes),
}

/// The next bytes from the session's host. An EOF read ("host gone") is no proof the
/// host left: the driver learns of a connect from a control message that may be handled
/// after the host's first bytes were read (its hello, after a restore, an adoption, or
/// on a busy guest), and until then every read sees EOF, for as long as that takes.
/// Ending the session on EOFs, however many, left such a host talking to an agent back
/// in `accept`, which drops HTTP/2: every request hung (found killing a server mid-pause
/// under load). So EOFs end nothing. A host that really left is followed by the next
/// one, which opens with a host line: bytes opening with one after an EOF end the
/// session; any other bytes are the same host's. Until the next host, a session whose
/// host left waits, holding nothing the next one needs.
async fn next_data(inbound: &mut mpsc::Receiver<Inbound>) -> Next {
    let mut after_eof = false;
    loop {
        match inbound.recv().await {
            None => return Next::Closed,
            Some(Inbound::HostGone) => after_eof = true,
            Some(Inbound::Data(d)) if after_eof && opens_host_line(&d) => return Next::NewHost(d),
            Some(Inbound::Data(d)) => return Next::Data(d),
        }
    }
}

/// One HTTP/2 session, until the next host comes (see `next_data`) or HTTP/2 ends it.
/// Returns the opening bytes of the next host, if one came.
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
                    Next::Closed => break,
                    Next::NewHost(d) => {
                        next_host = Some(d);
                        break;
                    }
                }
            }
        }
        // The host was replaced: HTTP/2 sees EOF and ends the session.
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

    /// A session on a port whose host is an HTTP/2 client, and the port's sender to
    /// put in what the client does not (EOF reads, the next host's bytes).
    struct Bridged {
        port: mpsc::Sender<Inbound>,
        client: hyper::client::conn::http2::SendRequest<http_body_util::Empty<Bytes>>,
        serving: tokio::task::JoinHandle<Option<Bytes>>,
        /// Cuts the client off the port (its socket closed), without a word.
        cut: tokio::sync::oneshot::Sender<()>,
    }

    async fn bridged(app: axum::Router) -> Bridged {
        let (host, mut inbound, outbound, mut to_host) = port();
        let (client_io, bridge) = tokio::io::duplex(1 << 16);
        let (mut from_client, mut to_client) = tokio::io::split(bridge);
        let (cut, cut_off) = tokio::sync::oneshot::channel::<()>();
        let port = host.clone();
        tokio::spawn(async move {
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
        });
        tokio::spawn(async move {
            while let Some(bytes) = to_host.recv().await {
                if to_client.write_all(&bytes).await.is_err() {
                    break;
                }
            }
        });
        let serving = tokio::spawn(async move { session(Vec::new(), &mut inbound, &outbound, app).await });
        let (client, connection) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(client_io)).await.expect("handshake");
        tokio::spawn(connection);
        Bridged { port, client, serving, cut }
    }

    fn get(path: &str) -> hyper::Request<http_body_util::Empty<Bytes>> {
        hyper::Request::get(format!("http://agent{path}")).body(http_body_util::Empty::new()).expect("request")
    }

    #[tokio::test]
    async fn eof_reads_do_not_end_a_session_whose_host_is_still_there() {
        // After a restore or an adoption the driver may read EOF for a while after the
        // host's hello, until it handles the connect: the host is there and is served.
        let app = axum::Router::new().route("/health", axum::routing::get(|| async { "ok" }));
        let mut b = bridged(app).await;
        for _ in 0..5 {
            b.port.send(Inbound::HostGone).await.expect("port open");
        }
        let answered = tokio::time::timeout(Duration::from_secs(5), b.client.send_request(get("/health"))).await;
        let response = answered.expect("the request was not answered after EOF reads").expect("a response");
        assert!(response.status().is_success());
        assert!(!b.serving.is_finished(), "the session ended");
    }

    #[tokio::test]
    async fn a_session_ends_when_the_next_host_comes_even_with_a_stream_open() {
        // A response that never ends, like a command's output stream: a line every 10 ms.
        let ticks = || async {
            let ticks = futures::stream::unfold(0u64, |n| async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                Some((Ok::<_, std::io::Error>(Bytes::from(format!("tick {n}\n"))), n + 1))
            });
            axum::body::Body::from_stream(ticks)
        };
        let mut b = bridged(axum::Router::new().route("/stream", axum::routing::get(ticks))).await;
        let response = b.client.send_request(get("/stream")).await.expect("the stream's headers");
        assert!(response.status().is_success());
        // The host leaves with the stream open, without a word: the port reads EOF, and
        // the next host opens with its hello.
        let _ = b.cut.send(());
        for _ in 0..2 {
            b.port.send(Inbound::HostGone).await.expect("port open");
        }
        let mut next = hello_line(11);
        next.extend_from_slice(b"PRI *");
        b.port.send(Inbound::Data(Bytes::from(next.clone()))).await.expect("port open");
        let ended = tokio::time::timeout(Duration::from_secs(5), b.serving).await;
        let carried = ended.expect("the session waited for the open stream instead of going back to accept").expect("session ran");
        assert_eq!(carried.as_deref(), Some(next.as_slice()), "the next host's opening bytes were not handed on");
        drop(response);
    }
}
