//! The one place where failures become HTTP: every error is JSON `{code, message}`
//! (the body the E2B SDKs parse), with a 4xx for what the client got wrong. The data
//! proxy's also name the sandbox (and a closed port), as E2B's edge does.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use hutch_core::manager::ManagerError;
use hutch_core::sandbox::errors::PauseError;
use hutch_core::snapshot::SaveError;
use serde_json::json;
use std::time::Duration;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// Already written to the log with its causes.
    logged: bool,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), logged: false }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() && !self.logged {
            tracing::error!(status = %self.status, "{}", self.message);
        }
        let mut response = (self.status, Json(json!({ "code": self.status.as_u16(), "message": self.message }))).into_response();
        if self.status == StatusCode::PAYLOAD_TOO_LARGE {
            // The rest of the body is left unread, so the connection cannot carry another
            // request: say so, or the client sends its next one on it and finds it closed.
            response.headers_mut().insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
        }
        response
    }
}

/// Why the data proxy did not pass a request on. The bodies are E2B's edge's, read by
/// its SDKs (a 502 naming the sandbox means "not running"), so their shapes and texts
/// must not change. Nothing is logged here: where each arises says whether it is worth
/// a line.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("this request names no sandbox (no E2b-Sandbox-Id header, no <port>-<id> host) and carries no signature; use a signed URL (download_url/upload_url) or send the header")]
    Unsigned,
    #[error("signature_expiration must be a Unix time in seconds")]
    BadExpiration,
    #[error("invalid signature: no sandbox's access token signs this URL's path, operation, user and expiration")]
    BadSignature,
    #[error("The sandbox was not found")]
    NotFound { sandbox: String },
    /// E2B's edge answers a paused sandbox like a missing one (502), with its own message.
    #[error("The sandbox is paused; resume it with Sandbox.connect()")]
    Paused { sandbox: String },
    /// It would resume for its traffic, but this request lacks the token it wants.
    #[error("this sandbox can't be resumed with the credentials provided: send its token in {header} and try again")]
    ResumeForbidden { sandbox: String, header: &'static str },
    /// The client hears what `ApiError` tells of the cause (a server failure's kind
    /// and incident, never its text).
    #[error("the paused sandbox could not be resumed for this request: {}", .cause.message)]
    ResumeFailed { sandbox: String, cause: ApiError },
    /// Its VM or agent stopped answering: the proxy cannot reach it, as for a paused
    /// one, and the message (`ManagerError::Failed`'s) says what to do.
    #[error("{message}")]
    Failed { sandbox: String, message: String },
    #[error("{path} is internal to hutch and not reachable through the proxy")]
    Internal { path: String },
    #[error("this sandbox's ports are private (allowPublicTraffic: false): send its trafficAccessToken in the e2b-traffic-access-token header")]
    PrivatePort { sandbox: String },
    #[error("{0}")]
    BadRequest(axum::http::Error),
    #[error("the sandbox's agent did not answer within {} s of the request; the guest may be overloaded or stuck", .waited.as_secs())]
    AgentTimeout { sandbox: String, waited: Duration },
    #[error("The sandbox is running but port is not open")]
    PortClosed { sandbox: String, port: u16 },
    /// A port in `httpsPorts` whose server did not speak TLS.
    #[error("port {port} is in the sandbox's httpsPorts, but its server did not complete a TLS handshake ({cause}); serve HTTPS on it, or create the sandbox without it in httpsPorts")]
    PortTls { sandbox: String, port: u16, cause: String },
    #[error("the server relays {max} upgraded connections at most; try again later")]
    TooManySplices { max: usize },
}

impl ProxyError {
    fn status(&self) -> StatusCode {
        match self {
            ProxyError::Unsigned | ProxyError::BadExpiration | ProxyError::BadSignature => StatusCode::UNAUTHORIZED,
            ProxyError::ResumeForbidden { .. } | ProxyError::Internal { .. } | ProxyError::PrivatePort { .. } => StatusCode::FORBIDDEN,
            ProxyError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ProxyError::AgentTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::TooManySplices { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::NotFound { .. }
            | ProxyError::Paused { .. }
            | ProxyError::ResumeFailed { .. }
            | ProxyError::Failed { .. }
            | ProxyError::PortClosed { .. }
            | ProxyError::PortTls { .. } => StatusCode::BAD_GATEWAY,
        }
    }

    /// The sandbox the body names: not when the request named none, nor for what is
    /// the same answer whichever sandbox it is for.
    fn sandbox(&self) -> Option<&str> {
        match self {
            ProxyError::NotFound { sandbox }
            | ProxyError::Paused { sandbox }
            | ProxyError::ResumeForbidden { sandbox, .. }
            | ProxyError::ResumeFailed { sandbox, .. }
            | ProxyError::Failed { sandbox, .. }
            | ProxyError::PrivatePort { sandbox }
            | ProxyError::AgentTimeout { sandbox, .. }
            | ProxyError::PortClosed { sandbox, .. }
            | ProxyError::PortTls { sandbox, .. } => Some(sandbox),
            ProxyError::Unsigned
            | ProxyError::BadExpiration
            | ProxyError::BadSignature
            | ProxyError::Internal { .. }
            | ProxyError::BadRequest(_)
            | ProxyError::TooManySplices { .. } => None,
        }
    }

    fn body(&self) -> serde_json::Value {
        let mut body = json!({ "code": self.status().as_u16(), "message": self.to_string() });
        if let ProxyError::PortClosed { port, .. } | ProxyError::PortTls { port, .. } = self {
            body["port"] = json!(port);
        }
        if let Some(id) = self.sandbox() {
            body["sandboxId"] = json!(id);
        }
        body
    }
}

impl IntoResponse for ProxyError {
    fn into_response(self) -> Response {
        (self.status(), Json(self.body())).into_response()
    }
}

/// What a client is told of a server-side failure: its kind, never its text (which
/// may name host paths or carry QEMU's and qemu-img's output).
fn summary(e: &ManagerError) -> &'static str {
    match e {
        ManagerError::Template(_) => "preparing the template failed",
        ManagerError::Create(_) => "creating the sandbox failed",
        ManagerError::Pause(_) => "pausing the sandbox failed",
        ManagerError::Resume(_) => "resuming the sandbox failed",
        ManagerError::Store(_) => "the server's database failed",
        _ => "the server failed",
    }
}

impl From<ManagerError> for ApiError {
    fn from(e: ManagerError) -> Self {
        let status = match &e {
            ManagerError::NotFound(_) | ManagerError::Missing(_) => StatusCode::NOT_FOUND,
            ManagerError::Forbidden(_) => StatusCode::FORBIDDEN,
            ManagerError::AtCapacity { .. } | ManagerError::Quota(_) => StatusCode::TOO_MANY_REQUESTS,
            ManagerError::InvalidArgument(_) => StatusCode::BAD_REQUEST,
            ManagerError::Agent(_) => StatusCode::BAD_GATEWAY,
            ManagerError::NoSpace(_) => StatusCode::INSUFFICIENT_STORAGE,
            ManagerError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            ManagerError::Paused(_) | ManagerError::AlreadyPaused(_) | ManagerError::Failed { .. } | ManagerError::Conflict(_) | ManagerError::Transition(_) => {
                StatusCode::CONFLICT
            }
            // The guest held its session past the deadline, or the VM is not running: the
            // sandbox's state, not a server failure, and nothing was changed.
            ManagerError::Pause(PauseError::Save(SaveError::AgentBusy(_)) | PauseError::NotRunning) => StatusCode::CONFLICT,
            // E2B's answer when a pause needs the guest agent and it does not respond.
            ManagerError::Pause(PauseError::Sync(_)) => StatusCode::SERVICE_UNAVAILABLE,
            ManagerError::Template(_)
            | ManagerError::Create(_)
            | ManagerError::Pause(_)
            | ManagerError::Resume(_)
            | ManagerError::Store(_)
            | ManagerError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if e.is_tampered_disk() {
            tracing::warn!("{}", hutch_proto::error_chain(&e));
            let message = "the sandbox's disk was changed from inside its VM (its image header names a file hutch did not make it on), so hutch will not start it again; kill it";
            return ApiError::new(StatusCode::CONFLICT, message);
        }
        // A full disk is the client's to hear about, but not how full the host's disk
        // is: the numbers go to the server's log.
        if let ManagerError::NoSpace(detail) = &e {
            tracing::warn!("refused for want of disk: {detail}");
            return ApiError::new(status, "the server is short of disk space for this; try again later, or ask its operator to free space");
        }
        if !status.is_server_error() {
            return ApiError::new(status, hutch_proto::error_chain(&e));
        }
        // The causes of a server-side failure name host paths and carry QEMU's stderr:
        // they go to the server's log, and the client gets the failure and a reference.
        let incident = format!("{:08x}", rand::random::<u32>());
        tracing::error!(incident, "{}", hutch_proto::error_chain(&e));
        ApiError { status, message: format!("{} (the server's log has the details under incident {incident})", summary(&e)), logged: true }
    }
}

/// Secrets' errors carry fixed sentences, never a value; a server-side one is logged
/// with its causes and told by incident, as the manager's are.
impl From<hutch_core::secrets::SecretError> for ApiError {
    fn from(e: hutch_core::secrets::SecretError) -> Self {
        use hutch_core::secrets::SecretError;
        let status = match &e {
            SecretError::Invalid(_) => StatusCode::BAD_REQUEST,
            SecretError::NotFound => StatusCode::NOT_FOUND,
            SecretError::NameTaken | SecretError::TooMany => StatusCode::CONFLICT,
            SecretError::Store(_) | SecretError::Keys(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if !status.is_server_error() {
            return ApiError::new(status, e.to_string());
        }
        let incident = format!("{:08x}", rand::random::<u32>());
        tracing::error!(incident, "{}", hutch_proto::error_chain(&e));
        ApiError { status, message: format!("the secrets store failed (the server's log has the details under incident {incident})"), logged: true }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_errors_tell_the_client_no_host_details() {
        let e = ApiError::from(ManagerError::Internal("qemu-img failed on /root/.local/share/hutch/x: stderr".into()));
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!e.message.contains("/root") && !e.message.contains("stderr"), "{}", e.message);
        assert!(e.message.contains("incident"), "{}", e.message);
        // Client mistakes keep their whole message.
        let e = ApiError::from(ManagerError::InvalidArgument("templateID 'x' is not allowed".into()));
        assert_eq!((e.status, e.message.as_str()), (StatusCode::BAD_REQUEST, "templateID 'x' is not allowed"));
        let e = ApiError::from(ManagerError::NoSpace("the server's disk has 3 MiB free".into()));
        assert_eq!(e.status, StatusCode::INSUFFICIENT_STORAGE);
        // The tenant hears the disk is short, not how full the host's disk is.
        assert!(e.message.contains("short of disk") && !e.message.contains("3 MiB"), "{}", e.message);
    }

    #[test]
    fn a_guest_that_keeps_its_session_is_a_conflict_not_a_server_failure() {
        let e = ApiError::from(ManagerError::Pause(PauseError::Save(SaveError::AgentBusy(10))));
        assert_eq!(e.status, StatusCode::CONFLICT);
        assert!(e.message.contains("did not release its session within 10 s"), "{}", e.message);
        let e = ApiError::from(ManagerError::Pause(PauseError::Save(SaveError::Vm(hutch_vmm::SnapshotError::NoQmp))));
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
        let e = ApiError::from(ManagerError::Failed { id: "i1".into(), why: "its guest agent does not answer".into() });
        assert_eq!(e.status, StatusCode::CONFLICT);
        assert!(e.message.contains("has failed (its guest agent does not answer); kill it"), "{}", e.message);
    }

    #[test]
    fn proxy_errors_keep_the_bodies_the_e2b_sdks_parse() {
        let e = ProxyError::NotFound { sandbox: "i1".into() };
        assert_eq!((e.status(), e.body()), (StatusCode::BAD_GATEWAY, json!({ "sandboxId": "i1", "message": "The sandbox was not found", "code": 502 })));
        let e = ProxyError::PortClosed { sandbox: "i1".into(), port: 8080 };
        let closed = json!({ "sandboxId": "i1", "message": "The sandbox is running but port is not open", "port": 8080, "code": 502 });
        assert_eq!((e.status(), e.body()), (StatusCode::BAD_GATEWAY, closed));
        // What is refused whichever sandbox it is for names none.
        let e = ProxyError::Internal { path: "/init".into() };
        let internal = json!({ "code": 403, "message": "/init is internal to hutch and not reachable through the proxy" });
        assert_eq!((e.status(), e.body()), (StatusCode::FORBIDDEN, internal));
        let e = ProxyError::AgentTimeout { sandbox: "i1".into(), waited: Duration::from_secs(120) };
        assert_eq!(e.status(), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(e.body()["message"], "the sandbox's agent did not answer within 120 s of the request; the guest may be overloaded or stuck");
    }
}
