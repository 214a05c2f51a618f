//! What the data proxy and the API ask of a sandbox without going through its owner:
//! its agent, metrics and console, the tokens its traffic must carry, the Host header
//! it gets, and waking a paused one for traffic (E2B's autoResume).

use super::live::Live;
use super::pause_kinds::{Connected, OnResume};
use super::{state, ManagerError, PauseMode, SandboxManager};
use hutch_envd::AgentClient;
use hutch_net::e2b::PortRoute;
use hutch_proto::agent::Metrics;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// How long a sandbox resumed by traffic lives at least (E2B's 5 minutes).
const AUTO_RESUME_TIMEOUT: Duration = Duration::from_secs(300);

impl SandboxManager {
    pub async fn metrics(&self, key_id: &str, id: &str) -> Result<Metrics, ManagerError> {
        let live = self.find(key_id, id)?;
        let agent = live.owner.agent().ok_or_else(|| ManagerError::Paused(id.to_string()))?;
        agent.get_json("/metrics").await.map_err(ManagerError::Agent)
    }

    /// The sandbox's serial console (kernel and agent messages): the newest
    /// `hutch_vmm::console::CAP` bytes, and how many older ones were dropped.
    pub fn console(&self, key_id: &str, id: &str) -> Result<(String, u64), ManagerError> {
        let live = self.find(key_id, id)?;
        let path = std::path::Path::new(&live.row.dir).join("console.log");
        let bytes = hutch_vmm::console::read(&path);
        Ok((String::from_utf8_lossy(&bytes).into_owned(), hutch_vmm::console::dropped(&path)))
    }

    /// The token port traffic to sandbox `id` must carry, if its ports are private
    /// (None too when there is no such sandbox: the proxy answers that itself).
    /// How the data proxy reaches the sandbox's `port`, read from its record.
    pub fn port_route(&self, id: &str, port: u16) -> PortRoute {
        let recorded = self.shown(id).and_then(|l| crate::sandbox::layout::recorded_network(Path::new(&l.row.dir)).ok());
        recorded.and_then(|s| s.e2b).and_then(|e| e.network).map(|net| net.route(port)).unwrap_or_default()
    }

    pub fn traffic_token(&self, id: &str) -> Option<String> {
        self.shown(id).and_then(|l| l.row.traffic_token.clone())
    }

    /// Every sandbox (running or paused) with an envd access token, and the token: the
    /// data proxy finds the sandbox a signed file URL without a sandbox id is for by
    /// its signature.
    pub fn access_tokens(&self) -> Vec<(String, String)> {
        let live: Vec<Arc<Live>> = self.live.lock().values().filter(|l| !l.is_creating()).cloned().collect();
        live.iter().filter_map(|l| l.row.envd_token.clone().map(|t| (l.row.id.clone(), t))).collect()
    }

    /// Whether traffic to sandbox `id` resumes it while it is paused, and the tokens
    /// the traffic must then carry: (envd access token, traffic token).
    pub fn auto_resumes(&self, id: &str) -> Option<(Option<String>, Option<String>)> {
        let live = self.shown(id)?;
        let row = &live.row;
        row.auto_resume.then(|| (row.envd_token.clone(), row.traffic_token.clone()))
    }

    /// Resumes paused sandbox `id` for data-plane traffic (E2B's autoResume), with
    /// E2B's 5 minutes to live from now; a running one is left as it is.
    pub async fn resume_for_traffic(&self, id: &str) -> Result<(), ManagerError> {
        let live = self.shown(id).ok_or_else(|| ManagerError::NotFound(id.to_string()))?;
        let (key_id, auto) = (live.row.key_id.clone(), live.row.auto_resume);
        // Without memory it boots rather than resumes: the request that woke it would
        // meet a guest that forgot everything (E2B resumes those only by an explicit
        // connect).
        let disk_only = crate::sandbox::layout::paused_mode(Path::new(&live.row.dir)) == Some(PauseMode::Filesystem);
        if !auto || disk_only {
            return Err(ManagerError::Paused(id.to_string()));
        }
        // A sandbox that runs (its agent only held for a snapshot) keeps its timeout.
        if self.connect(&key_id, id, None, OnResume::Restore).await?.1 == Connected::Resumed {
            tracing::info!(sandbox = %id, "traffic for the paused sandbox resumed it (autoResume)");
            self.set_timeout(&key_id, id, AUTO_RESUME_TIMEOUT.as_secs()).await?;
        }
        Ok(())
    }

    /// The agent of a running sandbox, for the data proxy (which has no API key: the
    /// agent itself checks the access token of secure sandboxes).
    pub fn agent(&self, id: &str) -> Result<AgentClient, ManagerError> {
        let live = self.shown(id).ok_or_else(|| ManagerError::NotFound(id.to_string()))?;
        if matches!(live.owner.state(), state::SandboxState::Stopping | state::SandboxState::Stopped) {
            return Err(ManagerError::NotFound(id.to_string()));
        }
        if let Some(why) = live.owner.failure() {
            return Err(ManagerError::Failed { id: id.to_string(), why });
        }
        live.owner.agent().ok_or_else(|| ManagerError::Paused(id.to_string()))
    }
}
