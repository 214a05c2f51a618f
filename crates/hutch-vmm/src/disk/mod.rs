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

/// An empty overlay made earlier on the same base is at most this big (qemu-img's is
/// a few hundred KiB); anything larger is not one, and is not copied.
const EMPTY_OVERLAY_MAX: u64 = 4 << 20;

/// An empty overlay on `base` at `overlay`, copied from `cache` when that is an empty
/// overlay on the same `base`: restoring one snapshot makes the same overlay every
/// time, and a copy costs well under a millisecond where `qemu-img` costs ~10 ms of
/// fork, exec and library loading on the start path. A missing or stale `cache` is
/// replaced by a copy of the new overlay, taken before any VM opened it. `base` must
/// not change while `cache` exists (a snapshot's frozen disk: the two go together).
pub async fn create_overlay_cached(base: &Path, cache: &Path, overlay: &Path) -> Result<(), DiskError> {
    // The copy is checked, not the cache: `overlay` is in the caller's own directory,
    // while the cache may be replaced in between (homes sharing a snapshot each keep
    // one naming their own path to it).
    if std::fs::symlink_metadata(cache).is_ok_and(|m| m.is_file() && m.len() <= EMPTY_OVERLAY_MAX) && std::fs::copy(cache, overlay).is_ok() && is_empty_overlay_on(overlay, base) {
        return Ok(());
    }
    let _ = std::fs::remove_file(overlay);
    create_overlay(base, overlay).await?;
    // Best effort: the next create pays qemu-img again if this fails. Written whole
    // under a unique name first, so a concurrent create never copies half of it.
    let partial = cache.with_extension(format!("partial-{}-{}", std::process::id(), PARTIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
    if let Err(e) = std::fs::copy(overlay, &partial).and_then(|_| std::fs::rename(&partial, cache)) {
        let _ = std::fs::remove_file(&partial);
        tracing::debug!(cache = %cache.display(), "keeping an empty overlay for the next create: {e}");
    }
    Ok(())
}

static PARTIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Whether `image` is a small regular file (not a link) whose qcow2 header names
/// exactly `base`, with no external data file.
fn is_empty_overlay_on(image: &Path, base: &Path) -> bool {
    let small = std::fs::symlink_metadata(image).is_ok_and(|m| m.is_file() && m.len() <= EMPTY_OVERLAY_MAX);
    small && matches!(backing::backing_name(image), Ok(Some(name)) if name == base) && matches!(backing::has_external_data(image), Ok(false))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn raw_base(dir: &Path, name: &str) -> std::path::PathBuf {
        let base = dir.join(name);
        std::fs::File::create(&base).and_then(|f| f.set_len(8 << 20)).expect("base");
        base
    }

    #[tokio::test]
    async fn an_empty_overlay_is_made_once_then_copied_and_a_stale_one_replaced() {
        let dir = tempfile::tempdir().expect("tmp");
        let (base, other) = (raw_base(dir.path(), "base.img"), raw_base(dir.path(), "other.img"));
        let cache = dir.path().join("empty-overlay.qcow2");
        create_overlay_cached(&base, &cache, &dir.path().join("a.qcow2")).await.expect("first overlay");
        assert_eq!(backing::backing_name(&cache).expect("cache header"), Some(base.clone()), "the first create keeps its overlay");
        // A marker past the header shows the second overlay is the cache's copy.
        let mut kept = std::fs::read(&cache).expect("cache");
        kept.extend_from_slice(b"copied");
        std::fs::write(&cache, &kept).expect("mark");
        create_overlay_cached(&base, &cache, &dir.path().join("b.qcow2")).await.expect("second overlay");
        assert_eq!(std::fs::read(dir.path().join("b.qcow2")).expect("b"), kept);
        // An overlay on another base is not one for this base: made anew and kept.
        create_overlay_cached(&other, &cache, &dir.path().join("c.qcow2")).await.expect("third overlay");
        assert_eq!(backing::backing_name(&dir.path().join("c.qcow2")).expect("c header"), Some(other.clone()));
        assert_eq!(backing::backing_name(&cache).expect("cache header"), Some(other));
        let left: Vec<_> = std::fs::read_dir(dir.path()).expect("dir").flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.contains("partial")).collect();
        assert!(left.is_empty(), "no partial cache left: {left:?}");
    }

    #[tokio::test]
    async fn a_link_is_never_taken_for_the_cache() {
        let dir = tempfile::tempdir().expect("tmp");
        let base = raw_base(dir.path(), "base.img");
        let real = dir.path().join("real.qcow2");
        create_overlay(&base, &real).await.expect("overlay");
        let cache = dir.path().join("empty-overlay.qcow2");
        std::os::unix::fs::symlink(&real, &cache).expect("link");
        assert!(!is_empty_overlay_on(&cache, &base));
        create_overlay_cached(&base, &cache, &dir.path().join("a.qcow2")).await.expect("overlay");
        assert!(!std::fs::symlink_metadata(&cache).expect("cache").file_type().is_symlink(), "the link was replaced by a file");
    }
}
