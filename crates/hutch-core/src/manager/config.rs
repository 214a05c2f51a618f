//! What a manager is set up with (`hutch serve`'s flags) and what a create asks for.

use super::key_quota::KeyQuota;
use crate::ids::MemMib;
use crate::sandbox::layout::PauseMode;
use hutch_vmm::Accel;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// Sandboxes allowed at once (all keys together); more answer 429.
    pub max_sandboxes: usize,
    pub default_timeout: Duration,
    /// No sandbox lives longer than this from its start, whatever timeouts ask.
    pub max_lifetime: Duration,
    pub accel: Accel,
    pub cpus: u32,
    /// Memory per sandbox; `None`: each template's own (`MemMib::of_template`).
    pub memory: Option<MemMib>,
    /// The warm pools: pinned sizes, sizing by demand, the memory they leave free.
    pub pool: super::pool_sizing::PoolPolicy,
    /// What one API key may hold.
    pub quota: KeyQuota,
    /// The operator's network settings every sandbox's stack shares.
    pub net_env: Arc<hutch_net::Environment>,
    /// Whether an E2B create that says nothing of `allow_internet_access` gets the
    /// public internet, as on E2B (its newest SDKs leave the field out by default).
    pub internet_by_default: bool,
    /// Registries (`host:port`) on this machine or a private network that API template
    /// builds may pull from, over plain HTTP (`hutch serve --insecure-registry`).
    pub insecure_registries: Vec<String>,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        ManagerConfig {
            max_sandboxes: 16,
            default_timeout: Duration::from_secs(300),
            max_lifetime: Duration::from_secs(24 * 3600),
            accel: Accel::Tcg,
            cpus: 1,
            memory: None,
            pool: super::pool_sizing::PoolPolicy::off(),
            quota: KeyQuota::default(),
            net_env: Arc::new(hutch_net::Environment::default()),
            internet_by_default: true,
            insecure_registries: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct CreateSpec {
    pub template: String,
    /// Seconds until the sandbox is killed; the default when absent.
    pub timeout: Option<u64>,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    /// Require the envd access token on the data plane.
    pub secure: bool,
    /// Pause instead of kill when the timeout is reached.
    pub auto_pause: bool,
    /// Resume when data-plane traffic arrives while paused.
    pub auto_resume: bool,
    /// What the timeout's auto-pause keeps.
    pub auto_pause_mode: PauseMode,
    /// Boot the kernel instead of restoring the template's memory snapshot.
    pub cold: bool,
    /// Ports take traffic only with the sandbox's traffic token (E2B's
    /// `allowPublicTraffic: false`).
    pub private_ports: bool,
    /// Where the sandbox may connect; nowhere when absent.
    pub network: Option<hutch_net::Settings>,
}

/// E2B caps a fork at 20 sandboxes.
pub const MAX_FORKS: u32 = 20;
