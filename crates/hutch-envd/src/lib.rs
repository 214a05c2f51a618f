//! The envd data-plane client: processes, files and tunnels, in the protocol the E2B
//! SDKs speak. Two transports: HTTP/2 straight over a local VM's agent socket (what
//! hutch itself uses), or HTTP through `hutch serve`'s data proxy (what remote clients
//! use), which routes by the `E2b-Sandbox-Id` header.

mod answer_deadline;
mod build;
mod client;
mod error;
mod files;
mod process;
mod tunnel;
mod transport;

pub use build::CopyTarget;
pub use process::ProcessStream;
pub use tunnel::Tunnel;
pub use client::{connect, AgentClient};
pub use error::{error_from, error_reply, full, read_limited, AgentError, Body, BoxError, CALL_DEADLINE, MAX_ERROR_BODY, MAX_REPLY};
pub use transport::{wait_idle, ConnectError};
