//! Rust client for hutch.
//!
//! - [`envd`]: the data-plane client (processes, files, tunnels) speaking the envd
//!   protocol, over either transport: a VM's agent socket (HTTP/2, used by hutch itself)
//!   or `hutch serve`'s data proxy (HTTP, with `E2b-Sandbox-Id` headers).
//! - [`Api`] and [`Sandbox`]: the control plane of `hutch serve` (create, list, kill,
//!   timeouts) with each sandbox's data plane attached.
//!
//! This crate does no VM work and holds no server state.

pub use hutch_envd as envd;
mod code;
mod commands;
mod lifecycle;
mod remote;

pub use code::{CodeContext, CodeEvent, CodeResult, Execution, ExecutionError};
pub use commands::{CommandOutput, RunOptions, SdkError};
pub use lifecycle::{PauseMode, SnapshotInfo};
pub use remote::{Api, ApiError, CreateOptions, PoolInfo, Sandbox, SandboxInfo, ServerStatus};
