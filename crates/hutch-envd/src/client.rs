//! `AgentClient`: a sandbox's agent, over a local VM's socket or through the server's
//! data proxy; the calls of each API (processes, files, tunnels, builds) are its
//! methods in files of their own.

use crate::error::{error_from, full, read_limited, AgentError, Body, CALL_DEADLINE, MAX_ERROR_BODY, MAX_REPLY};
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use hyper::body::Incoming;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::sync::Arc;

/// How requests reach the agent.
#[derive(Clone)]
enum Transport {
    /// HTTP/2 over a local VM's agent socket; the closer ends the connection.
    Socket(hyper::client::conn::http2::SendRequest<Body>, Arc<crate::transport::Closer>),
    /// `hutch serve`'s data proxy.
    Proxy(Arc<Proxy>),
}

struct Proxy {
    http: hyper_util::client::legacy::Client<hyper_util::client::legacy::connect::HttpConnector, Body>,
    base: String,
    sandbox_id: String,
}

/// A sandbox's agent. Cheap to clone; clones share the connection (or pool).
///
/// Requests it builds carry the sandbox's access token when it has one; `send` passes
/// a caller's request on exactly as given (the data proxy forwards clients' requests
/// with their own credentials, never the host's).
#[derive(Clone)]
pub struct AgentClient {
    transport: Transport,
    pub(crate) user: Option<String>,
    pub(crate) token: Option<Arc<str>>,
}

impl AgentClient {
    /// The agent of `sandbox_id` behind `hutch serve` at `base_url` (e.g.
    /// `http://127.0.0.1:3000`), with the sandbox's envd access token if it is secure.
    pub fn via_proxy(base_url: &str, sandbox_id: &str, token: Option<String>) -> AgentClient {
        let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
        let proxy = Proxy { http, base: base_url.trim_end_matches('/').to_string(), sandbox_id: sandbox_id.to_string() };
        AgentClient { transport: Transport::Proxy(Arc::new(proxy)), user: None, token: token.map(Arc::from) }
    }

    /// Acts as `user` for process and filesystem calls (envd's Basic auth header).
    pub fn as_user(&self, user: Option<&str>) -> AgentClient {
        AgentClient { user: user.map(str::to_string), ..self.clone() }
    }

    /// Sends `token` as `X-Access-Token` on every request this client builds (a
    /// secure sandbox's agent refuses the rest).
    pub fn with_token(&self, token: Option<&str>) -> AgentClient {
        AgentClient { token: token.map(Arc::from), ..self.clone() }
    }

    /// The access token this client sends, if any.
    pub fn access_token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    pub(crate) fn request(&self, method: Method, path_and_query: &str) -> http::request::Builder {
        let mut b = match &self.transport {
            Transport::Socket(..) => Request::builder().method(method).uri(format!("http://agent{path_and_query}")),
            Transport::Proxy(p) => Request::builder()
                .method(method)
                .uri(format!("{}{path_and_query}", p.base))
                .header("e2b-sandbox-id", &p.sandbox_id)
                .header("e2b-sandbox-port", "49983"),
        };
        if let Some(t) = &self.token {
            b = b.header("x-access-token", &**t);
        }
        if let Some(u) = &self.user {
            b = b.header(http::header::AUTHORIZATION, format!("Basic {}", hutch_proto::b64::encode(format!("{u}:").as_bytes())));
        }
        b
    }

    pub async fn send(&self, req: Request<Body>) -> Result<http::Response<Incoming>, AgentError> {
        match &self.transport {
            Transport::Socket(sender, _) => {
                let mut sender = sender.clone();
                sender.ready().await.map_err(AgentError::Disconnected)?;
                sender.send_request(req).await.map_err(AgentError::Disconnected)
            }
            Transport::Proxy(p) => p.http.request(req).await.map_err(|e| AgentError::Unreachable(Box::new(e))),
        }
    }

    pub(crate) fn from_socket(sender: hyper::client::conn::http2::SendRequest<Body>, closer: Arc<crate::transport::Closer>) -> AgentClient {
        AgentClient { transport: Transport::Socket(sender, closer), user: None, token: None }
    }

    /// Closes the socket connection now, for every clone, even with requests in
    /// flight: the guest then sees the host leave (before a snapshot, say).
    pub fn close(&self) {
        if let Transport::Socket(_, closer) = &self.transport {
            closer.close();
        }
    }

    /// Sends `method path` with an optional JSON body; returns the status and body.
    pub(crate) async fn call(&self, method: Method, path: &str, json: Option<Vec<u8>>) -> Result<(StatusCode, Bytes), AgentError> {
        self.call_within(method, path, json, CALL_DEADLINE).await
    }

    /// `call`, for a request whose work may take longer than `CALL_DEADLINE`.
    pub(crate) async fn call_within(&self, method: Method, path: &str, json: Option<Vec<u8>>, deadline: std::time::Duration) -> Result<(StatusCode, Bytes), AgentError> {
        let method_name = method.to_string();
        let mut req = self.request(method, path);
        if json.is_some() {
            req = req.header(http::header::CONTENT_TYPE, "application/json");
        }
        let req = req.body(full(json.unwrap_or_default())).map_err(|e| AgentError::Protocol(e.to_string()))?;
        let exchange = async {
            let resp = self.send(req).await?;
            let status = resp.status();
            let max = if status.is_success() { MAX_REPLY } else { MAX_ERROR_BODY };
            Ok((status, read_limited(resp.into_body(), max).await?))
        };
        tokio::time::timeout(deadline, exchange)
            .await
            .map_err(|_| AgentError::Timeout { what: format!("{method_name} {path}"), secs: deadline.as_secs() })?
    }

    pub(crate) fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, AgentError> {
        serde_json::to_vec(value).map_err(|e| AgentError::Protocol(e.to_string()))
    }

    pub(crate) fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, AgentError> {
        serde_json::from_slice(bytes).map_err(|e| AgentError::Protocol(e.to_string()))
    }

    /// A unary Connect call with JSON bodies.
    pub async fn unary<Req: Serialize, Resp: DeserializeOwned>(&self, path: &str, req: &Req) -> Result<Resp, AgentError> {
        match self.call(Method::POST, path, Some(Self::encode(req)?)).await? {
            (StatusCode::OK, bytes) => Self::decode(&bytes),
            (status, bytes) => Err(error_from(status, &bytes)),
        }
    }

    pub async fn health(&self) -> Result<(), AgentError> {
        match self.call(Method::GET, "/health", None).await? {
            (status, _) if status.is_success() => Ok(()),
            (status, bytes) => Err(error_from(status, &bytes)),
        }
    }

    /// Plain-HTTP JSON POST (`/init`), expecting no body back.
    pub async fn post_json<Req: Serialize>(&self, path: &str, req: &Req) -> Result<(), AgentError> {
        self.post_json_within(path, req, CALL_DEADLINE).await
    }

    /// `post_json`, for a request whose work may take longer than `CALL_DEADLINE`.
    pub async fn post_json_within<Req: Serialize>(&self, path: &str, req: &Req, deadline: std::time::Duration) -> Result<(), AgentError> {
        match self.call_within(Method::POST, path, Some(Self::encode(req)?), deadline).await? {
            (status, _) if status.is_success() => Ok(()),
            (status, bytes) => Err(error_from(status, &bytes)),
        }
    }

    /// Plain-HTTP GET of a JSON document (`/metrics`, `/envs`).
    pub async fn get_json<T: DeserializeOwned>(&self, path: &str) -> Result<T, AgentError> {
        match self.call(Method::GET, path, None).await? {
            (status, bytes) if status.is_success() => Self::decode(&bytes),
            (status, bytes) => Err(error_from(status, &bytes)),
        }
    }
}

/// Connects once to the agent behind a local VM's socket: the caller retries (with a
/// timeout) while the guest boots.
pub async fn connect(socket: &std::path::Path) -> Result<AgentClient, crate::transport::ConnectError> {
    let (sender, closer) = crate::transport::open(socket).await?;
    Ok(AgentClient::from_socket(sender, closer))
}
