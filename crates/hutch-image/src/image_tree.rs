//! An image's root filesystem made in a directory by this process: its layers applied
//! to a fresh tree, hutch's own files added as one more layer, the tree written as
//! ext4. `from_image.rs` runs it here as root; `unprivileged.rs` runs it in a user
//! namespace's helper, which is handed the same `ImageJob`.

use crate::file_error::{at, FileError};
use crate::progress::human_bytes;
use crate::template::{ImageSource, TemplateError, DISK_SIZE};
use crate::run::run;
use crate::Progress;
use hutch_oci::ImageDefaults;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// The user sandboxes run as by default (E2B's `user`).
const DEFAULT_USER: &str = "user";
const DEFAULT_UID: u32 = 1000;

#[derive(Debug, thiserror::Error)]
pub enum FromImageError {
    /// What the unprivileged helper reported (`unprivileged.rs`); `image` says whether the
    /// image's own contents were at fault.
    #[error("{message}")]
    InNamespace { message: String, image: bool },
    #[error("template names are 1-63 characters of a-z, 0-9, `.`, `_` and `-`, starting with a letter or digit; `{0}` is not one")]
    BadName(String),
    #[error(transparent)]
    Unpack(#[from] hutch_oci::unpack::UnpackError),
    #[error(transparent)]
    File(#[from] FileError),
    #[error(transparent)]
    Template(#[from] TemplateError),
}

impl FromImageError {
    /// Whether the image's own contents (too large, a bad layer) failed, not the host's
    /// tools, disk or privileges.
    pub fn is_the_images(&self) -> bool {
        match self {
            FromImageError::Unpack(_) => true,
            FromImageError::InNamespace { image, .. } => *image,
            _ => false,
        }
    }
}

/// What `make_image` does, as the namespace's helper process is handed it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ImageJob {
    /// (short digest, blob file), lowest layer first.
    pub layers: Vec<(String, PathBuf)>,
    pub source: ImageSource,
    pub work: PathBuf,
}

impl ImageJob {
    pub(crate) fn tree(&self) -> PathBuf {
        self.work.join("tree")
    }
}

/// The layers applied to `work/tree`, then the tree written as ext4, by this process.
pub(crate) fn make_image_here(job: &ImageJob, progress: &dyn Progress) -> Result<PathBuf, FromImageError> {
    let started = Instant::now();
    let tree = job.tree();
    std::fs::create_dir_all(&tree).map_err(at("creating", &tree))?;
    let tree = std::fs::canonicalize(&tree).map_err(at("reading", &tree))?;
    progress.step(&format!("unpacking {} layer(s) of {}", job.layers.len(), job.source.reference));
    // What the tree may hold, ext4's own metadata aside: checked entry by entry, so a
    // layer that decompresses without end stops here, not when the host's disk is full.
    let mut budget = DISK_SIZE / 10 * 9;
    for (short, path) in &job.layers {
        let file = std::fs::File::open(path).map_err(at("reading", path))?;
        let applied = hutch_oci::unpack::apply_layer(&tree, file, short, &mut budget)?;
        progress.detail(&format!("{short}: {} entries, {} whiteouts", applied.entries, applied.whiteouts));
    }
    // hutch's own files go in as one more layer, through the same checks: the tree is
    // the image's, and a symlink it planted (etc -> /etc) must not take a write to the host.
    let own = own_layer(&tree, &job.source.defaults)?;
    hutch_oci::unpack::apply_layer(&tree, &own[..], "hutch", &mut budget)?;
    progress.done(&format!("{} unpacked", human_bytes(DISK_SIZE / 10 * 9 - budget)), started.elapsed());

    let started = Instant::now();
    progress.step(&format!("writing the ext4 image ({} virtual)", human_bytes(DISK_SIZE)));
    let image = crate::template_store::sparse_image(&job.work)?;
    let mut mkfs = Command::new("mkfs.ext4");
    mkfs.args(["-q", "-F", "-L", "hutch-root", "-E", "root_owner=0:0", "-d"]).arg(&tree).arg(&image);
    run(mkfs, None, progress).map_err(TemplateError::from)?;
    let _ = std::fs::remove_dir_all(&tree);
    progress.done("written", started.elapsed());
    Ok(image)
}

/// A passwd or group file larger than this is not an account list.
const MAX_ACCOUNTS_FILE: u64 = 1 << 20;

/// The files hutch adds, as a tar layer: the image's defaults, and the default user
/// (uid 1000, home /home/user, bash where the image has it) unless the image has an
/// account of that name.
fn own_layer(tree: &Path, defaults: &ImageDefaults) -> Result<Vec<u8>, FromImageError> {
    let mut layer = tar::Builder::new(Vec::new());
    let mut add = |path: &str, kind: tar::EntryType, mode: u32, owner: u64, data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(owner);
        h.set_gid(owner);
        h.set_mtime(0);
        h.set_size(data.len() as u64);
        layer.append_data(&mut h, path, data)
    };
    // Where the agent reads them at `/init`, relative to the tree.
    let defaults_file = hutch_proto::agent::IMAGE_DEFAULTS_PATH.trim_start_matches('/');
    let json = serde_json::to_vec_pretty(defaults).map_err(std::io::Error::other).map_err(at("writing", Path::new(defaults_file)))?;
    let io = |e| at("assembling", tree)(e);
    let defaults_dir = Path::new(defaults_file).parent().and_then(Path::to_str).unwrap_or("etc");
    add(defaults_dir, tar::EntryType::Directory, 0o755, 0, &[]).map_err(io)?;
    add(defaults_file, tar::EntryType::Regular, 0o644, 0, &json).map_err(io)?;
    let passwd = read_accounts(tree, "etc/passwd")?;
    let has = |text: &[u8], name: &str| text.split(|b| *b == b'\n').any(|l| l.split(|b| *b == b':').next() == Some(name.as_bytes()));
    if !has(&passwd, DEFAULT_USER) {
        let shell = if tree.join("bin/bash").exists() || tree.join("usr/bin/bash").exists() { "/bin/bash" } else { "/bin/sh" };
        let mut passwd = passwd;
        if !has(&passwd, "root") {
            passwd.extend_from_slice(b"root:x:0:0:root:/root:/bin/sh\n");
        }
        passwd.extend_from_slice(format!("{DEFAULT_USER}:x:{DEFAULT_UID}:{DEFAULT_UID}::/home/{DEFAULT_USER}:{shell}\n").as_bytes());
        let mut group = read_accounts(tree, "etc/group")?;
        if !has(&group, "root") {
            group.extend_from_slice(b"root:x:0:\n");
        }
        if !has(&group, DEFAULT_USER) {
            group.extend_from_slice(format!("{DEFAULT_USER}:x:{DEFAULT_UID}:\n").as_bytes());
        }
        add("etc/passwd", tar::EntryType::Regular, 0o644, 0, &passwd).map_err(io)?;
        add("etc/group", tar::EntryType::Regular, 0o644, 0, &group).map_err(io)?;
        add(&format!("home/{DEFAULT_USER}"), tar::EntryType::Directory, 0o755, u64::from(DEFAULT_UID), &[]).map_err(io)?;
    }
    Ok(layer.into_inner().map_err(io)?)
}

/// The image's `etc/passwd` or `etc/group`, as bytes ending in a newline (empty when it
/// has none). Only a regular file is read, never through a symlink that leaves the tree
/// and never a device or FIFO; anything else counts as absent and is replaced.
fn read_accounts(tree: &Path, rel: &str) -> Result<Vec<u8>, FromImageError> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let Some(Some(path)) = hutch_oci::unpack::resolve_in_root(tree, Path::new(rel)) else { return Ok(Vec::new()) };
    match std::fs::symlink_metadata(&path) {
        Ok(m) if m.is_file() && m.len() <= MAX_ACCOUNTS_FILE => {}
        _ => return Ok(Vec::new()),
    }
    let mut bytes = Vec::new();
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(&path).map_err(at("reading", &path))?;
    file.take(MAX_ACCOUNTS_FILE).read_to_end(&mut bytes).map_err(at("reading", &path))?;
    if !bytes.is_empty() && !bytes.ends_with(b"\n") {
        bytes.push(b'\n');
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, MetadataExt};

    fn tree() -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = std::fs::canonicalize(dir.path()).expect("canonical");
        (dir, root)
    }

    fn add_own_files(tree: &Path) -> Result<(), FromImageError> {
        let layer = own_layer(tree, &ImageDefaults::default())?;
        let mut budget = u64::MAX;
        hutch_oci::unpack::apply_layer(tree, &layer[..], "hutch", &mut budget)?;
        Ok(())
    }

    /// The image's own symlinks never take hutch's writes (passwd, group, the user's
    /// home, the defaults file) to the host.
    #[test]
    fn symlinks_planted_by_the_image_do_not_reach_the_host() {
        let host = tempfile::tempdir().expect("host");
        let host_file = host.path().join("passwd");
        std::fs::write(&host_file, "host:x:0:0::/:/bin/sh\n").expect("host file");
        let (_dir, tree) = tree();
        std::fs::create_dir_all(tree.join("etc")).expect("etc");
        std::fs::create_dir_all(tree.join("home")).expect("home");
        symlink(&host_file, tree.join("etc/passwd")).expect("passwd link");
        symlink(host.path(), tree.join("home/user")).expect("home link");
        symlink(host.path(), tree.join("etc/hutch")).expect("hutch dir link");
        let before = std::fs::metadata(host.path()).expect("meta");
        add_own_files(&tree).expect("hutch's files go into the tree");
        assert_eq!(std::fs::read_to_string(&host_file).expect("host file"), "host:x:0:0::/:/bin/sh\n", "the host file is untouched");
        let after = std::fs::metadata(host.path()).expect("meta");
        assert_eq!((after.uid(), after.gid()), (before.uid(), before.gid()), "the host directory kept its owner");
        assert!(!host.path().join("image.json").exists());
        let passwd = std::fs::read_to_string(tree.join("etc/passwd")).expect("tree passwd");
        assert!(passwd.contains("user:x:1000:1000::/home/user:"), "{passwd}");
        assert!(std::fs::symlink_metadata(tree.join("home/user")).expect("home").is_dir());
        assert!(std::fs::symlink_metadata(tree.join("etc/hutch/image.json")).expect("defaults").is_file());
    }

    #[test]
    fn an_etc_that_leaves_the_tree_fails_the_build() {
        let host = tempfile::tempdir().expect("host");
        let (_dir, tree) = tree();
        symlink(host.path(), tree.join("etc")).expect("etc link");
        let err = add_own_files(&tree).expect_err("refused");
        assert!(err.to_string().contains("outside the image's root"), "{err}");
        assert_eq!(std::fs::read_dir(host.path()).expect("host dir").count(), 0, "nothing was written there");
    }

    #[test]
    fn a_fifo_or_device_as_passwd_is_not_read() {
        let (_dir, tree) = tree();
        std::fs::create_dir_all(tree.join("etc")).expect("etc");
        nix::unistd::mkfifo(&tree.join("etc/passwd"), nix::sys::stat::Mode::from_bits_truncate(0o644)).expect("fifo");
        // A read would block forever; it is treated as absent and replaced.
        assert!(read_accounts(&tree, "etc/passwd").expect("read").is_empty());
        add_own_files(&tree).expect("replaced");
        assert!(std::fs::symlink_metadata(tree.join("etc/passwd")).expect("passwd").is_file());
    }
}
