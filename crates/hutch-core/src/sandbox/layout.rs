//! A sandbox's directory under `$HUTCH_HOME/sandboxes/<id>`: what its files are called
//! and say (`vm.json`, the paused state, the server's mark, the console), read and
//! written here only.

use crate::ids::SandboxId;
use hutch_image::record::RecordError;
use hutch_image::HutchHome;
use hutch_vmm::VmSpec;
use std::path::{Path, PathBuf};

/// What a sandbox directory records about its VM (`vm.json`): enough to resume it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct VmRecord {
    pub spec: VmSpec,
    /// The snapshot whose disk layer this sandbox's overlay stacks on.
    pub base_snapshot: Option<PathBuf>,
    /// Where the sandbox may connect (nowhere in records from before networking).
    #[serde(default)]
    pub network: hutch_net::Settings,
}

/// The network settings in the record of the sandbox in `dir` (paused, or a fork's
/// parent).
pub fn recorded_network(dir: &Path) -> Result<hutch_net::Settings, RecordError> {
    Ok(read_record(dir)?.0.network)
}

/// Replaces the network settings in the record of the paused sandbox in `dir`: its
/// stack follows them when it resumes.
pub fn record_network(dir: &Path, settings: hutch_net::Settings) -> Result<(), RecordError> {
    let (mut record, _) = read_record(dir)?;
    record.network = settings;
    write_record(dir, &record)
}

/// The NIC of every VM hutch starts now (the stack on its host end: hutch-net).
pub fn guest_nic() -> hutch_vmm::Nic {
    hutch_vmm::Nic { mac: hutch_proto::net::GUEST_MAC, mtu: hutch_proto::net::MTU as u32, host_end: hutch_vmm::NicHostEnd::Stream }
}

pub const VM_RECORD: &str = "vm.json";

/// The snapshot directories the sandboxes of this home stack their disks on.
pub fn base_snapshots_in_use(home: &HutchHome) -> std::collections::HashSet<PathBuf> {
    std::fs::read_dir(home.sandboxes())
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| hutch_image::record::read::<VmRecord>(&e.path().join(VM_RECORD), hutch_image::record::Kind::Vm).ok())
        .filter_map(|r| r.base_snapshot)
        .collect()
}
/// Present while the sandbox is paused: its saved state lives beside it.
pub const PAUSED_STATE: &str = "memory.state";
/// Present while the sandbox is paused without its memory (E2B's filesystem-only
/// pause): its disk is all there is, and it resumes by booting on it.
pub const PAUSED_DISK: &str = "disk.paused";

/// What a pause keeps (E2B's `memory` flag of a pause; `pauseMode` in its API).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PauseMode {
    /// Memory and disk: a resume goes on where the guest was.
    #[default]
    Full,
    /// The disk only: a resume boots the guest on it, without its processes.
    Filesystem,
}

impl PauseMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PauseMode::Full => "full",
            PauseMode::Filesystem => "filesystem",
        }
    }
}

/// How the sandbox in `dir` is paused, if it is: what its files say.
pub fn paused_mode(dir: &Path) -> Option<PauseMode> {
    if !dir.join(VM_RECORD).is_file() {
        return None;
    }
    if dir.join(PAUSED_STATE).is_file() {
        Some(PauseMode::Full)
    } else if dir.join(PAUSED_DISK).is_file() {
        Some(PauseMode::Filesystem)
    } else {
        None
    }
}
/// A pause's save in progress; renamed to `PAUSED_STATE` once complete, so that name
/// always holds a whole state.
pub(crate) const SAVING_STATE: &str = "memory.state.partial";
/// Marks a sandbox a server answers for: its VM outlives that server, for the next
/// one to adopt, and local commands' orphan sweeps leave it alone.
pub const SERVER_OWNED: &str = "server.owned";

/// The sandbox directory's `vm.json`, and the sandbox id it names.
pub fn read_record(dir: &Path) -> Result<(VmRecord, SandboxId), RecordError> {
    let path = dir.join(VM_RECORD);
    let record: VmRecord = hutch_image::record::read(&path, hutch_image::record::Kind::Vm)?;
    match SandboxId::parse(&record.spec.id) {
        Some(id) => Ok((record, id)),
        None => Err(RecordError::Corrupt { detail: format!("bad sandbox id '{}'", record.spec.id), path }),
    }
}

pub fn write_record(dir: &Path, record: &VmRecord) -> Result<(), RecordError> {
    hutch_image::record::write(&dir.join(VM_RECORD), hutch_image::record::Kind::Vm, record)
}

/// Removes a half-made sandbox directory unless disarmed.
pub(crate) struct DirGuard(pub(crate) Option<PathBuf>);

impl Drop for DirGuard {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            remove_sandbox_dir(&dir);
        }
    }
}

/// Removes a sandbox's directory once its VM is gone, saying so if that fails (the next
/// sweep removes it then). A second pass takes what was created while the first ran:
/// a console copy that was mid-write on another thread when its VM's handle dropped
/// (rotating creates files), or a `qemu-img` killed on a cancel but not yet dead.
pub(crate) fn remove_sandbox_dir(dir: &Path) {
    let mut result = std::fs::remove_dir_all(dir);
    if result.is_err() && dir.exists() {
        result = std::fs::remove_dir_all(dir);
    }
    match result {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => tracing::warn!(dir = %dir.display(), "removing the sandbox directory: {e}"),
        _ => {}
    }
}

/// The last `lines` lines of a console log, for error messages.
pub fn console_tail(path: &Path, lines: usize) -> String {
    let text = String::from_utf8_lossy(&hutch_vmm::console::read(path)).into_owned();
    let all: Vec<&str> = text.lines().collect();
    let tail = all[all.len().saturating_sub(lines)..].join("\n");
    if tail.trim().is_empty() {
        "(the console is empty)".into()
    } else {
        tail
    }
}
