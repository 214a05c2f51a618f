//! What an agent call can fail with, and reading an agent's replies within bounds.

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};
use hutch_proto::connect::{Code, ErrorBody};
use hyper::body::Incoming;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("the agent connection is closed")]
    Disconnected(#[source] hyper::Error),
    #[error("cannot reach the sandbox through the server")]
    Unreachable(#[source] BoxError),
    #[error("{0}")]
    Rpc(ErrorBody),
    #[error("the agent answered {status}: {message}")]
    Http { status: StatusCode, message: String },
    #[error("the agent sent a malformed reply: {0}")]
    Protocol(String),
    #[error("the agent's reply exceeds {max} bytes")]
    TooLarge { max: usize },
    #[error("the agent did not answer {what} within {secs} s")]
    Timeout { what: String, secs: u64 },
}

/// Largest reply body the host reads whole from an agent (unary calls, `/metrics`,
/// upload results): a hostile guest could otherwise send an endless one.
pub const MAX_REPLY: usize = 16 << 20;
/// Largest error body read from an agent.
pub const MAX_ERROR_BODY: usize = 64 << 10;
/// Deadline of a plain call (request to whole reply); streams have none.
pub const CALL_DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);

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

/// Reads a whole body of at most `max` bytes.
pub async fn read_limited(body: Incoming, max: usize) -> Result<Bytes, AgentError> {
    match http_body_util::Limited::new(body, max).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => Err(AgentError::TooLarge { max }),
        Err(e) => match e.downcast::<hyper::Error>() {
            Ok(h) => Err(AgentError::Disconnected(*h)),
            Err(other) => Err(AgentError::Protocol(other.to_string())),
        },
    }
}

/// Reads an error reply's body (bounded) into the error it describes.
pub async fn error_reply(status: StatusCode, body: Incoming) -> AgentError {
    match read_limited(body, MAX_ERROR_BODY).await {
        Ok(bytes) => error_from(status, &bytes),
        Err(e) => e,
    }
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
