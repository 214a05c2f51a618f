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
}

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
