//! `hutch template`: templates from Dockerfiles and OCI images (`build`), the list,
//! removal, and the build cache (`prune`).

use anyhow::Context;
use clap::{Args, Subcommand};
use hutch_image::HutchHome;
use hutch_core::build::{Base, BuildLog, BuildSpec, Level};
use hutch_oci::pull::{PullProgress, RegistryOptions};
use hutch_oci::Digest;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

#[derive(Subcommand, Debug)]
pub enum TemplateCommand {
    /// Build a template from a Dockerfile (in CONTEXT, or -f) or from an image in any registry.
    Build(Box<BuildArgs>),
    /// List the templates on this machine.
    Ls,
    /// Remove a template (its builds and memory snapshots) that nothing uses, or with
    /// NAME:TAG only that tag (its build goes once nothing else names or uses it).
    Rm {
        /// NAME or NAME:TAG.
        name: String,
    },
    /// Remove the build cache (every cached step); templates stay.
    Prune,
}

#[derive(Args, Debug)]
pub struct BuildArgs {
    /// The template's name, and a tag for this build: NAME[:TAG]. With no tag (or
    /// `default`), the build becomes the template's current one; with a tag, only
    /// `--template NAME:TAG` starts it (unless it is the template's first build).
    #[arg(short = 't', long = "tag", value_name = "NAME[:TAG]")]
    pub name: String,
    /// The Dockerfile [default: CONTEXT/Dockerfile].
    #[arg(short = 'f', long = "file", value_name = "PATH")]
    pub file: Option<std::path::PathBuf>,
    /// Build from this image alone, with no Dockerfile: [REGISTRY/]NAME[:TAG][@DIGEST]
    /// (Docker Hub when no registry is named).
    #[arg(long, value_name = "REF", conflicts_with = "file")]
    pub from_image: Option<String>,
    /// A Dockerfile ARG's value (repeatable).
    #[arg(long = "build-arg", value_name = "NAME=VALUE")]
    pub build_args: Vec<String>,
    /// Rebuild every step, ignoring the build cache.
    #[arg(long)]
    pub no_cache: bool,
    /// vCPUs the template's sandboxes get unless a run asks otherwise.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub cpus: Option<u32>,
    /// Memory the template's sandboxes get unless a run asks otherwise (MiB, or 512M, 2G).
    #[arg(long)]
    pub memory: Option<hutch_core::MemMib>,
    /// Free space the template's root filesystem keeps at least after the build (MiB,
    /// or 512M, 10G); the disk grows to it.
    #[arg(long, value_parser = hutch_core::ids::parse_disk_mib)]
    pub min_free_disk: Option<u32>,
    /// Where RUN steps may connect: `public` (the internet, nothing private), `none`, or
    /// egress rules separated by commas.
    #[arg(long, default_value = "public", value_parser = super::run::parse_policy)]
    pub net: hutch_net::Policy,
    /// The registry's user, for images that need a login.
    #[arg(long, env = "HUTCH_REGISTRY_USER", requires = "registry_password")]
    pub registry_user: Option<String>,
    /// The registry's password (or token) for --registry-user.
    #[arg(long, env = "HUTCH_REGISTRY_PASSWORD", hide_env_values = true, requires = "registry_user")]
    pub registry_password: Option<String>,
    /// A registry (HOST:PORT) spoken to over plain HTTP, such as one on loopback.
    #[arg(long = "insecure-registry", value_name = "HOST:PORT")]
    pub insecure: Vec<String>,
    /// Accelerator for the builder VM: `auto` (KVM when it runs at native speed, else
    /// TCG), `kvm` or `tcg`.
    #[arg(long, default_value = "auto")]
    pub accel: hutch_vmm::AccelChoice,
    /// The build context: the directory COPY and ADD read from.
    #[arg(value_name = "CONTEXT")]
    pub context: Option<std::path::PathBuf>,
}

pub async fn run(cmd: TemplateCommand) -> anyhow::Result<i32> {
    let home = HutchHome::from_env();
    match cmd {
        TemplateCommand::Ls => {
            for name in hutch_image::template_store::list(&home) {
                // The template (its `default` build), then each other tag as NAME:TAG.
                let tags = hutch_image::tags::list(&home, &name).map(|t| t.into_iter().map(|(tag, _)| tag).collect()).unwrap_or_else(|_| vec![hutch_image::tags::DEFAULT.to_string()]);
                for tag in tags {
                    let reference = if tag == hutch_image::tags::DEFAULT { name.clone() } else { format!("{name}:{tag}") };
                    let from = match hutch_image::rootfs::cached(&home, &reference) {
                        Ok(Some(t)) => t.source.map(|s| format!("{} ({})", s.reference, s.manifest_digest)).unwrap_or_else(|| format!("Debian {} recipe", t.suite)),
                        _ => "unreadable manifest".into(),
                    };
                    crate::output::outln!("{reference:<24} {from}");
                }
            }
            Ok(0)
        }
        TemplateCommand::Rm { name } => {
            if let (template, Some(tag)) = name_and_tag(&name)? {
                hutch_image::tags::remove(&home, &template, std::slice::from_ref(&tag))?;
                hutch_core::pruning::release_tags(&home, &template, std::slice::from_ref(&tag));
                crate::output::outln!("removed tag {tag} of template {template}");
                return Ok(0);
            }
            hutch_core::build::remove_template(&home, &name)?;
            crate::output::outln!("removed template {name}");
            Ok(0)
        }
        TemplateCommand::Prune => {
            let cache = hutch_core::build::cache::BuildCache::new(&home);
            let Some(held) = cache.exclusive(std::time::Duration::from_secs(2))? else {
                anyhow::bail!("a template build is running and uses the build cache; run `hutch template prune` again when it ends");
            };
            let freed = cache.prune(&held)?;
            crate::output::outln!("removed the build cache ({})", hutch_image::progress::human_bytes(freed));
            Ok(0)
        }
        TemplateCommand::Build(args) => build(&home, *args).await,
    }
}

/// Build log lines on stderr, as `docker build` prints them.
struct TermLog {
    bars: Arc<LayerBars>,
}

impl BuildLog for TermLog {
    fn log(&self, level: Level, _step: Option<&str>, message: &str) {
        let line = match level {
            Level::Debug => return,
            Level::Info => message.to_string(),
            Level::Warn => format!("warning: {message}"),
            Level::Error => format!("error: {message}"),
        };
        // Piped, the bars draw nothing, and neither would their println.
        if self.bars.multi.is_hidden() {
            eprintln!("{line}");
        } else {
            let _ = self.bars.multi.println(line);
        }
    }
}

async fn build(home: &HutchHome, args: BuildArgs) -> anyhow::Result<i32> {
    let (name, tag) = name_and_tag(&args.name)?;
    home.make_private().with_context(|| format!("creating {} (mode 0700)", home.root().display()))?;
    let registry = RegistryOptions { credentials: args.registry_user.clone().zip(args.registry_password.clone()), insecure: args.insecure.clone(), local: true, proxy: None, aws: None };
    let mut build_args = BTreeMap::new();
    for pair in &args.build_args {
        let (k, v) = pair.split_once('=').with_context(|| format!("--build-arg {pair}: give NAME=VALUE"))?;
        build_args.insert(k.to_string(), v.to_string());
    }
    let scratch = hutch_core::build::cache::BuildCache::new(home).scratch()?;
    let planned = plan(&args, &build_args, &scratch);
    let result = match planned {
        Ok((base, steps)) => run_build(home, &args, (name, tag), base, steps, registry).await,
        Err(e) => Err(e),
    };
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

/// `NAME[:TAG]`, each checked (the tag in normal form; `default` stays a tag, as
/// `rm NAME:default` must be refused, not remove the template).
fn name_and_tag(reference: &str) -> anyhow::Result<(String, Option<String>)> {
    let (name, tag) = match reference.split_once(':') {
        Some((name, tag)) => (name, Some(hutch_image::tags::check(tag)?)),
        None => (reference, None),
    };
    hutch_image::from_image::check_name(name)?;
    Ok((name.to_string(), tag))
}

/// The base and steps: from the Dockerfile, or the image alone.
fn plan(args: &BuildArgs, build_args: &BTreeMap<String, String>, scratch: &std::path::Path) -> anyhow::Result<(String, Vec<hutch_core::build::Step>)> {
    if let Some(image) = &args.from_image {
        anyhow::ensure!(args.context.is_none(), "give --from-image or a build context with a Dockerfile, not both");
        return Ok((image.clone(), Vec::new()));
    }
    let context = args.context.clone().context("name the build context (such as `.`), or an image with --from-image")?;
    anyhow::ensure!(context.is_dir(), "the build context {} is not a directory", context.display());
    let file = args.file.clone().unwrap_or_else(|| context.join("Dockerfile"));
    let text = std::fs::read_to_string(&file).with_context(|| format!("reading the Dockerfile {}", file.display()))?;
    let shown = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "Dockerfile".into());
    let plan = hutch_core::build::dockerfile::plan(&text, &shown, &context, build_args, scratch)?;
    for warning in &plan.warnings {
        eprintln!("warning: {warning}");
    }
    Ok((plan.from, plan.steps))
}

async fn run_build(home: &HutchHome, args: &BuildArgs, (name, tag): (String, Option<String>), from: String, steps: Vec<hutch_core::build::Step>, registry: RegistryOptions) -> anyhow::Result<i32> {
    let accel_choice = args.accel;
    let cache = home.root().join("accel-probe");
    let accel = tokio::task::spawn_blocking(move || hutch_vmm::accel::select(accel_choice, Some(&cache))).await??;
    let net_env = hutch_net::Environment::from_env(Vec::new(), Vec::new()).map_err(anyhow::Error::msg)?;
    // E2B's default base image name is hutch's base template.
    let base = if from == "e2bdev/base" { Base::Template("base".into()) } else { Base::Image { reference: from, registry } };
    let spec = BuildSpec {
        name,
        tags: tag.into_iter().collect(),
        api_build: None,
        shape: hutch_image::template::Shape { cpus: args.cpus, memory_mib: args.memory.map(|m| m.get()), min_free_disk_mib: args.min_free_disk.filter(|&mib| mib > 0) },
        base,
        steps,
        start_cmd: None,
        ready_cmd: None,
        force: args.no_cache,
        docker_rules: true,
        network: hutch_net::Settings::native(args.net.clone()),
        net_env: Arc::new(net_env),
        accel: accel.accel,
    };
    let bars = Arc::new(LayerBars::new());
    let log = Arc::new(TermLog { bars: bars.clone() });
    let backend = hutch_vmm::qemu::QemuBackend::with_cache_dir(home.root());
    let started = std::time::Instant::now();
    let built = tokio::select! {
        b = hutch_core::build::build(home, &backend, spec, log, bars.clone()) => b,
        _ = tokio::signal::ctrl_c() => return Ok(130),
    };
    bars.clear();
    let built = built?;
    crate::output::outln!(
        "template {} (build {}) in {:.1} s: {} step(s) cached, {} run",
        args.name,
        built.template.build_id,
        started.elapsed().as_secs_f64(),
        built.cached_steps,
        built.built_steps
    );
    crate::output::outln!("try: hutch run --template {} -- /bin/sh -c 'cat /etc/os-release'", args.name);
    Ok(0)
}

/// One bar per layer being downloaded.
struct LayerBars {
    multi: MultiProgress,
    bars: Mutex<HashMap<Digest, ProgressBar>>,
}

impl LayerBars {
    fn new() -> LayerBars {
        LayerBars { multi: MultiProgress::new(), bars: Mutex::new(HashMap::new()) }
    }

    fn clear(&self) {
        let _ = self.multi.clear();
    }
}

impl PullProgress for LayerBars {
    fn layer_started(&self, digest: &Digest, size: u64, cached: bool) {
        if cached {
            let _ = self.multi.println(format!("  {}: cached", digest.short()));
            return;
        }
        let bar = self.multi.add(ProgressBar::new(size));
        bar.set_style(ProgressStyle::with_template("  {prefix}: {bytes}/{total_bytes} {wide_bar}").unwrap_or_else(|_| ProgressStyle::default_bar()));
        bar.set_prefix(digest.short().to_string());
        if bar.is_hidden() {
            eprintln!("hutch: downloading layer {} ({})", digest.short(), hutch_image::progress::human_bytes(size));
        }
        self.bars.lock().insert(digest.clone(), bar);
    }

    fn layer_bytes(&self, digest: &Digest, bytes: u64) {
        if let Some(bar) = self.bars.lock().get(digest) {
            bar.inc(bytes);
        }
    }

    fn layer_done(&self, digest: &Digest) {
        if let Some(bar) = self.bars.lock().remove(digest) {
            bar.finish_and_clear();
            let _ = self.multi.println(format!("  {}: downloaded", digest.short()));
        }
    }
}
