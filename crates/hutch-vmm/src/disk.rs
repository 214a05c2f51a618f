//! Per-sandbox disks: a qcow2 overlay over the read-only template image, so creating a
//! sandbox copies nothing.

use std::path::Path;
use std::process::Stdio;

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("qemu-img is not installed; install it with: apt-get install qemu-utils")]
    NoQemuImg,
    #[error("qemu-img could not create the overlay {path}: {stderr}")]
    Failed { path: String, stderr: String },
    #[error("running qemu-img")]
    Io(#[source] std::io::Error),
}

pub async fn create_overlay(base: &Path, overlay: &Path) -> Result<(), DiskError> {
    let out = tokio::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
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
