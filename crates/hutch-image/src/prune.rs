//! Removing the builds nothing needs any more: not a template's current build, not
//! named by a tag, and holding no file an overlay or snapshot stacks on.

use crate::tags::tagged_builds;
use crate::template::{Template, IMAGE};
use crate::template_store::{list, try_lock_within, BUILDS, MANIFEST};
use crate::HutchHome;
use std::path::{Path, PathBuf};

/// How long a prune waits for a template's lock before leaving it for the next prune.
const PRUNE_LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

/// Removes the builds of every template that are not its current one and hold no file
/// in `referenced` (every file some overlay or snapshot stacks on); returns them.
pub fn prune_builds(home: &HutchHome, referenced: &std::collections::HashSet<PathBuf>) -> Vec<PathBuf> {
    let canonical = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let referenced: std::collections::HashSet<PathBuf> = referenced.iter().map(|p| canonical(p)).collect();
    let mut removed = Vec::new();
    for name in list(home) {
        let dir = home.template(&name);
        // A template being built or retagged right now is left for the next prune.
        let Ok(Some(_held)) = try_lock_within(&dir, PRUNE_LOCK_PATIENCE) else { continue };
        // A template whose manifest cannot be read keeps every build.
        let Ok(mut current) = crate::record::read::<Template>(&dir.join(MANIFEST), crate::record::Kind::Template) else { continue };
        current.dir = dir.clone();
        let current = canonical(&current.image());
        // Builds a tag names stay; an unreadable tags file keeps every build.
        let Some(tagged) = tagged_builds(&dir) else { continue };
        let mut candidates: Vec<PathBuf> = std::fs::read_dir(dir.join(BUILDS)).into_iter().flatten().flatten().map(|e| e.path().join(IMAGE)).collect();
        // A build from before builds were kept apart.
        candidates.push(dir.join(IMAGE));
        for image in candidates.into_iter().filter(|i| i.is_file()) {
            let image = canonical(&image);
            let build = image.parent().and_then(Path::file_name).map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            if image == current || referenced.contains(&image) || tagged.contains(&build) {
                continue;
            }
            let gone = match image.parent().filter(|p| p.parent().and_then(Path::file_name).is_some_and(|n| n == BUILDS)) {
                Some(build_dir) => std::fs::remove_dir_all(build_dir),
                None => std::fs::remove_file(&image),
            };
            if gone.is_ok() {
                removed.push(image);
            }
        }
    }
    removed
}
