//! Template builds: a base (an OCI image or a template), then steps (`RUN`, `COPY`,
//! `ENV`, `WORKDIR`, `USER`, as E2B's template API and Dockerfiles name them) run in
//! a builder microVM through the agent, each disk-changing step leaving a cached layer
//! (see `cache`), then the result flattened into a template's raw ext4 image with the
//! final user, workdir, env and start command as its defaults.
//!
//! A build owns its builder VM and scratch directory: both are gone when `build`
//! returns, whatever the outcome. A failed build leaves no template and no cache entry
//! for the step that failed (layers are recorded only once complete).

pub mod cache;
mod finalize;
mod guest;
mod run_context;
pub mod spec;

// What a build does, read from what the user sent (Dockerfiles, contexts, steps): a
// crate of its own, which the fuzz targets build without the rest of hutch.
pub use hutch_formats::{context, dockerfile, shell_join, Step, StepKind};

use cache::{BuildCache, Key};
use run_context::Context;

pub use run_context::absolute;
pub use spec::{Base, BuildError, BuildLog, BuildSpec, Built, FailedAt, Level};
use hutch_image::template::ImageSource;
use hutch_image::HutchHome;
use hutch_oci::pull::{PullProgress, Puller};
use hutch_oci::{BlobStore, ImageDefaults};
use hutch_vmm::VmBackend;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Builds template `spec.name`. Its builder VM, if any step needs one, is gone when this returns.
pub async fn build(home: &HutchHome, backend: &dyn VmBackend, spec: BuildSpec, log: Arc<dyn BuildLog>, pull: Arc<dyn PullProgress>) -> Result<Built, BuildError> {
    hutch_image::from_image::check_name(&spec.name).map_err(|e| BuildError::at(FailedAt::Base, true, e.to_string()))?;
    let cache = BuildCache::new(home);
    // No cache layer is removed while this build may stack on it.
    let holding = cache.clone();
    let _in_use = tokio::task::spawn_blocking(move || holding.shared())
        .await
        .map_err(|e| BuildError::at(FailedAt::Base, false, e.to_string()))?
        .map_err(|e| BuildError::at(FailedAt::Base, false, e.to_string()))?;
    // Removed however the build ends, a dropped future (Ctrl-C, a server stopping)
    // included; the VM's own drop kills QEMU.
    let scratch = RemoveOnDrop::new(cache.scratch().map_err(|e| BuildError::at(FailedAt::Base, false, e.to_string()))?);
    let mut vm: Option<guest::BuildVm> = None;
    let result = run(home, backend, &spec, &cache, scratch.path(), &mut vm, &log, pull).await;
    if let Some(vm) = vm.take() {
        vm.destroy().await;
    }
    drop(scratch);
    if let Err(e) = &result {
        log.log(Level::Error, Some(&e.at.step_name()), &e.message);
    }
    result
}

struct BaseLayer {
    key: Key,
    layer: PathBuf,
    defaults: ImageDefaults,
    reference: String,
    digest: String,
}

async fn base_layer(home: &HutchHome, spec: &BuildSpec, cache: &BuildCache, scratch: &Path, log: &Arc<dyn BuildLog>, pull: Arc<dyn PullProgress>) -> Result<BaseLayer, BuildError> {
    let fail = |caller: bool| move |e: String| BuildError::at(FailedAt::Base, caller, e);
    match &spec.base {
        Base::Image { reference, registry } => {
            log.log(Level::Info, Some("base"), &format!("[base] FROM {reference}"));
            let store = BlobStore::new(home.root().join("cache").join("oci").join("blobs"));
            let image = Puller::new(store.clone(), registry).pull(reference, pull).await.map_err(|e| {
                use hutch_oci::pull::PullError;
                let caller = !matches!(e, PullError::Store { .. });
                BuildError::at(FailedAt::Base, caller, hutch_proto::error_chain(&e))
            })?;
            log.log(
                Level::Info,
                Some("base"),
                &format!(
                    "pulled {} ({}): {} layer(s) downloaded ({}), {} already cached",
                    image.reference,
                    image.manifest_digest.short(),
                    image.layers_downloaded,
                    hutch_image::progress::human_bytes(image.bytes_downloaded),
                    image.layers_cached
                ),
            );
            let digest = image.manifest_digest.to_string();
            let key = Key::of(None, &["image", &digest, &hutch_image::template::DISK_SIZE.to_string()]);
            let source = ImageSource { reference: image.reference.clone(), manifest_digest: digest.clone(), defaults: image.defaults.clone() };
            if let Some(layer) = cache.lookup(&key).filter(|_| !spec.force) {
                log.log(Level::Info, Some("base"), &format!("CACHED [base] FROM {reference} [{}]", key.short()));
                return Ok(BaseLayer { key, layer, defaults: image.defaults, reference: image.reference, digest });
            }
            let work = scratch.join("base");
            let (id, dir) = cache.new_layer().map_err(|e| fail(false)(e.to_string()))?;
            let guard = RemoveOnDrop::new(dir.clone());
            let (log2, layers) = (log.clone(), image.layers.clone());
            let src = source.clone();
            let made = tokio::task::spawn_blocking(move || {
                std::fs::create_dir_all(&work).map_err(|e| (false, e.to_string()))?;
                let progress = LogProgress(log2, "base");
                let image = hutch_image::from_image::make_image(&store, &layers, &src, &work, &progress).map_err(|e| {
                    // The image's own contents are the caller's; the host's are not.
                    (e.is_the_images(), hutch_proto::error_chain(&e))
                })?;
                std::fs::rename(&image, dir.join("disk.raw")).map_err(|e| (false, format!("moving the base image into the cache: {e}")))?;
                Ok::<_, (bool, String)>(dir.join("disk.raw"))
            })
            .await
            .map_err(|e| fail(false)(e.to_string()))?;
            let layer = made.map_err(|(caller, e)| fail(caller)(e))?;
            cache.record(&key, &id).map_err(|e| fail(false)(e.to_string()))?;
            guard.keep();
            Ok(BaseLayer { key, layer, defaults: image.defaults, reference: image.reference, digest })
        }
        Base::Template(name) => {
            log.log(Level::Info, Some("base"), &format!("[base] FROM template {name}"));
            let (home2, name2, log2) = (home.clone(), name.clone(), log.clone());
            let template = tokio::task::spawn_blocking(move || hutch_image::rootfs::ensure(&home2, &name2, &LogProgress(log2, "base")))
                .await
                .map_err(|e| fail(false)(e.to_string()))?
                .map_err(|e| {
                    let caller = matches!(e, hutch_image::template::TemplateError::Unknown { .. });
                    fail(caller)(hutch_proto::error_chain(&e))
                })?;
            let key = Key::of(None, &["template", &template.name, &template.build_id]);
            let defaults = template.source.as_ref().map(|s| s.defaults.clone()).unwrap_or_default();
            Ok(BaseLayer { key, layer: template.image(), defaults, reference: format!("template:{}", template.name), digest: template.build_id.clone() })
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn run(
    home: &HutchHome,
    backend: &dyn VmBackend,
    spec: &BuildSpec,
    cache: &BuildCache,
    scratch: &Path,
    vm: &mut Option<guest::BuildVm>,
    log: &Arc<dyn BuildLog>,
    pull: Arc<dyn PullProgress>,
) -> Result<Built, BuildError> {
    let base = base_layer(home, spec, cache, scratch, log, pull).await?;
    let image = &base.defaults;
    let mut ctx = if spec.docker_rules {
        Context {
            user: image.user.clone().unwrap_or_else(|| "root".into()),
            workdir: image.workdir.clone().unwrap_or_else(|| "/".into()),
            env: image.env.clone(),
            user_set: false,
            workdir_set: false,
            entrypoint: image.entrypoint.clone(),
            cmd: image.cmd.clone(),
            command_set: false,
        }
    } else {
        Context {
            user: "user".into(),
            workdir: "/home/user".into(),
            env: image.env.clone(),
            user_set: true,
            workdir_set: true,
            entrypoint: Vec::new(),
            cmd: Vec::new(),
            command_set: false,
        }
    };
    let total = spec.steps.len();
    // The rules the steps start under are part of every key: the same `RUN` as `user`
    // in /home/user (E2B) and as root in / (a Dockerfile) are different layers.
    let start = Key::of(Some(&base.key), &["context", &spec.docker_rules.to_string(), &ctx.user, &ctx.workdir]);
    let keys = step_keys(spec, &start, &ctx);
    // Each cached layer is looked up once: steps before the first that must run are
    // CACHED (metadata ones included), and every step from it on runs (each one's
    // parent is new).
    let hits: Vec<Option<PathBuf>> = keys.iter().zip(&spec.steps).map(|(k, s)| needs_disk(&s.kind).then(|| cache.lookup(k)).flatten()).collect();
    let first_run = if spec.force {
        0
    } else {
        spec.steps.iter().enumerate().position(|(i, s)| s.force || (needs_disk(&s.kind) && hits[i].is_none())).unwrap_or(total)
    };
    let mut key = start;
    let mut layer = base.layer.clone();
    let (mut cached, mut built) = (0, 0);
    for (i, step) in spec.steps.iter().enumerate() {
        let n = i + 1;
        let at = FailedAt::Step(n);
        let step_name = n.to_string();
        let say = |level: Level, text: &str| log.log(level, Some(&step_name), text);
        key = keys[i].clone();
        if i < first_run {
            if let Some(hit) = &hits[i] {
                layer = hit.clone();
                cached += 1;
            }
            apply_metadata(&mut ctx, &step.kind);
            say(Level::Info, &format!("CACHED [builder {n}/{total}] {}", step.text));
            continue;
        }
        if !needs_disk(&step.kind) {
            apply_metadata(&mut ctx, &step.kind);
            say(Level::Info, &format!("[builder {n}/{total}] {}", step.text));
            continue;
        }
        say(Level::Info, &format!("[builder {n}/{total}] {}", step.text));
        let machine = builder(home, backend, spec, vm, &layer, &at, log).await?;
        guest::execute(machine, step, &mut ctx, n, total, log).await.map_err(|(caller, e)| BuildError::at(at.clone(), caller, e))?;
        apply_metadata(&mut ctx, &step.kind);
        layer = commit(cache, machine, &key, &at).await?;
        built += 1;
    }
    // The defaults go into the image as one more cached layer, written by the agent:
    // nothing on the host parses the guest's filesystem. An image's own, unchanged,
    // are already there.
    let defaults = final_defaults(spec, image, &ctx);
    let json = serde_json::to_string(&defaults).unwrap_or_default();
    let unchanged = layer == base.layer && defaults == base.defaults;
    if !unchanged {
        let at = FailedAt::Finalize;
        let fin = Key::of(Some(&key), &["defaults", &json]);
        match cache.lookup(&fin).filter(|_| vm.is_none() && !spec.force) {
            Some(hit) => {
                log.log(Level::Info, Some("finalize"), &format!("CACHED [finalize] the template's defaults [{}]", fin.short()));
                layer = hit;
            }
            None => {
                log.log(Level::Info, Some("finalize"), "[finalize] the template's defaults (user, workdir, env, start command)");
                let machine = builder(home, backend, spec, vm, &layer, &at, log).await?;
                guest::write_defaults(machine, &json).await.map_err(|e| BuildError::at(at.clone(), false, e))?;
                layer = commit(cache, machine, &fin, &at).await?;
            }
        }
        key = fin;
    }
    if let Some(machine) = vm.take() {
        machine.destroy().await;
    }
    let source = ImageSource { reference: base.reference.clone(), manifest_digest: base.digest.clone(), defaults };
    let template = finalize::finish(home, spec, &layer, &key, source, scratch, log).await?;
    Ok(Built { template, cached_steps: cached, built_steps: built })
}

/// The builder VM, booted on `layer` the first time a step needs it.
async fn builder<'a>(
    home: &HutchHome,
    backend: &dyn VmBackend,
    spec: &BuildSpec,
    vm: &'a mut Option<guest::BuildVm>,
    layer: &Path,
    at: &FailedAt,
    log: &Arc<dyn BuildLog>,
) -> Result<&'a guest::BuildVm, BuildError> {
    if vm.is_none() {
        log.log(Level::Debug, Some(&at.step_name()), "starting the builder VM");
        *vm = Some(guest::BuildVm::boot(home, backend, spec, layer).await.map_err(|e| BuildError::at(at.clone(), false, e))?);
    }
    vm.as_ref().ok_or_else(|| BuildError::at(at.clone(), false, "the builder VM is gone"))
}

/// The VM's disk as the layer of `key`; its path. A layer not yet named by its key
/// is removed on any failure.
async fn commit(cache: &BuildCache, machine: &guest::BuildVm, key: &Key, at: &FailedAt) -> Result<PathBuf, BuildError> {
    let fail = |e: String| BuildError::at(at.clone(), false, e);
    let (id, dir) = cache.new_layer().map_err(|e| fail(e.to_string()))?;
    let guard = RemoveOnDrop::new(dir);
    let committed = guard.path().join("disk.qcow2");
    machine.commit(&committed).await.map_err(fail)?;
    cache.record(key, &id).map_err(|e| fail(e.to_string()))?;
    guard.keep();
    Ok(committed)
}

/// A directory removed when this is dropped, unless kept.
struct RemoveOnDrop(Option<PathBuf>);

impl RemoveOnDrop {
    fn new(path: PathBuf) -> RemoveOnDrop {
        RemoveOnDrop(Some(path))
    }
    fn path(&self) -> &Path {
        self.0.as_deref().unwrap_or(Path::new(""))
    }
    fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            // An unprivileged image unpack's tree may be left in it (`remove_tree`).
            let _ = hutch_image::unprivileged::remove_tree(&path);
        }
    }
}

fn needs_disk(kind: &StepKind) -> bool {
    matches!(kind, StepKind::Run { .. } | StepKind::Copy { .. } | StepKind::Workdir(_))
}

/// Every step's cache key, each on its parent's.
fn step_keys(spec: &BuildSpec, base: &Key, ctx: &Context) -> Vec<Key> {
    let mut ctx = ctx.clone();
    let mut key = base.clone();
    spec.steps
        .iter()
        .map(|step| {
            let inputs = cache_inputs(step, &ctx);
            key = Key::of(Some(&key), &inputs.iter().map(String::as_str).collect::<Vec<_>>());
            apply_metadata(&mut ctx, &step.kind);
            key.clone()
        })
        .collect()
}

/// What a step's cache key depends on, besides its parent's key.
fn cache_inputs(step: &Step, ctx: &Context) -> Vec<String> {
    match &step.kind {
        StepKind::Env(pairs) => std::iter::once("ENV".to_string()).chain(pairs.iter().flat_map(|(k, v)| [k.clone(), v.clone()])).collect(),
        StepKind::Workdir(dir) => vec!["WORKDIR".into(), dir.clone(), ctx.user.clone()],
        StepKind::User(user) => vec!["USER".into(), user.clone()],
        StepKind::Run { cmd, user, build_args } => {
            let mut v = vec!["RUN".into(), cmd.clone(), user.clone().unwrap_or_default()];
            v.extend(build_args.iter().flat_map(|(k, val)| [k.clone(), val.clone()]));
            v
        }
        StepKind::Copy { files, dest, owner, mode } => vec![
            "COPY".into(),
            files.hash.clone(),
            files.single.to_string(),
            dest.clone(),
            owner.clone().unwrap_or_else(|| ctx.user.clone()),
            mode.clone().unwrap_or_default(),
        ],
        StepKind::Command { entrypoint, cmd } => vec!["CMD".into(), format!("{entrypoint:?}"), format!("{cmd:?}")],
    }
}

fn apply_metadata(ctx: &mut Context, kind: &StepKind) {
    match kind {
        StepKind::Env(pairs) => ctx.env.extend(pairs.iter().cloned()),
        StepKind::Workdir(dir) => {
            ctx.workdir = absolute(&ctx.workdir, dir);
            ctx.workdir_set = true;
        }
        StepKind::User(user) => {
            ctx.user = user.clone();
            ctx.user_set = true;
        }
        StepKind::Command { entrypoint, cmd } => {
            ctx.command_set = true;
            if let Some(e) = entrypoint {
                ctx.entrypoint = e.clone();
                // Docker: a new ENTRYPOINT clears an inherited CMD.
                if cmd.is_none() {
                    ctx.cmd.clear();
                }
            }
            if let Some(c) = cmd {
                ctx.cmd = c.clone();
            }
        }
        StepKind::Run { .. } | StepKind::Copy { .. } => {}
    }
}

fn final_defaults(spec: &BuildSpec, image: &ImageDefaults, ctx: &Context) -> ImageDefaults {
    let user = if ctx.user_set { Some(ctx.user.clone()) } else { image.user.clone() };
    let workdir = if ctx.workdir_set { Some(ctx.workdir.clone()) } else { image.workdir.clone() };
    // Docker's start command is ENTRYPOINT + CMD, unless the build names one.
    let docker_start = (ctx.command_set && (!ctx.entrypoint.is_empty() || !ctx.cmd.is_empty())).then(|| shell_join(ctx.entrypoint.iter().chain(ctx.cmd.iter())));
    ImageDefaults {
        env: ctx.env.clone(),
        workdir,
        user,
        entrypoint: ctx.entrypoint.clone(),
        cmd: ctx.cmd.clone(),
        start_cmd: spec.start_cmd.clone().or(if spec.docker_rules { docker_start } else { None }),
        ready_cmd: spec.ready_cmd.clone(),
    }
}

/// hutch-image's progress, as build log lines.
struct LogProgress(Arc<dyn BuildLog>, &'static str);

impl hutch_image::Progress for LogProgress {
    fn step(&self, what: &str) {
        self.0.log(Level::Info, Some(self.1), what);
    }
    fn detail(&self, line: &str) {
        self.0.log(Level::Debug, Some(self.1), line);
    }
    fn done(&self, summary: &str, took: std::time::Duration) {
        self.0.log(Level::Info, Some(self.1), &format!("{summary} in {:.1} s", took.as_secs_f64()));
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RemoveError {
    #[error("there is no template '{0}' here; `hutch template ls` lists them")]
    Unknown(String),
    #[error("template '{name}' is in use ({what}); stop those sandboxes or delete those snapshots first")]
    InUse { name: String, what: String },
    #[error("could not tell what uses template '{0}' ({1}), so it was kept")]
    Unsure(String, String),
    #[error("removing {}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
}

/// Removes template `name`: its builds and its memory snapshots, unless a sandbox, a
/// stored snapshot or a cached build layer still stacks on them.
pub fn remove_template(home: &HutchHome, name: &str) -> Result<(), RemoveError> {
    let dir = home.template(name);
    if name.contains('/') || !dir.join("template.json").is_file() {
        return Err(RemoveError::Unknown(name.to_string()));
    }
    let used = crate::references::of_sandboxes_and_snapshots(home).map_err(|e| RemoveError::Unsure(name.into(), e.to_string()))?;
    let canonical = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let dir = canonical(&dir);
    let snapshots: Vec<PathBuf> = std::fs::read_dir(home.template_snapshots())
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|d| crate::snapshot::MemorySnapshot::open(d).is_some_and(|s| s.manifest.template == name))
        .collect();
    let mut users = Vec::new();
    for file in &used.files {
        let file = canonical(file);
        if file.starts_with(&dir) || snapshots.iter().any(|s| file.starts_with(canonical(s))) {
            users.push(file.display().to_string());
        }
    }
    if snapshots.iter().any(|s| used.snapshot_dirs.iter().any(|d| canonical(d) == canonical(s))) {
        users.push("a sandbox restored from its snapshot".into());
    }
    if !users.is_empty() {
        users.sort();
        users.dedup();
        return Err(RemoveError::InUse { name: name.into(), what: users.join(", ") });
    }
    // Build cache layers stacked on it go with it: the cache is disposable. Held first,
    // then listed: a build running now (one `FROM` it that has made no layer yet, or
    // one about to add a layer) would otherwise stack on a removed file.
    let cache = BuildCache::new(home);
    let Some(cache_held) = cache.exclusive(CACHE_PATIENCE).map_err(|e| RemoveError::Unsure(name.into(), e.to_string()))? else {
        return Err(RemoveError::InUse { name: name.into(), what: "a template build is running now and may stack on it; try again when it ends".into() });
    };
    let stacked: Vec<PathBuf> = cache.layer_files().into_iter().filter(|l| hutch_vmm::disk::backing::chain_in(home.root(), l).map(|c| c.iter().any(|f| canonical(f).starts_with(&dir))).unwrap_or(true)).collect();
    // Not while a build of it is being stored or its tags change.
    let _template_held = hutch_image::template_store::lock(&dir).map_err(|e| RemoveError::Unsure(name.into(), e.to_string()))?;
    cache.remove_layers(&cache_held, &stacked).map_err(|e| RemoveError::Unsure(name.into(), e.to_string()))?;
    for path in snapshots.iter().chain(std::iter::once(&dir)) {
        std::fs::remove_dir_all(path).map_err(|source| RemoveError::Io { path: path.clone(), source })?;
    }
    Ok(())
}

/// How long a removal waits for running builds to let go of the build cache.
const CACHE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);
