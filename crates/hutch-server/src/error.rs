//! The one place where failures become HTTP: every error is JSON `{code, message}`
//! (the body the E2B SDKs parse), with a 4xx for what the client got wrong.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use hutch_core::manager::ManagerError;
use hutch_core::sandbox::errors::PauseError;
use hutch_core::snapshot::SaveError;
use serde_json::json;

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
}
