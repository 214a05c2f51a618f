//! The sandbox lifecycle on one host: prepare artifacts, create a sandbox (directory,
//! overlay, VM, agent session), talk to its agent, destroy it leaving nothing behind.
//!
//! Owns sandbox directories under `$HUTCH_HOME/sandboxes`. Must not know about HTTP
//! routing, the CLI or terminals; those sit above it.

pub mod agent;
pub mod artifacts;
pub mod ids;
pub mod manager;
pub mod sandbox;
pub mod store;
pub mod sweep;

pub use agent::{AgentClient, AgentError};
pub use artifacts::{Artifacts, ArtifactsError};
pub use ids::{MemMib, SandboxId};
pub use sandbox::{CreateError, Sandbox, SandboxOptions};
