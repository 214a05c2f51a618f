//! The one reference graph of a home: which files something stacks on. Every pruner
//! asks it (template snapshots, template builds); nothing is removed that a sandbox's
//! disk, a paused sandbox, a stored snapshot (a fork's, an E2B snapshot, a fork of a
//! fork), a pooled sandbox or a template snapshot still in use reaches. Disks are
//! followed down their whole backing chain, as QEMU opens them.

use hutch_image::HutchHome;
use hutch_vmm::disk::backing::BackingError;
use hutch_vmm::Memory;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// What the sandboxes and stored snapshots of a home use.
#[derive(Debug, Default)]
pub struct InUse {
    /// Every image of every chain, and every memory file a sandbox maps.
    pub files: HashSet<PathBuf>,
    /// The snapshot directories sandboxes name as their disk's base.
    pub snapshot_dirs: HashSet<PathBuf>,
}

fn entries(dir: &Path) -> impl Iterator<Item = PathBuf> {
    std::fs::read_dir(dir).into_iter().flatten().flatten().map(|e| e.path())
}

/// Each disk's chain, its names held to what the jail would bind (`backing::Roots`).
/// A disk whose header a VM rewrote never starts again (`jail.rs`), so nothing is kept
/// for it: one tenant's rewritten header does not stop every pruner of the home.
fn chains(home: &HutchHome, disks: Vec<PathBuf>, into: &mut HashSet<PathBuf>) -> Result<(), BackingError> {
    for disk in disks.into_iter().filter(|d| d.is_file()) {
        match hutch_vmm::disk::backing::chain_in(home.root(), &disk) {
            Ok(chain) => into.extend(chain),
            Err(e) if e.is_tampered() => tracing::warn!("{e}"),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// What every sandbox (running, paused, pooled, starting) and every stored snapshot of
/// `home` stacks on or maps. An unreadable chain is an error: callers then keep all.
pub fn of_sandboxes_and_snapshots(home: &HutchHome) -> Result<InUse, BackingError> {
    let mut used = InUse::default();
    let mut disks = Vec::new();
    for dir in entries(&home.sandboxes()) {
        // A sandbox still starting has its overlay before its record.
        disks.push(dir.join("disk.qcow2"));
        let Ok(record) = hutch_image::record::read::<crate::sandbox::layout::VmRecord>(&dir.join(crate::sandbox::layout::VM_RECORD), hutch_image::record::Kind::Vm) else { continue };
        used.snapshot_dirs.extend(record.base_snapshot.clone());
        disks.push(record.spec.disk.clone());
        if let Memory::SharedFile(f) | Memory::PrivateFile(f) = &record.spec.memory {
            used.files.insert(f.clone());
        }
    }
    disks.extend(entries(&home.sandbox_snapshots()).map(|d| d.join("disk.qcow2")));
    chains(home, disks, &mut used.files)?;
    Ok(used)
}

/// Everything in use, template snapshots' own disks included: what template builds
/// may not lose.
pub fn of_everything(home: &HutchHome) -> Result<HashSet<PathBuf>, BackingError> {
    let mut files = of_sandboxes_and_snapshots(home)?.files;
    let templates = home.template_snapshots();
    chains(home, entries(&templates).map(|d| d.join("disk.qcow2")).collect(), &mut files)?;
    // The build cache's layers stack on template builds (a build `FROM` a template).
    chains(home, crate::build::cache::BuildCache::new(home).layer_files(), &mut files)?;
    Ok(files)
}
