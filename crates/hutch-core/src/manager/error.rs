//! What a manager operation can answer instead of its result; hutch-server maps each to
//! its HTTP status in one place (`hutch-server/src/error.rs`).

use super::state;
use crate::artifacts::ArtifactsError;
use crate::sandbox::errors::{CreateError, PauseError};
use crate::store::StoreError;
use hutch_image::tags::TagError;

#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    #[error("sandbox '{0}' not found")]
    NotFound(String),
    #[error("the server runs {max} sandboxes at most and all are in use; kill one or try again later")]
    AtCapacity { max: usize },
    #[error("{0}")]
    InvalidArgument(String),
    #[error(transparent)]
    Template(ArtifactsError),
    #[error("creating the sandbox failed")]
    Create(#[source] CreateError),
    #[error("the sandbox's agent did not answer")]
    Agent(#[source] hutch_envd::AgentError),
    #[error("sandbox '{0}' is paused; resume it with connect (POST /sandboxes/{0}/connect) first")]
    Paused(String),
    #[error("sandbox '{0}' is already paused")]
    AlreadyPaused(String),
    /// Its VM or agent stopped answering and an operation could not bring it back.
    #[error("sandbox '{id}' has failed ({why}); kill it (DELETE /sandboxes/{id}) and start another")]
    Failed { id: String, why: String },
    #[error("pausing the sandbox failed")]
    Pause(#[source] PauseError),
    #[error("resuming the sandbox failed")]
    Resume(#[source] CreateError),
    #[error("{0}")]
    Conflict(String),
    /// Something other than a sandbox is not there (a template, a build, an upload URL).
    #[error("{0}")]
    Missing(String),
    /// It exists, and is another API key's.
    #[error("{0}")]
    Forbidden(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("internal error: {0}")]
    Internal(String),
    /// The server is stopping: it starts no new sandbox (503).
    #[error("the server is shutting down and starts no new sandboxes; try again when it is back")]
    ShuttingDown,
    /// The key holds all its quota allows of something.
    #[error("{0}")]
    Quota(String),
    /// The host's disk is too full for the write asked for.
    #[error("{0}")]
    NoSpace(String),
    /// The operation does not fit the sandbox's state (`state.rs`).
    #[error(transparent)]
    Transition(#[from] state::TransitionError),
}

impl ManagerError {
    /// A sandbox whose disk header was rewritten from inside its VM: it stays down.
    pub fn is_tampered_disk(&self) -> bool {
        hutch_vmm::StartError::tampered_disk_in(self)
    }
}

/// The answer for a template name the caller may not use: the same whether it does not
/// exist or is another key's.
pub(crate) fn unknown_template(name: &str) -> ManagerError {
    ManagerError::InvalidArgument(format!(
        "unknown template '{name}': it is neither a built-in template ({}), one this API key built, nor a snapshot of yours",
        hutch_image::recipes::builtin_names().join(", ")
    ))
}

/// How a tag operation's failure reads to a client.
pub(crate) fn tag_error(e: TagError) -> ManagerError {
    match e {
        TagError::BadTag(_) | TagError::DefaultKept => ManagerError::InvalidArgument(e.to_string()),
        TagError::UnknownTag { .. } | TagError::UnknownTemplate(_) | TagError::BuildGone { .. } => ManagerError::Missing(e.to_string()),
        TagError::Template(hutch_image::template::TemplateError::Tag(inner)) => tag_error(*inner),
        TagError::Template(_) | TagError::Io { .. } => ManagerError::Internal(hutch_proto::error_chain(&e)),
    }
}
