//! A template's record (`template.json`: what a build made and how its sandboxes boot)
//! and what can go wrong finding, building or tagging one. Both error types live here,
//! as each can carry the other: a tag names a template, a template is found by tag.

use crate::file_error::FileError;
use crate::recipes::{builtin_names, recipe, WarmUp};
use crate::record::RecordError;
use crate::run::ToolError;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Virtual size of a template disk; ext4 written by `-d` only occupies what it holds.
pub const DISK_SIZE: u64 = 4 << 30;
/// A build's image file, in its build directory (or, before builds were kept apart, at
/// the template's top).
pub(crate) const IMAGE: &str = "rootfs.ext4";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Template {
    pub name: String,
    pub suite: String,
    pub packages: Vec<String>,
    pub built_at: String,
    pub disk_size: u64,
    /// The image's content id (a SHA-256 prefix): every build is a new one, so
    /// snapshots and overlays can tell, and the image under them is never replaced.
    pub build_id: String,
    /// The image, relative to the template's directory (`builds/<build_id>/rootfs.ext4`);
    /// empty in manifests from before builds were kept apart (`rootfs.ext4`).
    #[serde(default)]
    pub image: String,
    /// The fingerprint of the recipe it was built from (empty: not built by a recipe).
    #[serde(default)]
    pub recipe: String,
    /// The OCI image it was made from, with that image's defaults (None: a recipe's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<ImageSource>,
    /// The id the template API gave the build that made it (a UUID), if one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_build: Option<String>,
    /// The VM shape its build asked sandboxes to get (unset: the server's or caller's).
    #[serde(default, flatten)]
    pub shape: Shape,
    /// When the `default` tag was last pointed at this build (None: when it was built).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tagged_at: Option<String>,
    #[serde(skip)]
    pub dir: PathBuf,
    /// The tag it was found by (None: the current build, `default`).
    #[serde(skip)]
    pub tag: Option<String>,
}

/// The vCPUs, memory and free disk a template's sandboxes get, when its build named
/// them (E2B's `cpuCount`/`memoryMB`/`minFreeDiskMb`, `hutch template build --cpus
/// --memory --min-free-disk`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Shape {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u32>,
    /// Free space (MiB) the root filesystem has at least, for users, after the build
    /// steps: the disk grows to it (never shrinks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_free_disk_mib: Option<u32>,
}

impl Shape {
    /// What a build id says of it: empty when it names nothing, so builds that name no
    /// shape keep the ids they had (and those naming no free disk too).
    pub fn id_part(&self) -> String {
        let vm = match (self.cpus, self.memory_mib) {
            (None, None) if self.min_free_disk_mib.is_none() => return String::new(),
            (c, m) => format!("cpus={},mib={}", c.unwrap_or(0), m.unwrap_or(0)),
        };
        match self.min_free_disk_mib {
            Some(free) => format!("{vm},free={free}"),
            None => vm,
        }
    }
}

/// The OCI image a template was made from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageSource {
    pub reference: String,
    pub manifest_digest: String,
    pub defaults: hutch_oci::ImageDefaults,
}

impl Template {
    pub fn image(&self) -> PathBuf {
        match self.image.as_str() {
            "" => self.dir.join(IMAGE),
            relative => self.dir.join(relative),
        }
    }

    /// The port whose service must accept connections before a sandbox is ready.
    pub fn ready_port(&self) -> Option<u16> {
        recipe(&self.name).and_then(|r| r.ready_port)
    }

    /// The warm-up requests of a snapshot made at `memory_mib`.
    pub fn warm_up(&self, memory_mib: u32) -> impl Iterator<Item = &'static WarmUp> {
        recipe(&self.name).map(|r| r.warm_up).unwrap_or(&[]).iter().filter(move |w| memory_mib >= w.min_memory_mib)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// Names no other template: the home holds other API keys' templates too.
    #[error("unknown template '{name}': it is neither built here nor a built-in template ({}); build it first (`hutch template ls` lists the templates built here)", builtin_names().join(", "))]
    Unknown { name: String },
    #[error(transparent)]
    Tool(#[from] ToolError),
    #[error("building a template without root needs subordinate ids for user {user} in /etc/subuid and /etc/subgid (65536 of each; `usermod --add-subuids 100000-165535 --add-subgids 100000-165535 {user}`), or run as root")]
    NoSubordinateIds { user: String },
    #[error(transparent)]
    File(#[from] FileError),
    /// The record's own sentence says what is wrong and, for a newer one, what to do.
    #[error(transparent)]
    Manifest(RecordError),
    #[error("pip did not leave a wheel for {spec} in {dir}")]
    Wheel { spec: String, dir: PathBuf },
    #[error(transparent)]
    Tag(Box<TagError>),
}

#[derive(Debug, thiserror::Error)]
pub enum TagError {
    #[error("tag '{0}' is not allowed: use 1-64 lowercase letters, digits, '.', '-' or '_' (and not a UUID)")]
    BadTag(String),
    #[error("template '{name}' has no tag '{tag}'; its tags: {known}")]
    UnknownTag { name: String, tag: String, known: String },
    #[error("there is no template '{0}' here")]
    UnknownTemplate(String),
    #[error("the 'default' tag names the template's current build and cannot be removed; assign it to another build instead")]
    DefaultKept,
    #[error("build {build} of template '{name}' is gone (only builds something tags or uses are kept)")]
    BuildGone { name: String, build: String },
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error("{what} {}: {source}", path.display())]
    Io { what: &'static str, path: PathBuf, source: std::io::Error },
}
