//! TLS inspection for hosts with E2B header rules (`network.rules`). A flow to port
//! 443 of an address the guest looked up under such a host goes through `gate`: it
//! reads the ClientHello, and only when the server name has a rule and is one the
//! guest resolved to that address does hutch end the guest's TLS with a certificate
//! of the sandbox's own CA (`ca`), connect to the real server checking its
//! certificate (`upstream`), and relay HTTP/1.1 requests with the rule's headers set
//! (`http`), secrets filled in from the host's store. Every other flow is relayed
//! byte for byte, as without rules.

pub mod ca;
pub(crate) mod gate;
mod http;
mod rewind;
#[cfg(test)]
mod tests;
pub mod transforms;
pub mod upstream;

pub use ca::SandboxCa;
pub use gate::run as gate;
pub use transforms::{TransformError, Transforms};
pub use upstream::{Upstream, UpstreamCaError};

use std::sync::Arc;
use zeroize::Zeroizing;

/// Where the host keeps secrets' values (hutch-core's store). A sandbox's rules name
/// secrets of the API key that made it (`Transforms::secrets_of`).
#[async_trait::async_trait]
pub trait SecretVault: Send + Sync {
    /// The current value of `owner`'s secret `name`. The error is a sentence for the
    /// network log: it never holds a value.
    async fn reveal(&self, owner: &str, name: &str) -> Result<Zeroizing<String>, String>;
}

/// One sandbox's inspection: its CA, its rules, and how it reaches upstreams and secrets.
pub struct Inspector {
    pub ca: Arc<SandboxCa>,
    pub transforms: Transforms,
    pub upstream: Arc<Upstream>,
    pub vault: Option<Arc<dyn SecretVault>>,
}

impl std::fmt::Debug for Inspector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inspector").field("hosts", &self.transforms.hosts.keys().collect::<Vec<_>>()).finish_non_exhaustive()
    }
}

impl Inspector {
    /// Whether a flow to an address the guest resolved under `names` goes through the gate.
    pub fn wants(&self, port: u16, names: &[String]) -> bool {
        port == 443 && self.transforms.covers_any(names)
    }

    async fn reveal(&self, name: String) -> Result<Zeroizing<String>, String> {
        let (Some(vault), Some(owner)) = (&self.vault, &self.transforms.secrets_of) else {
            return Err(format!("secret `{name}` cannot be read: this hutch has no secrets store"));
        };
        vault.reveal(owner, &name).await
    }
}
