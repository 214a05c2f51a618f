//! What one API key may hold (`hutch serve --quota-*`), and the build shapes it may ask
//! for; `quota.rs` checks operations against it.

use super::error::ManagerError;
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
