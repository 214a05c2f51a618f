//! Warm pools: per template, a few sandboxes already restored from the template's
//! snapshot and waiting. A create takes one (handing it its identity, envs, clock and
//! entropy) instead of starting a VM, and a background task refills the pool. Pool
//! VMs count against the server's sandbox limit; they belong to no key until taken.

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

    /// Every configured pool: (template, waiting now, size).
    pub fn pools(&self) -> Vec<(String, usize, usize)> {
        self.config.pool.iter().map(|(t, n)| (t.clone(), self.pool_size(t), *n)).collect()
    }

    pub(super) fn pool_target(&self, template: &str) -> usize {
        self.config.pool.get(template).copied().unwrap_or(0)
    }

    /// Makes `pooled`, taken from the pool at admission, this request's: same guest,
    /// its own identity from here on, with the artifacts of the build it runs. None if
    /// it did not take its identity and was stopped (the caller starts another under
    /// the same id); an error if it could not even be stopped, so no second VM starts
    /// beside it.
    pub(super) async fn hand_over(&self, template: &str, pooled: Pooled, opts: &SandboxOptions) -> Result<Option<(Sandbox, Artifacts)>, super::ManagerError> {
        let Pooled { mut sandbox, artifacts, .. } = pooled;
        self.refill(template);
        match sandbox.reinit(opts).await {
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
        if self.pool_target(template) == 0 || !self.pools.lock().filling.insert(template.to_string()) {
            return;
        }
        let me = self.me.clone();
        let template = template.to_string();
        tokio::spawn(async move {
            loop {
                let Some(m) = me.upgrade() else { return };
                if m.pool_size(&template) >= m.pool_target(&template) || m.shutting_down() || !m.room_for_pool() {
                    break;
                }
                if let Err(e) = m.add_to_pool(&template).await {
                    tracing::warn!(template = %template, "filling the warm pool: {e}");
                    break;
                }
            }
            if let Some(m) = me.upgrade() {
                m.pools.lock().filling.remove(&template);
            }
        });
    }

    /// A refill never takes the last free slot: requests come first. Pools fill up
    /// again when sandboxes end.
    fn room_for_pool(&self) -> bool {
        self.running_count() + self.starting.lock().total() + 1 < self.config.max_sandboxes
    }

    async fn add_to_pool(&self, template: &str) -> Result<(), super::ManagerError> {
        let _slot = self.reserve_slot(None)?;
        // Read before preparing: a change of builds forgets the prepared artifacts
        // first and then moves the generation on, so a sandbox of the old build always
        // carries the old generation.
        let generation = self.pools.lock().generation(template);
        let artifacts = self.prepare(template).await?;
        let opts = self.options(template, &Default::default(), &Default::default(), None);
        let sandbox = Sandbox::create(&self.home, &artifacts, self.backend.as_ref(), &opts).await.map_err(super::ManagerError::Create)?;
        let user = artifacts.template.source.as_ref().and_then(|s| s.defaults.user.clone());
        prewarm(&sandbox, user.as_deref()).await;
        let unwanted = {
            let mut pools = self.pools.lock();
            if self.shutting_down() || pools.generation(template) != generation {
                // Shutting down, or its build changed while it started.
                Some(sandbox)
            } else {
                pools.ready.entry(template.to_string()).or_default().push(Pooled { sandbox, artifacts, generation });
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
        *self.pools.lock().generation.entry(name.to_string()).or_default() += 1;
        let me = self.me.clone();
        let name = name.to_string();
        tokio::spawn(async move {
            let Some(m) = me.upgrade() else { return };
            loop {
                // Counted as starting before it leaves the pool, so the limit holds
                // until its VM is gone.
                let _slot = SlotGuard::take(&m.starting, &mut m.starting.lock(), None);
                let Some(stale) = m.pools.lock().take_stale(&name) else { break };
                tracing::info!(template = %name, sandbox = %stale.sandbox.id(), "stopping a pooled sandbox of a replaced build");
                let _ = stale.sandbox.destroy().await;
            }
            m.fill_pools();
        });
    }

    /// Fills every configured pool (at start, and when a sandbox ends and frees room).
    pub(super) fn fill_pools(&self) {
        let templates: Vec<String> = self.config.pool.keys().cloned().collect();
        for t in templates {
            self.refill(&t);
        }
    }

    /// Stops every pooled VM (shutdown).
    pub(super) async fn drain_pools(&self) {
        let all: Vec<Pooled> = self.pools.lock().ready.drain().flat_map(|(_, v)| v).collect();
        for pooled in all {
            let _ = pooled.sandbox.destroy().await;
        }
    }
}

/// How long a pooled sandbox's warm-up may take before it is pooled as it is.
const PREWARM_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Runs what SDKs run first in a pooled sandbox before anyone takes it: every
/// `commands.run` starts `/bin/bash -l -c CMD` as the template's user. Under TCG a fresh
/// QEMU translates that start-up on its first run, and the translation stays with the
/// QEMU: measured through the official SDK, a pooled sandbox's first command took
/// 245-270 ms and the next 52 (docs/BENCHMARKS.md). Best effort: a guest without bash
/// or that user is pooled all the same.
async fn prewarm(sandbox: &Sandbox, user: Option<&str>) {
    let request = hutch_proto::process::StartRequest {
        process: hutch_proto::process::ProcessConfig { cmd: "/bin/bash".into(), args: vec!["-l".into(), "-c".into(), "true".into()], envs: Default::default(), cwd: None },
        pty: None,
        tag: None,
        stdin: Some(false),
    };
    let agent = sandbox.agent().as_user(Some(user.unwrap_or("user")));
    let run = async {
        let mut stream = agent.start(&request).await?;
        while stream.next().await.is_some() {}
        Ok::<_, hutch_envd::AgentError>(())
    };
    match tokio::time::timeout(PREWARM_WAIT, run).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(sandbox = %sandbox.id(), "warming a pooled sandbox up: {e}"),
        Err(_) => tracing::debug!(sandbox = %sandbox.id(), "warming a pooled sandbox up took more than {} s", PREWARM_WAIT.as_secs()),
    }
}
