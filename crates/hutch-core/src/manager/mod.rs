//! The sandbox manager behind `hutch serve`: every API operation on sandboxes, owned by
//! API keys, persisted in the store, with lifetimes enforced by a reaper task. Handlers
//! (HTTP, CLI, tests) call it with plain values; it never sees HTTP types.

pub mod build_ids;
pub mod build_plan;
pub mod build_records;
pub mod builds;
mod config;
mod create;
mod data_plane;
mod error;
mod key_quota;
mod listing;
mod live;
mod names;
mod owner;
mod pause;
mod pause_kinds;
mod pool;
mod pool_sizing;
mod pools;
mod quota;
mod reaper;
mod slots;
mod admission;
mod snapshots;
pub mod state;
pub mod tags;
#[cfg(test)]
mod tests;

pub use config::{CreateSpec, ManagerConfig};
pub use pool_sizing::{DemandPolicy, PoolPolicy, PoolStatus};
pub use error::ManagerError;
pub(crate) use error::unknown_template;
pub use listing::{started, ListFilter, ListOrder};
use live::Live;
pub use pause_kinds::{Connected, OnResume};
pub use config::MAX_FORKS;

use crate::artifacts::{Artifacts, ArtifactsError};
use crate::ids::MemMib;
pub use key_quota::KeyQuota;
pub use crate::sandbox::layout::PauseMode;
use crate::sandbox::errors::CreateError;
use crate::sandbox::Sandbox;
use crate::sandbox::boot::SandboxOptions;
use crate::store::{SandboxRow, Store};
use crate::time::Timestamp;
use hutch_image::HutchHome;
use hutch_vmm::VmBackend;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;

/// When a removal goes ahead, decided in the sandbox's owner (its state may have moved
/// since the caller looked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Removal {
    /// A kill.
    Always,
    /// Shutdown with --kill-on-exit: a pause that ended first stays.
    IfRunning,
    /// The reaper: a paused sandbox does not expire (one seen mid-snapshot, or paused
    /// by a client since).
    Expired,
}

pub struct SandboxManager {
    home: HutchHome,
    store: Store,
    /// Each API key's secrets (E2B's `/secrets`).
    secrets: crate::secrets::Secrets,
    backend: Arc<dyn VmBackend>,
    config: ManagerConfig,
    live: Mutex<HashMap<String, Arc<Live>>>,
    /// VMs being started that `live` does not count yet (`slots.rs`).
    starting: Mutex<slots::Starting>,
    /// Each template's artifacts, prepared once: a build holds only its own cell, so
    /// creates of other templates never wait behind it.
    artifacts: Mutex<HashMap<String, Arc<tokio::sync::OnceCell<Artifacts>>>>,
    /// Makes a template's artifacts (blocking: downloads, image builds).
    builder: Builder,
    /// Snapshot directories being made or used right now, which pruning must skip.
    pinned: Mutex<std::collections::HashSet<std::path::PathBuf>>,
    pools: Mutex<pools::Pools>,
    /// Woken when a pool VM has started (pooled, or stopped again).
    pool_started: tokio::sync::Notify,
    shutting_down: std::sync::atomic::AtomicBool,
    /// Operations running as tasks of their own (`detached`): shutdown lets them end.
    in_flight: std::sync::atomic::AtomicUsize,
    /// Template builds started through the API, and their uploads.
    builds: build_records::Builds,
    /// This manager, for the background tasks it starts.
    me: std::sync::Weak<SandboxManager>,
}

/// What makes a template's artifacts (`Artifacts::prepare` but in unit tests).
pub(crate) type Builder = Arc<dyn Fn(&HutchHome, &str) -> Result<Artifacts, ArtifactsError> + Send + Sync>;



impl SandboxManager {
    /// Opens the manager. Sandboxes recorded by an earlier server whose VMs are gone (or
    /// that this server cannot take over) are cleaned up and logged, never left behind.
    pub async fn start(home: HutchHome, store: Store, backend: Arc<dyn VmBackend>, config: ManagerConfig) -> Result<Arc<SandboxManager>, ManagerError> {
        let builder: Builder = Arc::new(|home: &HutchHome, template: &str| Artifacts::prepare(home, template, &hutch_image::progress::Quiet));
        Self::start_with(home, store, backend, config, builder).await
    }

    /// `start`, with templates' artifacts made by `builder` (unit tests: a fake backend
    /// boots no real image).
    pub(crate) async fn start_with(home: HutchHome, store: Store, backend: Arc<dyn VmBackend>, config: ManagerConfig, builder: Builder) -> Result<Arc<SandboxManager>, ManagerError> {
        let mut config = config;
        config.pool.pinned = std::mem::take(&mut config.pool.pinned).into_iter().map(|(t, n)| (canonical(&t), n)).collect();
        if let Some(demand) = &mut config.pool.demand {
            demand.default_template = canonical(&demand.default_template);
        }
        let secrets = crate::secrets::Secrets::new(home.root(), store.clone());
        // Rules' `${e2b.secrets.NAME}` are read from this server's store.
        config.net_env = Arc::new(hutch_net::Environment { vault: Some(Arc::new(secrets.clone())), ..(*config.net_env).clone() });
        let manager = Arc::new_cyclic(|me| SandboxManager {
            home,
            store,
            secrets,
            backend,
            config,
            live: Mutex::new(HashMap::new()),
            starting: Mutex::new(slots::Starting::default()),
            artifacts: Mutex::new(HashMap::new()),
            builder,
            pinned: Mutex::new(Default::default()),
            pools: Mutex::new(Default::default()),
            pool_started: tokio::sync::Notify::new(),
            shutting_down: Default::default(),
            in_flight: Default::default(),
            builds: build_records::Builds::default(),
            me: me.clone(),
        });
        manager.adopt_earlier().await?;
        // After adoption, which made this server the owner of every sandbox it took.
        crate::sweep::sweep_orphans(&manager.home, crate::sweep::Sweeper::Server);
        manager.prune_snapshot_files().await;
        manager.fill_pools();
        manager.start_reaper();
        manager.start_pool_upkeep();
        Ok(manager)
    }

    pub fn home(&self) -> &HutchHome {
        &self.home
    }

    fn arc(&self) -> Result<Arc<SandboxManager>, ManagerError> {
        self.me.upgrade().ok_or_else(|| ManagerError::Internal("the manager is shutting down".into()))
    }

    /// Runs an operation as a task of its own and awaits it: a caller that goes away
    /// (a client hanging up drops its handler) leaves it running to its end, so no
    /// operation stops halfway through its steps, pins or records.
    async fn detached<T, Fut>(&self, operation: impl FnOnce(Arc<SandboxManager>) -> Fut) -> Result<T, ManagerError>
    where
        T: Send + 'static,
        Fut: std::future::Future<Output = Result<T, ManagerError>> + Send + 'static,
    {
        let m = self.arc()?;
        let counted = InFlight::count(&m);
        let run = operation(m);
        let task = tokio::spawn(async move {
            let _counted = counted;
            run.await
        });
        task.await.map_err(|e| ManagerError::Internal(format!("the operation's task failed: {e}")))?
    }

    /// Runs `operation` in `live`'s owner, after what it was asked before, handing it
    /// this manager and the sandbox; returns its result.
    async fn in_owner<T, Op>(&self, live: &Arc<Live>, operation: Op) -> Result<T, ManagerError>
    where
        T: Send + 'static,
        Op: for<'a> FnOnce(Arc<SandboxManager>, Arc<Live>, &'a mut owner::Owned) -> futures::future::BoxFuture<'a, Result<T, ManagerError>> + Send + 'static,
    {
        let (m, held) = (self.arc()?, live.clone());
        live.owner.run(move |o: &mut owner::Owned| operation(m, held, o)).await?
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The API keys' secrets: every caller passes the key it acts for.
    pub fn secrets(&self) -> &crate::secrets::Secrets {
        &self.secrets
    }

    pub fn config(&self) -> &ManagerConfig {
        &self.config
    }

    /// Whether `template` (any of its names, or a tag) is a template built on this
    /// server: its artifacts are prepared, or its build is on disk.
    fn is_built(&self, template: &str) -> bool {
        self.artifacts.lock().get(template).is_some_and(|cell| cell.initialized())
            || hutch_image::rootfs::cached(&self.home, template).ok().flatten().is_some()
    }

    /// Makes sure a template's artifacts exist (builds them on first use).
    pub async fn prepare(&self, template: &str) -> Result<Artifacts, ManagerError> {
        let cell = self.artifacts.lock().entry(template.to_string()).or_default().clone();
        let prepared = cell.get_or_try_init(|| self.build(template)).await.cloned();
        if prepared.is_err() {
            // Nothing is kept for a name that failed (or was never a template): the next
            // create tries again, and made-up names do not pile up.
            let mut cells = self.artifacts.lock();
            if cells.get(template).is_some_and(|c| c.get().is_none()) {
                cells.remove(template);
            }
        }
        prepared
    }

    async fn build(&self, template: &str) -> Result<Artifacts, ManagerError> {
        let (home, name, builder) = (self.home.clone(), template.to_string(), self.builder.clone());
        tokio::task::spawn_blocking(move || builder(&home, &name))
            .await
            .map_err(|e| ManagerError::Internal(e.to_string()))?
            .map_err(|e| match e {
                // Only the built-in names: templates other keys built are not this caller's business.
                ArtifactsError::Template(hutch_image::template::TemplateError::Unknown { name, .. }) => unknown_template(&name),
                ArtifactsError::Template(hutch_image::template::TemplateError::Tag(e)) => error::tag_error(*e),
                other => ManagerError::Template(other),
            })
    }

    fn end_at(&self, started: Timestamp, timeout: Duration) -> Timestamp {
        let wanted = Timestamp::now().after(timeout);
        wanted.min(started.after(self.config.max_lifetime))
    }

    /// Running and pooled sandboxes (plus those being started): what the limit
    /// counts. Paused sandboxes hold no VM and do not count.
    fn running_count(&self) -> usize {
        self.in_use_count() + self.pooled_count()
    }

    /// Sandboxes holding a VM, pools not included (they give way to creates).
    fn in_use_count(&self) -> usize {
        self.live.lock().values().filter(|l| l.holds_vm()).count()
    }

    /// (running, paused) sandboxes of all keys, pools not included.
    pub fn counts(&self) -> (usize, usize) {
        let live = self.live.lock();
        (live.values().filter(|l| l.holds_vm()).count(), live.values().filter(|l| l.is_paused()).count())
    }

    /// Refuses a save of `memory_mib` of guest RAM (plus its disk's copy, bounded by the
    /// same) that would eat into the disk's reserve.
    fn room_for_memory(&self, memory_mib: u32) -> Result<(), ManagerError> {
        hutch_vmm::space::check_room(self.home.root(), u64::from(memory_mib) << 20).map_err(ManagerError::NoSpace)
    }

    fn shutting_down(&self) -> bool {
        self.shutting_down.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// A sandbox's options. `template` sets its memory when the server sets none (a
    /// sandbox started from a stored snapshot takes the snapshot's instead).
    /// The VM shape sandboxes of `template` get: the one its build asked for, else the
    /// server's (`--cpus`, `--memory`), else the template's default.
    pub(crate) fn shape(&self, template: &str) -> (u32, MemMib) {
        // The build a create boots: the prepared one if there is one (its image and
        // shape go together), else the one the template's manifest names now.
        let prepared = self.artifacts.lock().get(template).and_then(|cell| cell.get().map(|a| a.template.shape));
        let own = prepared.unwrap_or_else(|| hutch_image::rootfs::cached(&self.home, template).ok().flatten().map(|t| t.shape).unwrap_or_default());
        let memory = own.memory_mib.and_then(|m| MemMib::new(m).ok()).or(self.config.memory).unwrap_or_else(|| MemMib::of_template(template));
        (own.cpus.unwrap_or(self.config.cpus), memory)
    }

    fn options(&self, template: &str, env_vars: &BTreeMap<String, String>, metadata: &BTreeMap<String, String>, token: Option<String>) -> SandboxOptions {
        let (cpus, memory) = self.shape(template);
        SandboxOptions {
            access_token: token,
            cpus,
            memory,
            accel: self.config.accel,
            envs: env_vars.clone(),
            metadata: metadata.clone(),
            // A server's VMs outlive it: the next server adopts them.
            die_with_parent: false,
            net_env: self.config.net_env.clone(),
            ..SandboxOptions::default()
        }
    }

    /// A sandbox clients may see (one being created is not yet).
    fn shown(&self, id: &str) -> Option<Arc<Live>> {
        self.live.lock().get(id).filter(|l| !l.is_creating()).cloned()
    }

    fn find(&self, key_id: &str, id: &str) -> Result<Arc<Live>, ManagerError> {
        match self.shown(id) {
            Some(l) if l.row.key_id == key_id => Ok(l),
            _ => Err(ManagerError::NotFound(id.to_string())),
        }
    }

    pub fn get(&self, key_id: &str, id: &str) -> Result<SandboxRow, ManagerError> {
        Ok(self.find(key_id, id)?.row())
    }

    pub fn list(&self, key_id: &str, filter: &ListFilter) -> Vec<SandboxRow> {
        let live: Vec<_> = self.live.lock().values().filter(|l| !l.is_creating()).cloned().collect();
        let mut rows: Vec<SandboxRow> = live
            .iter()
            .map(|l| l.row())
            .filter(|r| r.key_id == key_id)
            .filter(|r| filter.states.is_empty() || filter.states.contains(&r.state))
            .filter(|r| filter.metadata.iter().all(|(k, v)| r.metadata.get(k) == Some(v)))
            .filter(|r| filter.started_after.is_none_or(|t| started(r) >= t))
            .filter(|r| filter.template.as_ref().is_none_or(|t| *t == r.template || canonical(t) == canonical(&r.template)))
            .collect();
        rows.sort_by(|a, b| filter.order.compare((started(a), &a.id), (started(b), &b.id)));
        rows
    }

    pub async fn kill(&self, key_id: &str, id: &str) -> Result<(), ManagerError> {
        let live = self.find(key_id, id)?;
        let id = id.to_string();
        self.detached(move |m| async move { m.remove(&id, &live).await }).await
    }

    async fn remove(&self, id: &str, live: &Live) -> Result<(), ManagerError> {
        self.remove_if(id, live, Removal::Always).await.map(drop)
    }

    /// `remove`, unless `when` says otherwise once its owner gets to it. Whether it was
    /// removed.
    async fn remove_if(&self, id: &str, live: &Live, when: Removal) -> Result<bool, ManagerError> {
        // The reaper's removals count too: until the row is gone, it is in flight.
        let _counted = InFlight::count(&self.arc()?);
        // Listed (as being killed) until its VM and files are gone: a 404 means gone.
        let (dir, sandbox_id) = (live.row.dir.clone(), id.to_string());
        let removed = live
            .owner
            .run(move |o: &mut owner::Owned| -> futures::future::BoxFuture<'_, bool> {
                Box::pin(async move {
                    match when {
                        Removal::IfRunning if o.sandbox().is_none() => return false,
                        Removal::Expired if o.state() == state::SandboxState::Paused => return false,
                        _ => {}
                    }
                    // From any settled state; a second kill finds it stopped already.
                    let Ok(was) = o.advance(state::SandboxState::Stopping) else { return true };
                    match o.take_sandbox() {
                        Some(sandbox) => {
                            if let Err(e) = sandbox.destroy().await {
                                tracing::warn!(sandbox = %sandbox_id, "stopping the VM: {e}");
                            }
                        }
                        // Paused, or failed without a VM: only files.
                        None if matches!(was, state::SandboxState::Paused | state::SandboxState::Failed) => {
                            let _ = std::fs::remove_dir_all(&dir);
                        }
                        // Let go for the next server (shutdown): its VM and files are that one's.
                        None => return false,
                    }
                    let _ = o.advance(state::SandboxState::Stopped);
                    true
                })
            })
            .await?;
        if !removed {
            return Ok(false);
        }
        self.live.lock().remove(id);
        self.store.delete_sandbox(id).await?;
        self.prune_snapshot_files().await;
        self.fill_pools();
        Ok(true)
    }

    /// Replaces the sandbox's network settings (E2B's `PUT /sandboxes/{id}/network`):
    /// a running sandbox's stack follows them at once and keeps open connections; a
    /// paused one's take effect when it resumes.
    pub async fn set_network(&self, key_id: &str, id: &str, mut settings: hutch_net::Settings) -> Result<(), ManagerError> {
        let live = self.find(key_id, id)?;
        let dir = live.row.dir.clone();
        // An update replaces the rules; the secrets bound at create stay bound for the
        // sandbox's life, as the guest's variables still hold their placeholders.
        let recorded = crate::sandbox::layout::recorded_network(Path::new(&dir)).map_err(|e| ManagerError::Internal(format!("reading the network settings: {}", hutch_proto::error_chain(&e))))?;
        settings.transforms = settings.transforms.keeping_bindings_of(&recorded.transforms);
        let mut settings = settings.keeping_ingress_of(&recorded);
        self.check_rules(key_id, &mut settings).await?;
        if !settings.transforms.is_empty() && !Path::new(&dir).join(hutch_net::inspect::ca::CA_CERT_FILE).exists() {
            return Err(ManagerError::InvalidArgument(
                "network.rules: this sandbox was created without header rules, so its guest does not trust hutch's inspection CA; create a sandbox with the rules it needs".into(),
            ));
        }
        let env = self.config.net_env.clone();
        self.in_owner(&live, move |_, _, o| {
            Box::pin(async move {
                match o.sandbox_mut() {
                    Some(sandbox) => sandbox.set_network(settings, &env, None),
                    None => crate::sandbox::layout::record_network(Path::new(&dir), settings).map_err(CreateError::Record),
                }
                .map_err(|e| ManagerError::Internal(format!("keeping the network settings: {}", hutch_proto::error_chain(&e))))
            })
        })
        .await
    }

    /// Checks what a sandbox's network settings need from the world. Binds header rules to the API key whose secrets they name; a secret that key
    /// does not have is a 400, so a typo never reaches the destination as a bad header.
    /// The egress proxy's address must resolve now, outside the protected ranges.
    pub(super) async fn check_rules(&self, key_id: &str, settings: &mut hutch_net::Settings) -> Result<(), ManagerError> {
        if let Some(proxy) = &settings.egress_proxy {
            let env = &self.config.net_env;
            hutch_net::stack::proxy_address(proxy, env.seam.as_ref(), &env.reach).await.map_err(|e| ManagerError::InvalidArgument(format!("network.egressProxy.address: {e}")))?;
        }
        if settings.transforms.is_empty() {
            return Ok(());
        }
        settings.transforms.secrets_of = Some(key_id.to_string());
        for name in settings.transforms.secret_names() {
            match self.secrets.get(key_id, &name).await {
                Ok(_) => {}
                Err(crate::secrets::SecretError::NotFound | crate::secrets::SecretError::Invalid(_)) => {
                    let field = if settings.transforms.bound.values().any(|names| names.contains_key(&name)) { "secrets" } else { "network.rules" };
                    return Err(ManagerError::InvalidArgument(format!(
                        "{field}: no secret named `{name}` for this API key; create it first (POST /secrets or `hutch secret create`)"
                    )));
                }
                Err(e) => return Err(ManagerError::Internal(format!("reading the secrets the network rules name: {}", hutch_proto::error_chain(&e)))),
            }
        }
        Ok(())
    }

    /// The sandbox's network settings, read from its record (written whole by a
    /// rename), so reading never waits for an operation in the owner.
    pub fn network(&self, key_id: &str, id: &str) -> Result<hutch_net::Settings, ManagerError> {
        let live = self.find(key_id, id)?;
        let dir = live.row.dir.clone();
        crate::sandbox::layout::recorded_network(Path::new(&dir)).map_err(|e| ManagerError::Internal(format!("reading the network settings: {}", hutch_proto::error_chain(&e))))
    }

    /// What the sandbox's stack refused, and its counters (None while paused).
    pub async fn network_log(&self, key_id: &str, id: &str) -> Result<Option<hutch_net::LogView>, ManagerError> {
        let live = self.find(key_id, id)?;
        self.in_owner(&live, move |_, _, o| Box::pin(async move { Ok(o.sandbox().and_then(Sandbox::net_log)) })).await
    }

    /// Sets the sandbox to end `secs` from now (within the maximum lifetime), in its
    /// owner: after whatever it is doing, which may itself move the end.
    pub async fn set_timeout(&self, key_id: &str, id: &str, secs: u64) -> Result<SandboxRow, ManagerError> {
        let live = self.find(key_id, id)?;
        let end_at = self.end_at(live.row.started_at, Duration::from_secs(secs));
        self.in_owner(&live, move |_, _, o| Box::pin(async move { Ok(o.set_end_at(end_at).await?) })).await?;
        Ok(live.row())
    }

    /// Server shutdown. Running sandboxes are let go with their VMs running, for the
    /// next server to adopt (or killed, with `kill_running`); paused ones stay as they
    /// are (their state is on disk and in the store). Pooled VMs, which nobody holds,
    /// are killed.
    pub async fn shutdown(&self, kill_running: bool) {
        self.shutting_down.store(true, std::sync::atomic::Ordering::SeqCst);
        // A create in flight ends registered (and is let go below), not cut off; a pool
        // VM being started sees the shutdown and stops its VM, and one being stopped
        // (start slots count those) ends stopped: none is left running behind the server.
        let deadline = tokio::time::Instant::now() + SHUTDOWN_WAIT;
        let busy = || {
            // One lock at a time (each guard ends with its statement).
            let slots = self.starting.lock().total();
            let pool_starts = self.pools.lock().starting;
            self.in_flight.load(std::sync::atomic::Ordering::SeqCst) > 0 || pool_starts > 0 || slots > 0
        };
        while busy() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.drain_pools().await;
        let all: Vec<(String, Arc<Live>)> = self.live.lock().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        for (id, live) in all {
            if !live.is_running() {
                continue;
            }
            if kill_running {
                let _ = self.remove_if(&id, &live, Removal::IfRunning).await;
                continue;
            }
            // In the owner: after whatever it is doing ends, so no save is cut short.
            let released = live.owner.run(|o: &mut owner::Owned| -> futures::future::BoxFuture<'_, ()> {
                Box::pin(async move {
                    if let Some(sandbox) = o.take_sandbox() {
                        sandbox.release();
                    }
                })
            });
            if released.await.is_ok() {
                tracing::info!(sandbox = %id, "left running for the next server to adopt");
            }
        }
    }
}

/// A template's own name for one of its aliases (`code-interpreter-v1`).
fn canonical(template: &str) -> String {
    hutch_image::recipes::recipe(template).map_or(template, |r| r.name).to_string()
}

/// One operation counted in `in_flight` while this lives.
struct InFlight(Arc<SandboxManager>);

impl InFlight {
    fn count(m: &Arc<SandboxManager>) -> InFlight {
        m.in_flight.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        InFlight(m.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// How long shutdown waits for operations in flight (a create under TCG takes tens
/// of seconds) before letting go of the sandboxes.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(30);
