//! Templates from OCI images: the image's layers (already in the blob cache) applied to
//! a fresh tree, the default user added when the image lacks one, and the tree written
//! as the same raw ext4 image a recipe's template is. The agent comes from the
//! initramfs, so any Linux userland boots, busybox and musl ones included.

use crate::file_error::{at, FileError};
use crate::progress::human_bytes;
use crate::rootfs::{install, nix_is_root, ImageSource, Template, TemplateError, DISK_SIZE};
use crate::run::run;
use crate::{HutchHome, Progress};
use hutch_oci::{BlobStore, Digest, ImageDefaults};
use std::path::Path;
use std::process::Command;
use std::time::Instant;

/// The user sandboxes run as by default (E2B's `user`).
const DEFAULT_USER: &str = "user";
const DEFAULT_UID: u32 = 1000;

#[derive(Debug, thiserror::Error)]
pub enum FromImageError {
    #[error("building a template from an image needs root (to keep the image's owners and device nodes); run it as root")]
    NotRoot,
    #[error("template names are 1-63 characters of a-z, 0-9, `.`, `_` and `-`, starting with a letter or digit; `{0}` is not one")]
    BadName(String),
    #[error(transparent)]
    Unpack(#[from] hutch_oci::unpack::UnpackError),
    #[error("the image's files take {} but a template disk holds {}; use a smaller image", human_bytes(*.size), human_bytes(*.limit))]
    TooLarge { size: u64, limit: u64 },
    #[error(transparent)]
    File(#[from] FileError),
    #[error(transparent)]
    Template(#[from] TemplateError),
}

/// Whether `name` can name a template (it names a directory under `$HUTCH_HOME`).
pub fn check_name(name: &str) -> Result<(), FromImageError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.bytes().next().is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(FromImageError::BadName(name.to_string()))
    }
}

/// Makes template `name` from an image whose layers are in `store`.
pub fn build(home: &HutchHome, name: &str, store: &BlobStore, layers: &[Digest], source: ImageSource, progress: &dyn Progress) -> Result<Template, FromImageError> {
    check_name(name)?;
    if !nix_is_root() {
        return Err(FromImageError::NotRoot);
    }
    let work = home.tmp().join(format!("template-image-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(at("creating", &work))?;
    let result = build_in(home, name, store, layers, source, &work, progress);
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn build_in(home: &HutchHome, name: &str, store: &BlobStore, layers: &[Digest], source: ImageSource, work: &Path, progress: &dyn Progress) -> Result<Template, FromImageError> {
    let started = Instant::now();
    let tree = work.join("tree");
    std::fs::create_dir_all(&tree).map_err(at("creating", &tree))?;
    let tree = std::fs::canonicalize(&tree).map_err(at("reading", &tree))?;
    progress.step(&format!("unpacking {} layer(s) of {}", layers.len(), source.reference));
    for digest in layers {
        let path = store.path(digest);
        let file = std::fs::File::open(&path).map_err(at("reading", &path))?;
        let applied = hutch_oci::unpack::apply_layer(&tree, file, digest.short())?;
        progress.detail(&format!("{}: {} entries, {} whiteouts", digest.short(), applied.entries, applied.whiteouts));
    }
    ensure_default_user(&tree)?;
    write_defaults(&tree, &source.defaults)?;
    let size = crate::progress::tree_size(&tree);
    // ext4's own metadata needs room too.
    if size > DISK_SIZE / 10 * 9 {
        return Err(FromImageError::TooLarge { size, limit: DISK_SIZE });
    }
    progress.done(&format!("{} unpacked", human_bytes(size)), started.elapsed());

    let started = Instant::now();
    progress.step(&format!("writing the ext4 image ({} virtual)", human_bytes(DISK_SIZE)));
    let image = work.join("rootfs.ext4");
    let file = std::fs::File::create(&image).map_err(at("creating", &image))?;
    file.set_len(DISK_SIZE).map_err(at("sizing", &image))?;
    drop(file);
    let mut mkfs = Command::new("mkfs.ext4");
    mkfs.args(["-q", "-F", "-L", "hutch-root", "-E", "root_owner=0:0", "-d"]).arg(&tree).arg(&image);
    run(mkfs, None, progress).map_err(TemplateError::from)?;
    progress.done("written", started.elapsed());
    let template = Template {
        name: name.into(),
        suite: "oci".into(),
        packages: Vec::new(),
        built_at: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        disk_size: DISK_SIZE,
        build_id: String::new(),
        image: String::new(),
        recipe: String::new(),
        source: Some(source),
        dir: Default::default(),
    };
    Ok(install(home, &image, template)?)
}

/// Where the agent reads the image's defaults at `/init` (hutch-proto's
/// `IMAGE_DEFAULTS_PATH`): the template carries them, so every sandbox of it, however
/// it starts, gets the image's `Env`, `WorkingDir` and `User`.
const DEFAULTS_FILE: &str = "etc/hutch/image.json";

fn write_defaults(tree: &Path, defaults: &ImageDefaults) -> Result<(), FromImageError> {
    let path = tree.join(DEFAULTS_FILE);
    let dir = path.parent().unwrap_or(tree);
    std::fs::create_dir_all(dir).map_err(at("creating", dir))?;
    let json = serde_json::to_vec_pretty(defaults).map_err(|e| at("writing", &path)(std::io::Error::other(e)))?;
    std::fs::write(&path, json).map_err(at("writing", &path))?;
    Ok(())
}

/// Adds the default user (uid 1000, home /home/user) unless the image has a user of
/// that name: E2B's SDKs run commands as `user`. The shell is bash where the image has
/// it, else /bin/sh.
fn ensure_default_user(tree: &Path) -> Result<(), FromImageError> {
    let etc = tree.join("etc");
    std::fs::create_dir_all(&etc).map_err(at("creating", &etc))?;
    let passwd = etc.join("passwd");
    let text = std::fs::read_to_string(&passwd).unwrap_or_default();
    if text.lines().any(|l| l.split(':').next() == Some(DEFAULT_USER)) {
        return Ok(());
    }
    let mut text = text;
    if !text.lines().any(|l| l.starts_with("root:")) {
        text.push_str("root:x:0:0:root:/root:/bin/sh\n");
    }
    let shell = if tree.join("bin/bash").exists() || tree.join("usr/bin/bash").exists() { "/bin/bash" } else { "/bin/sh" };
    text.push_str(&format!("{DEFAULT_USER}:x:{DEFAULT_UID}:{DEFAULT_UID}::/home/{DEFAULT_USER}:{shell}\n"));
    std::fs::write(&passwd, text).map_err(at("writing", &passwd))?;
    let group = etc.join("group");
    let mut groups = std::fs::read_to_string(&group).unwrap_or_default();
    if !groups.lines().any(|l| l.starts_with("root:")) {
        groups.push_str("root:x:0:\n");
    }
    if !groups.lines().any(|l| l.split(':').next() == Some(DEFAULT_USER)) {
        groups.push_str(&format!("{DEFAULT_USER}:x:{DEFAULT_UID}:\n"));
        std::fs::write(&group, groups).map_err(at("writing", &group))?;
    }
    let home = tree.join("home").join(DEFAULT_USER);
    std::fs::create_dir_all(&home).map_err(at("creating", &home))?;
    nix::unistd::chown(&home, Some(DEFAULT_UID.into()), Some(DEFAULT_UID.into())).map_err(|e| at("owning", &home)(e.into()))?;
    Ok(())
}
