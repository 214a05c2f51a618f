//! Template tags, as E2B has them: `name:tag` names one build of template `name`.
//!
//! The `default` tag is the template's current build, whose manifest is the template's
//! `template.json` (what every caller that names no tag reads). Every other tag lives
//! in the template's `tags.json`, a record mapping the tag to a build id; each build
//! keeps its own manifest in `builds/<id>/template.json`, so a tagged build boots with
//! the defaults it was built with. Changes are read-modify-write under an exclusive
//! lock on the template's `.tags.lock`, so a CLI build and a server assigning tags at
//! the same moment do not lose each other's tags.

use crate::record::{self, Kind};
use crate::template::{Template, TemplateError};
use crate::template_store::{lock, MANIFEST};
use crate::HutchHome;

pub use crate::template::TagError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// The tag a name without one means.
pub const DEFAULT: &str = "default";
const TAGS: &str = "tags.json";
pub(crate) const HISTORY: &str = "tag-history.json";
/// Assignments kept per template; older ones are forgotten.
const HISTORY_KEPT: usize = 1000;

/// One tag of a template: the build it names and when it was given.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TagEntry {
    pub build: String,
    /// RFC 3339.
    pub created_at: String,
}

/// One time a tag was pointed at a build (E2B's tag assignment events).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    pub tag: String,
    pub build: String,
    /// RFC 3339.
    pub assigned_at: String,
    /// Its place in the template's history: with the rest, a stable identity.
    pub seq: u64,
}

/// `name[:tag]` → (name, tag); an empty tag or `default` is no tag.
pub fn split(reference: &str) -> (&str, Option<&str>) {
    match reference.split_once(':') {
        Some((name, tag)) if !tag.is_empty() && tag != DEFAULT => (name, Some(tag)),
        Some((name, _)) => (name, None),
        None => (reference, None),
    }
}

/// A tag as E2B takes it: trimmed and lowercased, `[a-z0-9._-]`, and not a UUID (a
/// UUID names a build). Returns the normal form.
pub fn check(tag: &str) -> Result<String, TagError> {
    let normal = tag.trim().to_ascii_lowercase();
    let uuid_like = normal.len() == 36 && normal.bytes().enumerate().all(|(i, b)| if [8, 13, 18, 23].contains(&i) { b == b'-' } else { b.is_ascii_hexdigit() });
    let ok = !normal.is_empty() && normal.len() <= 64 && normal.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b)) && !uuid_like;
    if ok {
        Ok(normal)
    } else {
        Err(TagError::BadTag(tag.to_string()))
    }
}

/// A tags or manifest record that cannot be read or written.
fn record_error(e: record::RecordError) -> TagError {
    TagError::Template(TemplateError::Manifest(e))
}

/// The tags a template has, for a sentence saying which.
fn known(tags: &BTreeMap<String, TagEntry>) -> String {
    std::iter::once(DEFAULT).chain(tags.keys().map(String::as_str)).collect::<Vec<_>>().join(", ")
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> TagError + 'a {
    move |source| TagError::Io { what, path: path.to_path_buf(), source }
}

/// The non-default tags of `name` (none when it has no `tags.json`).
fn read_tags(dir: &Path) -> Result<BTreeMap<String, TagEntry>, TagError> {
    match record::read(&dir.join(TAGS), Kind::Tags) {
        Ok(tags) => Ok(tags),
        Err(e) if e.is_missing() => Ok(BTreeMap::new()),
        Err(e) => Err(record_error(e)),
    }
}

/// The manifest of build `build` of template `name`.
pub fn build_manifest(home: &HutchHome, name: &str, build: &str) -> Result<Template, TagError> {
    let dir = home.template(name);
    let path = crate::template_store::build_manifest_path(&dir, build);
    let mut t: Template = match record::read(&path, Kind::Template) {
        Ok(t) => t,
        Err(e) if e.is_missing() => return Err(TagError::BuildGone { name: name.into(), build: build.into() }),
        Err(e) => return Err(record_error(e)),
    };
    t.dir = dir;
    if !t.image().is_file() {
        return Err(TagError::BuildGone { name: name.into(), build: build.into() });
    }
    Ok(t)
}

/// The build `tag` of template `name` names (None: the current one, `cached`'s).
pub fn resolve(home: &HutchHome, name: &str, tag: &str) -> Result<Template, TagError> {
    let tags = read_tags(&home.template(name))?;
    let Some(entry) = tags.get(tag) else {
        return Err(TagError::UnknownTag { name: name.into(), tag: tag.into(), known: known(&tags) });
    };
    let mut t = build_manifest(home, name, &entry.build)?;
    t.tag = Some(tag.to_string());
    Ok(t)
}

/// Every tag of template `name`, `default` first.
pub fn list(home: &HutchHome, name: &str) -> Result<Vec<(String, TagEntry)>, TagError> {
    let current = crate::template_store::current(home, name)?.ok_or_else(|| TagError::UnknownTemplate(name.into()))?;
    list_of(&current)
}

/// Every tag of the template whose current build is `current` (as `cached` read it),
/// `default` first.
pub fn list_of(current: &Template) -> Result<Vec<(String, TagEntry)>, TagError> {
    let mut all = vec![(DEFAULT.to_string(), TagEntry { build: current.build_id.clone(), created_at: current.tagged_at.clone().unwrap_or(current.built_at.clone()) })];
    all.extend(read_tags(&current.dir)?);
    Ok(all)
}

/// The tags a new build of template `name` gets: `tags` (checked, normal form), with
/// `default` first when they name none or the template has no build yet (so its name
/// alone starts something).
pub fn for_new_build(home: &HutchHome, name: &str, tags: &[String]) -> Vec<String> {
    let mut out = tags.to_vec();
    let first = !home.template(name).join(MANIFEST).is_file();
    if (out.is_empty() || first) && !out.iter().any(|t| t == DEFAULT) {
        out.insert(0, DEFAULT.to_string());
    }
    out
}

/// Stores the image at `built` as build `build_id` of its template and gives it `tags`,
/// in one hold of the template's lock (a prune between the two would take the build).
pub fn install_tagged(home: &HutchHome, built: &Path, template: Template, build_id: &str, tags: &[String]) -> Result<Template, TagError> {
    let dir = home.template(&template.name);
    std::fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
    let _held = lock(&dir)?;
    let stored = crate::template_store::store_build(home, built, template, build_id)?;
    assign_locked(home, &stored.name, build_id, tags)?;
    Ok(stored)
}

/// Points each of `tags` (checked, normal form) at the build `target` of template `name`
/// names (`name` or `name:tag`); returns that build. `default` makes it the current
/// build: its manifest replaces `template.json`.
pub fn assign(home: &HutchHome, name: &str, target: Option<&str>, tags: &[String]) -> Result<Template, TagError> {
    let dir = home.template(name);
    let _held = lock(&dir)?;
    let build = match target {
        Some(tag) => resolve(home, name, tag)?,
        None => crate::template_store::current(home, name)?.ok_or_else(|| TagError::UnknownTemplate(name.into()))?,
    };
    // A build from before builds kept their own manifests gets one now.
    if build_manifest(home, name, &build.build_id).is_err() {
        crate::template_store::keep_manifest(&build)?;
    }
    assign_locked(home, name, &build.build_id, tags)?;
    Ok(build)
}

fn assign_locked(home: &HutchHome, name: &str, build: &str, tags: &[String]) -> Result<(), TagError> {
    let dir = home.template(name);
    let mut manifest = build_manifest(home, name, build)?;
    let now = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    let mut map = read_tags(&dir)?;
    let before = map.clone();
    for tag in tags {
        if tag == DEFAULT {
            manifest.tagged_at = Some(now.clone());
            crate::template_store::make_current(&dir, &manifest)?;
        } else {
            map.insert(tag.clone(), TagEntry { build: build.to_string(), created_at: now.clone() });
        }
    }
    if map != before {
        record::write(&dir.join(TAGS), Kind::Tags, &map).map_err(record_error)?;
    }
    // The history is what E2B's assignment lists show; losing it loses no build.
    let mut past = read_history(&dir).unwrap_or_default();
    let next = past.last().map_or(0, |a| a.seq + 1);
    past.extend(tags.iter().zip(next..).map(|(tag, seq)| Assignment { tag: tag.clone(), build: build.to_string(), assigned_at: now.clone(), seq }));
    let drop = past.len().saturating_sub(HISTORY_KEPT);
    past.drain(..drop);
    if let Err(e) = record::write(&dir.join(HISTORY), Kind::TagHistory, &past) {
        tracing::warn!(template = name, "keeping the tag history: {e}");
    }
    Ok(())
}

fn read_history(dir: &Path) -> Result<Vec<Assignment>, TagError> {
    match record::read(&dir.join(HISTORY), Kind::TagHistory) {
        Ok(past) => Ok(past),
        Err(e) if e.is_missing() => Ok(Vec::new()),
        Err(e) => Err(record_error(e)),
    }
}

/// Every assignment of the tags template `current` (as `cached` read it) has now,
/// oldest first. A tag given before hutch kept a history has its current assignment.
/// Builds that are gone are left out: E2B lists ready builds only.
pub fn history_of(home: &HutchHome, current: &Template) -> Result<Vec<Assignment>, TagError> {
    let tags = list_of(current)?;
    let mut past: Vec<Assignment> = read_history(&current.dir)?.into_iter().filter(|a| tags.iter().any(|(t, _)| *t == a.tag)).collect();
    for (tag, entry) in &tags {
        if !past.iter().any(|a| a.tag == *tag && a.build == entry.build) {
            // Never written: seq 0 with its tag, build and time is still one identity.
            let seq = 0;
            past.push(Assignment { tag: tag.clone(), build: entry.build.clone(), assigned_at: entry.created_at.clone(), seq });
        }
    }
    past.retain(|a| a.build == current.build_id || build_manifest(home, &current.name, &a.build).is_ok());
    past.sort_by(|a, b| (&a.assigned_at, a.seq).cmp(&(&b.assigned_at, b.seq)));
    Ok(past)
}

/// Removes `tags` (checked, normal form) from template `name`; all of them or, if one is
/// not there, none.
pub fn remove(home: &HutchHome, name: &str, tags: &[String]) -> Result<(), TagError> {
    if tags.iter().any(|t| t == DEFAULT) {
        return Err(TagError::DefaultKept);
    }
    let dir = home.template(name);
    if !dir.join(MANIFEST).is_file() {
        return Err(TagError::UnknownTemplate(name.into()));
    }
    let _held = lock(&dir)?;
    let mut map = read_tags(&dir)?;
    if let Some(missing) = tags.iter().find(|t| !map.contains_key(*t)) {
        return Err(TagError::UnknownTag { name: name.into(), tag: missing.clone(), known: known(&map) });
    }
    map.retain(|t, _| !tags.contains(t));
    record::write(&dir.join(TAGS), Kind::Tags, &map).map_err(record_error)
}

/// The builds of template `dir` some non-default tag names (pruning keeps them).
pub(crate) fn tagged_builds(dir: &Path) -> Option<std::collections::HashSet<String>> {
    read_tags(dir).ok().map(|m| m.into_values().map(|e| e.build).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_checked_and_normalised_as_e2b_does() {
        assert_eq!(check(" V1.2_rc-1 ").expect("ok"), "v1.2_rc-1");
        for bad in ["", "a b", "x/y", "a:b", "é", "3f2b8c1e-0d4a-4c8e-9b1a-2f3e4d5c6b7a", &"x".repeat(65)] {
            assert!(matches!(check(bad), Err(TagError::BadTag(_))), "{bad:?}");
        }
        assert_eq!(split("app:v1"), ("app", Some("v1")));
        assert_eq!(split("app:default"), ("app", None));
        assert_eq!(split("app"), ("app", None));
        assert_eq!(split("app:"), ("app", None));
    }
}
