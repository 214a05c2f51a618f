//! Template builds through the API (E2B's `POST /v3/templates` flow): the manager owns
//! every build's record (status, log, reason), the uploaded COPY files, and which API
//! key owns which template name. Builds run one at a time (they boot a VM each) as
//! tasks of the manager, and their records live until the server stops.

use super::build_ids::{build_uuid, new_build_uuid, BuildInfo};
use super::build_records::{BuildRecord, BuildStatus, RecordLog};
use super::build_plan::{BuildPlan, PlannedBase, PlannedKind, PlannedStep};
use super::{ManagerError, SandboxManager};
use crate::build::{context, Base, BuildLog, BuildSpec, Level, Step, StepKind};
use hutch_formats::budget::{Budget, BudgetError};
use hutch_formats::upload::{self, UnpackError};
use hutch_oci::pull::RegistryOptions;
pub use hutch_image::template::Shape;
use std::path::{Path, PathBuf};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// An uploaded COPY context is a tar of the files a step names; more is not one.
pub const MAX_UPLOAD: u64 = 2 << 30;
/// How long an upload URL stays valid (the SDK's own upload timeout is an hour).
const UPLOAD_VALID: Duration = Duration::from_secs(60 * 60);
/// COPY steps one template may have. Each unpacks an upload and writes a tar into the
/// build's scratch; the SDK makes one per `copy()` and real templates have a handful,
/// so 64 leaves room while bounding the uploads, statvfs calls and time one build takes.
const MAX_COPY_STEPS: usize = 64;

/// What a build's COPY files may take of the host's disk, counted in tar bytes
/// (headers and padded data) as they are written (`hutch_formats::budget`).
#[derive(Debug, Clone, Copy)]
struct CopyLimits {
    /// One upload's unpacked files, and again its COPY's tar. A gzip upload of at most
    /// `MAX_UPLOAD` may inflate to 4 times that, no more.
    per_copy: u64,
    /// A build's unpacked files and tars together. Builds run one at a time
    /// (`Builds::gate`) and their scratch is removed when they end, so this is also
    /// the most COPY files take on the host at once, for one API key or for all.
    per_build: u64,
    /// Free space kept on the scratch's filesystem for every tenant's VMs.
    reserve: u64,
}

const COPY_LIMITS: CopyLimits = CopyLimits { per_copy: MAX_UPLOAD * 4, per_build: MAX_UPLOAD * 8, reserve: hutch_vmm::space::FLOOR };

/// A built template as the API lists it.
#[derive(Debug, Clone)]
pub struct TemplateInfo {
    pub name: String,
    pub build_id: String,
    /// RFC 3339.
    pub built_at: String,
    pub disk_size: u64,
    /// A built-in template (every key may use it), not one a key built.
    pub public: bool,
    /// What a sandbox of it gets unless its create asks otherwise.
    pub cpus: u32,
    pub memory_mib: u32,
    /// Its builds a tag names, the current one first.
    pub builds: Vec<BuildInfo>,
}

/// What a finished API build becomes: its tags, its id, its sandboxes' shape.
struct BuildTarget {
    tags: Vec<String>,
    api_build: String,
    shape: Shape,
}

/// Builds one API key may have started and not finished.
const MAX_OPEN_PER_KEY: usize = 4;
/// How long the record of an ended build is kept for its status.
const KEEP_ENDED: Duration = Duration::from_secs(60 * 60);

/// Whether `hash` is a lowercase hex SHA-256, as E2B's API checks it.
pub fn is_files_hash(hash: &str) -> bool {
    hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Template names the API builds into: hutch's own recipes stay hutch's.
fn check_buildable(name: &str) -> Result<(), ManagerError> {
    hutch_image::from_image::check_name(name).map_err(|e| ManagerError::InvalidArgument(e.to_string()))?;
    if hutch_image::recipes::builtin_names().contains(&name) {
        return Err(ManagerError::Conflict(format!("'{name}' is a built-in template; build under another name")));
    }
    // `/templates/tags` is the tags endpoint, so no template can be reached by that name.
    if name == "tags" {
        return Err(ManagerError::InvalidArgument("'tags' cannot name a template (the API's /templates/tags is taken); choose another name".into()));
    }
    Ok(())
}

impl SandboxManager {
    /// Where `key_id`'s uploaded COPY files are: each key's apart, so one key's upload
    /// never stands in for another's (the SDK's hash of a file list is predictable).
    fn files_dir(&self, key_id: &str) -> PathBuf {
        use sha2::Digest;
        let dir = hex::encode(&sha2::Sha256::digest(key_id.as_bytes())[..16]);
        self.home.root().join("cache").join("build").join("files").join(dir)
    }

    fn owner_file(&self, name: &str) -> PathBuf {
        self.home.template(name).join("owner")
    }

    /// The API key that built template `name`, if one did.
    pub fn template_owner(&self, name: &str) -> Option<String> {
        std::fs::read_to_string(self.owner_file(name)).ok().map(|s| s.trim().to_string())
    }

    /// Whether `reference` (`name` or `name:tag`) names a template `key_id` may use:
    /// Ok(public) for a built-in one (true) or one it built (false).
    pub fn template_alias(&self, key_id: &str, reference: &str) -> Result<bool, ManagerError> {
        let (alias, tag) = hutch_image::tags::split(reference);
        let public = self.template_name_alias(key_id, alias)?;
        if let Some(tag) = tag {
            hutch_image::tags::resolve(&self.home, alias, tag).map_err(super::error::tag_error)?;
        }
        Ok(public)
    }

    fn template_name_alias(&self, key_id: &str, alias: &str) -> Result<bool, ManagerError> {
        // Not a name a template can have (a path param may carry '/' or '..' decoded).
        if hutch_image::from_image::check_name(alias).is_err() {
            return Err(ManagerError::Missing(format!("there is no template '{}'", alias.escape_default())));
        }
        if hutch_image::recipes::builtin_names().contains(&alias) {
            return Ok(true);
        }
        match self.template_owner(alias) {
            Some(owner) if owner == key_id && self.home.template(alias).join("template.json").is_file() => Ok(false),
            // Claimed by this key's build, not built (yet).
            Some(owner) if owner == key_id => Err(ManagerError::Missing(format!("there is no template '{alias}' yet (no build of it finished)"))),
            Some(_) => Err(ManagerError::Forbidden(format!("template '{alias}' belongs to another API key"))),
            None => Err(ManagerError::Missing(format!("there is no template '{alias}'"))),
        }
    }

    /// The templates `key_id` may start sandboxes of (`GET /templates`): the built-in
    /// ones built on this machine, and the ones this key built.
    pub fn templates(&self, key_id: &str) -> Vec<TemplateInfo> {
        hutch_image::template_store::list(&self.home).into_iter().filter_map(|name| self.template_info(key_id, &name).ok()).collect()
    }

    /// One template `key_id` may use (`GET /templates/{id}`).
    pub fn template_info(&self, key_id: &str, name: &str) -> Result<TemplateInfo, ManagerError> {
        let public = self.template_name_alias(key_id, name)?;
        let template = hutch_image::rootfs::cached(&self.home, name)
            .map_err(|e| ManagerError::Internal(format!("reading template '{name}': {e}")))?
            .ok_or_else(|| ManagerError::Missing(format!("template '{name}' is not built on this server yet")))?;
        let (build_id, builds) = (build_uuid(&template), self.tagged_builds(&template));
        let (cpus, memory) = self.shape(name);
        Ok(TemplateInfo {
            memory_mib: memory.get(),
            cpus,
            name: template.name,
            build_id,
            builds,
            built_at: template.built_at,
            disk_size: template.disk_size,
            public,
        })
    }

    /// Claims `name` for `key_id` (its first build writes the owner file, created only
    /// if absent, so two keys cannot both claim it), or checks the claim is this key's.
    fn claim(&self, key_id: &str, name: &str) -> Result<(), ManagerError> {
        use std::io::Write;
        let taken = || ManagerError::Conflict(format!("template '{name}' belongs to another API key; choose another name"));
        match self.template_owner(name) {
            Some(owner) if owner == key_id => return Ok(()),
            Some(_) => return Err(taken()),
            None if self.home.template(name).join("template.json").is_file() => {
                return Err(ManagerError::Conflict(format!("template '{name}' was built on this machine outside the API; choose another name")))
            }
            None => {}
        }
        let dir = self.home.template(name);
        std::fs::create_dir_all(&dir).map_err(|e| ManagerError::Internal(format!("creating {}: {e}", dir.display())))?;
        match std::fs::OpenOptions::new().write(true).create_new(true).open(self.owner_file(name)) {
            Ok(mut f) => f.write_all(key_id.as_bytes()).map_err(|e| ManagerError::Internal(format!("claiming template '{name}': {e}"))),
            // Another request claimed it first: it counts only if it was this key.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => match self.template_owner(name) {
                Some(owner) if owner == key_id => Ok(()),
                _ => Err(taken()),
            },
            Err(e) => Err(ManagerError::Internal(format!("claiming template '{name}': {e}"))),
        }
    }

    /// Lets go of `name` when `key_id` claimed it but no build of it ever finished, as
    /// E2B deletes a template whose builds all failed: Ok(true) when it was such a claim
    /// and is gone, Ok(false) when it is not one (a built template, which the caller
    /// removes whole, or another key's). A build of it still running keeps it (409).
    pub fn release_unbuilt_template(&self, key_id: &str, name: &str) -> Result<bool, ManagerError> {
        if hutch_image::from_image::check_name(name).is_err() || self.template_owner(name).as_deref() != Some(key_id) {
            return Ok(false);
        }
        let dir = self.home.template(name);
        // Under the records' lock, as a build's start claims the name and becomes
        // Building: no build starts in between, and one that starts later claims the
        // name again. Moved aside under it, removed after.
        let aside = {
            let records = self.builds.records.lock();
            if dir.join("template.json").is_file() {
                return Ok(false);
            }
            if records.values().any(|r| {
                let r = r.lock();
                r.template_id == name && r.status == BuildStatus::Building
            }) {
                return Err(ManagerError::Conflict(format!("a build of template '{name}' is running; delete the template once it ends")));
            }
            let aside = self.home.template(&format!(".released-{name}-{}", new_build_uuid()));
            std::fs::rename(&dir, &aside).map_err(|e| ManagerError::Internal(format!("moving {} aside: {e}", dir.display())))?;
            aside
        };
        if let Err(e) = std::fs::remove_dir_all(&aside) {
            tracing::warn!("removing {}: {e}", aside.display());
        }
        Ok(true)
    }

    /// Starts a template build record (`POST /v3/templates`) of `name` that will get
    /// `tags`: (templateID, buildID, the tags in normal form).
    pub fn new_template_build(&self, key_id: &str, name: &str, tags: &[String], shape: Shape) -> Result<(String, String, Vec<String>), ManagerError> {
        check_buildable(name)?;
        // The tags finalize will give it (the answer names them).
        let tags = hutch_image::tags::for_new_build(&self.home, name, &super::tags::checked(tags)?);
        self.config.quota.check_shape(&shape)?;
        self.claim(key_id, name)?;
        let mut records = self.builds.records.lock();
        // Ended builds are kept an hour for their status, then let go.
        let now = SystemTime::now();
        records.retain(|_, r| r.lock().ended.is_none_or(|t| now.duration_since(t).unwrap_or_default() < KEEP_ENDED));
        let open = records.values().filter(|r| {
            let r = r.lock();
            r.key_id == key_id && r.ended.is_none()
        });
        if open.count() >= MAX_OPEN_PER_KEY {
            return Err(ManagerError::Quota(format!("this API key has {MAX_OPEN_PER_KEY} template builds open; wait for one to finish")));
        }
        let build_id = new_build_uuid();
        let record = BuildRecord {
            template_id: name.to_string(),
            build_id: build_id.clone(),
            key_id: key_id.to_string(),
            status: BuildStatus::Waiting,
            entries: Default::default(),
            dropped: 0,
            ended: None,
            reason: None,
            tags: tags.clone(),
            shape,
        };
        records.insert(build_id.clone(), Arc::new(Mutex::new(record)));
        Ok((name.to_string(), build_id, tags))
    }

    fn record(&self, key_id: &str, template_id: &str, build_id: &str) -> Result<Arc<Mutex<BuildRecord>>, ManagerError> {
        let record = self.builds.records.lock().get(build_id).cloned();
        match record {
            Some(r) if r.lock().key_id == key_id && r.lock().template_id == template_id => Ok(r),
            _ => Err(ManagerError::Missing(format!("there is no build '{build_id}' of template '{template_id}' for this API key"))),
        }
    }

    /// A build's record as it is now.
    pub fn template_build(&self, key_id: &str, template_id: &str, build_id: &str) -> Result<BuildRecord, ManagerError> {
        let record = self.record(key_id, template_id, build_id)?;
        let view = record.lock().clone();
        Ok(view)
    }

    /// Whether the COPY files `hash` were uploaded; if not, a token for uploading them.
    pub fn files_upload(&self, key_id: &str, template_id: &str, hash: &str) -> Result<Option<String>, ManagerError> {
        if !is_files_hash(hash) {
            return Err(ManagerError::InvalidArgument(format!("'{hash}' is not a files hash (64 lowercase hex digits)")));
        }
        let known = self.builds.records.lock().values().any(|r| {
            let r = r.lock();
            r.key_id == key_id && r.template_id == template_id
        });
        if !known {
            return Err(ManagerError::Missing(format!("no build of template '{template_id}' was started with this API key; POST /v3/templates first")));
        }
        let dir = self.files_dir(key_id);
        if dir.join(hash).is_file() {
            return Ok(None);
        }
        let token = hex::encode(rand::random::<[u8; 24]>());
        let now = SystemTime::now();
        let mut uploads = self.builds.uploads.lock();
        uploads.retain(|_, (_, _, until)| *until > now);
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        uploads.insert(token.clone(), (name, hash.to_string(), now + UPLOAD_VALID));
        Ok(Some(token))
    }

    /// Takes the one-time upload `token` for `hash`: where its bytes go (a temporary
    /// file, then `commit_upload`), and where they end up.
    pub fn upload_target(&self, hash: &str, token: &str) -> Result<(PathBuf, PathBuf), ManagerError> {
        let gone = || ManagerError::Missing("this upload URL is unknown, used or expired; ask for the files' URL again".into());
        let (dir_name, for_hash, until) = self.builds.uploads.lock().remove(token).ok_or_else(gone)?;
        if for_hash != hash || SystemTime::now() > until || !is_files_hash(hash) {
            return Err(gone());
        }
        let dir = self.home.root().join("cache").join("build").join("files").join(dir_name);
        std::fs::create_dir_all(&dir).map_err(|e| ManagerError::Internal(format!("creating {}: {e}", dir.display())))?;
        Ok((dir.join(format!(".{hash}.{}.partial", hex::encode(rand::random::<[u8; 6]>()))), dir.join(hash)))
    }

    /// Puts a complete upload in place. One already there stays: an upload under a
    /// hash never replaces what a build may be reading.
    pub fn commit_upload(&self, partial: &Path, target: &Path) -> Result<(), ManagerError> {
        let stored = match std::fs::hard_link(partial, target) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(ManagerError::Internal(format!("storing the upload: {e}"))),
        };
        let _ = std::fs::remove_file(partial);
        stored
    }

    /// The URL of the proxy API builds pull images through: it dials public addresses
    /// and the operator's listed registries only.
    fn public_proxy(&self) -> Result<String, ManagerError> {
        if let Some(p) = self.builds.proxy.get() {
            return Ok(p.url());
        }
        let started = hutch_net::public_proxy::PublicProxy::start(self.config.insecure_registries.clone())
            .map_err(|e| ManagerError::Internal(format!("starting the proxy image pulls go through: {e}")))?;
        // Two first builds at once: one proxy is kept, the other dropped (and stopped).
        Ok(self.builds.proxy.get_or_init(|| started).url())
    }

    /// Starts build `build_id` (`POST /v2/templates/{id}/builds/{buildID}`). Checks what
    /// can be checked at once (a 4xx); the rest fails the build, as its status says.
    pub fn start_template_build(&self, key_id: &str, template_id: &str, build_id: &str, plan: BuildPlan) -> Result<(), ManagerError> {
        let record = self.record(key_id, template_id, build_id)?;
        let started_already = || ManagerError::Conflict(format!("build '{build_id}' was already started"));
        if record.lock().status != BuildStatus::Waiting {
            return Err(started_already());
        }
        let base = match &plan.base {
            PlannedBase::Image { reference, login } => {
                // Registries on this machine or its private networks only as the operator
                // listed them (`hutch serve --insecure-registry`): a tenant's image
                // reference must not reach the host's own services.
                let mut registry = RegistryOptions { insecure: self.config.insecure_registries.clone(), local: false, proxy: Some(self.public_proxy()?), ..Default::default() };
                if let Some(login) = login {
                    login.apply(&mut registry)?;
                }
                Base::Image { reference: reference.clone(), registry }
            }
            PlannedBase::Template(template) => {
                // A base this key may use: a built-in template or one of its own.
                self.template_alias(key_id, template).map_err(|_| super::unknown_template(template))?;
                Base::Template(template.clone())
            }
        };
        check_steps(&plan.steps, &self.files_dir(key_id))?;
        let Some(me) = self.me.upgrade() else { return Err(ManagerError::Internal("the server is stopping".into())) };
        {
            // Claimed and moved on under the records' lock, which a DELETE of an unbuilt
            // template takes too: it never removes the claim of a build starting now.
            let _records = self.builds.records.lock();
            // The name may have been claimed by another key since this record was made.
            self.claim(key_id, template_id)?;
            // Checked again and moved on in one lock: of two starts racing, one builds.
            let mut r = record.lock();
            if r.status != BuildStatus::Waiting {
                return Err(started_already());
            }
            r.status = BuildStatus::Building;
        }
        let template_id = template_id.to_string();
        let key_id = key_id.to_string();
        let target = {
            let r = record.lock();
            BuildTarget { tags: r.tags.clone(), api_build: build_id.to_string(), shape: r.shape }
        };
        tokio::spawn(async move {
            // Waiting for its turn holds no thread.
            let turn = me.builds.gate.clone().acquire_owned().await;
            // The build's future is not Send (rustc cannot prove it for the closures its
            // layer downloads and steps hold across awaits), so it runs on a blocking-pool
            // thread of its own, driven by this runtime.
            let runtime = tokio::runtime::Handle::current();
            let (me2, record2) = (me.clone(), record.clone());
            let ran = tokio::task::spawn_blocking(move || {
                let log: Arc<dyn BuildLog> = Arc::new(RecordLog(record2));
                runtime.block_on(me2.run_api_build(&key_id, &template_id, target, base, plan, log))
            })
            .await;
            drop(turn);
            let mut r = record.lock();
            r.ended = Some(SystemTime::now());
            match ran {
                Ok(Ok(())) => r.status = BuildStatus::Ready,
                Ok(Err(e)) => {
                    r.status = BuildStatus::Error;
                    r.reason = Some((e.message.clone(), e.at.step_name()));
                }
                Err(e) => {
                    r.status = BuildStatus::Error;
                    r.reason = Some((format!("the build task failed: {e}"), "base".into()));
                }
            }
        });
        Ok(())
    }

    async fn run_api_build(&self, key_id: &str, name: &str, target: BuildTarget, base: Base, plan: BuildPlan, log: Arc<dyn BuildLog>) -> Result<(), crate::build::BuildError> {
        use crate::build::{BuildError, FailedAt};
        let scratch = crate::build::cache::BuildCache::new(&self.home).scratch().map_err(|e| BuildError { at: FailedAt::Base, message: e.to_string(), caller_fault: false })?;
        let steps = api_steps(&plan.steps, &self.files_dir(key_id), &scratch, COPY_LIMITS);
        let result = match steps {
            Ok(steps) => {
                let spec = BuildSpec {
                    name: name.to_string(),
                    tags: target.tags,
                    api_build: Some(target.api_build),
                    shape: target.shape,
                    base,
                    steps,
                    start_cmd: plan.start_cmd.filter(|c| !c.is_empty()),
                    ready_cmd: plan.ready_cmd.filter(|c| !c.is_empty()),
                    force: plan.force,
                    docker_rules: false,
                    network: hutch_net::Settings::native(if self.config.internet_by_default { hutch_net::Policy::public() } else { hutch_net::Policy::none() }),
                    net_env: self.config.net_env.clone(),
                    accel: self.config.accel,
                };
                crate::build::build(&self.home, self.backend.as_ref(), spec, log, Arc::new(hutch_oci::pull::Quiet)).await
            }
            Err(e) => {
                log.log(Level::Error, Some(&e.at.step_name()), &e.message);
                Err(e)
            }
        };
        let _ = std::fs::remove_dir_all(&scratch);
        result?;
        // Sandboxes created from now on use the new build.
        self.forget_artifacts(name);
        Ok(())
    }
}

/// What the steps need of this server: at most `MAX_COPY_STEPS` COPYs, each of files
/// this key uploaded. (Their shape was checked where the request was read.)
fn check_steps(steps: &[PlannedStep], files: &Path) -> Result<(), ManagerError> {
    let copies = steps.iter().filter(|s| matches!(s.kind, PlannedKind::Copy { .. })).count();
    if copies > MAX_COPY_STEPS {
        return Err(ManagerError::InvalidArgument(format!(
            "the template has {copies} COPY steps, more than the {MAX_COPY_STEPS} one template may have; copy whole directories in fewer steps"
        )));
    }
    for (i, step) in steps.iter().enumerate() {
        let PlannedKind::Copy { files_hash, .. } = &step.kind else { continue };
        let bad = |why: &str| ManagerError::InvalidArgument(format!("step {} ({}): {why}", i + 1, step.text));
        // The hash names a file: nothing but a hash may.
        if !is_files_hash(files_hash) {
            return Err(bad("filesHash is missing or not 64 lowercase hex digits"));
        }
        if !files.join(files_hash).is_file() {
            return Err(bad("its files were never uploaded; upload them first (GET /templates/{id}/files/{hash})"));
        }
    }
    Ok(())
}

/// The plan's steps as the build engine's. A COPY's uploaded tar (gzip or plain, names
/// relative to the SDK's context) is unpacked into a scratch context, collected into
/// the step's tar, and the context removed, all within `limits`.
fn api_steps(steps: &[PlannedStep], files: &Path, scratch: &Path, limits: CopyLimits) -> Result<Vec<Step>, crate::build::BuildError> {
    use crate::build::{BuildError, FailedAt};
    let mut budget = Budget::new(scratch, limits.per_build, limits.reserve);
    let mut out = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        let n = i + 1;
        let text = step.text.clone();
        // A host short of disk is not the caller's fault; the rest is its files'.
        let refused = |e: &dyn std::fmt::Display, short: bool| BuildError { at: FailedAt::Step(n), message: format!("step {n} `{text}`: {e}"), caller_fault: !short };
        let kind = match &step.kind {
            PlannedKind::Env(pairs) => StepKind::Env(pairs.clone()),
            PlannedKind::Workdir(dir) => StepKind::Workdir(dir.clone()),
            PlannedKind::User(user) => StepKind::User(user.clone()),
            PlannedKind::Run { cmd, user } => StepKind::Run { cmd: cmd.clone(), user: user.clone(), build_args: Default::default() },
            PlannedKind::Copy { files_hash, src, dest, owner, mode } => {
                let ctx = scratch.join(format!("context-{n}"));
                budget.begin(limits.per_copy);
                upload::unpack(&files.join(files_hash), &ctx, &mut budget).map_err(|e| refused(&e, matches!(e, UnpackError::Budget(BudgetError::NoSpace { .. }))))?;
                budget.begin(limits.per_copy);
                // As E2B's builder: a pattern's matches, uploaded under its directory, are that
                // directory's contents (symlinks kept as the SDK sent them).
                let source = context::pattern_base(src).to_string();
                let copy = context::collect_within(&ctx, &[source], dest, &context::Ignore::default(), &scratch.join(format!("copy-{n}.tar")), &mut budget);
                // The tar holds what the step needs: the unpacked files would only take disk.
                let _ = std::fs::remove_dir_all(&ctx);
                let copy = copy.map_err(|e| refused(&e, matches!(e, context::ContextError::Budget(BudgetError::NoSpace { .. }))))?;
                StepKind::Copy { files: copy, dest: dest.clone(), owner: owner.clone(), mode: mode.clone() }
            }
        };
        out.push(Step { kind, force: step.force, text });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::{api_steps, check_steps, CopyLimits, PlannedKind, PlannedStep, MAX_COPY_STEPS};
    use crate::build::StepKind;
    use std::path::Path;

    fn copy(hash: &str) -> PlannedStep {
        let kind = PlannedKind::Copy { files_hash: hash.into(), src: "app".into(), dest: "/srv/".into(), owner: None, mode: None };
        PlannedStep { kind, force: false, text: "COPY app /srv/".into() }
    }

    /// An upload stored under `hash` in `files`, a tar.gz whose entries `fill` makes.
    fn stored(files: &Path, hash: &str, fill: impl FnOnce(&mut tar::Builder<flate2::write::GzEncoder<std::fs::File>>)) {
        let gz = flate2::write::GzEncoder::new(std::fs::File::create(files.join(hash)).expect("create"), flate2::Compression::default());
        let mut tar = tar::Builder::new(gz);
        fill(&mut tar);
        tar.into_inner().expect("tar").finish().expect("gzip");
    }

    fn file(tar: &mut tar::Builder<impl std::io::Write>, name: &str, size: u64) {
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        h.set_size(size);
        tar.append_data(&mut h, name, std::io::Read::take(std::io::repeat(b'x'), size)).expect("append");
    }

    fn left_in(scratch: &Path) -> Vec<String> {
        std::fs::read_dir(scratch).expect("scratch").flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect()
    }

    const ROOMY: CopyLimits = CopyLimits { per_copy: 1 << 30, per_build: 1 << 30, reserve: 0 };

    #[test]
    fn a_template_has_at_most_64_copy_steps() {
        let files = tempfile::tempdir().expect("dir");
        let hash = "a".repeat(64);
        std::fs::write(files.path().join(&hash), b"").expect("upload");
        check_steps(&vec![copy(&hash); MAX_COPY_STEPS], files.path()).expect("64 are fine");
        let e = check_steps(&vec![copy(&hash); MAX_COPY_STEPS + 1], files.path()).expect_err("65 are not");
        assert!(matches!(e, super::ManagerError::InvalidArgument(_)), "a 400: {e:?}");
        assert!(e.to_string().contains("65 COPY steps, more than the 64"), "{e}");
    }

    #[test]
    fn a_copy_unpacks_its_upload_into_the_steps_tar_and_leaves_only_the_tar() {
        let (files, scratch) = (tempfile::tempdir().expect("dir"), tempfile::tempdir().expect("dir"));
        let hash = "b".repeat(64);
        stored(files.path(), &hash, |t| file(t, "app/main.py", 9));
        let steps = api_steps(&[copy(&hash)], files.path(), scratch.path(), ROOMY).expect("steps");
        let StepKind::Copy { files: tar, .. } = &steps[0].kind else { panic!("a COPY: {:?}", steps[0].kind) };
        assert_eq!(tar.entries, 1);
        assert_eq!(left_in(scratch.path()), ["copy-1.tar"]);
    }

    #[test]
    fn a_copy_past_its_allowance_fails_the_build_as_the_callers_fault_and_leaves_nothing() {
        let (files, scratch) = (tempfile::tempdir().expect("dir"), tempfile::tempdir().expect("dir"));
        let (small, big) = ("c".repeat(64), "d".repeat(64));
        stored(files.path(), &small, |t| file(t, "app/a", 300 << 10));
        stored(files.path(), &big, |t| file(t, "app/b", 2 << 20));
        // Each COPY may hold 1 MiB: the big one is refused while it unpacks.
        let per_copy = CopyLimits { per_copy: 1 << 20, per_build: 1 << 30, reserve: 0 };
        let e = api_steps(&[copy(&small), copy(&big)], files.path(), scratch.path(), per_copy).expect_err("too big");
        assert!(e.caller_fault && e.at.step_name() == "2", "{e:?}");
        assert!(e.message.starts_with("step 2 `COPY app /srv/`: the COPY's files come to more than 1 MiB"), "{}", e.message);
        assert_eq!(left_in(scratch.path()), ["copy-1.tar"], "the refused step's files are gone");
        // The build's allowance counts every COPY's files and tars: the second small one passes it.
        let per_build = CopyLimits { per_copy: 1 << 20, per_build: 1 << 20, reserve: 0 };
        let e = api_steps(&[copy(&small), copy(&small)], files.path(), tempfile::tempdir().expect("dir").path(), per_build).expect_err("build");
        assert!(e.message.contains("the most one template build may write"), "{}", e.message);
    }

    #[test]
    fn a_host_short_of_disk_fails_the_build_with_a_sentence_that_says_so() {
        let (files, scratch) = (tempfile::tempdir().expect("dir"), tempfile::tempdir().expect("dir"));
        let hash = "e".repeat(64);
        stored(files.path(), &hash, |t| file(t, "app/a", 10));
        let free = hutch_vmm::space::available(scratch.path()).expect("statvfs");
        let short = CopyLimits { per_copy: 1 << 30, per_build: 1 << 30, reserve: free + (1 << 30) };
        let e = api_steps(&[copy(&hash)], files.path(), scratch.path(), short).expect_err("short of disk");
        assert!(!e.caller_fault && e.message.contains("the server is short of disk"), "{e:?}");
        assert!(left_in(scratch.path()).is_empty());
    }
}
