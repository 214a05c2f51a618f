//! The on-disk store of a template's builds under `$HUTCH_HOME/templates/<name>`: each
//! build's image in `builds/<id>/` with a manifest of its own, `template.json` naming
//! the current one, and the lock that lets one writer at a time change them.

use crate::file_error::at;
use crate::recipes::recipe;
use crate::template::{Template, TemplateError, DISK_SIZE, IMAGE};
use crate::HutchHome;
use std::path::{Path, PathBuf};

/// The template directory's lock file (named for the tags, which came first).
const LOCK: &str = ".tags.lock";

pub(crate) const MANIFEST: &str = "template.json";
/// Where a template's builds live, each in a directory named by its content id.
pub(crate) const BUILDS: &str = "builds";

/// An empty, sparse `rootfs.ext4` of the template disk's size in `work`, for
/// `mkfs.ext4 -d` to fill.
pub(crate) fn sparse_image(work: &Path) -> Result<PathBuf, TemplateError> {
    let image = work.join(IMAGE);
    let file = std::fs::File::create(&image).map_err(at("creating", &image))?;
    file.set_len(DISK_SIZE).map_err(at("sizing", &image))?;
    Ok(image)
}

/// The content id of a built image.
fn content_id(image: &Path) -> Result<String, TemplateError> {
    use sha2::Digest;
    let mut file = std::fs::File::open(image).map_err(at("reading", image))?;
    let mut hash = sha2::Sha256::new();
    std::io::copy(&mut file, &mut hash).map_err(at("reading", image))?;
    Ok(hex::encode(&hash.finalize()[..8]))
}

/// Makes the image at `built` the template's current build: it moves into a directory
/// of its own, and the manifest naming it replaces the old one in one rename. Earlier
/// builds stay where they are, for the overlays and snapshots stacked on them, until
/// `prune_builds` finds nothing refers to them.
pub(crate) fn install(home: &HutchHome, built: &Path, template: Template) -> Result<Template, TemplateError> {
    let id = content_id(built)?;
    install_as(home, built, template, &id)
}

/// `install` with the build's id given: a build whose id says what went into it (a
/// template build's cache key) need not read its whole image to name it.
pub fn install_as(home: &HutchHome, built: &Path, template: Template, build_id: &str) -> Result<Template, TemplateError> {
    let dir = home.template(&template.name);
    std::fs::create_dir_all(&dir).map_err(at("creating", &dir))?;
    let _held = lock(&dir)?;
    let template = store_build(home, built, template, build_id)?;
    make_current(&template.dir, &template)?;
    Ok(template)
}

/// Where build `build`'s own manifest is, in template directory `dir`.
pub(crate) fn build_manifest_path(dir: &Path, build: &str) -> PathBuf {
    dir.join(BUILDS).join(build).join(MANIFEST)
}

/// Keeps the image at `built` as build `build_id` of its template, with a manifest of
/// its own (what a tag naming it boots), without making it the current build. The
/// caller holds the template's lock (`lock`): a prune waits for neither.
pub(crate) fn store_build(home: &HutchHome, built: &Path, mut template: Template, build_id: &str) -> Result<Template, TemplateError> {
    let dir = home.template(&template.name);
    template.build_id = build_id.to_string();
    let relative = format!("{BUILDS}/{}/{IMAGE}", template.build_id);
    let image = dir.join(&relative);
    let build_dir = image.parent().unwrap_or(&dir).to_path_buf();
    std::fs::create_dir_all(&build_dir).map_err(at("creating", &build_dir))?;
    if image.is_file() {
        // The same bytes were built before: that build stands.
        let _ = std::fs::remove_file(built);
    } else {
        std::fs::rename(built, &image).map_err(at("moving the image to", &build_dir))?;
    }
    template.image = relative;
    template.dir = dir.clone();
    template.tagged_at = None;
    if template.api_build.is_none() {
        // Made again outside the API: it keeps the id an API build gave it.
        template.api_build = crate::record::read::<Template>(&build_manifest_path(&dir, build_id), crate::record::Kind::Template).ok().and_then(|t| t.api_build);
    }
    crate::record::write(&build_manifest_path(&dir, build_id), crate::record::Kind::Template, &template).map_err(TemplateError::Manifest)?;
    // The same build made again by an API build is known by that build's id from now
    // on, also as the current build: one id per build wherever it is shown.
    if template.api_build.is_some() {
        if let Ok(mut current) = crate::record::read::<Template>(&dir.join(MANIFEST), crate::record::Kind::Template) {
            if current.build_id == build_id && current.api_build != template.api_build {
                current.api_build = template.api_build.clone();
                make_current(&dir, &current)?;
            }
        }
    }
    Ok(template)
}

/// Gives a build from before builds kept their own manifests one (a tag can name it).
/// A build from before builds were kept apart (`rootfs.ext4` at the template's top) is
/// hard-linked into `builds/<id>/` too, so it is a build like any other (the top file
/// goes when it is no longer current; the link keeps the bytes for its tags).
pub(crate) fn keep_manifest(template: &Template) -> Result<(), TemplateError> {
    let path = build_manifest_path(&template.dir, &template.build_id);
    let build_dir = path.parent().unwrap_or(&template.dir).to_path_buf();
    std::fs::create_dir_all(&build_dir).map_err(at("creating", &build_dir))?;
    let mut own = Template { tagged_at: None, tag: None, ..template.clone() };
    if own.image.is_empty() {
        let linked = build_dir.join(IMAGE);
        if !linked.is_file() {
            std::fs::hard_link(template.image(), &linked).map_err(at("linking the build into", &build_dir))?;
        }
        own.image = format!("{BUILDS}/{}/{IMAGE}", own.build_id);
    }
    crate::record::write(&path, crate::record::Kind::Template, &own).map_err(TemplateError::Manifest)
}

/// Makes `template` (a stored build) its template's current one: the manifest naming it
/// replaces the old one in one rename, so readers see the old build or the new one.
pub(crate) fn make_current(dir: &Path, template: &Template) -> Result<(), TemplateError> {
    crate::record::write(&dir.join(MANIFEST), crate::record::Kind::Template, template).map_err(TemplateError::Manifest)
}

/// Holds the template's tag lock while alive: builds being stored, tags changing and
/// prunes of the template's builds happen one at a time.
pub struct Locked(#[allow(dead_code)] std::fs::File);

fn lock_file(dir: &Path) -> Result<std::fs::File, TemplateError> {
    let path = dir.join(LOCK);
    Ok(std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path).map_err(at("opening", &path))?)
}

pub fn lock(dir: &Path) -> Result<Locked, TemplateError> {
    let file = lock_file(dir)?;
    file.lock().map_err(at("locking", &dir.join(LOCK)))?;
    Ok(Locked(file))
}

/// The lock if it comes free within `patience` (None: someone still holds it; see
/// [`crate::flock`] for why a moment's wait).
pub(crate) fn try_lock_within(dir: &Path, patience: std::time::Duration) -> Result<Option<Locked>, TemplateError> {
    let file = lock_file(dir)?;
    let locked = crate::flock::lock_within(&file, patience).map_err(at("locking", &dir.join(LOCK)))?;
    Ok(locked.then_some(Locked(file)))
}

/// The current build of template `name` (a built-in's alias names it too) if it is
/// built and not stale.
pub fn current(home: &HutchHome, name: &str) -> Result<Option<Template>, TemplateError> {
    let name = recipe(name).map(|r| r.name).unwrap_or(name);
    let dir = home.template(name);
    let mut t: Template = match crate::record::read(&dir.join(MANIFEST), crate::record::Kind::Template) {
        Ok(t) => t,
        Err(e) if e.is_missing() => return Ok(None),
        Err(e) => return Err(TemplateError::Manifest(e)),
    };
    t.dir = dir;
    // A template built from an older recipe of ours is stale: the caller rebuilds it.
    let stale = recipe(name).is_some_and(|r| r.fingerprint() != t.recipe);
    Ok((t.image().is_file() && !stale).then_some(t))
}

/// Names of the templates built under this home.
pub fn list(home: &HutchHome) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(home.templates())
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join(MANIFEST).is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}
