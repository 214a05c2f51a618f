//! The host side of the agent channel: an HTTP/2 client over the VM's agent socket,
//! speaking the same envd protocol the E2B SDKs speak.

mod files;
mod process;
mod tunnel;
mod transport;

pub use process::ProcessStream;
pub use tunnel::Tunnel;
pub use transport::{connect, ConnectError};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};
use hutch_proto::connect::{Code, ErrorBody};
use hyper::body::Incoming;
use serde::de::DeserializeOwned;
use serde::Serialize;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("the agent connection is closed")]
    Disconnected(#[source] hyper::Error),
    #[error("{0}")]
    Rpc(ErrorBody),
    #[error("the agent answered {status}: {message}")]
    Http { status: StatusCode, message: String },
    #[error("the agent sent a malformed reply: {0}")]
    Protocol(String),
}

impl AgentError {
    pub fn code(&self) -> Option<Code> {
        match self {
            AgentError::Rpc(e) => Some(e.code),
            AgentError::Http { status, .. } => Some(Code::from_http_status(status.as_u16())),
            _ => None,
        }
    }
}

pub fn full(data: impl Into<Bytes>) -> Body {
    Full::new(data.into()).map_err(|never| match never {}).boxed_unsync()
}

/// A connected agent. Cheap to clone; all clones share one HTTP/2 connection.
#[derive(Clone)]
pub struct AgentClient {
    sender: hyper::client::conn::http2::SendRequest<Body>,
    user: Option<String>,
}

impl AgentClient {
    /// Acts as `user` for process and filesystem calls (envd's Basic auth header).
    pub fn as_user(&self, user: Option<&str>) -> AgentClient {
        AgentClient { sender: self.sender.clone(), user: user.map(str::to_string) }
    }

    fn request(&self, method: Method, path_and_query: &str) -> http::request::Builder {
        let mut b = Request::builder().method(method).uri(format!("http://agent{path_and_query}"));
        if let Some(u) = &self.user {
            b = b.header(http::header::AUTHORIZATION, format!("Basic {}", hutch_proto::b64::encode(format!("{u}:").as_bytes())));
        }
        b
    }

    pub async fn send(&self, req: Request<Body>) -> Result<http::Response<Incoming>, AgentError> {
        let mut sender = self.sender.clone();
        sender.ready().await.map_err(AgentError::Disconnected)?;
        sender.send_request(req).await.map_err(AgentError::Disconnected)
    }

    /// Sends `method path` with an optional JSON body; returns the status and body.
    async fn call(&self, method: Method, path: &str, json: Option<Vec<u8>>) -> Result<(StatusCode, Bytes), AgentError> {
        let mut req = self.request(method, path);
        if json.is_some() {
            req = req.header(http::header::CONTENT_TYPE, "application/json");
        }
        let req = req.body(full(json.unwrap_or_default())).map_err(|e| AgentError::Protocol(e.to_string()))?;
        let resp = self.send(req).await?;
        let status = resp.status();
        Ok((status, read_all(resp.into_body()).await?))
    }

    fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, AgentError> {
        serde_json::to_vec(value).map_err(|e| AgentError::Protocol(e.to_string()))
    }

    fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, AgentError> {
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
        match self.call(Method::POST, path, Some(Self::encode(req)?)).await? {
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

pub async fn read_all(body: Incoming) -> Result<Bytes, AgentError> {
    Ok(body.collect().await.map_err(AgentError::Disconnected)?.to_bytes())
}

/// An error reply: a Connect error body, envd's `{code:int,message}`, or plain text.
pub fn error_from(status: StatusCode, body: &[u8]) -> AgentError {
    if let Ok(e) = serde_json::from_slice::<ErrorBody>(body) {
        return AgentError::Rpc(e);
    }
    let message = serde_json::from_slice::<hutch_proto::agent::HttpError>(body)
        .map(|e| e.message)
        .unwrap_or_else(|_| String::from_utf8_lossy(body).trim().to_string());
    AgentError::Http { status, message }
}

