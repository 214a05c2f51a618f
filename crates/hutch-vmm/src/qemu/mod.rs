//! The QEMU `microvm` backend: one QEMU process per VM, driven over QMP.

mod args;
mod vm;

pub use args::{command_line, KERNEL_CMDLINE};
pub use vm::QemuVm;

use crate::backend::{StartError, VmBackend, VmHandle, VmSpec};

pub const DEFAULT_BINARY: &str = "qemu-system-x86_64";

#[derive(Debug, Clone)]
pub struct QemuBackend {
    pub binary: String,
}

impl Default for QemuBackend {
    fn default() -> Self {
        QemuBackend { binary: std::env::var("HUTCH_QEMU").unwrap_or_else(|_| DEFAULT_BINARY.into()) }
    }
}

#[async_trait::async_trait]
impl VmBackend for QemuBackend {
    fn name(&self) -> &'static str {
        "qemu-microvm"
    }

    async fn start(&self, spec: &VmSpec) -> Result<Box<dyn VmHandle>, StartError> {
        Ok(Box::new(QemuVm::start(&self.binary, spec).await?))
    }
}

/// `qemu-system-x86_64 --version`'s first line, or why it cannot be run.
pub fn version(binary: &str) -> Result<String, String> {
    match std::process::Command::new(binary).arg("--version").output() {
        Ok(out) => Ok(String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or("").to_string()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(format!("{binary} is not installed; install it with: apt-get install qemu-system-x86"))
        }
        Err(e) => Err(format!("cannot run {binary}: {e}")),
    }
}
