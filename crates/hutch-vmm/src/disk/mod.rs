//! Per-sandbox disks: a qcow2 overlay over a read-only base (a template's raw image or a
//! snapshot's frozen qcow2 layer), so creating a sandbox copies nothing.

pub mod backing;

use std::path::Path;
use std::process::Stdio;

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("qemu-img is not installed (package qemu-utils); {}", crate::qemu::version::install_hint())]
    NoQemuImg,
    #[error("qemu-img could not create the overlay {path}: {stderr}")]
    Failed { path: String, stderr: String },
    #[error("the disk copy {path} cannot be stored: {why}")]
    Unsafe { path: String, why: String },
    /// The host path stays in the server's log: this one reaches API clients (a build's
    /// reason).
    #[error("qemu-img could not flatten the layers into one image: {stderr}")]
    Flatten { stderr: String },
    #[error("running qemu-img")]
    Io(#[source] std::io::Error),
}

/// Creating an overlay or rewriting a header touches a few clusters: seconds even on
/// a loaded host. Beyond this the tool is wedged.
const QEMU_IMG_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// The base's format: qcow2 files start with "QFI\xfb"; anything else is raw.
fn format_of(base: &Path) -> &'static str {
    let mut magic = [0u8; 4];
    let is_qcow2 = std::fs::File::open(base).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic)).is_ok() && &magic == b"QFI\xfb";
    if is_qcow2 { "qcow2" } else { "raw" }
}

/// Gives `image`, a copy of a VM's overlay, the header backing name `base` (the image
/// hutch made the overlay on), whatever the VM's QEMU wrote there: a stored snapshot's
/// header is then hutch's own, and so is every header below a disk made on it. An
/// image whose data lives in another file is refused: its header names that file too.
pub fn reset_backing(image: &Path, base: &Path) -> Result<(), DiskError> {
    let changed = |why: String| DiskError::Unsafe { path: image.display().to_string(), why };
    if backing::has_external_data(image).map_err(|e| changed(e.to_string()))? {
        return Err(changed("its header names an external data file, which hutch never makes (the VM changed it)".into()));
    }
    // -u rewrites only the header; the image's own clusters stay as they are.
    let mut cmd = std::process::Command::new("qemu-img");
    cmd.args(["rebase", "-q", "-u", "-f", "qcow2", "-F", format_of(base), "-b"]).arg(base).arg(image);
    let out = crate::process::output_within(&mut cmd, QEMU_IMG_WAIT)
        .map_err(|e| if e.kind() == std::io::ErrorKind::NotFound { DiskError::NoQemuImg } else { DiskError::Io(e) })?;
    if !out.status.success() {
        return Err(changed(String::from_utf8_lossy(&out.stderr).trim().to_string()));
    }
    Ok(())
}

/// The chain under `layer` (qcow2 by its extension, else raw) copied into one sparse
/// raw image at `raw`: a build's layers become a template's image. Given `limit`, as it
/// reads and writes the whole disk.
pub fn flatten_to_raw(layer: &Path, raw: &Path, limit: std::time::Duration) -> Result<(), DiskError> {
    let format = if layer.extension().is_some_and(|e| e == "qcow2") { "qcow2" } else { "raw" };
    let mut cmd = std::process::Command::new("qemu-img");
    cmd.args(["convert", "-f", format, "-O", "raw"]).arg(layer).arg(raw);
    let out = crate::process::output_within(&mut cmd, limit)
        .map_err(|e| if e.kind() == std::io::ErrorKind::NotFound { DiskError::NoQemuImg } else { DiskError::Io(e) })?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        tracing::warn!(image = %raw.display(), "flattening a build's layers failed: {stderr}");
        // qemu-img names the files it failed on: host paths, which stay in the log.
        let first = stderr.lines().next().unwrap_or_default();
        let stderr = first.rsplit(": ").next().unwrap_or(first).to_string();
        return Err(DiskError::Flatten { stderr });
    }
    Ok(())
}

pub async fn create_overlay(base: &Path, overlay: &Path) -> Result<(), DiskError> {
    let run = tokio::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", format_of(base), "-b"])
        .arg(base)
        .arg(overlay)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let timed_out = || std::io::Error::new(std::io::ErrorKind::TimedOut, format!("it did not finish within {} s and was killed", QEMU_IMG_WAIT.as_secs()));
    let out = tokio::time::timeout(QEMU_IMG_WAIT, run)
        .await
        .unwrap_or_else(|_| Err(timed_out()))
        .map_err(|e| if e.kind() == std::io::ErrorKind::NotFound { DiskError::NoQemuImg } else { DiskError::Io(e) })?;
    if !out.status.success() {
        return Err(DiskError::Failed {
            path: overlay.display().to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}
