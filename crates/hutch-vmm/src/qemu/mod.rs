//! The QEMU `microvm` backend: one QEMU process per VM, driven over QMP.

mod args;
pub mod boot_stand_ins;
pub mod cgroup;
pub mod jail;
mod ram_blocks;
pub mod spawn;
pub mod userns;
pub mod version;
mod vm;

pub use args::{command_line, kernel_cmdline, Loading, NIC_QUIRKS};
pub use version::{QemuVersion, QemuVersionError, MIN_VERSION};
pub use vm::QemuVm;

use crate::backend::{StartError, VmBackend, VmHandle, VmSpec};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

pub const DEFAULT_BINARY: &str = "qemu-system-x86_64";

#[derive(Debug, Clone)]
pub struct QemuBackend {
    pub binary: String,
    /// Where host facts (the QEMU version) are cached between processes.
    cache_dir: Option<PathBuf>,
    /// The version check, made once per backend before its first VM.
    version: Arc<OnceLock<Result<QemuVersion, QemuVersionError>>>,
    /// How each VM is confined (`jail.rs`); None runs QEMU as hutch's own user.
    jail: Option<jail::JailConfig>,
}

impl Default for QemuBackend {
    fn default() -> Self {
        QemuBackend { binary: std::env::var("HUTCH_QEMU").unwrap_or_else(|_| DEFAULT_BINARY.into()), cache_dir: None, version: Arc::default(), jail: None }
    }
}

impl QemuBackend {
    /// The backend for a hutch home: it caches what it learns about the host there and,
    /// confines each VM to its own files in that home (`jail.rs`).
    pub fn with_cache_dir(dir: impl Into<PathBuf>) -> Self {
        let dir = dir.into();
        let jail = match jail::JailConfig::for_home(&dir) {
            Ok(config) => Some(config),
            Err(jail::Unconfined::Off) => None,
            Err(why) => {
                tracing::warn!("QEMU runs as this user, confined by seccomp only: {why}");
                None
            }
        };
        QemuBackend { jail, cache_dir: Some(dir), ..QemuBackend::default() }
    }

    /// How VMs are confined, if they are.
    pub fn jail(&self) -> Option<&jail::JailConfig> {
        self.jail.as_ref()
    }

    /// This QEMU's version, or why hutch cannot use it (missing, too old).
    pub fn version(&self) -> Result<QemuVersion, QemuVersionError> {
        self.version.get_or_init(|| version::probe(&self.binary, self.cache_dir.as_deref())).clone()
    }
}

#[async_trait::async_trait]
impl VmBackend for QemuBackend {
    fn name(&self) -> &'static str {
        "qemu-microvm"
    }

    async fn start(&self, spec: &VmSpec) -> Result<Box<dyn VmHandle>, StartError> {
        self.version().map_err(|e| StartError::Unavailable(e.into()))?;
        Ok(Box::new(QemuVm::start(&self.binary, spec, self.jail.as_ref()).await?))
    }

    fn snapshot_key(&self) -> String {
        // QEMU's version line; the flags the guest kernel boots with (the TSC rate
        // aside: the caller keys on the host's); the NIC a saved VM has.
        let version = self.version().map(|v| v.line).unwrap_or_default();
        let cmdline = kernel_cmdline(crate::clock::FALLBACK_TSC_KHZ);
        format!("{version}\0{cmdline}\0nic:virtio-net-device,{NIC_QUIRKS}")
    }

    async fn adopt(&self, spec: &VmSpec, pid: u32) -> Result<Box<dyn VmHandle>, crate::backend::AdoptError> {
        Ok(Box::new(QemuVm::adopt(spec, pid, self.jail.as_ref()).await?))
    }
}
