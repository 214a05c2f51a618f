//! Per-sandbox disks: a qcow2 overlay over a read-only base (a template's raw image or a
//! snapshot's frozen qcow2 layer), so creating a sandbox copies nothing.

use std::path::Path;
use std::process::Stdio;

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("qemu-img is not installed (package qemu-utils); {}", crate::qemu::version::install_hint())]
    NoQemuImg,
    #[error("qemu-img could not create the overlay {path}: {stderr}")]
    Failed { path: String, stderr: String },
    #[error("running qemu-img")]
    Io(#[source] std::io::Error),
}

/// The base's format: qcow2 files start with "QFI\xfb"; anything else is raw.
fn format_of(base: &Path) -> &'static str {
    let mut magic = [0u8; 4];
    let is_qcow2 = std::fs::File::open(base).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic)).is_ok() && &magic == b"QFI\xfb";
    if is_qcow2 { "qcow2" } else { "raw" }
}

pub async fn create_overlay(base: &Path, overlay: &Path) -> Result<(), DiskError> {
    let out = tokio::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", format_of(base), "-b"])
        .arg(base)
        .arg(overlay)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| if e.kind() == std::io::ErrorKind::NotFound { DiskError::NoQemuImg } else { DiskError::Io(e) })?;
    if !out.status.success() {
        return Err(DiskError::Failed {
            path: overlay.display().to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}
