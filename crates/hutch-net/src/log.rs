//! What the stack refused, for the API and `hutch net log`: counters and a bounded
//! log of the latest denials.

use crate::rules::{DenyReason, Proto};
use serde::Serialize;
use parking_lot::Mutex;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// Denials kept per sandbox; older ones only count.
pub const EVENTS_KEPT: usize = 256;

#[derive(Debug, Clone, Serialize)]
pub struct Denial {
    /// Unix time in milliseconds.
    pub at_ms: u64,
    /// `tcp`, `udp`, `icmp`, or `dns` for a name the guest could not resolve.
    pub proto: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ip: Option<IpAddr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub reason: DenyReason,
    /// The reason as a sentence.
    pub message: String,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Counters {
    pub flows_allowed: u64,
    pub flows_denied: u64,
    pub names_resolved: u64,
    pub names_denied: u64,
    /// Flows and datagrams ended for carrying a secret's placeholder (each counted; a
    /// burst to one destination is one entry in the log).
    pub placeholders_refused: u64,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct LogView {
    pub counters: Counters,
    pub denials: Vec<Denial>,
    /// Why the link to QEMU ended, once it has: the guest has no network from then on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub link_lost: Option<String>,
}

impl LogView {
    /// Adds `denial`, the oldest going once `EVENTS_KEPT` are kept.
    fn keep(&mut self, denial: Denial) {
        if self.denials.len() == EVENTS_KEPT {
            self.denials.remove(0);
        }
        self.denials.push(denial);
    }
}

/// Shared between a sandbox's stack and whoever reports on it.
#[derive(Debug, Clone, Default)]
pub struct NetLog(Arc<Mutex<LogView>>);

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

impl NetLog {
    fn with<R>(&self, f: impl FnOnce(&mut LogView) -> R) -> R {
        let mut view = self.0.lock();
        f(&mut view)
    }

    pub fn flow_allowed(&self) {
        self.with(|v| v.counters.flows_allowed += 1);
    }

    pub fn name_resolved(&self) {
        self.with(|v| v.counters.names_resolved += 1);
    }

    pub fn flow_denied(&self, proto: Proto, ip: IpAddr, port: u16, name: Option<String>, reason: DenyReason) {
        tracing::debug!(proto = proto.name(), %ip, port, %reason, "egress denied");
        let message = reason.to_string();
        self.push(|v| v.counters.flows_denied += 1, Denial { at_ms: now_ms(), proto: proto.name(), ip: Some(ip), port: Some(port), name, reason, message });
    }

    /// A flow or datagram ended for carrying a placeholder. Repeats to the same
    /// destination within a second are counted, not logged again, so a guest cannot
    /// flush the log's older entries with them.
    pub fn placeholder_sent(&self, proto: Proto, ip: IpAddr, port: u16, name: Option<String>, form: crate::scan::Form) {
        let reason = DenyReason::Placeholder { form };
        let at_ms = now_ms();
        self.with(|v| {
            v.counters.placeholders_refused += 1;
            let repeat = v.denials.iter().rev().find(|d| matches!(d.reason, DenyReason::Placeholder { .. })).is_some_and(|d| d.ip == Some(ip) && d.port == Some(port) && d.proto == proto.name() && at_ms.saturating_sub(d.at_ms) < 1000);
            if repeat {
                return;
            }
            let message = reason.to_string();
            v.keep(Denial { at_ms, proto: proto.name(), ip: Some(ip), port: Some(port), name, reason, message });
        });
    }

    pub fn name_denied(&self, name: &str, reason: DenyReason) {
        tracing::debug!(name, %reason, "name denied");
        let message = reason.to_string();
        self.push(|v| v.counters.names_denied += 1, Denial { at_ms: now_ms(), proto: "dns", ip: None, port: None, name: Some(name.to_string()), reason, message });
    }

    fn push(&self, count: impl FnOnce(&mut LogView), denial: Denial) {
        self.with(|v| {
            count(v);
            v.keep(denial);
        });
    }

    pub fn view(&self) -> LogView {
        self.with(|v| v.clone())
    }
}

