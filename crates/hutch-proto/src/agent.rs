//! hutch's own agent messages, beyond the envd surface the E2B SDKs use.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `POST /init`: the host hands a fresh (or restored) guest its identity.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InitRequest {
    #[serde(default)]
    pub env_vars: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_token: Option<String>,
    /// Host wall clock, nanoseconds since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp_ns: Option<u128>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// The sandbox's id, as processes see it (`E2B_SANDBOX_ID`, /run/hutch/sandbox.json).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// Host randomness (base64) the agent mixes into the guest RNG and reseeds from: a
    /// guest restored from a snapshot would otherwise share its RNG state with every
    /// other clone of that snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entropy: Option<String>,
}

/// `POST /clock`: reads the guest's wall clock, after stepping it by `step_ns` (may be
/// negative). The host uses it NTP-style after `/init`, whose absolute time lands late
/// by the first request's delay in a freshly restored guest (TCG translating the path).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClockRequest {
    #[serde(default)]
    pub step_ns: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClockReply {
    /// The guest's wall clock after the step, nanoseconds since the Unix epoch.
    pub unix_ns: i128,
}

/// The console line an agent prints once it serves the agent channel.
pub const READY_LINE: &str = "hutch-agent: ready";

/// The console line an agent prints when a host session ends and it waits for the
/// next one: the moment a template VM can be snapshotted.
pub const IDLE_LINE: &str = "hutch-agent: idle";

/// Error body of the agent's plain HTTP endpoints (same as envd's).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HttpError {
    pub code: u16,
    pub message: String,
}

/// `GET /metrics` (envd shape).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Metrics {
    pub ts: i64,
    pub cpu_count: u32,
    pub cpu_used_pct: f32,
    pub mem_total: u64,
    pub mem_used: u64,
    pub mem_cache: u64,
    pub mem_total_mib: u64,
    pub mem_used_mib: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// Every host session on the agent channel starts with a hello line, which the agent
/// echoes before HTTP/2 begins. The channel is a byte stream that outlives host
/// connections: QEMU hands guest output that no host read (a GOAWAY written after the
/// previous host left, say) to the next host that connects. The host skips everything
/// up to its own echoed nonce, so each HTTP/2 session starts on a clean boundary.
pub const HELLO_PREFIX: &[u8] = b"HUTCH-HELLO ";

pub fn hello_line(nonce: u64) -> Vec<u8> {
    let mut line = HELLO_PREFIX.to_vec();
    line.extend_from_slice(format!("{nonce:016x}\n").as_bytes());
    line
}

/// Finds a hello line in `buf`: returns the index just past it and its nonce. A
/// malformed one (the prefix, then anything but a hex nonce and a newline: a guest can
/// write that) is skipped, so it cannot hide a real hello after it.
pub fn find_hello(buf: &[u8]) -> Option<(usize, u64)> {
    let mut from = 0;
    loop {
        let start = from + buf[from..].windows(HELLO_PREFIX.len()).position(|w| w == HELLO_PREFIX)?;
        let body = start + HELLO_PREFIX.len();
        // No newline yet: this line is still arriving, and so is anything after it.
        let nl = buf[body..].iter().position(|b| *b == b'\n')?;
        let nonce = std::str::from_utf8(&buf[body..body + nl]).ok().and_then(|t| u64::from_str_radix(t, 16).ok());
        match nonce {
            Some(n) => return Some((body + nl + 1, n)),
            None => from = start + 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_is_found_after_stale_bytes() {
        let mut buf = b"\x00\x00\x08\x07stale goaway".to_vec();
        buf.extend_from_slice(&hello_line(0xabc));
        buf.extend_from_slice(b"PRI * HTTP/2.0");
        let (end, nonce) = find_hello(&buf).expect("hello");
        assert_eq!(nonce, 0xabc);
        assert_eq!(&buf[end..], b"PRI * HTTP/2.0");
        assert_eq!(find_hello(&buf[..end - 1]), None);
    }

    #[test]
    fn a_malformed_hello_does_not_hide_the_real_one() {
        // Found by the agent_hello fuzz target: garbage shaped like a hello's prefix.
        let mut buf = b"\xd4\xd4HUTCH-HELLO \xb2 not hex\n".to_vec();
        buf.extend_from_slice(&hello_line(7));
        assert_eq!(find_hello(&buf).map(|(_, n)| n), Some(7));
        assert_eq!(find_hello(b"HUTCH-HELLO zz\nHUTCH-HELLO 1"), None);
    }
}
