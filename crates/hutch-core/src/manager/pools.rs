//! The sandboxes waiting in warm pools, by template, and which of them still run their
//! template's current build; `pool.rs` fills and takes from them.

use crate::artifacts::Artifacts;
use crate::sandbox::Sandbox;
use hutch_image::tags;

/// A sandbox waiting in a pool, with the build it runs.
pub(super) struct Pooled {
    /// The reference whose pool it waits in (`name` or `name:tag`).
    pub reference: String,
    pub sandbox: Sandbox,
    pub artifacts: Artifacts,
    /// Its template's generation when its fill began (see `Pools::generation`).
    pub generation: u64,
}

impl Pooled {
    /// Stops this sandbox, taken out of a pool at admission for a create's or a
    /// resume's VM to take its place; an error if it could not be, so that no VM starts
    /// beside it.
    pub async fn make_room(self) -> Result<(), super::error::ManagerError> {
        tracing::info!(sandbox = %self.sandbox.id(), "stopping a pooled sandbox to make room");
        self.sandbox.destroy().await.map_err(|e| super::error::ManagerError::Internal(format!("stopping a pooled sandbox to make room: {e}")))
    }
}

#[derive(Default)]
pub(super) struct Pools {
    /// Waiting sandboxes by (canonical) template reference, `name` or `name:tag`.
    pub ready: std::collections::HashMap<String, Vec<Pooled>>,
    /// Templates with a refill task running.
    pub filling: std::collections::HashSet<String>,
    /// Per template name, how many times its builds or tags have changed under the
    /// pools. A waiting sandbox of an older generation runs a build its reference no
    /// longer names: it is never handed out, only stopped.
    pub generation: std::collections::HashMap<String, u64>,
    /// Recent creates by template, which size the pools not pinned.
    pub demand: super::pool_sizing::Demand,
    /// Pool VMs being started now (each holds a start slot): a create that finds the
    /// server full while one starts waits for it rather than being refused.
    pub starting: usize,
}

impl Pools {
    /// Sandboxes waiting, all templates (they count against the limit).
    pub fn waiting(&self) -> usize {
        self.ready.values().map(Vec::len).sum()
    }

    pub fn generation(&self, reference: &str) -> u64 {
        self.generation.get(tags::split(reference).0).copied().unwrap_or(0)
    }

    /// A waiting sandbox of `reference` that runs its current build.
    pub fn take_current(&mut self, reference: &str) -> Option<Pooled> {
        let current = self.generation(reference);
        let waiting = self.ready.get_mut(reference)?;
        let at = waiting.iter().rposition(|p| p.generation == current)?;
        Some(waiting.remove(at))
    }

    /// Puts back a sandbox taken out by `take_to_make_room` that made no room after all.
    pub fn put_back(&mut self, pooled: Pooled) {
        self.ready.entry(pooled.reference.clone()).or_default().push(pooled);
    }

    /// A waiting sandbox to stop so that a create has room (the server's limit or the
    /// host's memory): one of an older build first, then one of the template with the
    /// most waiting other than `keep`'s, and `keep`'s last.
    pub fn take_to_make_room(&mut self, keep: Option<&str>) -> Option<Pooled> {
        let stale = self.ready.keys().find(|r| {
            let current = self.generation(r);
            self.ready[*r].iter().any(|p| p.generation != current)
        });
        if let Some(reference) = stale.cloned() {
            let current = self.generation(&reference);
            let waiting = self.ready.get_mut(&reference)?;
            let at = waiting.iter().position(|p| p.generation != current)?;
            return Some(waiting.remove(at));
        }
        let reference = self
            .ready
            .iter()
            .filter(|(_, waiting)| !waiting.is_empty())
            .max_by_key(|(reference, waiting)| (Some(reference.as_str()) != keep, waiting.len()))
            .map(|(reference, _)| reference.clone())?;
        self.ready.get_mut(&reference)?.pop()
    }

    /// A waiting sandbox of `reference` beyond `target` of its current build, or of an
    /// older one (the pool shrinks to what demand says now).
    pub fn take_surplus(&mut self, reference: &str, target: usize) -> Option<Pooled> {
        let current = self.generation(reference);
        let waiting = self.ready.get_mut(reference)?;
        if let Some(at) = waiting.iter().position(|p| p.generation != current) {
            return Some(waiting.remove(at));
        }
        (waiting.len() > target).then(|| waiting.remove(0))
    }

    /// A waiting sandbox of template `name` (or one of its tags) that no longer runs
    /// its reference's build.
    pub fn take_stale(&mut self, name: &str) -> Option<Pooled> {
        let current = self.generation.get(name).copied().unwrap_or(0);
        self.ready
            .iter_mut()
            .filter(|(reference, _)| tags::split(reference).0 == name)
            .find_map(|(_, waiting)| waiting.iter().position(|p| p.generation != current).map(|at| waiting.remove(at)))
    }
}
