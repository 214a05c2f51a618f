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
