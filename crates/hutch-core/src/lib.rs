//! The sandbox lifecycle on one host: prepare artifacts, create a sandbox (directory,
//! overlay, VM, agent session), talk to its agent, destroy it leaving nothing behind.
//!
//! Owns sandbox directories under `$HUTCH_HOME/sandboxes`. Must not know about HTTP
//! routing, the CLI or terminals; those sit above it.

pub mod artifacts;
pub mod build;
pub mod clock_sync;
pub mod host_memory;
#[cfg(test)]
mod fake_guest;
pub mod ids;
pub mod manager;
pub mod orphans;
pub mod pruning;
pub mod references;
pub mod sandbox;
pub mod secrets;
mod shell_warm_up;
pub mod snapshot;
pub mod store;
pub mod sweep;
pub mod template_snapshot;
pub mod time;

pub use artifacts::{Artifacts, ArtifactsError};
pub use ids::{MemMib, SandboxId};
pub use sandbox::boot::SandboxOptions;
pub use sandbox::errors::CreateError;
pub use sandbox::Sandbox;
