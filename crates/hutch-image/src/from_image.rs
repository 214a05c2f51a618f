//! Templates from OCI images: the image's layers (already in the blob cache) applied to
//! a fresh tree, the default user added when the image lacks one, and the tree written
//! as the same raw ext4 image a recipe's template is. The agent comes from the
//! initramfs, so any Linux userland boots, busybox and musl ones included.

use crate::image_tree::{make_image_here, ImageJob};
use crate::rootfs::BuildMode;
use crate::template::{ImageSource, Template, DISK_SIZE};
use crate::Progress;
use hutch_oci::{BlobStore, Digest};
use std::path::{Path, PathBuf};

pub use crate::image_tree::FromImageError;

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

/// The record of template `name` made from `source` (its image file set by `install`).
pub fn image_template(name: &str, source: ImageSource) -> Template {
    Template {
        name: name.into(),
        suite: "oci".into(),
        packages: Vec::new(),
        built_at: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        disk_size: DISK_SIZE,
        build_id: String::new(),
        image: String::new(),
        recipe: String::new(),
        source: Some(source),
        api_build: None,
        shape: Default::default(),
        tagged_at: None,
        dir: Default::default(),
        tag: None,
    }
}

/// Writes the image's root filesystem, with hutch's own files, as a raw ext4 image in
/// `work` (an empty directory of the caller's); returns its path. As root the layers are
/// applied here; otherwise in a user namespace where this user is root and 1-65535 are
/// its subordinate ids (`unprivileged.rs`), so the image's owners come out the same.
pub fn make_image(store: &BlobStore, layers: &[Digest], source: &ImageSource, work: &Path, progress: &dyn Progress) -> Result<PathBuf, FromImageError> {
    let job = ImageJob {
        layers: layers.iter().map(|d| (d.short().to_string(), store.path(d))).collect(),
        source: source.clone(),
        work: work.to_path_buf(),
    };
    match BuildMode::for_this_user()? {
        BuildMode::Root => make_image_here(&job, progress),
        mode => crate::unprivileged::make_image(&mode, &job, progress),
    }
}
