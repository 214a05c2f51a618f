//! Memory snapshots: a VM saved so it can be restored, any number of times, in a
//! fraction of a boot. A snapshot directory holds
//!
//! - `disk.qcow2`: the VM's disk as it was, a frozen layer restored sandboxes stack
//!   their own overlay on;
//! - `state`: QEMU's migration stream (device state, and RAM unless `memory` exists);
//! - `memory`: guest RAM as a plain file, when the VM ran on a shared file mapping and
//!   was saved with `x-ignore-shared`; restored VMs map it copy-on-write, so clones
//!   share its pages in the host page cache;
//! - `snapshot.json`: the manifest below.
//!
//! A snapshot is taken only after the host closed its agent session and the agent said
//! it is idle, so a restored guest starts a fresh session instead of a half-open one.

use hutch_envd::AgentClient;
use hutch_vmm::{Incoming, Memory, SnapshotError, VmHandle};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub const MANIFEST: &str = "snapshot.json";
/// The console of the VM the snapshot was saved from, up to the save.
pub const CONSOLE: &str = "console.log";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    /// The template the disk descends from.
    pub template: String,
    pub cpus: u32,
    pub memory_mib: u32,
    pub accel: hutch_vmm::Accel,
    /// RAM is in the `memory` file, not in `state`.
    pub shared_memory: bool,
    pub created_at: String,
    /// Where it came from: a template's first boot, or a sandbox (fork, E2B snapshot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_sandbox: Option<String>,
    /// The snapshot whose disk layer `disk.qcow2` stacks on, if any: it must outlive
    /// this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<PathBuf>,
    /// The saved VM has a NIC, so its restores get one too (false in manifests from
    /// before sandboxes had networks).
    #[serde(default)]
    pub nic: bool,
    /// The access token the saved guest's agent holds (a secure sandbox's; the saved
    /// memory holds it too): a restore presents it to the agent's `/init`, which wants
    /// it once one is set. None for a guest never given one, and for snapshots saved
    /// before agents asked (their agents do not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_token: Option<String>,
}

#[derive(Debug, Clone)]
pub struct MemorySnapshot {
    pub dir: PathBuf,
    pub manifest: Manifest,
}

#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    #[error("the guest agent did not release its session within {0} s; the sandbox was not snapshotted")]
    AgentBusy(u64),
    #[error("saving the VM state")]
    Vm(#[source] SnapshotError),
    #[error("{what} {path}")]
    File { what: &'static str, path: PathBuf, #[source] source: std::io::Error },
    #[error(transparent)]
    Disk(hutch_vmm::disk::DiskError),
    #[error("the snapshot's manifest")]
    Record(#[source] hutch_image::record::RecordError),
}

fn file_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> SaveError + 'a {
    move |source| SaveError::File { what, path: path.to_path_buf(), source }
}

impl MemorySnapshot {
    /// The snapshot in `dir`, if its manifest reads (`record.rs`: a damaged, foreign
    /// or newer one does not, and is logged).
    pub fn open(dir: &Path) -> Option<MemorySnapshot> {
        let path = dir.join(MANIFEST);
        match hutch_image::record::read(&path, hutch_image::record::Kind::Snapshot) {
            Ok(manifest) => Some(MemorySnapshot { dir: dir.to_path_buf(), manifest }),
            Err(hutch_image::record::RecordError::Read { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                tracing::warn!("{e}");
                None
            }
        }
    }

    pub fn disk(&self) -> PathBuf {
        self.dir.join("disk.qcow2")
    }

    /// A new sandbox's overlay on `disk()` at `overlay`, copied from an empty one kept
    /// in the snapshot (made by the first restore, removed with the snapshot).
    pub async fn new_overlay(&self, overlay: &Path) -> Result<(), hutch_vmm::disk::DiskError> {
        hutch_vmm::disk::create_overlay_cached(&self.disk(), &self.dir.join("empty-overlay.qcow2"), overlay).await
    }

    /// Whether it holds a guest's memory to restore (else only a disk to boot on).
    pub fn has_memory(&self) -> bool {
        self.dir.join("state").is_file()
    }

    /// Makes it disk-only: sandboxes started from it boot on its disk.
    pub fn drop_memory(&self) -> std::io::Result<()> {
        for file in ["state", "memory"] {
            match std::fs::remove_file(self.dir.join(file)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }

    /// Starts a restored sandbox's console with the saved VM's, and says so: the guest
    /// kernel's messages from its boot are part of the state it continues from.
    pub fn seed_console(&self, console: &Path) {
        let mut text = std::fs::read(self.dir.join(CONSOLE)).unwrap_or_default();
        let when = humantime::format_rfc3339_seconds(std::time::SystemTime::now());
        let name = self.dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        text.extend_from_slice(format!("hutch: restored from the snapshot {name} at {when}\n").as_bytes());
        let _ = hutch_vmm::console::seed(console, &text);
    }

    /// How a VM restored from it maps its RAM and what it loads.
    pub fn restore_memory(&self) -> (Memory, Incoming) {
        let memory = if self.manifest.shared_memory { Memory::PrivateFile(self.dir.join("memory")) } else { Memory::Anonymous };
        (memory, Incoming { state: self.dir.join("state"), ignore_shared: self.manifest.shared_memory })
    }

    pub fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<(), SaveError> {
        hutch_image::record::write(&dir.join(MANIFEST), hutch_image::record::Kind::Snapshot, manifest).map_err(SaveError::Record)
    }
}

/// Rewrites a snapshot saved with its RAM inside the state (a fork's, an E2B
/// snapshot's) into the shared-memory form template snapshots have: QEMU loads the
/// state into RAM that is a shared mapping of `memory` and, without running the guest,
/// saves again with `x-ignore-shared`. Sandboxes restored from it then map `memory`
/// copy-on-write and share its pages, instead of each loading a private copy.
pub async fn share_memory(snapshot: &MemorySnapshot, backend: &dyn hutch_vmm::VmBackend, kernel: PathBuf, initrd: PathBuf) -> Result<MemorySnapshot, SaveError> {
    if snapshot.manifest.shared_memory {
        return Ok(snapshot.clone());
    }
    let dir = &snapshot.dir;
    // Short: QEMU's sockets live here while it runs.
    let work = dir.join("s");
    std::fs::create_dir_all(&work).map_err(file_err("creating", &work))?;
    let spec = hutch_vmm::VmSpec {
        id: "share-memory".into(),
        dir: work.clone(),
        kernel,
        initrd,
        disk: snapshot.disk(),
        base: None,
        cpus: snapshot.manifest.cpus,
        memory_mib: snapshot.manifest.memory_mib,
        accel: snapshot.manifest.accel,
        memory: Memory::SharedFile(dir.join("memory")),
        incoming: Some(Incoming { state: dir.join("state"), ignore_shared: false }),
        die_with_parent: true,
        agent_channel: hutch_proto::AGENT_PORT_NAME.into(),
        nic: snapshot.manifest.nic.then(crate::sandbox::layout::guest_nic),
    };
    let result = async {
        let mut vm = backend.start(&spec).await.map_err(|e| SaveError::Vm(SnapshotError::Migration { what: "load", detail: e.to_string() }))?;
        vm.load().await.map_err(SaveError::Vm)?;
        // The guest never runs here: the state goes out as it came in, minus RAM.
        vm.save(&dir.join("state.shared"), true).await.map_err(SaveError::Vm)?;
        let _ = vm.kill().await;
        std::fs::rename(dir.join("state.shared"), dir.join("state")).map_err(file_err("replacing", &dir.join("state")))?;
        let manifest = Manifest { shared_memory: true, ..snapshot.manifest.clone() };
        MemorySnapshot::write_manifest(dir, &manifest)?;
        Ok(MemorySnapshot { dir: dir.clone(), manifest })
    }
    .await;
    let _ = std::fs::remove_dir_all(&work);
    if result.is_err() {
        let _ = std::fs::remove_file(dir.join("memory"));
        let _ = std::fs::remove_file(dir.join("state.shared"));
    }
    result
}

/// Copies `from` to a new `to`, leaving holes where it has them (a memory file is
/// mostly holes: zero pages are never written).
pub(crate) fn copy_sparse(from: &Path, to: &Path) -> std::io::Result<()> {
    use nix::unistd::{lseek, Whence};
    use std::io::{Read, Seek, SeekFrom};
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    let mut src = std::fs::File::open(from)?;
    let dst = std::fs::OpenOptions::new().write(true).create_new(true).open(to)?;
    let len = src.metadata()?.len();
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0i64;
    while (at as u64) < len {
        let data = match lseek(src.as_raw_fd(), at, Whence::SeekData) {
            Ok(data) => data,
            // No data after `at`: the rest is a hole.
            Err(nix::errno::Errno::ENXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let hole = lseek(src.as_raw_fd(), data, Whence::SeekHole).map_err(std::io::Error::from)?;
        src.seek(SeekFrom::Start(data as u64))?;
        let mut pos = data as u64;
        while pos < hole as u64 {
            let n = ((hole as u64 - pos) as usize).min(buf.len());
            src.read_exact(&mut buf[..n])?;
            dst.write_all_at(&buf[..n], pos)?;
            pos += n as u64;
        }
        at = hole;
    }
    dst.set_len(len)
}

/// Closes the host's agent session and waits until the guest agent, asked over its
/// channel (`socket`), answers that it has left the session (an idle probe): the
/// moment a VM can be saved. Nothing the guest prints on its console counts.
pub async fn release_agent(agent: &AgentClient, socket: &Path, limit: Duration) -> Result<(), SaveError> {
    agent.close();
    match tokio::time::timeout(limit, hutch_envd::wait_idle(socket)).await {
        Ok(Ok(())) => Ok(()),
        // QEMU ended, the channel broke or the deadline passed: not idle.
        _ => Err(SaveError::AgentBusy(limit.as_secs())),
    }
}

/// Saves a paused-for-saving VM into `dir`: its state (RAM left out when it lives in a
/// shared file) and a copy of its disk overlay, taken while QEMU has the disk flushed
/// and inactive, its header naming `base` (the image hutch made the overlay on). The VM
/// stays paused.
pub async fn save_vm(vm: &mut dyn VmHandle, overlay: &Path, base: Option<&Path>, dir: &Path, shared_memory: bool) -> Result<(), SaveError> {
    vm.save(&dir.join("state"), shared_memory).await.map_err(SaveError::Vm)?;
    let console = dir.join(CONSOLE);
    if vm.console_log() != console {
        let _ = hutch_vmm::console::copy(&vm.console_log(), &console);
    }
    let disk = dir.join("disk.qcow2");
    if overlay != disk {
        std::fs::copy(overlay, &disk).map_err(file_err("copying the disk to", &disk))?;
        if let Some(base) = base {
            hutch_vmm::disk::reset_backing(&disk, base).map_err(SaveError::Disk)?;
        }
    }
    Ok(())
}

/// The built-in template the sandbox in `dir` descends from, as the snapshot its disk
/// stacks on records it: what it boots with, even after the user's snapshot it was
/// started from (its row's template) was deleted.
pub fn descends_from(dir: &Path) -> Option<String> {
    let (record, _) = crate::sandbox::layout::read_record(dir).ok()?;
    MemorySnapshot::open(&record.base_snapshot?).map(|s| s.manifest.template)
}

