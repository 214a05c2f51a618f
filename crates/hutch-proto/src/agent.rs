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
    /// The sandbox's TLS inspection CA (PEM), which every process is to trust; None:
    /// the guest trusts no hutch CA (one an earlier `/init` installed is removed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_bundle: Option<String>,
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

/// The console line an agent prints once it serves the agent channel. For people and
/// benchmarks reading the console only: the host takes no signal from the console,
/// which any guest root can write (see `IDLE_PROBE_PREFIX`).
pub const READY_LINE: &str = "hutch-agent: ready";

/// The console line an agent prints when a host session ends (for people, as above).
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

/// The idle probe: a host asks whether the agent is between sessions, waiting for a
/// hello. Only then does the agent answer, with `IDLE_REPLY_PREFIX` and the same nonce,
/// and it stays waiting. This is how the host learns that a booting agent serves the
/// channel and that a released one has left its session (before a snapshot): over the
/// channel, echoing a nonce the host just drew, never from console output.
pub const IDLE_PROBE_PREFIX: &[u8] = b"HUTCH-IDLE? ";
pub const IDLE_REPLY_PREFIX: &[u8] = b"HUTCH-IDLE ";

fn line(prefix: &[u8], nonce: u64) -> Vec<u8> {
    let mut line = prefix.to_vec();
    line.extend_from_slice(format!("{nonce:016x}\n").as_bytes());
    line
}

pub fn hello_line(nonce: u64) -> Vec<u8> {
    line(HELLO_PREFIX, nonce)
}

pub fn idle_probe(nonce: u64) -> Vec<u8> {
    line(IDLE_PROBE_PREFIX, nonce)
}

pub fn idle_reply(nonce: u64) -> Vec<u8> {
    line(IDLE_REPLY_PREFIX, nonce)
}

/// Hex digits in a line's nonce (`line` writes a u64 as `{:016x}`), then its newline.
const NONCE_DIGITS: usize = 16;

/// Finds a `prefix` line in `buf`: returns where it starts, the index just past it and
/// its nonce. A malformed one (the prefix, then anything but 16 hex digits and a
/// newline: a guest can write that) is skipped, so it cannot hide a real one after it.
/// Each candidate is judged by the 17 bytes after its prefix alone, so a guest filling
/// the channel with prefixes costs a scan, never a scan per prefix.
pub fn find_line(buf: &[u8], prefix: &[u8]) -> Option<(usize, usize, u64)> {
    let mut from = 0;
    loop {
        let start = from + buf[from..].windows(prefix.len()).position(|w| w == prefix)?;
        let body = start + prefix.len();
        let end = body + NONCE_DIGITS + 1;
        let arrived = &buf[body..end.min(buf.len())];
        let digits = &arrived[..arrived.len().min(NONCE_DIGITS)];
        let well_formed = digits.iter().all(u8::is_ascii_hexdigit) && arrived.get(NONCE_DIGITS).is_none_or(|b| *b == b'\n');
        if well_formed && end > buf.len() {
            // This line is still arriving, and so is anything after it.
            return None;
        }
        let nonce = well_formed.then(|| std::str::from_utf8(digits).ok().and_then(|t| u64::from_str_radix(t, 16).ok())).flatten();
        match nonce {
            Some(n) => return Some((start, end, n)),
            None => from = start + 1,
        }
    }
}

/// Finds a hello line in `buf`: returns the index just past it and its nonce.
pub fn find_hello(buf: &[u8]) -> Option<(usize, u64)> {
    find_line(buf, HELLO_PREFIX).map(|(_, end, nonce)| (end, nonce))
}

/// What a host opens with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostLine {
    Hello(u64),
    IdleProbe(u64),
}

/// The first hello or idle probe in `buf`, and the index just past it.
pub fn find_host_line(buf: &[u8]) -> Option<(usize, HostLine)> {
    let hello = find_line(buf, HELLO_PREFIX).map(|(start, end, n)| (start, end, HostLine::Hello(n)));
    let probe = find_line(buf, IDLE_PROBE_PREFIX).map(|(start, end, n)| (start, end, HostLine::IdleProbe(n)));
    [hello, probe].into_iter().flatten().min_by_key(|(start, _, _)| *start).map(|(_, end, l)| (end, l))
}

/// Whether bytes from the host open a new host's connection.
pub fn opens_host_line(bytes: &[u8]) -> bool {
    bytes.starts_with(HELLO_PREFIX) || bytes.starts_with(IDLE_PROBE_PREFIX)
}

/// Where a template made from an OCI image keeps that image's defaults, for the agent
/// to apply at `/init`: the template carries them, so every way a sandbox starts
/// (boot, restore, pool, resume, fork) gets them.
pub const IMAGE_DEFAULTS_PATH: &str = "/etc/hutch/image.json";

/// What an image's config says a container starts with, as the template records it
/// (in `template.json` and at `IMAGE_DEFAULTS_PATH`). The agent applies `env`,
/// `workdir` and `user`; `entrypoint` and `cmd` are kept for a start command.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageDefaults {
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub entrypoint: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cmd: Vec<String>,
    /// Started (by the host, as the default user) when a sandbox of the template
    /// starts, before its memory snapshot is taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_cmd: Option<String>,
    /// Run until it exits 0 before the started sandbox counts as ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_cmd: Option<String>,
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

    #[test]
    fn a_channel_full_of_prefixes_hides_nothing_and_a_line_cut_short_is_still_arriving() {
        // A guest can write prefixes by the megabyte: each is judged by the 17 bytes
        // after it (scanning to the next newline for each took minutes here).
        let mut buf = IDLE_REPLY_PREFIX.repeat(100_000);
        buf.push(b'\n');
        buf.extend_from_slice(&idle_reply(9));
        assert_eq!(find_line(&buf, IDLE_REPLY_PREFIX).map(|(_, _, n)| n), Some(9));
        let whole = idle_reply(9);
        assert_eq!(find_line(&whole[..whole.len() - 1], IDLE_REPLY_PREFIX), None);
        assert_eq!(find_line(&whole[..IDLE_REPLY_PREFIX.len() + 3], IDLE_REPLY_PREFIX), None);
        // Not 16 digits and a newline: malformed, and what follows it still counts.
        let mut short = b"HUTCH-IDLE 5\n".to_vec();
        assert_eq!(find_line(&short, IDLE_REPLY_PREFIX), None);
        short.extend_from_slice(&whole);
        assert_eq!(find_line(&short, IDLE_REPLY_PREFIX), Some((13, 13 + whole.len(), 9)));
    }

    #[test]
    fn host_lines_are_taken_in_order_and_replies_are_not_probes() {
        let mut buf = b"stale".to_vec();
        buf.extend_from_slice(&idle_probe(5));
        buf.extend_from_slice(&hello_line(6));
        let (end, first) = find_host_line(&buf).expect("a host line");
        assert_eq!(first, HostLine::IdleProbe(5));
        assert_eq!(find_host_line(&buf[end..]).map(|(_, l)| l), Some(HostLine::Hello(6)));
        // The agent's reply does not read as a probe, and a probe is not a reply.
        assert_eq!(find_host_line(&idle_reply(5)), None);
        assert_eq!(find_line(&idle_probe(5), IDLE_REPLY_PREFIX), None);
        assert!(opens_host_line(&idle_probe(1)) && opens_host_line(&hello_line(1)) && !opens_host_line(b"PRI *"));
    }
}
