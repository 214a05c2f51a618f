//! E2B's REST shapes (field names exact; see the protocol spec §2.2).

use hutch_core::store::{SandboxRow, SnapshotRow};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// E2B returns this constant; the SDKs require the field.
pub const CLIENT_ID: &str = "6532622b";

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(default)]
    pub timeout: Option<i64>,
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub env_vars: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub secure: Option<bool>,
    /// E2B's switch: true is the public internet and DNS (the SDKs send true unless
    /// told otherwise), false or absent is no egress.
    #[serde(default, rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    /// hutch's own: egress rules (`allow@public:tcp:443`, …), instead of E2B's fields.
    #[serde(default)]
    pub egress: Option<Vec<String>>,
    #[serde(default)]
    pub auto_pause: Option<bool>,
    #[serde(default)]
    pub auto_resume: Option<AutoResume>,
    /// The timeout's auto-pause keeps memory (true, the default) or only the disk.
    #[serde(default)]
    pub auto_pause_memory: Option<bool>,
    /// hutch's own: boot the kernel instead of restoring the template's snapshot.
    #[serde(default)]
    pub cold: Option<bool>,
    #[serde(default)]
    pub network: Option<hutch_net::e2b::E2bNetwork>,
    /// hutch's own: secrets of the API key bound to environment variables, which hold
    /// their placeholders, and to the hosts the values are filled in for.
    #[serde(default)]
    pub secrets: Option<BTreeMap<String, hutch_net::inspect::SecretBinding>>,
}

/// E2B's `SandboxNetworkUpdateConfig` (`PUT /sandboxes/{id}/network`): it replaces the
/// whole configuration; what it leaves out is cleared.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkUpdate {
    #[serde(default, alias = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    #[serde(flatten)]
    pub network: hutch_net::e2b::E2bNetwork,
    /// hutch's own rules, instead of E2B's fields.
    #[serde(default)]
    pub egress: Option<Vec<String>>,
}

/// A sandbox's network as `GET /sandboxes/{id}/network` shows it: the rules in force,
/// what the client set, and what the stack refused.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkView {
    pub egress: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allow_internet_access: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<hutch_net::e2b::E2bNetwork>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log: Option<hutch_net::LogView>,
}

impl NetworkView {
    pub fn new(settings: &hutch_net::Settings, log: Option<hutch_net::LogView>) -> NetworkView {
        NetworkView {
            egress: settings.policy.texts(),
            allow_internet_access: settings.e2b.as_ref().and_then(|e| e.allow_internet_access),
            network: settings.e2b.as_ref().and_then(|e| e.network.clone()),
            log,
        }
    }
}

/// E2B's `SandboxAutoResumeConfig`: traffic to the paused sandbox resumes it.
#[derive(Debug, Default, Deserialize)]
pub struct AutoResume {
    #[serde(default)]
    pub enabled: bool,
}

#[derive(Debug, Default, Deserialize)]
pub struct ForkBody {
    #[serde(default)]
    pub timeout: Option<i64>,
    #[serde(default)]
    pub count: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
pub struct SnapshotBody {
    #[serde(default)]
    pub name: Option<String>,
    /// false: the disk only (sandboxes started from it boot).
    #[serde(default)]
    pub memory: Option<bool>,
}

/// E2B's `SandboxPauseRequest` (older SDKs send no body).
#[derive(Debug, Default, Deserialize)]
pub struct PauseBody {
    /// false: keep only the disk; a resume boots on it.
    #[serde(default)]
    pub memory: Option<bool>,
}

/// E2B's `SnapshotInfo`.
#[derive(Debug, Serialize)]
pub struct SnapshotInfo {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    pub names: Vec<String>,
    /// hutch's additions.
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID", skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    #[serde(rename = "createdAt")]
    pub created_at: String,
    pub memory: bool,
}

impl From<&SnapshotRow> for SnapshotInfo {
    fn from(r: &SnapshotRow) -> Self {
        SnapshotInfo {
            snapshot_id: r.id.clone(),
            names: r.name.iter().cloned().collect(),
            template_id: r.template.clone(),
            sandbox_id: r.source_sandbox.clone(),
            created_at: r.created_at.clone(),
            memory: r.memory,
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct TimeoutBody {
    pub timeout: i64,
}

#[derive(Debug, Default, Deserialize)]
pub struct ConnectBody {
    #[serde(default)]
    pub timeout: Option<i64>,
    /// false: boot on the disk, whatever memory the pause kept (E2B's reboot).
    #[serde(default)]
    pub memory: Option<bool>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Sandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: &'static str,
    pub envd_version: &'static str,
    pub alias: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
    pub traffic_access_token: Option<String>,
    pub domain: Option<String>,
}

impl From<&SandboxRow> for Sandbox {
    fn from(r: &SandboxRow) -> Self {
        Sandbox {
            template_id: r.template.clone(),
            sandbox_id: r.id.clone(),
            client_id: CLIENT_ID,
            envd_version: hutch_proto::ENVD_VERSION,
            alias: r.template.clone(),
            envd_access_token: r.envd_token.clone(),
            traffic_access_token: r.traffic_token.clone(),
            domain: None,
        }
    }
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxDetail {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: &'static str,
    pub envd_version: &'static str,
    pub alias: String,
    pub started_at: String,
    pub end_at: String,
    pub cpu_count: i64,
    #[serde(rename = "memoryMB")]
    pub memory_mb: i64,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: i64,
    pub state: String,
    /// hutch's own: why the sandbox failed (its VM or agent stopped answering). E2B's
    /// `state` has only running and paused, so a failed sandbox stays "running" there
    /// (the SDKs parse it) and says it here; kill it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    pub metadata: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traffic_access_token: Option<String>,
    pub allow_internet_access: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<hutch_net::e2b::E2bNetwork>,
    /// hutch's own: the egress rules in force.
    pub egress: Vec<String>,
    /// What a paused sandbox's pause kept: `full` or `filesystem`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pause_mode: Option<&'static str>,
}

impl SandboxDetail {
    /// With the sandbox's network settings.
    pub fn with_network(mut self, settings: &hutch_net::Settings) -> SandboxDetail {
        let e2b = settings.e2b.as_ref();
        self.allow_internet_access = match e2b.and_then(|e| e.allow_internet_access) {
            Some(v) => v,
            None => settings.policy.rules.iter().any(|r| r.action == hutch_net::rules::Action::Allow),
        };
        self.network = e2b.and_then(|e| e.network.clone());
        self.egress = settings.policy.texts();
        self
    }
}

impl From<&SandboxRow> for SandboxDetail {
    fn from(r: &SandboxRow) -> Self {
        SandboxDetail {
            template_id: r.template.clone(),
            sandbox_id: r.id.clone(),
            client_id: CLIENT_ID,
            envd_version: hutch_proto::ENVD_VERSION,
            alias: r.template.clone(),
            started_at: r.started_at.to_string(),
            end_at: r.end_at.to_string(),
            cpu_count: r.cpu_count,
            memory_mb: r.memory_mb,
            disk_size_mb: r.disk_mb,
            state: r.state.clone(),
            failure: r.failure.clone(),
            metadata: r.metadata.clone(),
            envd_access_token: r.envd_token.clone(),
            traffic_access_token: r.traffic_token.clone(),
            allow_internet_access: false,
            network: None,
            egress: Vec::new(),
            pause_mode: r.pause_mode.map(|m| m.as_str()),
        }
    }
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxMetric {
    pub timestamp: String,
    pub timestamp_unix: i64,
    pub cpu_count: u32,
    pub cpu_used_pct: f32,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}
