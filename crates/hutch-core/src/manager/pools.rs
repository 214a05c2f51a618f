//! The sandboxes waiting in warm pools, by template, and which of them still run their
//! template's current build; `pool.rs` fills and takes from them.

use crate::artifacts::Artifacts;
use crate::sandbox::Sandbox;
use hutch_image::tags;

/// A sandbox waiting in a pool, with the build it runs.
pub(super) struct Pooled {
    pub sandbox: Sandbox,
    pub artifacts: Artifacts,
    /// Its template's generation when its fill began (see `Pools::generation`).
    pub generation: u64,
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
