//! HTTP between an inspected guest connection and its server, HTTP/1.1 or HTTP/2 on
//! each side as ALPN chose: every request must be for the host the TLS was for, gets
//! the host's rule applied, and goes on over the one upstream connection; the answer
//! streams back as it came.

use super::conn;
use super::flow::{shown, Flow};
use super::scanned::Scanned;
use super::transforms;
use super::tunnel::Tunnel;
use super::upstream::Http;
use bytes::Bytes;
use http::header::{HeaderValue, CONNECTION, HOST};
use http::{Request, Response, StatusCode, Uri, Version};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};

type Answer = Response<Either<Incoming, Full<Bytes>>>;

/// A request's deadline for the server's answer to begin (its body then streams
/// without one, as a download may take long).
const ANSWER_WAIT: Duration = Duration::from_secs(300);
/// How long a guest has to send a request's head, and how many headers it may have:
/// bounded like any other flow's buffers.
const HEAD_WAIT: Duration = Duration::from_secs(30);
const HEADERS_MAX: usize = 128;
/// Requests in flight at once on one HTTP/2 connection from the guest (over an
/// HTTP/1.1 server, whose one connection serves one request at a time: 1).
const STREAMS_MAX: u32 = 8;
/// How often an idle HTTP/2 guest is pinged, and how long it has to answer.
const PING_EVERY: Duration = Duration::from_secs(30);
const PING_WAIT: Duration = Duration::from_secs(20);

/// Serves the guest's requests (in its version) until it goes away, each sent on to
/// `host` (in the server's version) by `forward`.
pub async fn relay<G, U>((guest, guest_speaks): (G, Http), (upstream, server_speaks): (U, Http), host: &str, flow: Arc<Flow>) -> Result<(), String>
where
    G: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    U: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, mut upstream) = conn::connect(upstream, server_speaks, host).await?;
    let (ending_host, ending_flow) = (host.to_string(), flow.clone());
    let sender = Arc::new(sender);
    let host = Arc::new(host.to_string());
    let tunnel = Arc::new(Tunnel::default());
    let upgrades = tunnel.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let (sender, host, flow, tunnel) = (sender.clone(), host.clone(), flow.clone(), upgrades.clone());
        async move {
            let mut answer = forward(req, &sender, &host, &flow, &tunnel).await;
            // The guest's own version, and none of HTTP/1's connection headers in HTTP/2.
            *answer.version_mut() = match guest_speaks {
                Http::H1 => Version::HTTP_11,
                Http::H2 => {
                    for name in CONNECTION_HEADERS {
                        answer.headers_mut().remove(*name);
                    }
                    Version::HTTP_2
                }
            };
            Ok::<_, std::convert::Infallible>(answer)
        }
    });
    let guest = TokioIo::new(guest);
    // Serves until the guest goes away (mid-request is not a refusal), or, once the
    // server's connection has ended, winds the guest's down (HTTP/2's GOAWAY, HTTP/1's
    // close after the request in hand) so its client opens a new one. A server
    // connection that ended by upgrading is not dead: the tunnel carries on.
    macro_rules! serve {
        ($connection:expr) => {{
            let connection = $connection;
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                failed = upstream.ended() => {
                    // A server that insisted on a client certificate may end the
                    // connection before the guest's first request reaches it.
                    if let Some(line) = failed.and_then(|e| ending_flow.client_certificate.failure(&ending_host, format_args!("ended the connection ({e})"))) {
                        ending_flow.refuse(&ending_host, line);
                    }
                    if !tunnel.is_open() {
                        connection.as_mut().graceful_shutdown();
                    }
                    let _ = connection.await;
                }
            }
        }};
    }
    match guest_speaks {
        Http::H1 => serve!(hyper::server::conn::http1::Builder::new()
            .preserve_header_case(true)
            .timer(TokioTimer::new())
            .header_read_timeout(HEAD_WAIT)
            .max_buf_size(conn::HEAD_MAX)
            .max_headers(HEADERS_MAX)
            .serve_connection(guest, service)
            .with_upgrades()),
        // Small windows and few streams: what the guest sends ahead is what hutch holds.
        Http::H2 => serve!(hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .max_header_list_size(conn::HEAD_MAX as u32)
            .max_concurrent_streams(if server_speaks == Http::H1 { 1 } else { STREAMS_MAX })
            .initial_stream_window_size(64 * 1024)
            .initial_connection_window_size(256 * 1024)
            .max_send_buf_size(64 * 1024)
            .keep_alive_interval(PING_EVERY)
            .keep_alive_timeout(PING_WAIT)
            .serve_connection(guest, service)),
    }
    tunnel.closed().await;
    Ok(())
}

/// HTTP/1's headers about the connection, which HTTP/2 forbids.
const CONNECTION_HEADERS: &[&str] = &["connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"];

async fn forward(mut req: Request<Incoming>, sender: &conn::Sender, host: &str, flow: &Flow, tunnel: &Tunnel) -> Answer {
    if let Err(asked) = for_host(&req, host) {
        flow.refuse(host, format!("a request over TLS for {host} named the host {asked}; hutch applies a host's rule only to requests for that host"));
        return refusal(StatusCode::MISDIRECTED_REQUEST, format!("hutch: this connection is for {host}; a request for another host needs a connection of its own\n"));
    }
    // Methods that echo the request back (with the rule's headers in it), or open a tunnel.
    if ["TRACE", "TRACK", "CONNECT"].iter().any(|m| req.method().as_str().eq_ignore_ascii_case(m)) {
        flow.refuse(host, format!("a {} request to {host}; hutch does not send it with the rule's headers", req.method()));
        return refusal(StatusCode::METHOD_NOT_ALLOWED, format!("hutch: {} is not sent to a host with a network rule\n", req.method()));
    }
    // An upgrade (a WebSocket) goes through as HTTP/1.1 on both sides, once per flow.
    let upgrade = req.headers().contains_key(http::header::UPGRADE);
    if upgrade && sender.speaks() == Http::H2 {
        flow.refuse(host, format!("the guest asked to upgrade the connection (a WebSocket?), which hutch relays over HTTP/1.1 only; {host} speaks HTTP/2"));
        return refusal(StatusCode::NOT_IMPLEMENTED, format!("hutch: {host} speaks HTTP/2 here, and hutch relays connection upgrades (WebSockets) to a host with a network rule over HTTP/1.1 only\n"));
    }
    if upgrade && tunnel.is_open() {
        flow.refuse(host, "the guest asked to upgrade a connection that has upgraded already".into());
        return refusal(StatusCode::NOT_IMPLEMENTED, "hutch: this connection has been upgraded once; open a new one\n".into());
    }
    let guest_side = upgrade.then(|| hyper::upgrade::on(&mut req));
    // The rule in force now: one changed or removed since the connection opened applies.
    let Some(inspector) = flow.current() else {
        flow.refuse(host, format!("{host} no longer has a network rule; the guest is to open a new connection"));
        return refusal(StatusCode::MISDIRECTED_REQUEST, format!("hutch: the network rules changed; open a new connection to {host}\n"));
    };
    if !inspector.transforms.covers(host) {
        flow.refuse(host, format!("{host} no longer has a network rule; the guest is to open a new connection"));
        return refusal(StatusCode::MISDIRECTED_REQUEST, format!("hutch: the network rules changed; open a new connection to {host}\n"));
    }
    let no_rule = std::collections::BTreeMap::new();
    let rule = inspector.transforms.for_host(host).unwrap_or(&no_rule);
    // The request goes to the verified host, by that name, in origin form.
    let origin = match req.uri().path_and_query().map(|p| p.as_str()) {
        Some(p) if p.starts_with('/') || p == "*" => p.to_string(),
        Some(p) => format!("/{p}"),
        None => "/".to_string(),
    };
    match origin.parse::<Uri>() {
        Ok(uri) => *req.uri_mut() = uri,
        Err(_) => return refusal(StatusCode::BAD_REQUEST, "hutch: the request's target is not a path\n".into()),
    }
    let Ok(host_value) = HeaderValue::from_str(host) else {
        return refusal(StatusCode::BAD_REQUEST, "hutch: the host is not a header value\n".into());
    };
    req.headers_mut().insert(HOST, host_value);
    // What the rule sets replaces the guest's own, placeholders and all; then the
    // guest's own placeholders elsewhere.
    for name in rule.keys() {
        req.headers_mut().remove(name.as_str());
    }
    let mut target = req.uri().clone();
    let in_query = match super::fill::fill(&mut target, req.headers_mut(), host, &inspector).await {
        Ok(in_query) => in_query,
        Err(why) => {
            flow.refuse(host, why);
            return placeholder_refused(host);
        }
    };
    *req.uri_mut() = target;
    for (name, template) in rule {
        let value = match transforms::render(template, |secret| inspector.reveal(secret)).await {
            Ok(v) => v,
            Err(why) => {
                // The guest hears only that it failed; the reason is the network log's.
                flow.refuse(host, format!("header {name} of {host}'s rule: {why}"));
                return refusal(StatusCode::BAD_GATEWAY, format!("hutch: the network rule for {host} could not be applied; see the sandbox's network log\n"));
            }
        };
        let Ok(mut value) = HeaderValue::from_str(&value) else {
            flow.refuse(host, format!("header {name} of {host}'s rule: a secret's value holds a byte a header cannot"));
            return refusal(StatusCode::BAD_GATEWAY, format!("hutch: the network rule for {host} could not be applied; see the sandbox's network log\n"));
        };
        value.set_sensitive(true);
        let Ok(name) = http::HeaderName::from_bytes(name.as_bytes()) else { continue };
        req.headers_mut().insert(name, value);
    }
    // The server's version: HTTP/1.1 in origin form with Host, HTTP/2 with the
    // authority in the URI (`:authority`) and no Host.
    match sender.speaks() {
        Http::H1 => *req.version_mut() = Version::HTTP_11,
        Http::H2 => {
            *req.version_mut() = Version::HTTP_2;
            req.headers_mut().remove(HOST);
            for name in CONNECTION_HEADERS {
                req.headers_mut().remove(*name);
            }
            // `OPTIONS *` has no path HTTP/2 can carry with an authority.
            let target = req.uri().path_and_query().map(|p| p.as_str().to_string()).filter(|p| p.starts_with('/'));
            let uri = target.and_then(|path| Uri::builder().scheme("https").authority(host).path_and_query(path).build().ok());
            match uri {
                Some(uri) => *req.uri_mut() = uri,
                None => return refusal(StatusCode::BAD_REQUEST, format!("hutch: this request's target cannot be sent to {host}, which speaks HTTP/2\n")),
            }
        }
    }
    let req = req.map(|body| Scanned::new(body, inspector.scans()));
    let found = req.body().found.clone();
    let sent = tokio::time::timeout(ANSWER_WAIT, sender.send(req)).await;
    if let Some(header) = sent.as_ref().ok().and_then(|r| r.as_ref().ok()).and_then(|answer| super::fill::reflected(answer.headers(), &in_query)) {
        flow.refuse(host, format!("{host}'s answer repeats a secret's value filled into the request's query in its {header} header (a redirect?); the answer was not passed on"));
        return refusal(StatusCode::BAD_GATEWAY, format!("hutch: {host}'s answer repeated a secret in its {header} header, so hutch did not pass it on; see the sandbox's network log\n"));
    }
    match sent {
        Ok(Ok(mut answer)) if answer.status() == StatusCode::SWITCHING_PROTOCOLS => match guest_side {
            Some(guest_side) => {
                tunnel.open(guest_side, hyper::upgrade::on(&mut answer));
                answer.map(Either::Left)
            }
            None => {
                flow.refuse(host, format!("{host} switched protocols on a request that did not ask to"));
                refusal(StatusCode::BAD_GATEWAY, format!("hutch: {host} answered in a protocol the request did not ask for\n"))
            }
        },
        Ok(Ok(answer)) => answer.map(Either::Left),
        Ok(Err(_)) if found.get().is_some() => {
            let form = found.get().map(|f| f.name()).unwrap_or_default();
            flow.refuse(host, format!("the request's body holds a secret's placeholder ({form}); hutch fills placeholders in headers only, so the request was cut off"));
            placeholder_refused(host)
        }
        Ok(Err(e)) if flow.client_certificate.asked() => {
            if let Some(line) = flow.client_certificate.failure(host, format_args!("did not answer the request ({e})")) {
                flow.refuse(host, line);
            }
            refusal(StatusCode::BAD_GATEWAY, format!("hutch: {host} wants a client certificate (mutual TLS), which hutch cannot present on a host it inspects\n"))
        }
        Ok(Err(e)) => {
            flow.refuse(host, format!("{host} did not answer the request: {e}"));
            refusal(StatusCode::BAD_GATEWAY, format!("hutch: {host} did not answer: {e}\n"))
        }
        Err(_) => {
            flow.refuse(host, format!("{host} did not begin its answer within {} s", ANSWER_WAIT.as_secs()));
            refusal(StatusCode::GATEWAY_TIMEOUT, format!("hutch: {host} did not answer within {} s\n", ANSWER_WAIT.as_secs()))
        }
    }
}

/// Checks that the request is for `host` on the default port: exactly one Host header
/// naming it (or, in HTTP/2, none and `:authority`), and the URI's authority, if the
/// request has one, naming it too. `Err` holds what it named instead, escaped and cut
/// short for the log.
fn for_host(req: &Request<Incoming>, host: &str) -> Result<(), String> {
    let same = |named: &str| {
        let named = named.to_ascii_lowercase();
        let bare = named.strip_suffix(":443").unwrap_or(&named);
        bare.strip_suffix('.').unwrap_or(bare) == host
    };
    let hosts: Vec<_> = req.headers().get_all(HOST).iter().collect();
    match hosts.as_slice() {
        [one] => {
            let named = one.to_str().map_err(|_| "a Host that is not text".to_string())?;
            if !same(named) {
                return Err(shown(named));
            }
        }
        // HTTP/2 names the host in `:authority` (the URI's), checked below.
        [] if req.version() == Version::HTTP_2 && req.uri().authority().is_some() => {}
        [] => return Err("no Host".into()),
        _ => return Err("more than one Host".into()),
    }
    if let Some(authority) = req.uri().authority() {
        if authority.as_str().contains('@') || !same(authority.as_str()) {
            return Err(shown(authority.as_str()));
        }
    }
    Ok(())
}


fn placeholder_refused(host: &str) -> Answer {
    refusal(StatusCode::FORBIDDEN, format!("hutch: this request to {host} carries a secret's placeholder where hutch does not fill it in; see the sandbox's network log\n"))
}

fn refusal(status: StatusCode, body: String) -> Answer {
    let mut answer = Response::new(Either::Right(Full::new(Bytes::from(body))));
    *answer.status_mut() = status;
    answer.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
    answer.headers_mut().insert(http::header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    answer
}
