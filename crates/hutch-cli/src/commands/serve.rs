//! `hutch serve`: the REST control plane and data proxy.

use crate::local::Local;
use anyhow::Context;
use clap::Args;
use hutch_core::manager::{KeyQuota, ManagerConfig, PoolPolicy, SandboxManager};
use hutch_core::store::Store;
use hutch_core::MemMib;
use hutch_vmm::AccelChoice;
use std::sync::Arc;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:3000", env = "HUTCH_LISTEN")]
    pub listen: String,
    /// Domain for data-plane hosts `<port>-<sandbox>.<domain>` (headers work without it).
    #[arg(long, env = "HUTCH_DOMAIN")]
    pub domain: Option<String>,
    /// Sandboxes at once, all keys together; more answer 429.
    #[arg(long, default_value_t = 16)]
    pub max_sandboxes: usize,
    /// Running sandboxes one API key may have; more answer 429.
    #[arg(long, default_value_t = KeyQuota::default().running)]
    pub key_max_running: usize,
    /// Paused sandboxes one API key may have; more answer 429.
    #[arg(long, default_value_t = KeyQuota::default().paused)]
    pub key_max_paused: usize,
    /// Stored snapshots one API key may have; more answer 429.
    #[arg(long, default_value_t = KeyQuota::default().snapshots)]
    pub key_max_snapshots: usize,
    /// The most vCPUs a template one API key builds (E2B's cpuCount) may give its
    /// sandboxes; more answer 400.
    #[arg(long, default_value_t = KeyQuota::default().cpus, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub key_max_cpus: u32,
    /// The most memory a template one API key builds (E2B's memoryMB) may give its
    /// sandboxes (MiB, or 512M, 8G); more answer 400.
    #[arg(long, default_value = "8G")]
    pub key_max_memory: MemMib,
    /// The most free disk a template one API key builds (E2B's minFreeDiskMb) may ask
    /// for its sandboxes (MiB, or 512M, 32G); more answer 400.
    #[arg(long, default_value = "32G", value_parser = hutch_core::ids::parse_disk_mib)]
    pub key_max_free_disk: u32,
    /// Seconds a sandbox lives when the request names no timeout.
    #[arg(long, default_value_t = 300)]
    pub default_timeout: u64,
    /// A registry (HOST:PORT) on this machine or a private network that template builds
    /// through the API may pull from, over plain HTTP (repeatable). Others there are refused.
    #[arg(long = "insecure-registry", value_name = "HOST:PORT")]
    pub insecure_registries: Vec<String>,
    /// A protected address group sandboxes' rules may reach: private, loopback,
    /// link-local, metadata or host (repeatable; by default they reach none).
    #[arg(long = "net-open", value_name = "GROUP", value_parser = parse_group)]
    pub net_open: Vec<hutch_net::Group>,
    /// A reserved range this deployment counts as `public` (a package mirror at a
    /// documentation address, say); repeat for more.
    #[arg(long = "net-public", value_name = "CIDR")]
    pub net_public: Vec<hutch_net::IpNet>,
    /// A PEM file of CA certificates trusted, besides this host's, when hutch checks
    /// the real server of a host whose network rules it inspects (repeatable).
    #[arg(long = "upstream-ca", value_name = "FILE")]
    pub upstream_ca: Vec<std::path::PathBuf>,
    /// What an E2B-style create that does not mention allow_internet_access (the
    /// newest official SDKs' default) gets: `public` as on E2B, or `none`.
    #[arg(long, default_value = "public", value_parser = ["public", "none"])]
    pub egress_default: String,
    /// Seconds no sandbox outlives, whatever timeouts ask.
    #[arg(long, default_value_t = 86_400)]
    pub max_lifetime: u64,
    /// Accelerator for sandboxes: `auto` (KVM when it runs at native speed, else TCG),
    /// `kvm` or `tcg`.
    #[arg(long, default_value = "auto")]
    pub accel: AccelChoice,
    /// vCPUs per sandbox.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub cpus: u32,
    /// Memory per sandbox [default: each template's own: 2 GiB for code-interpreter,
    /// else 512 MiB].
    #[arg(long)]
    pub memory: Option<MemMib>,
    /// Pin TEMPLATE's warm pool at N sandboxes restored and waiting (repeatable:
    /// --pool base=2 --pool code-interpreter=0). Other templates' pools are sized by
    /// demand: one for base, and for a template created from in the last 10 minutes as
    /// many as its creates came at once, up to --pool-max. Pools count against
    /// --max-sandboxes, never take its last slot, and give way to creates.
    #[arg(long = "pool", value_name = "TEMPLATE=N", value_parser = parse_pool)]
    pub pool: Vec<(String, usize)>,
    /// The most sandboxes demand makes one template's pool keep.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub pool_max: u64,
    /// Keep no warm pools except those pinned with --pool: every create restores its
    /// own sandbox.
    #[arg(long)]
    pub no_pool: bool,
    /// Kill running sandboxes when the server stops. Without it they run on, and the
    /// next `hutch serve` on this home adopts them with their processes.
    #[arg(long)]
    pub kill_on_exit: bool,
}

fn parse_pool(s: &str) -> Result<(String, usize), String> {
    let (template, n) = s.split_once('=').ok_or_else(|| format!("'{s}' is not TEMPLATE=N (for example base=2)"))?;
    let n: usize = n.parse().map_err(|_| format!("'{n}' in '{s}' is not a number of sandboxes"))?;
    if template.is_empty() {
        return Err(format!("'{s}' names no template"));
    }
    Ok((template.to_string(), n))
}

/// Raises this process's open-file limit to its hard limit: every sandbox's flows and
/// lookups are descriptors of the server, and a soft limit of 1,024 would be a ceiling
/// a few sandboxes' 256 flows each could reach for every tenant.
fn raise_open_file_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!("raising the open-file limit from {soft} to {hard}: {e}");
            }
        }
    }
}

/// `key`: `HUTCH_API_KEY`, taken out of the environment by `main` before any thread.
pub async fn run(args: ServeArgs, key: Option<String>) -> anyhow::Result<i32> {
    raise_open_file_limit();
    let local = Local::prepare("base", args.accel).await?;
    if local.accel.accel == hutch_vmm::Accel::Tcg {
        tracing::warn!("sandboxes run on TCG (software emulation), which is not a security boundary: {}", local.accel.why);
    }
    let db = local.home.root().join("hutch.db");
    let store = Store::open_file(&db).await.with_context(|| format!("opening {}", db.display()))?;
    if let Some(key) = key {
        store.ensure_key("HUTCH_API_KEY", &key).await?;
    }
    if store.list_keys().await?.iter().all(|k| k.revoked) {
        eprintln!("hutch serve: no API key exists yet; create one with `hutch keys create` (or set HUTCH_API_KEY)");
    }
    let config = ManagerConfig {
        max_sandboxes: args.max_sandboxes,
        default_timeout: Duration::from_secs(args.default_timeout),
        max_lifetime: Duration::from_secs(args.max_lifetime),
        accel: local.accel.accel,
        cpus: args.cpus,
        memory: args.memory,
        pool: PoolPolicy {
            pinned: args.pool.iter().cloned().collect(),
            ..if args.no_pool { PoolPolicy::off() } else { PoolPolicy::by_demand(args.pool_max as usize) }
        },
        quota: KeyQuota {
            running: args.key_max_running,
            paused: args.key_max_paused,
            snapshots: args.key_max_snapshots,
            cpus: args.key_max_cpus,
            memory: args.key_max_memory,
            free_disk_mib: args.key_max_free_disk,
        },
        net_env: std::sync::Arc::new(hutch_net::Environment {
            upstream: std::sync::Arc::new(hutch_net::inspect::Upstream::with_ca_files(&args.upstream_ca)?),
            ..hutch_net::Environment::from_env(args.net_open.clone(), args.net_public.clone()).map_err(anyhow::Error::msg)?
        }),
        internet_by_default: args.egress_default == "public",
        insecure_registries: args.insecure_registries.clone(),
    };
    let pinned = config.pool.pinned.values().try_fold(0usize, |sum, n| sum.checked_add(*n)).unwrap_or(usize::MAX);
    anyhow::ensure!(
        pinned < args.max_sandboxes,
        "the pinned warm pools ({pinned} sandboxes) must leave room under --max-sandboxes ({}) for sandboxes in use; pin smaller pools or raise --max-sandboxes",
        args.max_sandboxes
    );
    let backend = Arc::new(local.backend());
    let manager = SandboxManager::start(local.home.clone(), store, backend, config).await?;
    // After adoption: this server's VMs get an end time that holds without it.
    super::reaper::spawn(&local.home)?;
    manager.prepare("base").await?;
    let app = hutch_server::router(hutch_server::AppState { manager: manager.clone(), domain: args.domain.clone() });
    let listener = tokio::net::TcpListener::bind(&args.listen).await.with_context(|| format!("listening on {}", args.listen))?;
    eprintln!("hutch serve: listening on http://{}", listener.local_addr()?);
    hutch_server::serve(listener, app, hutch_server::Limits::default(), shutdown_signal()).await?;
    if args.kill_on_exit {
        eprintln!("hutch serve: shutting down; killing running sandboxes (--kill-on-exit)");
    } else {
        eprintln!("hutch serve: shutting down; running sandboxes keep running for the next `hutch serve` to adopt (--kill-on-exit ends them)");
    }
    manager.shutdown(args.kill_on_exit).await;
    Ok(0)
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term.recv() => {},
    }
}

fn parse_group(name: &str) -> Result<hutch_net::Group, String> {
    match hutch_net::Group::from_name(name) {
        Some(g) if hutch_net::Group::PROTECTED.contains(&g) => Ok(g),
        Some(g) => Err(format!("{} is not a protected group; rules reach it without --net-open", g.name())),
        None => Err(format!("unknown group {name}; the protected groups are private, loopback, link-local, metadata and host")),
    }
}
