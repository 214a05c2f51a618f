//! Warm pools: per template, a few sandboxes already restored from the template's
//! snapshot and waiting. A create takes one (handing it its identity, envs, clock and
//! entropy) instead of starting a VM, and a background task refills the pool. Pool
//! VMs count against the server's sandbox limit; they belong to no key until taken.

use super::{lock, SandboxManager, SlotGuard};
use crate::sandbox::{Sandbox, SandboxOptions};

#[derive(Default)]
pub(super) struct Pools {
    /// Waiting sandboxes by (canonical) template name.
    ready: std::collections::HashMap<String, Vec<Sandbox>>,
    /// Templates with a refill task running.
    filling: std::collections::HashSet<String>,
}

impl SandboxManager {
    /// Sandboxes waiting in pools (they count against the limit).
    pub(super) fn pooled_count(&self) -> usize {
        lock(&self.pools).ready.values().map(Vec::len).sum()
    }

    /// Whether a refill task runs now (tests wait for it).
    #[cfg(test)]
    pub(super) fn pools_filling(&self) -> bool {
        !lock(&self.pools).filling.is_empty()
    }

    /// The ids of the sandboxes waiting in pools (tests check their directories).
    #[cfg(test)]
    pub(super) fn pooled_ids(&self) -> Vec<String> {
        lock(&self.pools).ready.values().flatten().map(|s| s.id().to_string()).collect()
    }

    /// How many sandboxes of `template` wait in the pool now.
    pub fn pool_size(&self, template: &str) -> usize {
        lock(&self.pools).ready.get(template).map_or(0, Vec::len)
    }

    /// Every configured pool: (template, waiting now, size).
    pub fn pools(&self) -> Vec<(String, usize, usize)> {
        self.config.pool.iter().map(|(t, n)| (t.clone(), self.pool_size(t), *n)).collect()
    }

    fn pool_target(&self, template: &str) -> usize {
        self.config.pool.get(template).copied().unwrap_or(0)
    }

    /// A waiting sandbox of `template`, made this request's: same guest, its own
    /// identity from here on. None when the pool is empty (or there is none).
    /// The slot guard keeps the sandbox counted until the caller registers it.
    pub(super) async fn take_pooled(&self, template: &str, opts: &SandboxOptions) -> Option<(Sandbox, SlotGuard<'_>)> {
        if self.pool_target(template) == 0 {
            return None;
        }
        // The caller refills once the sandbox counts as running.
        // Counted as starting before it leaves the pool (never both locks at once:
        // reserve_slot takes them in the other order).
        *lock(&self.starting) += 1;
        let slot = SlotGuard(&self.starting);
        let mut sandbox = lock(&self.pools).ready.get_mut(template).and_then(Vec::pop)?;
        match sandbox.reinit(opts).await {
            Ok(()) => Some((sandbox, slot)),
            Err(e) => {
                tracing::warn!(template, "a pooled sandbox did not take its identity, discarding it: {e}");
                let _ = sandbox.destroy().await;
                self.refill(template);
                None
            }
        }
    }

    /// Starts filling `template`'s pool up to its size in the background, unless a
    /// fill is running. A fill stops when the server is at its limit.
    pub(super) fn refill(&self, template: &str) {
        if self.pool_target(template) == 0 || !lock(&self.pools).filling.insert(template.to_string()) {
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
                lock(&m.pools).filling.remove(&template);
            }
        });
    }

    /// A refill never takes the last free slot: requests come first. Pools fill up
    /// again when sandboxes end.
    fn room_for_pool(&self) -> bool {
        self.running_count() + *lock(&self.starting) + 1 < self.config.max_sandboxes
    }

    async fn add_to_pool(&self, template: &str) -> Result<(), super::ManagerError> {
        let _slot = self.reserve_slot()?;
        let artifacts = self.prepare(template).await?;
        let opts = self.options(template, &Default::default(), &Default::default(), None);
        let sandbox = Sandbox::create(&self.home, &artifacts, self.backend.as_ref(), &opts).await.map_err(super::ManagerError::Create)?;
        if self.shutting_down() {
            let _ = sandbox.destroy().await;
            return Ok(());
        }
        lock(&self.pools).ready.entry(template.to_string()).or_default().push(sandbox);
        Ok(())
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
        let all: Vec<Sandbox> = lock(&self.pools).ready.drain().flat_map(|(_, v)| v).collect();
        for sandbox in all {
            let _ = sandbox.destroy().await;
        }
    }
}
