//! Warm pools: per template, a few sandboxes already restored from the template's
//! snapshot and waiting. A create takes one (handing it its identity, envs, clock and
//! entropy) instead of starting a VM, and a background task refills the pool. Pool
//! VMs count against the server's sandbox limit; they belong to no key until taken.

use super::pool_sizing::PoolStatus;
use super::pools::Pooled;
use super::slots::SlotGuard;
use super::SandboxManager;
use crate::artifacts::Artifacts;
use crate::sandbox::Sandbox;
use crate::sandbox::boot::SandboxOptions;

impl SandboxManager {
    /// Sandboxes waiting in pools (they count against the limit).
    pub(super) fn pooled_count(&self) -> usize {
        self.pools.lock().waiting()
    }

    /// Whether a refill task runs now (tests wait for it).
    #[cfg(test)]
    pub(super) fn pools_filling(&self) -> bool {
        !self.pools.lock().filling.is_empty()
    }

    /// The ids of the sandboxes waiting in pools (tests check their directories).
    #[cfg(test)]
    pub(super) fn pooled_ids(&self) -> Vec<String> {
        self.pools.lock().ready.values().flatten().map(|p| p.sandbox.id().to_string()).collect()
    }

    /// How many sandboxes of `template`'s current build wait in the pool now.
    pub fn pool_size(&self, template: &str) -> usize {
        let pools = self.pools.lock();
        let current = pools.generation(template);
        pools.ready.get(template).map_or(0, |waiting| waiting.iter().filter(|p| p.generation == current).count())
    }

    /// Every pool that keeps or holds a sandbox now, pinned or sized by demand, of the
    /// templates `key_id` may use (another key's template is not this one's to learn of).
    pub fn pools(&self, key_id: &str) -> Vec<PoolStatus> {
        self.pool_templates()
            .into_iter()
            .filter(|t| self.template_owner(hutch_image::tags::split(t).0).is_none_or(|owner| owner == key_id))
            .map(|template| PoolStatus {
                ready: self.pool_size(&template),
                target: self.pool_target(&template),
                pinned: self.config.pool.pinned.contains_key(&template),
                template,
            })
            .filter(|p| p.ready > 0 || p.target > 0)
            .collect()
    }

    /// The templates a pool may be kept for: pinned, the default, those created from
    /// lately, and any with sandboxes waiting.
    fn pool_templates(&self) -> Vec<String> {
        let policy = &self.config.pool;
        let pools = self.pools.lock();
        let mut all: std::collections::BTreeSet<String> = policy.pinned.keys().cloned().collect();
        all.extend(policy.demand.as_ref().map(|d| d.default_template.clone()));
        all.extend(pools.demand.templates().map(str::to_string));
        all.extend(pools.ready.iter().filter(|(_, w)| !w.is_empty()).map(|(t, _)| t.clone()));
        all.into_iter().collect()
    }

    pub(super) fn pool_target(&self, template: &str) -> usize {
        self.pools.lock().demand.target(&self.config.pool, template)
    }

    /// A create of `template` (canonical) was served: demand sizes its pool from it,
    /// and the pool refills off the request path. Only for templates no API key owns
    /// (the built-in ones and the operator's): a pool of a key's own template would
    /// run that key's image, start command and login scripts in VMs no quota of its
    /// counts, as often as its creates asked. An operator may still pin one (`--pool`).
    pub(super) fn record_demand(&self, template: &str) {
        if self.config.pool.demand.is_none() || self.template_owner(hutch_image::tags::split(template).0).is_some() {
            return;
        }
        self.pools.lock().demand.record(template, std::time::Instant::now());
        self.refill(template);
    }

    /// Makes `pooled`, taken from the pool at admission, this request's: same guest,
    /// its own identity from here on, with the artifacts of the build it runs. None if
    /// it did not take its identity and was stopped (the caller starts another under
    /// the same id); an error if it could not even be stopped, so no second VM starts
    /// beside it.
    pub(super) async fn hand_over(&self, template: &str, pooled: Pooled, opts: &SandboxOptions) -> Result<Option<(Sandbox, Artifacts)>, super::ManagerError> {
        let Pooled { mut sandbox, artifacts, .. } = pooled;
        // Before the refill starts: from here on the refill gives way to this one.
        // One that stayed behind would run a tenant's code at an eighth of the weight.
        let forward = sandbox.set_cpu_share(hutch_vmm::CpuShare::Foreground);
        self.refill(template);
        let taken = match forward {
            true => sandbox.reinit(opts).await.map_err(|e| e.to_string()),
            false => Err("its CPU weight could not be set back to the default".to_string()),
        };
        match taken {
            Ok(()) => Ok(Some((sandbox, artifacts))),
            Err(e) => {
                tracing::warn!(template, "a pooled sandbox did not take its identity, discarding it: {e}");
                sandbox.destroy().await.map_err(|e| super::ManagerError::Internal(format!("stopping a pooled sandbox that did not take its identity: {e}")))?;
                Ok(None)
            }
        }
    }

    /// Starts filling `template`'s pool up to its size in the background, unless a
    /// fill is running. A fill stops when the server is at its limit.
    pub(super) fn refill(&self, template: &str) {
        if self.pool_target(template) == 0 || self.shutting_down() || !self.pools.lock().filling.insert(template.to_string()) {
            return;
        }
        let me = self.me.clone();
        let template = template.to_string();
        tokio::spawn(async move {
            loop {
                let Some(m) = me.upgrade() else { return };
                if m.pool_size(&template) >= m.pool_target(&template) || m.shutting_down() || !m.room_for_pool(&template) {
                    break;
                }
                if let Err(e) = m.add_to_pool(&template).await {
                    tracing::warn!(template = %template, "filling the warm pool: {e}");
                    // Not again until the next create of it asks (a pinned pool: until
                    // a sandbox ends or the upkeep comes round).
                    m.pools.lock().demand.forget(&template);
                    break;
                }
            }
            if let Some(m) = me.upgrade() {
                m.pools.lock().filling.remove(&template);
            }
        });
    }

    /// A refill never takes the last free slot, nor memory the host needs: requests
    /// come first. Pools fill up again when sandboxes end.
    fn room_for_pool(&self, template: &str) -> bool {
        let slot = self.running_count() + self.starting.lock().total() + 1 < self.config.max_sandboxes;
        let memory = u64::from(self.shape(template).1.get());
        slot && (self.config.pool.free_memory)().is_none_or(|free| free >= self.config.pool.reserve_mib + memory)
    }

    /// Whether the host has less memory free than the pools must leave it.
    pub(super) fn memory_short(&self) -> bool {
        (self.config.pool.free_memory)().is_some_and(|free| free < self.config.pool.reserve_mib)
    }

    async fn add_to_pool(&self, template: &str) -> Result<(), super::ManagerError> {
        // Counted before its slot and dropped after it: a create woken by its end finds
        // the slot given back.
        let _starting = PoolStart::count(self);
        // After counting itself: a shutdown either waits for this start or is seen here.
        if self.shutting_down() {
            return Err(super::ManagerError::ShuttingDown);
        }
        let _slot = self.reserve_slot()?;
        // Read before preparing: a change of builds forgets the prepared artifacts
        // first and then moves the generation on, so a sandbox of the old build always
        // carries the old generation.
        let generation = self.pools.lock().generation(template);
        let artifacts = self.prepare(template).await?;
        // Restored and warmed up in the background: a create running on the host now,
        // or the first commands of a sandbox just taken, come first (measured:
        // docs/BENCHMARKS.md). It comes to the foreground when taken (`hand_over`).
        let opts = SandboxOptions { cpu_share: hutch_vmm::CpuShare::Background, ..self.options(template, &Default::default(), &Default::default(), None) };
        let sandbox = Sandbox::create(&self.home, &artifacts, self.backend.as_ref(), &opts).await.map_err(super::ManagerError::Create)?;
        let user = artifacts.template.source.as_ref().and_then(|s| s.defaults.user.clone());
        if let Err(why) = prewarm(&sandbox, &artifacts, user.as_deref()).await {
            let _ = sandbox.destroy().await;
            return Err(super::ManagerError::Internal(format!("a sandbox for the pool was stopped: {why}")));
        }
        let unwanted = {
            let mut pools = self.pools.lock();
            if self.shutting_down() || pools.generation(template) != generation {
                // Shutting down, or its build changed while it started.
                Some(sandbox)
            } else {
                pools.ready.entry(template.to_string()).or_default().push(Pooled { reference: template.to_string(), sandbox, artifacts, generation });
                None
            }
        };
        if let Some(sandbox) = unwanted {
            let _ = sandbox.destroy().await;
        }
        Ok(())
    }

    /// Template `name`'s builds or tags changed: its waiting sandboxes (and those of
    /// its tags) run builds a create may no longer get. They are stopped in the
    /// background, counted against the limit until gone, and the pools refill with
    /// what the references name now.
    pub(super) fn retire_pooled(&self, name: &str) {
        {
            let mut pools = self.pools.lock();
            *pools.generation.entry(name.to_string()).or_default() += 1;
            // Sized again by the creates of what the name is now (or of nothing).
            pools.demand.forget_template(name);
        }
        let me = self.me.clone();
        let name = name.to_string();
        tokio::spawn(async move {
            let Some(m) = me.upgrade() else { return };
            while let Some(stale) = m.take_pooled(|pools| pools.take_stale(&name)) {
                tracing::info!(template = %name, sandbox = %stale.id(), "stopping a pooled sandbox of a replaced build");
                stale.stop().await;
            }
            m.fill_pools();
        });
    }

    /// Fills every pool to its size (at start, when a sandbox ends and frees room, and
    /// at each upkeep).
    pub(super) fn fill_pools(&self) {
        for t in self.pool_templates() {
            self.refill(&t);
        }
    }

    /// Starts the pools' upkeep: every few seconds demand that fell out of its window
    /// is forgotten, pools larger than their size now shrink, waiting sandboxes stop
    /// while the host is short of memory, and the pools refill.
    pub(super) fn start_pool_upkeep(self: &std::sync::Arc<Self>) {
        if self.config.pool.demand.is_none() && self.config.pool.pinned.is_empty() {
            return;
        }
        let me = std::sync::Arc::downgrade(self);
        let every = self.config.pool.upkeep_every;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(m) = me.upgrade() else { return };
                if m.shutting_down() {
                    return;
                }
                m.tend_pools().await;
            }
        });
    }

    pub(super) async fn tend_pools(&self) {
        if let Some(demand) = &self.config.pool.demand {
            self.pools.lock().demand.expire(demand.window, std::time::Instant::now());
        }
        for template in self.pool_templates() {
            let target = self.pool_target(&template);
            while let Some(surplus) = self.take_pooled(|pools| pools.take_surplus(&template, target)) {
                tracing::info!(template = %template, sandbox = %surplus.id(), "stopping a pooled sandbox no longer asked for");
                surplus.stop().await;
            }
        }
        while self.memory_short() {
            let Some(spare) = self.take_pooled(|pools| pools.take_to_make_room(None)) else { break };
            tracing::info!(sandbox = %spare.id(), "stopping a pooled sandbox: the host is short of memory");
            spare.stop().await;
        }
        self.fill_pools();
    }

    /// Takes a waiting sandbox out of the pools as `take` picks it, counted as a start
    /// slot until it has stopped, so the server's limit holds until its VM is gone.
    fn take_pooled(&self, take: impl FnOnce(&mut super::pools::Pools) -> Option<Pooled>) -> Option<Leaving<'_>> {
        let mut starting = self.starting.lock();
        let pooled = take(&mut self.pools.lock())?;
        Some(Leaving { pooled, _slot: SlotGuard::take(&self.starting, &mut starting, None) })
    }

    /// Stops every pooled VM (shutdown).
    pub(super) async fn drain_pools(&self) {
        let all: Vec<Pooled> = self.pools.lock().ready.drain().flat_map(|(_, v)| v).collect();
        for pooled in all {
            let _ = pooled.sandbox.destroy().await;
        }
    }
}

/// A pool VM being started, counted in `Pools::starting` while this lives; creates
/// waiting for it are woken when it drops.
struct PoolStart<'a>(&'a SandboxManager);

impl<'a> PoolStart<'a> {
    fn count(m: &'a SandboxManager) -> PoolStart<'a> {
        m.pools.lock().starting += 1;
        PoolStart(m)
    }
}

impl Drop for PoolStart<'_> {
    fn drop(&mut self) {
        self.0.pools.lock().starting -= 1;
        self.0.pool_started.notify_waiters();
    }
}

/// A sandbox taken out of a pool to be stopped, still counted against the server's
/// limit (its start slot) until it is.
struct Leaving<'a> {
    pooled: Pooled,
    _slot: SlotGuard<'a>,
}

impl Leaving<'_> {
    fn id(&self) -> &crate::ids::SandboxId {
        self.pooled.sandbox.id()
    }

    async fn stop(self) {
        if let Err(e) = self.pooled.sandbox.destroy().await {
            tracing::warn!("stopping a pooled sandbox: {e}");
        }
    }
}

/// How long a pooled sandbox's service warm-up may take before the sandbox is stopped.
const PREWARM_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Runs what SDKs run first in a pooled sandbox before anyone takes it: the shells
/// (`shell_warm_up`), and for a template with a service (the code interpreter) its
/// first warm-up request again (a Python cell, not counted: the user's first cell is
/// still number 1). Under TCG a fresh QEMU translates that code on its first run, and
/// the translation stays with the QEMU: measured through the official SDKs, a pooled
/// sandbox's first command took 245-270 ms and the next 52, its first `run_code` 460
/// ms and the next 145 (docs/BENCHMARKS.md). A guest without bash or that user is
/// pooled all the same; one whose agent or service does not answer in time, or whose
/// service's warm-up fails, is not: the error says why it must not wait there.
async fn prewarm(sandbox: &Sandbox, artifacts: &Artifacts, user: Option<&str>) -> Result<(), String> {
    // Each with its own time: a slow profile does not eat the service's.
    use crate::shell_warm_up::{warm_shells, WarmShellsError};
    match warm_shells(sandbox.agent(), user).await {
        Ok(()) => {}
        Err(e @ WarmShellsError::Agent(_)) => tracing::debug!(sandbox = %sandbox.id(), "warming a pooled sandbox's shell up: {e}"),
        Err(e @ WarmShellsError::Timeout) => return Err(e.to_string()),
    }
    let service = async {
        let template = &artifacts.template;
        match (template.ready_port(), template.warm_up(sandbox.memory_mib()).next()) {
            (Some(port), Some(first)) => crate::template_snapshot::warm_up(sandbox.agent(), port, first.path, first.body).await,
            _ => Ok(()),
        }
    };
    match tokio::time::timeout(PREWARM_WAIT, service).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("its service's warm-up failed: {e}")),
        // The warm-up may still run in the guest: a user would wait behind it, or
        // find what it left half done.
        Err(_) => Err(format!("its service's warm-up took more than {} s", PREWARM_WAIT.as_secs())),
    }
}
