//! What is removed once nothing uses it, each asking the home's one reference graph
//! (`references.rs`) first: template memory snapshots a newer one replaced, a removed or
//! moved tag's snapshots, and template builds nothing stacks on.

use hutch_image::HutchHome;
use std::path::{Path, PathBuf};

/// Removes the template builds nothing stacks on any more (a rebuild's predecessors).
pub fn prune_template_builds(home: &HutchHome) {
    match crate::references::of_everything(home) {
        Ok(files) => {
            for image in hutch_image::prune::prune_builds(home, &files) {
                tracing::info!(image = %image.display(), "removed a template build that was replaced and that nothing stacks on");
            }
        }
        Err(e) => tracing::warn!("keeping every template build: {e}"),
    }
}

/// After `tags` of template `name` were removed or moved: what only they kept goes,
/// their memory snapshots and then the builds nothing names or uses. (The `default`
/// tag's snapshot is replaced when the current build is next used.)
pub fn release_tags(home: &HutchHome, name: &str, tags: &[String]) {
    for tag in tags.iter().filter(|t| *t != hutch_image::tags::DEFAULT) {
        remove_tag_snapshots(home, name, tag);
    }
    prune_template_builds(home);
}

/// The template snapshots something in this home still uses (`references.rs`): one
/// whose file is under a sandbox's or stored snapshot's disk, is the memory a sandbox
/// maps, or is a sandbox's base. An unreadable chain counts as using them all.
fn in_use(home: &HutchHome) -> std::collections::HashSet<PathBuf> {
    let templates = home.template_snapshots();
    match crate::references::of_sandboxes_and_snapshots(home) {
        Ok(used) => {
            let under = used.files.iter().filter_map(|f| f.strip_prefix(&templates).ok()?.components().next()).map(|c| templates.join(c));
            let mut dirs: std::collections::HashSet<PathBuf> = under.collect();
            dirs.extend(used.snapshot_dirs);
            dirs
        }
        Err(e) => {
            tracing::warn!("keeping every template snapshot: {e}");
            std::fs::read_dir(&templates).into_iter().flatten().flatten().map(|e| e.path()).collect()
        }
    }
}

/// Removes the memory snapshots of template `name`'s tag `tag` (the tag was removed or
/// now names another build) that nothing uses. Only that tag's: the rest of the name
/// must be the shape and hash (`-1cpu-512mib-kvm-<16 hex>`), so tag `v1` leaves
/// `v1-rc`'s alone.
pub(crate) fn remove_tag_snapshots(home: &HutchHome, name: &str, tag: &str) {
    let prefix = format!("{name}@{tag}-");
    let is_shape_and_hash = |rest: &str| {
        let parts: Vec<&str> = rest.split('-').collect();
        let number_then = |p: &str, unit: &str| p.strip_suffix(unit).is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        parts.len() == 4
            && number_then(parts[0], "cpu")
            && number_then(parts[1], "mib")
            && !parts[2].is_empty()
            && parts[2].bytes().all(|b| b.is_ascii_alphanumeric())
            && parts[3].len() == 16
            && parts[3].bytes().all(|b| b.is_ascii_hexdigit())
    };
    remove_unused(home, "the memory snapshot of a tag that was removed or moved", |dir_name| dir_name.strip_prefix(&prefix).is_some_and(is_shape_and_hash));
}

/// Removes each template snapshot whose directory name `matches`, unless something
/// still uses it (`in_use`); `what` says why, in the log.
fn remove_unused(home: &HutchHome, what: &str, matches: impl Fn(&str) -> bool) {
    let in_use = in_use(home);
    for entry in std::fs::read_dir(home.template_snapshots()).into_iter().flatten().flatten() {
        let dir = entry.path();
        if matches(&entry.file_name().to_string_lossy()) && !in_use.contains(&dir) && dir.join(crate::snapshot::MANIFEST).is_file() {
            tracing::info!(dir = %dir.display(), "removing {what}");
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

/// Removes the snapshots `current` replaced (same template and shape, older build of
/// something), unless something still uses one (`in_use`).
pub(crate) fn prune_replaced(home: &HutchHome, current: &Path, prefix: &str) {
    let current = current.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    remove_unused(home, "a template snapshot its replacement made stale", |dir_name| {
        dir_name != current && dir_name.strip_prefix(prefix).is_some_and(|rest| rest.starts_with('-') && !rest.contains('.'))
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::references::of_everything;
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
        let left: Vec<_> = std::fs::read_dir(home.template("t").join("builds")).into_iter().flatten().flatten().map(|e| e.path()).collect();
        assert_eq!(left, vec![current.parent().expect("build dir").to_path_buf()]);
    }
}
