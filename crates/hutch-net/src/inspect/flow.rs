//! What the stack knew when it allowed an inspected flow, and how the flow's refusals
//! reach the sandbox's network log.

use super::inspector::Inspector;
use super::upstream::ClientCertificate;
use crate::log::NetLog;
use crate::rules::{DenyReason, Proto};
use std::net::{IpAddr, SocketAddrV4};
use std::sync::Arc;

/// The stack's inspector, which a sandbox's network update replaces.
pub type Current = Arc<parking_lot::RwLock<Option<Arc<Inspector>>>>;

/// What the stack knew when it allowed the flow.
pub struct Flow {
    pub dst: SocketAddrV4,
    /// The names the guest resolved to `dst` (the DNS pins).
    pub names: Vec<String>,
    /// The inspector when the flow began: it decides whether to inspect.
    pub inspector: Arc<Inspector>,
    /// The inspector now: each request follows the rules in force when it is sent.
    pub current: Current,
    pub log: NetLog,
    /// Whether the server asked for a client certificate (set during the upstream's
    /// handshake), which explains its failures.
    pub client_certificate: ClientCertificate,
}

impl Flow {
    /// Logs why the flow, or one request on it, was refused. The host is a name with a
    /// rule (so one the tenant wrote); guest text in `error` is escaped and bounded by
    /// whoever put it there.
    pub(super) fn refuse(&self, host: &str, error: String) {
        tracing::debug!(host, "inspected flow refused: {error}");
        self.log.flow_denied(Proto::Tcp, IpAddr::V4(*self.dst.ip()), self.dst.port(), Some(host.to_string()), DenyReason::Inspection { error });
    }

    pub(super) fn current(&self) -> Option<Arc<Inspector>> {
        self.current.read().clone()
    }
}

/// Guest text for the log: escaped, at most 128 characters.
pub(super) fn shown(text: &str) -> String {
    let escaped: String = text.escape_debug().take(128).collect();
    format!("`{escaped}`")
}
