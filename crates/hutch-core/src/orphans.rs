//! VMs no server owns. A server's VMs outlive it so the next server can adopt them
//! (docs/ARCHITECTURE.md, "Restart and adoption"), but while no server runs nobody
//! enforces their end time. The reaper does: one small process per `$HUTCH_HOME`,
//! started by `hutch serve` and living apart from it, that ends a server-owned VM whose
//! server is gone once the end time recorded in the store has passed. While the owner
//! lives, the owner decides (it may extend, pause or kill), and the reaper does
//! nothing but look at the owner's pid every few seconds.

use crate::sandbox::layout::SERVER_OWNED;
use crate::store::{Store, StoreError};
use crate::sweep::{alive, read_pid, running_qemu};
use hutch_image::HutchHome;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

/// How often the reaper looks; an orphan outlives its end time by at most this.
pub const REAP_INTERVAL: Duration = Duration::from_secs(5);

/// A server-owned VM still running after its server ended.
#[derive(Debug, Clone)]
pub struct Orphan {
    pub id: String,
    pub qemu_pid: i32,
    /// When the store says it ends; None when the store has no row for it (no server
    /// will adopt it either).
    pub end_at: Option<SystemTime>,
}

#[derive(Debug, thiserror::Error)]
pub enum ReaperError {
    #[error("opening the store to read orphaned VMs' end times: {0}")]
    Store(#[from] StoreError),
    #[error("locking {0} (one reaper per HUTCH_HOME): {1}")]
    Lock(PathBuf, std::io::Error),
}

/// Server-owned sandbox directories whose QEMU runs and whose owner is gone:
/// (id, QEMU pid).
fn unowned_vms(home: &HutchHome) -> Vec<(String, i32)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(home.sandboxes()).into_iter().flatten().flatten() {
        let dir = entry.path();
        if !dir.join(SERVER_OWNED).is_file() || read_pid(&dir.join("owner.pid")).is_some_and(alive) {
            continue;
        }
        if let Some(pid) = running_qemu(&dir) {
            found.push((entry.file_name().to_string_lossy().into_owned(), pid));
        }
    }
    found
}

/// The VMs no server owns, with their end times from the store.
pub async fn find(home: &HutchHome, store: &Store) -> Result<Vec<Orphan>, StoreError> {
    let vms = unowned_vms(home);
    if vms.is_empty() {
        return Ok(Vec::new());
    }
    // A damaged row tells nothing of its sandbox's end: that orphan's is unknown.
    let rows: Vec<_> = store.sandbox_records().await?.into_iter().filter_map(Result::ok).collect();
    Ok(vms
        .into_iter()
        .map(|(id, qemu_pid)| {
            let end_at = rows.iter().find(|r| r.id == id).map(|r| r.end_at.system_time());
            Orphan { id, qemu_pid, end_at }
        })
        .collect())
}

/// Ends every orphan whose end time has passed (or that the store no longer knows);
/// the ids it ended. Their directories and rows stay for the next server, which finds
/// the VM gone and cleans up as after any VM that ended while it was away.
pub async fn reap_expired(home: &HutchHome, store: &Store, now: SystemTime) -> Result<Vec<String>, StoreError> {
    let mut ended = Vec::new();
    for orphan in find(home, store).await? {
        if orphan.end_at.is_some_and(|end| end > now) {
            continue;
        }
        // Checked again just before the kill: its command line names its directory, so
        // a pid recycled since the scan is not taken for it.
        let dir = home.sandboxes().join(&orphan.id);
        if running_qemu(&dir) == Some(orphan.qemu_pid) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(orphan.qemu_pid), nix::sys::signal::Signal::SIGKILL);
            ended.push(orphan.id);
        }
    }
    Ok(ended)
}

/// The reaper's life: waits its turn (one per home), then every `REAP_INTERVAL` ends
/// expired orphans. It returns once `server_pid` has ended and no orphan is left, so a
/// home with no server and no VMs has no reaper.
pub async fn run_reaper(home: &HutchHome, server_pid: i32) -> Result<(), ReaperError> {
    let lock_path = home.root().join("reaper.lock");
    let lock = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&lock_path).map_err(|e| ReaperError::Lock(lock_path.clone(), e))?;
    // An earlier server's reaper may still be ending that server's orphans: it watches
    // every directory, so this one waits for it to finish (without a deadline: it is a
    // background process whose only job is this).
    let _held = tokio::task::spawn_blocking(move || nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive))
        .await
        .map_err(|e| ReaperError::Lock(lock_path.clone(), std::io::Error::other(e)))?
        .map_err(|(_, e)| ReaperError::Lock(lock_path.clone(), e.into()))?;
    // Held open, so the reaper hears the moment its server ends (and does not stay on
    // in the server's cgroup for a round after it).
    let server = u32::try_from(server_pid).ok().and_then(|pid| hutch_vmm::pidfd::PidFd::open(pid).ok());
    let mut store = None;
    loop {
        let server_alive = match &server {
            Some(s) => !s.has_exited(),
            None => alive(server_pid),
        };
        let orphans = unowned_vms(home);
        if orphans.is_empty() {
            if !server_alive {
                tracing::info!("no server and no orphaned VM left in {}: the reaper ends", home.root().display());
                return Ok(());
            }
        } else {
            let store = match &store {
                Some(s) => s,
                None => store.insert(Store::open_file(&home.root().join("hutch.db")).await?),
            };
            match reap_expired(home, store, SystemTime::now()).await {
                Ok(ended) => {
                    for id in ended {
                        tracing::warn!(sandbox = %id, "ended an orphaned VM at its end time (no server owned it)");
                    }
                }
                Err(e) => tracing::warn!("reading orphaned VMs' end times: {e}"),
            }
        }
        match &server {
            Some(s) if server_alive => {
                s.wait(REAP_INTERVAL).await;
            }
            _ => tokio::time::sleep(REAP_INTERVAL).await,
        }
    }
}
