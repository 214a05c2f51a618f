//! Template tags through the API (E2B's `POST`/`DELETE /templates/tags` and `GET
//! /templates/{id}/tags`): only the key that built a template tags it. The tags
//! themselves are hutch-image's (`tags.rs`); this checks who may change them and keeps
//! the manager's prepared artifacts in step with them.

use super::error::tag_error;
use super::build_ids::{build_uuid, name_uuid, BuildInfo};
use super::{ManagerError, SandboxManager};
use hutch_image::template::Template;
use hutch_image::tags;

/// One tag as the API shows it.
#[derive(Debug, Clone)]
pub struct TagView {
    pub tag: String,
    /// The build's UUID.
    pub build_id: String,
    /// RFC 3339.
    pub created_at: String,
}

/// One time a tag was pointed at a build, as E2B's assignment lists show it.
#[derive(Debug, Clone)]
pub struct AssignmentView {
    pub tag: String,
    /// A UUID naming this assignment.
    pub assignment_id: String,
    /// The build's UUID.
    pub build_id: String,
    /// RFC 3339, as the rest.
    pub assigned_at: String,
    /// hutch does not record when a build began: this is when it was finished.
    pub build_created_at: String,
    pub build_finished_at: String,
}

/// One tag as E2B takes it, in normal form (a bad one is a 400).
pub fn normal_tag(tag: &str) -> Result<String, ManagerError> {
    tags::check(tag).map_err(tag_error)
}

/// Tags as E2B takes them: each checked, in normal form, once.
pub(crate) fn checked(tags: &[String]) -> Result<Vec<String>, ManagerError> {
    let mut out: Vec<String> = Vec::new();
    for tag in tags {
        let tag = tags::check(tag).map_err(tag_error)?;
        if !out.contains(&tag) {
            out.push(tag);
        }
    }
    Ok(out)
}

impl SandboxManager {
    /// Template `name` if `key_id` built it (only the builder changes its tags).
    fn own_template(&self, key_id: &str, name: &str) -> Result<(), ManagerError> {
        if self.template_alias(key_id, name)? {
            return Err(ManagerError::Forbidden(format!("template '{name}' is built in; its tags are hutch's")));
        }
        Ok(())
    }

    /// Every tag of template `name` (`GET /templates/{id}/tags`); a tag whose build is
    /// gone (a damaged home) is left out.
    pub fn template_tags(&self, key_id: &str, name: &str) -> Result<Vec<TagView>, ManagerError> {
        if name.contains(':') {
            return Err(ManagerError::InvalidArgument(format!("'{name}' names a tag; give the template's name")));
        }
        self.template_alias(key_id, name)?;
        let current = self.current(name)?;
        let mut out = Vec::new();
        for (tag, entry) in tags::list_of(&current).map_err(tag_error)? {
            let build = if entry.build == current.build_id { Ok(current.clone()) } else { tags::build_manifest(&self.home, name, &entry.build) };
            if let Ok(build) = build {
                out.push(TagView { tag, build_id: build_uuid(&build), created_at: entry.created_at });
            }
        }
        Ok(out)
    }

    /// Every assignment of the tags template `name` has now, oldest first (E2B's tag
    /// groups and assignment lists); builds that are gone are left out.
    pub fn tag_assignments(&self, key_id: &str, name: &str) -> Result<Vec<AssignmentView>, ManagerError> {
        if name.contains(':') {
            return Err(ManagerError::InvalidArgument(format!("'{name}' names a tag; give the template's name")));
        }
        self.template_alias(key_id, name)?;
        let current = self.current(name)?;
        let past = tags::history_of(&self.home, &current).map_err(tag_error)?;
        let mut out = Vec::with_capacity(past.len());
        for a in past {
            let build = if a.build == current.build_id { Ok(current.clone()) } else { tags::build_manifest(&self.home, name, &a.build) };
            let Ok(build) = build else { continue };
            let id = name_uuid(&format!("hutch-tag-assignment:{name}:{}:{}:{}:{}", a.seq, a.tag, a.build, a.assigned_at));
            out.push(AssignmentView {
                tag: a.tag,
                assignment_id: id,
                build_id: build_uuid(&build),
                assigned_at: a.assigned_at,
                build_created_at: build.built_at.clone(),
                build_finished_at: build.built_at,
            });
        }
        Ok(out)
    }

    /// Points `tags` at the build `target` (`name` or `name:tag`) names (`POST
    /// /templates/tags`): (the build's UUID, the tags in normal form).
    pub fn assign_template_tags(&self, key_id: &str, target: &str, new_tags: &[String]) -> Result<(String, Vec<String>), ManagerError> {
        let (name, tag) = tags::split(target);
        let tag = tag.map(tags::check).transpose().map_err(tag_error)?;
        self.own_template(key_id, name)?;
        let new_tags = checked(new_tags)?;
        if new_tags.is_empty() {
            return Err(ManagerError::InvalidArgument("tags is empty: name at least one tag to assign".into()));
        }
        let build = tags::assign(&self.home, name, tag.as_deref(), &new_tags).map_err(tag_error)?;
        self.tags_changed(name, &new_tags);
        Ok((build_uuid(&build), new_tags))
    }

    /// Removes `tags` from template `name` (`DELETE /templates/tags`); the builds only
    /// they named go when nothing else uses them (the next prune).
    pub fn remove_template_tags(&self, key_id: &str, name: &str, gone: &[String]) -> Result<(), ManagerError> {
        if name.contains(':') {
            return Err(ManagerError::InvalidArgument(format!("name '{name}' names a tag; give the template's name, and the tags in tags")));
        }
        self.own_template(key_id, name)?;
        let gone = checked(gone)?;
        if gone.is_empty() {
            return Err(ManagerError::InvalidArgument("tags is empty: name at least one tag to remove".into()));
        }
        tags::remove(&self.home, name, &gone).map_err(tag_error)?;
        self.tags_changed(name, &gone);
        Ok(())
    }

    /// After `changed` tags of template `name` were moved or removed: the next sandbox
    /// finds the build its reference names now, and what only those tags kept (their
    /// memory snapshots, builds nothing else names) goes, off the request's thread.
    fn tags_changed(&self, name: &str, changed: &[String]) {
        self.forget_artifacts(name);
        let (home, name, changed) = (self.home.clone(), name.to_string(), changed.to_vec());
        tokio::task::spawn_blocking(move || crate::pruning::release_tags(&home, &name, &changed));
    }

    /// The builds of `current`'s template that a tag names, `current` first.
    pub(crate) fn tagged_builds(&self, current: &Template) -> Vec<BuildInfo> {
        let info = |t: &Template| BuildInfo { id: build_uuid(t), built_at: t.built_at.clone(), disk_size: t.disk_size };
        let mut out = vec![info(current)];
        let mut seen = vec![current.build_id.clone()];
        for (_, entry) in tags::list_of(current).unwrap_or_default() {
            if seen.contains(&entry.build) {
                continue;
            }
            if let Ok(t) = tags::build_manifest(&self.home, &current.name, &entry.build) {
                out.push(info(&t));
            }
            seen.push(entry.build);
        }
        out
    }

    fn current(&self, name: &str) -> Result<Template, ManagerError> {
        hutch_image::rootfs::cached(&self.home, name)
            .map_err(|e| ManagerError::Internal(hutch_proto::error_chain(&e)))?
            .ok_or_else(|| ManagerError::Missing(format!("template '{name}' is not built on this server yet")))
    }

    /// Drops the prepared artifacts of template `name` and each of its tags, and
    /// retires the pooled sandboxes of its old builds: the next sandbox finds the build
    /// its reference names now (or that it is gone). Artifacts go first: a pool fill
    /// that reads the new generation must not find the old build prepared.
    pub fn forget_artifacts(&self, name: &str) {
        self.artifacts.lock().retain(|reference, _| tags::split(reference).0 != name);
        self.retire_pooled(name);
    }
}
