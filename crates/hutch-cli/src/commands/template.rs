//! `hutch template`: templates from OCI images (`build --from-image`), and the list.

use anyhow::Context;
use clap::{Args, Subcommand};
use hutch_image::HutchHome;
use hutch_oci::pull::{PullProgress, Puller, RegistryOptions};
use hutch_oci::{BlobStore, Digest};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

#[derive(Subcommand, Debug)]
pub enum TemplateCommand {
    /// Build a template from an OCI image in any registry.
    Build(BuildArgs),
    /// List the templates on this machine.
    Ls,
}

#[derive(Args, Debug)]
pub struct BuildArgs {
    /// The template's name.
    #[arg(short = 't', long = "tag", value_name = "NAME")]
    pub name: String,
    /// The image: [REGISTRY/]NAME[:TAG][@DIGEST] (Docker Hub when no registry is named).
    #[arg(long, value_name = "REF")]
    pub from_image: String,
    /// The registry's user, for images that need a login.
    #[arg(long, env = "HUTCH_REGISTRY_USER", requires = "registry_password")]
    pub registry_user: Option<String>,
    #[arg(long, env = "HUTCH_REGISTRY_PASSWORD", hide_env_values = true, requires = "registry_user")]
    pub registry_password: Option<String>,
    /// A registry (HOST:PORT) spoken to over plain HTTP, such as one on loopback.
    #[arg(long = "insecure-registry", value_name = "HOST:PORT")]
    pub insecure: Vec<String>,
}

pub async fn run(cmd: TemplateCommand) -> anyhow::Result<i32> {
    let home = HutchHome::from_env();
    match cmd {
        TemplateCommand::Ls => {
            for name in hutch_image::rootfs::list(&home) {
                let from = match hutch_image::rootfs::cached(&home, &name) {
                    Ok(Some(t)) => t.source.map(|s| format!("{} ({})", s.reference, s.manifest_digest)).unwrap_or_else(|| format!("Debian {} recipe", t.suite)),
                    _ => "unreadable manifest".into(),
                };
                crate::outln!("{name:<24} {from}");
            }
            Ok(0)
        }
        TemplateCommand::Build(args) => build(&home, args).await,
    }
}

async fn build(home: &HutchHome, args: BuildArgs) -> anyhow::Result<i32> {
    hutch_image::from_image::check_name(&args.name)?;
    home.make_private().with_context(|| format!("creating {} (mode 0700)", home.root().display()))?;
    let store = BlobStore::new(home.root().join("cache").join("oci").join("blobs"));
    let options = RegistryOptions { credentials: args.registry_user.zip(args.registry_password), insecure: args.insecure };
    let puller = Puller::new(store.clone(), &options);
    eprintln!("hutch: pulling {}", args.from_image);
    let started = std::time::Instant::now();
    let progress = Arc::new(LayerBars::new());
    let image = puller.pull(&args.from_image, progress.clone()).await?;
    progress.clear();
    eprintln!(
        "hutch: pulled {} ({}): {} layer(s) downloaded ({}), {} already cached, in {:.1} s",
        image.reference,
        image.manifest_digest.short(),
        image.layers_downloaded,
        hutch_image::progress::human_bytes(image.bytes_downloaded),
        image.layers_cached,
        started.elapsed().as_secs_f64()
    );
    let source = hutch_image::rootfs::ImageSource { reference: image.reference.clone(), manifest_digest: image.manifest_digest.to_string(), defaults: image.defaults.clone() };
    let name = args.name.clone();
    let home2 = home.clone();
    let template = tokio::task::spawn_blocking(move || {
        let progress = crate::progress::TermProgress::new();
        hutch_image::from_image::build(&home2, &name, &store, &image.layers, source, &progress)
    })
    .await??;
    crate::outln!("template {} ({})", template.name, template.image().display());
    crate::outln!("try: hutch run --template {} -- /bin/sh -c 'cat /etc/os-release'", template.name);
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
        self.bars.lock().unwrap_or_else(|e| e.into_inner()).insert(digest.clone(), bar);
    }

    fn layer_bytes(&self, digest: &Digest, bytes: u64) {
        if let Some(bar) = self.bars.lock().unwrap_or_else(|e| e.into_inner()).get(digest) {
            bar.inc(bytes);
        }
    }

    fn layer_done(&self, digest: &Digest) {
        if let Some(bar) = self.bars.lock().unwrap_or_else(|e| e.into_inner()).remove(digest) {
            bar.finish_and_clear();
            let _ = self.multi.println(format!("  {}: downloaded", digest.short()));
        }
    }
}
