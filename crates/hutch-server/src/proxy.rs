//! The data proxy: requests for a sandbox's port go to its agent over the agent
//! channel. 49983 is the agent's envd API, forwarded as requests on the HTTP/2 agent
//! connection. Any other port is a TCP tunnel into the guest carrying HTTP/1.1 (with
//! WebSocket and other upgrades), so a server started in the sandbox is reachable.

use crate::app::AppState;
use crate::error::ProxyError;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;

pub const ENVD_PORT: u16 = 49983;

/// Upgraded (WebSocket) connections relayed at once, all sandboxes together.
const MAX_SPLICES: usize = 1024;
static SPLICES: std::sync::LazyLock<std::sync::Arc<tokio::sync::Semaphore>> =
    std::sync::LazyLock::new(|| std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_SPLICES)));

/// Agent endpoints only hutch itself may call (over the agent socket): `/init` sets the
/// sandbox's access token and environment, `/clock` steps the guest clock, `/shutdown`
/// powers it off, `/build/*` serve template builds. The proxy refuses them, as E2B's
/// proxy refuses envd's internal endpoints.
const INTERNAL: &[&str] = &["/init", "/clock", "/shutdown", "/sync", "/build/copy", "/build/freeze", "/build/thaw"];

pub struct Target {
    pub sandbox: String,
    pub port: u16,
}

/// The sandbox and port a request is for, if it is a data-plane request.
pub fn target(req: &Request, domain: Option<&str>) -> Option<Target> {
    let h = req.headers();
    if let Some(id) = h.get("e2b-sandbox-id").and_then(|v| v.to_str().ok()) {
        let port = h.get("e2b-sandbox-port").and_then(|v| v.to_str().ok()).and_then(|p| p.parse().ok()).unwrap_or(ENVD_PORT);
        return Some(Target { sandbox: id.to_string(), port });
    }
    let host = h.get(axum::http::header::HOST).and_then(|v| v.to_str().ok())?;
    let host = host.split(':').next().unwrap_or(host);
    let (label, rest) = host.split_once('.')?;
    if domain.is_some_and(|d| rest != d) {
        return None;
    }
    let (port, id) = label.split_once('-')?;
    let port = port.parse().ok()?;
    (!id.is_empty() && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())).then(|| Target { sandbox: id.to_string(), port })
}

/// The sandbox a signed file URL is for when it names none (a client configured with
/// one sandbox URL for all, `E2B_SANDBOX_URL`, builds such URLs): the one whose access
/// token signs it. None when the request is not a signed `/files` request; a 401 when
/// it is one that no sandbox signed.
pub fn signed_target(req: &Request, manager: &hutch_core::manager::SandboxManager) -> Option<Result<Target, Response>> {
    use hutch_proto::access::{secrets_equal, sign, Operation};
    if req.uri().path() != "/files" {
        return None;
    }
    let op = match *req.method() {
        http::Method::GET | http::Method::HEAD => Operation::Read,
        http::Method::POST | http::Method::PUT => Operation::Write,
        _ => return None,
    };
    let params: std::collections::BTreeMap<String, String> = crate::query::pairs(req.uri().query()).into_iter().collect();
    let refused = |e: ProxyError| Some(Err(e.into_response()));
    let Some(signature) = params.get("signature") else {
        return refused(ProxyError::Unsigned);
    };
    let expiration = match params.get("signature_expiration").filter(|e| !e.is_empty()) {
        Some(e) => match e.parse::<u64>() {
            Ok(e) => Some(e),
            Err(_) => return refused(ProxyError::BadExpiration),
        },
        None => None,
    };
    let (path, user) = (params.get("path").map_or("", String::as_str), params.get("username").map_or("", String::as_str));
    // Every token is tried (no early exit: how long this takes says nothing of which).
    let signed: Vec<String> = manager
        .access_tokens()
        .into_iter()
        .filter(|(_, token)| secrets_equal(signature, &sign(path, op, user, token, expiration)))
        .map(|(id, _)| id)
        .collect();
    match &signed[..] {
        [id] => Some(Ok(Target { sandbox: id.clone(), port: ENVD_PORT })),
        _ => refused(ProxyError::BadSignature),
    }
}

/// Whether `headers` carry `expected` in `header` (compared in constant time).
fn carries(headers: &http::HeaderMap, header: &str, expected: &str) -> bool {
    headers.get(header).and_then(|v| v.to_str().ok()).is_some_and(|given| hutch_proto::access::secrets_equal(given, expected))
}

/// Resumes a paused sandbox that asked for it (E2B's autoResume) for this request,
/// once the request carries what the sandbox would want of it: the access token of a
/// secure sandbox on the envd port, the traffic token of private ports on others. A
/// request that cannot resume it gets the paused answer.
async fn resume_for(state: &AppState, target: &Target, headers: &http::HeaderMap) -> Result<hutch_envd::AgentClient, ProxyError> {
    let Some((envd_token, traffic_token)) = state.manager.auto_resumes(&target.sandbox) else { return Err(ProxyError::Paused { sandbox: target.sandbox.clone() }) };
    let (header, expected) = if target.port == ENVD_PORT { ("x-access-token", envd_token) } else { ("e2b-traffic-access-token", traffic_token) };
    if let Some(expected) = expected {
        if !carries(headers, header, &expected) {
            return Err(ProxyError::ResumeForbidden { sandbox: target.sandbox.clone(), header });
        }
    }
    if let Err(e) = state.manager.resume_for_traffic(&target.sandbox).await {
        tracing::warn!(sandbox = %target.sandbox, "resuming the sandbox for its traffic: {e}");
        return Err(ProxyError::ResumeFailed { sandbox: target.sandbox.clone(), cause: e.into() });
    }
    state.manager.agent(&target.sandbox).map_err(|_| ProxyError::NotFound { sandbox: target.sandbox.clone() })
}

const HOP_BY_HOP: &[&str] = &["connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "host"];

fn hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(&name.as_str())
}

/// Credentials meant for hutch (the control plane's API key, E2B's traffic token) that
/// must never reach a guest, which may log or replay them.
const HUTCH_CREDENTIALS: &[&str] = &["x-api-key", "e2b-traffic-access-token"];

/// Whether a client header is dropped before the request reaches the agent: hop-by-hop
/// headers, hutch's credentials, cookies (the agent uses none, and a browser sends the
/// server's own), and any `Authorization` but envd's `Basic <user>:` (which picks the
/// guest user and carries no secret).
fn withheld_from_agent(name: &HeaderName, value: &http::HeaderValue) -> bool {
    hop_by_hop(name)
        || HUTCH_CREDENTIALS.contains(&name.as_str())
        || name == http::header::COOKIE
        || (name == http::header::AUTHORIZATION && !value.as_bytes().get(..6).is_some_and(|scheme| scheme.eq_ignore_ascii_case(b"basic ")))
}

pub async fn forward(state: &AppState, target: Target, req: Request) -> Response {
    relay(state, target, req).await.into_response()
}

async fn relay(state: &AppState, target: Target, req: Request) -> Result<Response, ProxyError> {
    let agent = match state.manager.agent(&target.sandbox) {
        Ok(agent) => agent,
        Err(hutch_core::manager::ManagerError::Paused(_)) => resume_for(state, &target, req.headers()).await?,
        Err(e @ hutch_core::manager::ManagerError::Failed { .. }) => return Err(ProxyError::Failed { sandbox: target.sandbox, message: e.to_string() }),
        Err(_) => return Err(ProxyError::NotFound { sandbox: target.sandbox }),
    };
    if target.port == ENVD_PORT && INTERNAL.contains(&req.uri().path().trim_end_matches('/')) {
        return Err(ProxyError::Internal { path: req.uri().path().to_string() });
    }
    if target.port != ENVD_PORT {
        if let Some(expected) = state.manager.traffic_token(&target.sandbox) {
            if !carries(req.headers(), "e2b-traffic-access-token", &expected) {
                return Err(ProxyError::PrivatePort { sandbox: target.sandbox });
            }
        }
        let route = state.manager.port_route(&target.sandbox, target.port);
        return tunnel(agent, target, req, route).await;
    }
    let (parts, body) = req.into_parts();
    let path = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let mut builder = http::Request::builder().method(parts.method.clone()).uri(format!("http://agent{path}"));
    for (name, value) in parts.headers.iter().filter(|(n, v)| !withheld_from_agent(n, v)) {
        builder = builder.header(name, value);
    }
    let body = body.map_err(|e| Box::new(e) as hutch_envd::BoxError).boxed_unsync();
    let upstream = builder.body(body).map_err(ProxyError::BadRequest)?;
    match agent.send_answered_within(upstream, ANSWER_WAIT).await {
        Ok(resp) => {
            let (mut parts, body) = resp.into_parts();
            for name in HOP_BY_HOP {
                parts.headers.remove(*name);
            }
            Ok(Response::from_parts(parts, Body::new(body)))
        }
        Err(e @ hutch_envd::AgentError::Timeout { .. }) => {
            tracing::warn!(sandbox = %target.sandbox, "proxying to the agent: {e}");
            Err(ProxyError::AgentTimeout { sandbox: target.sandbox, waited: ANSWER_WAIT })
        }
        Err(e) => {
            tracing::warn!(sandbox = %target.sandbox, "proxying to the agent: {e}");
            Err(ProxyError::NotFound { sandbox: target.sandbox })
        }
    }
}

/// How long the agent may take to start answering a data-plane request once its body
/// is sent (streams then run as long as they do): a guest stuck for this long gets
/// its caller a 504 instead of a request that never ends.
const ANSWER_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// HTTP/1.1 over a tunnel to the guest port (inside TLS for E2B's `httpsPorts`);
/// upgrades (WebSocket) are spliced through. The route's host replaces the client's
/// Host header (E2B's `maskRequestHost`).
async fn tunnel(agent: hutch_envd::AgentClient, target: Target, mut req: Request, route: hutch_net::e2b::PortRoute) -> Result<Response, ProxyError> {
    let closed = || ProxyError::PortClosed { sandbox: target.sandbox.clone(), port: target.port };
    let io = agent.tunnel(target.port).await.map_err(|_| closed())?;
    let io = if route.tls {
        let tls = crate::guest_tls::connect(io).await.map_err(|cause| ProxyError::PortTls { sandbox: target.sandbox.clone(), port: target.port, cause })?;
        tokio_util::either::Either::Left(tls)
    } else {
        tokio_util::either::Either::Right(io)
    };
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io)).await.map_err(|_| closed())?;
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    let wants_upgrade = req.headers().contains_key(axum::http::header::UPGRADE);
    // An upgraded connection leaves the listener's accounting once it is spliced, so
    // the splices have their own cap.
    let splice_slot = match wants_upgrade.then(|| SPLICES.clone().try_acquire_owned()) {
        Some(Err(_)) => return Err(ProxyError::TooManySplices { max: MAX_SPLICES }),
        Some(Ok(p)) => Some(p),
        None => None,
    };
    let client_upgrade = wants_upgrade.then(|| hyper::upgrade::on(&mut req));
    let (parts, body) = req.into_parts();
    let mut upstream = http::Request::from_parts(parts, body);
    // A guest's own server gets the client's cookies and auth (they are its own), never
    // hutch's credentials.
    for name in HUTCH_CREDENTIALS {
        upstream.headers_mut().remove(*name);
    }
    if let Some(value) = route.host.and_then(|h| http::HeaderValue::from_str(&h).ok()) {
        upstream.headers_mut().insert(http::header::HOST, value);
    }
    if !wants_upgrade {
        for name in HOP_BY_HOP.iter().filter(|n| **n != "host") {
            upstream.headers_mut().remove(*name);
        }
    }
    let mut resp = match sender.send_request(upstream).await {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(sandbox = %target.sandbox, port = target.port, "tunnelled request failed: {e}");
            return Err(closed());
        }
    };
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(client_upgrade) = client_upgrade {
            let server_upgrade = hyper::upgrade::on(&mut resp);
            tokio::spawn(async move {
                if let (Ok(client), Ok(server)) = (client_upgrade.await, server_upgrade.await) {
                    let mut client = hyper_util::rt::TokioIo::new(client);
                    let mut server = hyper_util::rt::TokioIo::new(server);
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
                drop(splice_slot);
            });
        }
    }
    let (parts, body) = resp.into_parts();
    Ok(Response::from_parts(parts, Body::new(body)))
}
