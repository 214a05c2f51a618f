//! A forward proxy on loopback that connects only to public addresses, for the
//! server's own outbound requests on a tenant's behalf (template builds pulling an
//! image). A registry's host name may resolve to the server's network, and a registry
//! may redirect a blob download anywhere (a cloud's metadata service among them); the
//! HTTP client follows both. Sent through this proxy, every connection is decided here,
//! on the addresses actually dialled, before a packet leaves: public ones (`ranges`)
//! or a `host:port` the operator listed, nothing else.
//!
//! It speaks the two forms an HTTP client uses with a proxy: `CONNECT host:port` (for
//! https; the bytes inside the tunnel are the client's TLS) and absolute-form requests
//! (`GET http://host:port/path`, plain http). A plain-http connection carries one
//! bodiless GET or HEAD and its answer, then closes: a second request, whatever its
//! host, needs a new connection and is checked again. A relayed direction silent for
//! `IDLE` ends the connection, so a destination that never closes holds nothing.

use crate::ranges::{Group, HostAddrs};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A request head longer than this is refused.
const MAX_HEAD: usize = 16 * 1024;
/// How long a client may take to send its request head.
const HEAD_WAIT: Duration = Duration::from_secs(30);
/// How long resolving and connecting may take, all addresses together.
const DIAL_WAIT: Duration = Duration::from_secs(15);
/// How long a relayed direction may go without a byte (the registry client's own read
/// timeout is 60 s).
const IDLE: Duration = Duration::from_secs(90);

/// Why a destination was refused or could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error("{dest} resolves to {ip}, which is not a public address (it is this machine's, or on a private, link-local or reserved network); outbound requests for tenants reach public addresses only (an operator may list a registry with --insecure-registry HOST:PORT)")]
    NotPublic { dest: String, ip: IpAddr },
    #[error("{dest} could not be resolved: {reason}")]
    Unresolvable { dest: String, reason: String },
}

/// The addresses of `host:port` to dial: all of them public, or `host:port` is one the
/// operator listed. Any non-public address refuses the name (a name with one private
/// address among public ones is a rebinding attempt as likely as not).
pub async fn resolve_public(host: &str, port: u16, listed: &[String]) -> Result<Vec<SocketAddr>, Refused> {
    let dest = if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
    let addrs: Vec<SocketAddr> = match tokio::time::timeout(DIAL_WAIT, tokio::net::lookup_host((host, port))).await {
        Ok(Ok(found)) => found.collect(),
        Ok(Err(e)) => return Err(Refused::Unresolvable { dest, reason: e.to_string() }),
        Err(_) => return Err(Refused::Unresolvable { dest, reason: format!("no answer within {} s", DIAL_WAIT.as_secs()) }),
    };
    if addrs.is_empty() {
        return Err(Refused::Unresolvable { dest, reason: "no addresses".into() });
    }
    if is_listed(listed, host, port) {
        return Ok(addrs);
    }
    let this_machine = HostAddrs::of_this_machine();
    match addrs.iter().find(|a| !Group::Public.contains(a.ip(), &this_machine)) {
        Some(private) => Err(Refused::NotPublic { dest, ip: private.ip() }),
        None => Ok(addrs),
    }
}

/// Whether the operator listed `host:port`: an entry `HOST:PORT` for that port, or a
/// bare `HOST` for any (host names compared case-insensitively).
fn is_listed(listed: &[String], host: &str, port: u16) -> bool {
    listed.iter().filter_map(|l| split_authority(l, 0).ok()).any(|(h, p)| h.eq_ignore_ascii_case(host) && (p == 0 || p == port))
}

/// The running proxy; it stops when dropped.
pub struct PublicProxy {
    addr: SocketAddr,
    accept: tokio::task::JoinHandle<()>,
}

impl PublicProxy {
    /// Listens on a free loopback port; `listed` are `host:port`s allowed whatever
    /// their addresses.
    /// Call within a tokio runtime.
    pub fn start(listed: Vec<String>) -> std::io::Result<PublicProxy> {
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
        listener.set_nonblocking(true)?;
        let listener = TcpListener::from_std(listener)?;
        let addr = listener.local_addr()?;
        let listed = std::sync::Arc::new(listed);
        let accept = tokio::spawn(async move {
            loop {
                let client = match listener.accept().await {
                    Ok((client, _)) => client,
                    Err(e) => {
                        // Out of descriptors, say: back off instead of spinning on it.
                        tracing::warn!("the outbound proxy could not accept a connection: {e}");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                };
                let listed = listed.clone();
                tokio::spawn(async move {
                    match serve(client, &listed).await {
                        Err(ServeError::Refused(e)) => tracing::warn!("outbound connection refused: {e}"),
                        Err(e) => tracing::debug!("outbound proxy connection ended: {e}"),
                        Ok(()) => {}
                    }
                });
            }
        });
        Ok(PublicProxy { addr, accept })
    }

    /// `http://127.0.0.1:PORT`, for an HTTP client's proxy settings (http and https).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for PublicProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

#[derive(Debug, thiserror::Error)]
enum ServeError {
    #[error("{0}")]
    Refused(#[from] Refused),
    #[error("a bad proxy request: {0}")]
    Bad(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// A reply the proxy makes itself, then closes. Refusals are 502s, not 403s: to the
/// client the registry was not reached, which is not a credentials problem.
async fn reply(client: &mut TcpStream, status: &str, body: &str) {
    let reply = format!("HTTP/1.1 {status}\r\nConnection: close\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}", body.len());
    let _ = tokio::time::timeout(IDLE, client.write_all(reply.as_bytes())).await;
}

/// One client connection, for one destination: a CONNECT tunnel, or one plain-http
/// request and its response.
async fn serve(mut client: TcpStream, listed: &[String]) -> Result<(), ServeError> {
    let read = match tokio::time::timeout(HEAD_WAIT, read_head(&mut client)).await {
        Ok(read) => read,
        Err(_) => Err(ServeError::Bad(format!("no request head within {} s", HEAD_WAIT.as_secs()))),
    };
    let request = match read.and_then(|(head, rest)| parse(&head).map(|r| (r, rest))) {
        Ok(r) => r,
        Err(e) => {
            reply(&mut client, "400 Bad Request", &format!("hutch's outbound proxy: {e}")).await;
            return Err(e);
        }
    };
    let (request, rest) = request;
    let dialled = match tokio::time::timeout(DIAL_WAIT, dial(&request.host, request.port, listed)).await {
        Ok(d) => d,
        Err(_) => Err(ServeError::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no connection within {} s", DIAL_WAIT.as_secs())))),
    };
    let mut upstream = match dialled {
        Ok(s) => s,
        Err(e) => {
            reply(&mut client, "502 Bad Gateway", &format!("hutch's outbound proxy refused the connection: {e}")).await;
            return Err(e);
        }
    };
    match request.forward {
        // A tunnel: the client's TLS runs inside it, both ways.
        None => {
            client.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n").await?;
            upstream.write_all(&rest).await?;
            relay(client, upstream, true).await;
        }
        // One bodiless request (`parse` takes no other); whatever else the client sends
        // on this connection goes nowhere, so a request for another host cannot ride it.
        Some(origin_form_head) => {
            upstream.write_all(&origin_form_head).await?;
            relay(client, upstream, false).await;
        }
    }
    Ok(())
}

/// Copies upstream → client until the upstream ends, and client → upstream while it
/// lasts if `both_ways`; a direction silent for `IDLE` ends it, so a destination that
/// never closes holds nothing for long.
async fn relay(client: TcpStream, upstream: TcpStream, both_ways: bool) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut upstream_read, mut upstream_write) = upstream.into_split();
    let down = pump(&mut upstream_read, &mut client_write);
    let up = async {
        if both_ways {
            let _ = pump(&mut client_read, &mut upstream_write).await;
            let _ = upstream_write.shutdown().await;
        }
        // The client has finished sending: the answer may still be coming.
        std::future::pending::<()>().await
    };
    tokio::select! {
        _ = down => {}
        _ = up => {}
    }
}

/// Copies `from` to `to` until `from` ends, an error, or `IDLE` without progress.
async fn pump(from: &mut (impl tokio::io::AsyncRead + Unpin), to: &mut (impl tokio::io::AsyncWrite + Unpin)) -> std::io::Result<()> {
    let idle = || std::io::Error::new(std::io::ErrorKind::TimedOut, "idle");
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = tokio::time::timeout(IDLE, from.read(&mut buf)).await.map_err(|_| idle())??;
        if n == 0 {
            return Ok(());
        }
        tokio::time::timeout(IDLE, to.write_all(&buf[..n])).await.map_err(|_| idle())??;
    }
}

async fn dial(host: &str, port: u16, listed: &[String]) -> Result<TcpStream, ServeError> {
    let addrs = resolve_public(host, port, listed).await?;
    let mut last = None;
    for addr in addrs {
        match TcpStream::connect(addr).await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(ServeError::Io(last.unwrap_or_else(|| std::io::Error::other("no address to connect to"))))
}

/// The request head (through its blank line) and whatever followed it in the same reads.
async fn read_head(client: &mut TcpStream) -> Result<(Vec<u8>, Vec<u8>), ServeError> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(end + 4);
            return Ok((buf, rest));
        }
        if buf.len() > MAX_HEAD {
            return Err(ServeError::Bad(format!("a request head over {MAX_HEAD} bytes")));
        }
        let n = client.read(&mut chunk).await?;
        if n == 0 {
            return Err(ServeError::Bad("the client left before its request head ended".into()));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

struct ProxyRequest {
    host: String,
    port: u16,
    /// For a plain-http request, its head rewritten for the origin server; None for a
    /// CONNECT.
    forward: Option<Vec<u8>>,
}

fn parse(head: &[u8]) -> Result<ProxyRequest, ServeError> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err(ServeError::Bad("an incomplete request head".into())),
        Err(e) => return Err(ServeError::Bad(e.to_string())),
    }
    let (method, target) = (req.method.unwrap_or(""), req.path.unwrap_or(""));
    if method == "CONNECT" {
        let (host, port) = split_authority(target, 443)?;
        return Ok(ProxyRequest { host, port, forward: None });
    }
    let Some(after_scheme) = target.strip_prefix("http://") else {
        return Err(ServeError::Bad(format!("'{target}' is not an absolute http:// URL or a CONNECT")));
    };
    if method != "GET" && method != "HEAD" {
        return Err(ServeError::Bad(format!("plain-http {method} is not forwarded (GET and HEAD are)")));
    }
    let header = |name: &str| req.headers.iter().find(|h| h.name.eq_ignore_ascii_case(name)).map(|h| String::from_utf8_lossy(h.value).trim().to_string());
    if header("transfer-encoding").is_some() || header("content-length").is_some_and(|l| l != "0") {
        return Err(ServeError::Bad("a plain-http request with a body is not forwarded".into()));
    }
    let (authority, path) = match after_scheme.find(['/', '?']) {
        Some(i) if after_scheme[i..].starts_with('?') => (&after_scheme[..i], format!("/{}", &after_scheme[i..])),
        Some(i) => (&after_scheme[..i], after_scheme[i..].to_string()),
        None => (after_scheme, "/".to_string()),
    };
    if authority.contains('@') {
        return Err(ServeError::Bad("credentials in a proxied URL are not forwarded".into()));
    }
    let (host, port) = split_authority(authority, 80)?;
    // Hop-by-hop headers stay here: the fixed ones and any the client's Connection names.
    let mut hop_by_hop: Vec<String> = ["connection", "proxy-connection", "keep-alive", "proxy-authorization", "te", "trailer", "upgrade", "host"].map(String::from).to_vec();
    hop_by_hop.extend(header("connection").into_iter().flat_map(|v| v.split(',').map(|n| n.trim().to_ascii_lowercase()).collect::<Vec<_>>()));
    let mut forward = format!("{method} {path} HTTP/1.1\r\nHost: {authority}\r\n").into_bytes();
    for h in req.headers.iter().filter(|h| !hop_by_hop.contains(&h.name.to_ascii_lowercase())) {
        forward.extend_from_slice(h.name.as_bytes());
        forward.extend_from_slice(b": ");
        forward.extend_from_slice(h.value);
        forward.extend_from_slice(b"\r\n");
    }
    forward.extend_from_slice(b"Connection: close\r\n\r\n");
    Ok(ProxyRequest { host, port, forward: Some(forward) })
}

/// `host[:port]` or `[v6][:port]` as (host, port), `default_port` when none is given;
/// None if it is neither. Also how a registry name (`reg.example:5000`) reads.
pub fn host_and_port(authority: &str, default_port: u16) -> Option<(String, u16)> {
    let (host, port) = match authority.strip_prefix('[') {
        Some(rest) => {
            let (host, after) = rest.split_once(']')?;
            (host, after.strip_prefix(':'))
        }
        None => match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        },
    };
    let port = match port {
        Some(p) => p.parse().ok()?,
        None => default_port,
    };
    (!host.is_empty()).then(|| (host.to_string(), port))
}

fn split_authority(authority: &str, default_port: u16) -> Result<(String, u16), ServeError> {
    host_and_port(authority, default_port).ok_or_else(|| ServeError::Bad(format!("'{authority}' is not host:port")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener that records whether anything connected to it.
    async fn target(ip: &str) -> (TcpListener, String) {
        let l = TcpListener::bind((ip, 0)).await.expect("bind a loopback target");
        let addr = l.local_addr().expect("addr").to_string();
        (l, addr)
    }

    async fn ask(proxy: &PublicProxy, request: String) -> String {
        let mut s = TcpStream::connect(proxy.addr).await.expect("connect to the proxy");
        s.write_all(request.as_bytes()).await.expect("send");
        let mut reply = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut reply)).await.expect("a reply in time").expect("read");
        String::from_utf8_lossy(&reply).into_owned()
    }

    /// Whether no connection is waiting on `l` (the proxy answers only after deciding,
    /// so one it made would be queued by then).
    fn nothing_connected(l: &TcpListener) -> bool {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        !matches!(l.poll_accept(&mut cx), std::task::Poll::Ready(Ok(_)))
    }

    #[tokio::test]
    async fn loopback_and_private_destinations_are_refused_before_connecting() {
        let (listener, addr) = target("127.0.0.1").await;
        let proxy = PublicProxy::start(vec![]).expect("proxy");
        let tunnel = ask(&proxy, format!("CONNECT {addr} HTTP/1.1\r\nHost: {addr}\r\n\r\n")).await;
        assert!(tunnel.starts_with("HTTP/1.1 502"), "{tunnel}");
        assert!(tunnel.contains("resolves to 127.0.0.1"), "{tunnel}");
        let port = addr.rsplit_once(':').expect("port").1;
        let plain = ask(&proxy, format!("GET http://localhost:{port}/v2/ HTTP/1.1\r\nHost: localhost:{port}\r\n\r\n")).await;
        assert!(plain.starts_with("HTTP/1.1 502") && plain.contains("not a public address"), "a name resolving to loopback is refused too: {plain}");
        assert!(nothing_connected(&listener), "the refused destination saw no connection");
    }

    #[tokio::test]
    async fn a_listed_destination_is_forwarded_with_connection_close() {
        let (listener, addr) = target("127.0.0.1").await;
        let proxy = PublicProxy::start(vec![addr.clone()]).expect("proxy");
        let origin = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            let mut buf = vec![0u8; 4096];
            let n = s.read(&mut buf).await.expect("read");
            s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok").await.expect("write");
            String::from_utf8_lossy(&buf[..n]).into_owned()
        });
        // A second request pipelined on the same connection (for another host) goes nowhere.
        let reply = ask(
            &proxy,
            format!("GET http://{addr}/v2/?x=1 HTTP/1.1\r\nHost: elsewhere\r\nProxy-Connection: keep-alive\r\nConnection: X-Drop\r\nX-Drop: 1\r\nAccept: */*\r\n\r\nGET http://10.9.9.9/ HTTP/1.1\r\n\r\n"),
        )
        .await;
        assert!(reply.starts_with("HTTP/1.1 200") && reply.ends_with("ok"), "{reply}");
        let seen = origin.await.expect("origin");
        assert!(seen.starts_with(&format!("GET /v2/?x=1 HTTP/1.1\r\nHost: {addr}\r\n")), "origin-form request line, the URL's host: {seen}");
        assert!(seen.contains("Accept: */*\r\n") && seen.ends_with("Connection: close\r\n\r\n"), "{seen}");
        let lower = seen.to_ascii_lowercase();
        assert!(!lower.contains("proxy-connection") && !lower.contains("x-drop") && !lower.contains("elsewhere") && !seen.contains("10.9.9.9"), "{seen}");
    }

    #[tokio::test]
    async fn bad_requests_get_a_400() {
        let proxy = PublicProxy::start(vec![]).expect("proxy");
        for bad in [
            "GET /relative HTTP/1.1\r\nHost: x\r\n\r\n",
            "POST http://127.0.0.1:1/ HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi",
            "GET http://127.0.0.1:1/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
            "GET http://user:pw@127.0.0.1:1/ HTTP/1.1\r\n\r\n",
        ] {
            let reply = ask(&proxy, bad.into()).await;
            assert!(reply.starts_with("HTTP/1.1 400"), "{bad:?}: {reply}");
        }
    }

    #[test]
    fn listed_entries_match_by_host_and_port() {
        let listed = vec!["Reg.Internal:5000".to_string(), "10.0.0.5".to_string(), "[fd00::1]:443".to_string()];
        assert!(is_listed(&listed, "reg.internal", 5000));
        assert!(!is_listed(&listed, "reg.internal", 80), "a listed port is that port only");
        assert!(is_listed(&listed, "10.0.0.5", 80) && is_listed(&listed, "10.0.0.5", 443), "a bare host: any port");
        assert!(is_listed(&listed, "fd00::1", 443) && !is_listed(&listed, "fd00::2", 443));
    }

    #[test]
    fn authorities_split_with_default_ports() {
        assert_eq!(split_authority("example.com", 443).expect("ok"), ("example.com".into(), 443));
        assert_eq!(split_authority("example.com:5000", 443).expect("ok"), ("example.com".into(), 5000));
        assert_eq!(split_authority("[::1]:8080", 80).expect("ok"), ("::1".into(), 8080));
        assert_eq!(split_authority("[::1]", 80).expect("ok"), ("::1".into(), 80));
        assert!(split_authority(":80", 80).is_err());
        assert!(split_authority("h:notaport", 80).is_err());
        // Registry names, as the image puller reads them.
        assert_eq!(host_and_port("ghcr.io", 443), Some(("ghcr.io".into(), 443)));
        assert_eq!(host_and_port("registry.example:5000", 443), Some(("registry.example".into(), 5000)));
        assert_eq!(host_and_port("[fd00::1]:5000", 443), Some(("fd00::1".into(), 5000)));
        assert_eq!(host_and_port("[fd00::1]", 443), Some(("fd00::1".into(), 443)));
    }
}
