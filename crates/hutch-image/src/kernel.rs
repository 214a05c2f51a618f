//! The guest kernel: Debian's `linux-image-cloud-amd64`, downloaded with `apt-get
//! download` and unpacked with `dpkg-deb -x` (never installed into the host's /boot).

use crate::progress::{human_bytes, tree_size};
use crate::run::{run, ToolError};
use crate::file_error::{at, FileError};
use crate::{HutchHome, Progress};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

pub const META_PACKAGE: &str = "linux-image-cloud-amd64";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Kernel {
    /// Kernel release, as `uname -r` prints it in the guest.
    pub version: String,
    pub package: String,
    pub package_version: String,
    #[serde(skip)]
    pub dir: PathBuf,
}

impl Kernel {
    pub fn vmlinuz(&self) -> PathBuf {
        self.dir.join(format!("boot/vmlinuz-{}", self.version))
    }
    pub fn modules(&self) -> PathBuf {
        self.dir.join(format!("lib/modules/{}", self.version))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error(transparent)]
    Tool(#[from] ToolError),
    #[error("cannot tell which kernel package '{META_PACKAGE}' depends on (got '{0}')")]
    NoDependency(String),
    #[error("the package {package} has no {missing}")]
    Incomplete { package: String, missing: String },
    #[error(transparent)]
    File(#[from] FileError),
    #[error(transparent)]
    Manifest(crate::record::RecordError),
}


const MANIFEST: &str = "current.json";
/// Held while a kernel is fetched into `kernels()` (beside the versions and manifest).
const FETCH_LOCK: &str = "fetch.lock";

/// The cached kernel, if there is one.
pub fn cached(home: &HutchHome) -> Result<Option<Kernel>, KernelError> {
    let mut k: Kernel = match crate::record::read(&home.kernels().join(MANIFEST), crate::record::Kind::Kernel) {
        Ok(k) => k,
        Err(e) if e.is_missing() => return Ok(None),
        Err(e) => return Err(KernelError::Manifest(e)),
    };
    k.dir = home.kernels().join(&k.version);
    Ok(k.vmlinuz().is_file().then_some(k))
}

/// The cached kernel, downloading and unpacking it first if needed.
pub fn ensure(home: &HutchHome, progress: &dyn Progress) -> Result<Kernel, KernelError> {
    if let Ok(Some(k)) = cached(home) {
        return Ok(k);
    }
    // One fetch per home at a time: two hutch processes on a fresh home (two setups, or
    // a setup and a run) would otherwise each replace the other's unpacked kernel while
    // it is being read. The second waits, then finds the first one's kernel cached.
    std::fs::create_dir_all(home.kernels()).map_err(at("creating", &home.kernels()))?;
    let lock_path = home.kernels().join(FETCH_LOCK);
    let lock = std::fs::File::create(&lock_path).map_err(at("creating", &lock_path))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            progress.detail("waiting for another hutch that is downloading the guest kernel");
            lock.lock().map_err(at("locking", &lock_path))?;
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(at("locking", &lock_path)(e).into()),
    }
    match cached(home) {
        Ok(Some(k)) => return Ok(k),
        Ok(None) => {}
        // A damaged manifest: fetching the kernel again replaces it. A newer hutch's
        // is left alone.
        Err(KernelError::Manifest(e)) if e.is_replaceable() => tracing::warn!("fetching the guest kernel again: {e}"),
        Err(e) => return Err(e),
    }
    let started = Instant::now();
    progress.step(&format!("downloading the guest kernel ({META_PACKAGE} from Debian)"));
    let work = home.tmp().join(format!("kernel-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(at("creating", &work))?;
    let result = fetch(home, &work, progress);
    let _ = std::fs::remove_dir_all(&work);
    let kernel = result?;
    progress.done(
        &format!("kernel {} ({})", kernel.version, human_bytes(tree_size(&kernel.dir))),
        started.elapsed(),
    );
    Ok(kernel)
}

fn only_deb(dir: &Path, prefix: &str) -> Result<PathBuf, KernelError> {
    std::fs::read_dir(dir)
        .map_err(at("listing", dir))?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            name.starts_with(prefix) && name.ends_with(".deb")
        })
        .ok_or_else(|| KernelError::Incomplete { package: prefix.trim_end_matches('_').into(), missing: ".deb file after download".into() })
}

fn apt_download(package: &str, dir: &Path, progress: &dyn Progress) -> Result<PathBuf, KernelError> {
    let mut cmd = Command::new("apt-get");
    cmd.args(["download", "-q", package]);
    run(cmd, Some(dir), progress)?;
    only_deb(dir, &format!("{package}_"))
}

fn deb_field(deb: &Path, field: &str, progress: &dyn Progress) -> Result<String, KernelError> {
    let mut cmd = Command::new("dpkg-deb");
    cmd.arg("-f").arg(deb).arg(field);
    Ok(run(cmd, None, progress)?.trim().to_string())
}

fn fetch(home: &HutchHome, work: &Path, progress: &dyn Progress) -> Result<Kernel, KernelError> {
    let meta = apt_download(META_PACKAGE, work, progress)?;
    let depends = deb_field(&meta, "Depends", progress)?;
    let package = depends
        .split(',')
        .map(|d| d.split_whitespace().next().unwrap_or_default())
        .find(|d| d.starts_with("linux-image-"))
        .ok_or_else(|| KernelError::NoDependency(depends.clone()))?
        .to_string();
    let deb = apt_download(&package, work, progress)?;
    let package_version = deb_field(&deb, "Version", progress)?;
    let version = package.trim_start_matches("linux-image-").to_string();
    progress.detail(&format!("unpacking {package} {package_version}"));
    let unpacked = work.join("root");
    let mut cmd = Command::new("dpkg-deb");
    cmd.arg("-x").arg(&deb).arg(&unpacked);
    run(cmd, None, progress)?;
    let mut kernel = Kernel { version: version.clone(), package, package_version, dir: unpacked };
    for (what, path) in [("kernel image", kernel.vmlinuz()), ("modules directory", kernel.modules())] {
        if !path.exists() {
            return Err(KernelError::Incomplete { package: kernel.package.clone(), missing: what.into() });
        }
    }
    let dest = home.kernels().join(&version);
    std::fs::create_dir_all(home.kernels()).map_err(at("creating", &home.kernels()))?;
    let _ = std::fs::remove_dir_all(&dest);
    std::fs::rename(&kernel.dir, &dest).map_err(at("moving the kernel to", &dest))?;
    kernel.dir = dest;
    crate::record::write(&home.kernels().join(MANIFEST), crate::record::Kind::Kernel, &kernel).map_err(KernelError::Manifest)?;
    Ok(kernel)
}
