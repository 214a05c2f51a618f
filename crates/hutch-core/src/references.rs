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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pruning::prune_template_builds;
    use std::os::unix::fs::OpenOptionsExt;

    fn qcow2_on(base: &Path, overlay: &Path) {
        std::fs::create_dir_all(overlay.parent().expect("parent")).expect("dir");
        let format = if base.extension().is_some_and(|e| e == "qcow2") { "qcow2" } else { "raw" };
        let out = std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", format, "-b"])
            .arg(base)
            .arg(overlay)
            .output()
            .expect("qemu-img");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }

    /// A build of template `t` at `builds/<id>/rootfs.ext4`.
    fn build(home: &HutchHome, id: &str) -> PathBuf {
        let image = home.template("t").join("builds").join(id).join("rootfs.ext4");
        std::fs::create_dir_all(image.parent().expect("parent")).expect("dir");
        std::fs::write(&image, vec![0u8; 1 << 16]).expect("image");
        image
    }

    /// A home whose template `t` is the build `current` (its image returned).
    fn home_with_template() -> (tempfile::TempDir, HutchHome, PathBuf) {
        let root = tempfile::tempdir().expect("tempdir");
        let home = HutchHome::at(root.path());
        let current = build(&home, "current");
        let manifest = serde_json::json!({
            "name": "t", "suite": "bookworm", "packages": [], "built_at": "", "disk_size": 1,
            "build_id": "current", "image": "builds/current/rootfs.ext4"
        });
        std::fs::write(home.template("t").join("template.json"), manifest.to_string()).expect("manifest");
        (root, home, current)
    }

    /// A sandbox's overlay whose header a VM rewrote to name a FIFO (the open would
    /// block) or a file outside hutch's directories: pruning goes on for everyone else.
    #[test]
    fn a_rewritten_header_neither_blocks_nor_stops_pruning() {
        let (root, home, current) = home_with_template();
        let unreferenced = build(&home, "replaced");
        let fifo = root.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("fifo");
        let outside = root.path().join("secret");
        std::fs::write(&outside, "key").expect("secret");
        for (sandbox, named) in [("sb1", &fifo), ("sb2", &outside)] {
            let disk = home.sandboxes().join(sandbox).join("disk.qcow2");
            std::fs::create_dir_all(disk.parent().expect("parent")).expect("dir");
            let name = named.to_str().expect("utf-8").as_bytes();
            let mut header = b"QFI\xfb\0\0\0\x03".to_vec();
            header.extend_from_slice(&100u64.to_be_bytes());
            header.extend_from_slice(&(name.len() as u32).to_be_bytes());
            header.resize(100, 0);
            header.extend_from_slice(name);
            std::fs::write(&disk, header).expect("disk");
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let home2 = home.clone();
        std::thread::spawn(move || tx.send(of_everything(&home2).map(|files| files.len())));
        let Ok(used) = rx.recv_timeout(std::time::Duration::from_secs(5)) else {
            // A writer arriving lets the stuck open return, so the thread ends.
            let _ = std::fs::OpenOptions::new().write(true).custom_flags(nix::libc::O_NONBLOCK).open(&fifo);
            panic!("reading the references blocked on the FIFO a disk header names");
        };
        assert_eq!(used.expect("the rewritten headers are skipped"), 0);
        prune_template_builds(&home);
        assert!(current.is_file() && !unreferenced.exists(), "pruning stopped");
    }

    #[test]
    fn template_builds_are_kept_for_every_kind_of_reference_and_only_then() {
        let (_root, home, current) = home_with_template();
        // A sandbox's disk (running, paused or pooled: all are a directory with a disk).
        let by_sandbox = build(&home, "sandbox");
        qcow2_on(&by_sandbox, &home.sandboxes().join("sb1").join("disk.qcow2"));
        // A template snapshot that a sandbox's disk stacks on.
        let by_template_snapshot = build(&home, "template-snapshot");
        let snap_disk = home.template_snapshots().join("t-1cpu").join("disk.qcow2");
        qcow2_on(&by_template_snapshot, &snap_disk);
        qcow2_on(&snap_disk, &home.sandboxes().join("sb2").join("disk.qcow2"));
        // A stored snapshot, and a fork of it stored in turn.
        let by_stored = build(&home, "stored");
        let stored = home.root().join("snapshots/sandboxes/snap_a/disk.qcow2");
        qcow2_on(&by_stored, &stored);
        qcow2_on(&stored, &home.root().join("snapshots/sandboxes/snap_b/disk.qcow2"));
        // A template snapshot nothing else uses still needs its build.
        let by_idle_template_snapshot = build(&home, "idle-template-snapshot");
        qcow2_on(&by_idle_template_snapshot, &home.template_snapshots().join("t-2cpu").join("disk.qcow2"));
        let unreferenced = build(&home, "replaced");

        prune_template_builds(&home);
        for kept in [&current, &by_sandbox, &by_template_snapshot, &by_stored, &by_idle_template_snapshot] {
            assert!(kept.is_file(), "{} was pruned while something stacks on it", kept.display());
        }
        assert!(!unreferenced.parent().expect("build dir").exists(), "the unreferenced build was kept");

        // Once the references go, so do the builds (the current one stays).
        for dir in [home.sandboxes(), home.root().join("snapshots")] {
            std::fs::remove_dir_all(dir).expect("remove");
        }
        prune_template_builds(&home);
        let left: Vec<_> = entries(&home.template("t").join("builds")).collect();
        assert_eq!(left, vec![current.parent().expect("build dir").to_path_buf()]);
    }
}
