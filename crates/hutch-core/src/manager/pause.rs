//! Pause and resume (E2B semantics): a paused sandbox keeps its memory, processes and
//! files on disk under its directory, holds no VM, and survives server restarts; a
//! connect (or resume) brings it back under the same id.

use super::{lock, parse_time, Live, ManagerError, SandboxManager};
use crate::sandbox::{Sandbox, PAUSED_STATE, VM_RECORD};
use crate::store::{rfc3339, SandboxRow};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// What a connect did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connected {
    AlreadyRunning,
    Resumed,
}

fn is_paused_dir(dir: &Path) -> bool {
    dir.join(PAUSED_STATE).is_file() && dir.join(VM_RECORD).is_file()
}

/// Who asks for a pause. The paused-sandbox quota binds clients; a sandbox the key
/// asked to pause at its timeout (autoPause) is paused over it rather than destroyed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PausedBy {
    Client,
    AutoPause,
}

impl SandboxManager {
    /// At start: paused sandboxes of earlier runs are taken over; running ones died
    /// with that server (their VMs end with it) and are removed, each logged.
    pub(super) async fn adopt_paused(&self) -> Result<(), ManagerError> {
        let mut kept = std::collections::HashSet::new();
        for row in self.store.sandboxes().await? {
            if row.state == "paused" && is_paused_dir(Path::new(&row.dir)) {
                tracing::info!(sandbox = %row.id, "paused sandbox from an earlier server run: kept, resumes on connect");
                kept.insert(row.dir.clone());
                lock(&self.live).insert(row.id.clone(), Live::paused(row));
                continue;
            }
            tracing::warn!(sandbox = %row.id, state = %row.state, "sandbox from an earlier server run is gone (its VM ended with that server); removing its record and files");
            let _ = std::fs::remove_dir_all(&row.dir);
            self.store.delete_sandbox(&row.id).await?;
        }
        // Paused directories without a record (a crash between the save and the
        // store update) cannot be resumed by anyone: remove them.
        for entry in std::fs::read_dir(self.home.sandboxes()).into_iter().flatten().flatten() {
            let dir = entry.path();
            if is_paused_dir(&dir) && !kept.contains(&dir.display().to_string()) {
                tracing::warn!(dir = %dir.display(), "paused sandbox files without a record; removing them");
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
        Ok(())
    }

    /// E2B's pause: saves the sandbox and stops its VM.
    pub async fn pause(&self, key_id: &str, id: &str) -> Result<(), ManagerError> {
        let live = self.find(key_id, id)?;
        self.pause_live(id, &live, PausedBy::Client).await
    }

    pub(super) async fn pause_live(&self, id: &str, live: &Arc<Live>, by: PausedBy) -> Result<(), ManagerError> {
        let mut slot = live.sandbox.lock().await;
        let Some(sandbox) = slot.as_mut() else { return Err(ManagerError::AlreadyPaused(id.to_string())) };
        if by == PausedBy::Client {
            let key_id = lock(&live.row).key_id.clone();
            self.quota_paused(&key_id)?;
        }
        self.room_for_memory(sandbox.memory_mib())?;
        // New data-plane requests see "paused" from here on.
        lock(&live.agent).take();
        if let Err(e) = sandbox.pause().await {
            *lock(&live.agent) = Some(sandbox.agent().clone());
            return Err(ManagerError::Pause(e));
        }
        // Dropping a paused Sandbox keeps its directory.
        slot.take();
        let end_at = lock(&live.row).end_at.clone();
        self.store.set_state(id, "paused", None, &end_at).await?;
        let mut row = lock(&live.row);
        row.state = "paused".into();
        row.qemu_pid = None;
        Ok(())
    }

    /// E2B's connect: resumes a paused sandbox; extends the timeout (never shortens
    /// it) to `secs` from now.
    pub async fn connect(&self, key_id: &str, id: &str, secs: Option<u64>) -> Result<(SandboxRow, Connected), ManagerError> {
        let live = self.find(key_id, id)?;
        let how = self.resume_live(id, &live, secs).await?;
        let row = lock(&live.row).clone();
        let Some(secs) = secs else { return Ok((row, how)) };
        let wanted = SystemTime::now() + Duration::from_secs(secs);
        if wanted > parse_time(&row.end_at) {
            return Ok((self.set_timeout(key_id, id, secs).await?, how));
        }
        Ok((row, how))
    }

    async fn resume_live(&self, id: &str, live: &Arc<Live>, secs: Option<u64>) -> Result<Connected, ManagerError> {
        let mut slot = live.sandbox.lock().await;
        if slot.is_some() {
            return Ok(Connected::AlreadyRunning);
        }
        let row = lock(&live.row).clone();
        self.quota_running(&row.key_id, 1)?;
        let _reserved = self.reserve_slot()?;
        let opts = self.options(&row.env_vars, &row.metadata, row.envd_token.clone());
        let sandbox = Sandbox::resume(Path::new(&row.dir), self.backend.as_ref(), &opts).await.map_err(ManagerError::Resume)?;
        let started = parse_time(&row.started_at);
        let timeout = Duration::from_secs(secs.unwrap_or(self.config.default_timeout.as_secs()));
        let end_at = rfc3339(self.end_at(started, timeout).max(SystemTime::now() + Duration::from_secs(1)));
        let pid = sandbox.pid().map(i64::from);
        self.store.set_state(id, "running", pid, &end_at).await?;
        *lock(&live.agent) = Some(sandbox.agent().clone());
        *slot = Some(sandbox);
        let mut row = lock(&live.row);
        row.state = "running".into();
        row.qemu_pid = pid;
        row.end_at = end_at;
        Ok(Connected::Resumed)
    }
}
