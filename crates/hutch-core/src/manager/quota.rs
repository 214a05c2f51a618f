//! Per-key quotas: how much of the server one API key may hold, so one tenant cannot
//! take every VM slot or fill the disk with paused sandboxes and snapshots. Checked
//! before the operation that would exceed them; a key's requests racing each other may
//! overshoot by the few in flight at once (bounded by the per-key request cap).

use super::{lock, ManagerError, SandboxManager};
use crate::ids::MemMib;
use hutch_image::template::Shape;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyQuota {
    /// Running sandboxes of one key.
    pub running: usize,
    /// Paused sandboxes of one key (each holds its RAM on disk).
    pub paused: usize,
    /// Stored snapshots of one key (each holds a disk, and RAM unless imported).
    pub snapshots: usize,
    /// The most vCPUs a template one key builds may give its sandboxes.
    pub cpus: u32,
    /// The most memory a template one key builds may give its sandboxes.
    pub memory: MemMib,
    /// The most free disk (MiB) a template one key builds may ask for its sandboxes.
    pub free_disk_mib: u32,
}

impl Default for KeyQuota {
    fn default() -> Self {
        KeyQuota { running: 8, paused: 16, snapshots: 32, cpus: 8, memory: MemMib::new(8192).unwrap_or(MemMib::DEFAULT), free_disk_mib: 32 << 10 }
    }
}

impl KeyQuota {
    /// A template build's `cpuCount`/`memoryMB`/`minFreeDiskMb`, checked against what a
    /// key may ask.
    pub fn check_shape(&self, shape: &Shape) -> Result<(), ManagerError> {
        if let Some(cpus) = shape.cpus {
            if cpus == 0 || cpus > self.cpus {
                return Err(ManagerError::InvalidArgument(format!("cpuCount {cpus} is not allowed: a template's sandboxes may have 1 to {} vCPUs on this server", self.cpus)));
            }
        }
        if let Some(mib) = shape.memory_mib {
            if !(MemMib::MIN..=self.memory.get()).contains(&mib) {
                return Err(ManagerError::InvalidArgument(format!(
                    "memoryMB {mib} is not allowed: a template's sandboxes may have {} to {} MiB on this server",
                    MemMib::MIN,
                    self.memory.get()
                )));
            }
        }
        if let Some(mib) = shape.min_free_disk_mib {
            if mib > self.free_disk_mib {
                return Err(ManagerError::InvalidArgument(format!("minFreeDiskMb {mib} is not allowed: a template's sandboxes may ask for at most {} MiB free on this server", self.free_disk_mib)));
            }
        }
        Ok(())
    }
}

fn over(what: &str, limit: usize, fix: &str) -> ManagerError {
    ManagerError::Quota(format!("this API key already has {limit} {what}, its quota; {fix}"))
}

impl SandboxManager {
    /// (running, paused) sandboxes of `key_id`.
    fn held_by(&self, key_id: &str) -> (usize, usize) {
        let live = lock(&self.live);
        let mine: Vec<_> = live.values().filter(|l| l.row.key_id == key_id).collect();
        (mine.iter().filter(|l| l.holds_vm()).count(), mine.iter().filter(|l| l.is_paused()).count())
    }

    /// Room for `more` running sandboxes of `key_id`.
    pub(super) fn quota_running(&self, key_id: &str, more: usize) -> Result<(), ManagerError> {
        let limit = self.config.quota.running;
        if self.held_by(key_id).0 + more > limit {
            return Err(over("running sandboxes", limit, "kill or pause one first"));
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
