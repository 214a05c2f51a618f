//! TLS inspection for hosts with E2B header rules (`network.rules`). A flow to port
//! 443 of an address the guest looked up under such a host goes through `gate`: it
//! reads the ClientHello, and only when the server name has a rule and is one the
//! guest resolved to that address does hutch end the guest's TLS with a certificate
//! of the sandbox's own CA (`ca`), connect to the real server checking its
//! certificate (`upstream`), and relay HTTP/1.1 or HTTP/2 requests with the rule's headers set
//! (`http`), secrets filled in from the host's store. Every other flow is relayed
//! byte for byte, as without rules.

pub mod ca;
mod conn;
pub mod flow;
mod fill;
mod gate;
mod http;
mod inspector;
mod rewind;
mod scanned;
#[cfg(test)]
mod tests;
pub mod transforms;
mod tunnel;
pub mod upstream;

pub use ca::SandboxCa;
pub use inspector::{InlineVault, Inspector, SecretVault};
pub use gate::run as gate;
pub use transforms::{SecretBinding, TransformError, Transforms};
pub use upstream::{Upstream, UpstreamCaError};
