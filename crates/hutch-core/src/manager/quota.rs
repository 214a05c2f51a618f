//! Per-key quotas: how much of the server one API key may hold, so one tenant cannot
//! take every VM slot or fill the disk with paused sandboxes and snapshots. Checked
//! before the operation that would exceed them; a key's requests racing each other may
//! overshoot by the few in flight at once (bounded by the per-key request cap).

use super::error::ManagerError;
use super::SandboxManager;

fn over(what: &str, limit: usize, fix: &str) -> ManagerError {
    ManagerError::Quota(format!("this API key already has {limit} {what}, its quota; {fix}"))
}

/// The refusal of one more running sandbox for a key that has `limit` (`create.rs`
/// counts it as it admits a sandbox).
pub(super) fn over_running(limit: usize) -> ManagerError {
    over("running sandboxes", limit, "kill or pause one first")
}

impl SandboxManager {
    /// (running, paused) sandboxes of `key_id`.
    fn held_by(&self, key_id: &str) -> (usize, usize) {
        let live = self.live.lock();
        let mine: Vec<_> = live.values().filter(|l| l.row.key_id == key_id).collect();
        (mine.iter().filter(|l| l.holds_vm()).count(), mine.iter().filter(|l| l.is_paused()).count())
    }

    /// Room for `more` running sandboxes of `key_id`.
    pub(super) fn quota_running(&self, key_id: &str, more: usize) -> Result<(), ManagerError> {
        let limit = self.config.quota.running;
        if self.held_by(key_id).0 + more > limit {
            return Err(over_running(limit));
        }
        Ok(())
    }

    pub(super) fn quota_paused(&self, key_id: &str) -> Result<(), ManagerError> {
        let limit = self.config.quota.paused;
        if self.held_by(key_id).1 >= limit {
            return Err(over("paused sandboxes", limit, "resume or kill one first"));
        }
        Ok(())
    }

    pub(super) async fn quota_snapshots(&self, key_id: &str) -> Result<(), ManagerError> {
        let limit = self.config.quota.snapshots;
        if self.store.snapshots(key_id).await?.len() >= limit {
            return Err(over("snapshots", limit, "delete one first (DELETE /templates/{id})"));
        }
        Ok(())
    }
}
