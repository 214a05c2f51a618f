//! HTTP/1.1 between an inspected guest connection and its server: every request must
//! be for the host the TLS was for, gets the host's rule applied, and goes on over the
//! one upstream connection; the answer streams back as it came.

use super::gate::Flow;
use super::transforms;
use bytes::Bytes;
use http::header::{HeaderValue, CONNECTION, HOST};
use http::{Request, Response, StatusCode};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};

type Answer = Response<Either<Incoming, Full<Bytes>>>;

/// A request's deadline for the server's answer to begin (its body then streams
/// without one, as a download may take long).
const ANSWER_WAIT: std::time::Duration = std::time::Duration::from_secs(300);

pub async fn relay<G, U>(guest: G, upstream: U, host: &str, flow: Arc<Flow>) -> Result<(), String>
where
    G: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    U: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::Builder::new()
        .preserve_header_case(true)
        .handshake::<_, Incoming>(TokioIo::new(upstream))
        .await
        .map_err(|e| format!("HTTP with {host} could not start: {e}"))?;
    let upstream_task = tokio::spawn(connection);
    let sender = Arc::new(tokio::sync::Mutex::new(sender));
    let host = Arc::new(host.to_string());
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let (sender, host, flow) = (sender.clone(), host.clone(), flow.clone());
        async move { Ok::<_, std::convert::Infallible>(forward(req, &sender, &host, &flow).await) }
    });
    let served = hyper::server::conn::http1::Builder::new().preserve_header_case(true).serve_connection(TokioIo::new(guest), service).await;
    upstream_task.abort();
    // A guest that goes away mid-request is not a refusal.
    let _ = served;
    Ok(())
}

async fn forward(mut req: Request<Incoming>, sender: &tokio::sync::Mutex<hyper::client::conn::http1::SendRequest<Incoming>>, host: &str, flow: &Flow) -> Answer {
    if !for_host(&req, host) {
        let asked = req.headers().get(HOST).and_then(|h| h.to_str().ok()).unwrap_or("none").to_string();
        flow.refuse(host, format!("a request over TLS for {host} named the host `{asked}`; hutch applies a host's rule only to requests for that host"));
        return refusal(StatusCode::MISDIRECTED_REQUEST, format!("hutch: this connection is for {host}; a request for another host needs a connection of its own\n"));
    }
    if req.headers().contains_key(http::header::UPGRADE) {
        flow.refuse(host, "the guest asked to upgrade the connection (a WebSocket?); hutch does not relay upgrades on inspected hosts yet".into());
        return refusal(StatusCode::NOT_IMPLEMENTED, format!("hutch: connection upgrades (WebSockets) to {host} are not relayed while {host} has a network rule\n"));
    }
    if let Some(rule) = flow.inspector.transforms.for_host(host) {
        for (name, template) in rule {
            let inspector = &flow.inspector;
            let value = match transforms::render(template, |secret| inspector.reveal(secret)).await {
                Ok(v) => v,
                Err(why) => {
                    flow.refuse(host, format!("header {name} of {host}'s rule: {why}"));
                    return refusal(StatusCode::BAD_GATEWAY, format!("hutch: the network rule for {host} could not be applied: {why}\n"));
                }
            };
            let Ok(mut value) = HeaderValue::from_str(&value) else {
                flow.refuse(host, format!("header {name} of {host}'s rule: a secret's value holds a byte a header cannot"));
                return refusal(StatusCode::BAD_GATEWAY, format!("hutch: the network rule for {host} could not be applied: a secret's value cannot be sent in header {name}\n"));
            };
            value.set_sensitive(true);
            let Ok(name) = http::HeaderName::from_bytes(name.as_bytes()) else { continue };
            req.headers_mut().insert(name, value);
        }
    }
    let sent = async {
        let mut sender = sender.lock().await;
        sender.ready().await?;
        sender.send_request(req).await
    };
    match tokio::time::timeout(ANSWER_WAIT, sent).await {
        Ok(Ok(answer)) => answer.map(Either::Left),
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

/// Whether the request's Host (or absolute URI) names `host`, on the default port.
fn for_host(req: &Request<Incoming>, host: &str) -> bool {
    let named = match req.uri().authority() {
        Some(authority) => Some(authority.as_str().to_string()),
        None => req.headers().get(HOST).and_then(|h| h.to_str().ok()).map(str::to_string),
    };
    let Some(named) = named else { return false };
    let named = named.to_ascii_lowercase();
    let bare = named.strip_suffix(":443").unwrap_or(&named);
    bare.strip_suffix('.').unwrap_or(bare) == host
}

fn refusal(status: StatusCode, body: String) -> Answer {
    let mut answer = Response::new(Either::Right(Full::new(Bytes::from(body))));
    *answer.status_mut() = status;
    answer.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
    answer.headers_mut().insert(http::header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    answer
}
