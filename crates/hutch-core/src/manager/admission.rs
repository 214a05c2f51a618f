//! Admission: whether the server and the key have room for one more VM, decided and
//! recorded in one lock (starting, then live, then pools: the one order every holder
//! of more than one of them takes), so requests racing each other never pass a limit
//! together. A create is admitted into the map as `Creating`; a resume or a pool fill
//! takes a start slot (`slots.rs`).

use super::error::ManagerError;
use super::live::Live;
use super::pools::Pooled;
use super::slots::{SlotGuard, Starting};
use super::SandboxManager;
use std::collections::HashMap;
use std::sync::Arc;

/// The manager's map of sandboxes, as its lock gives it.
type Lives = HashMap<String, Arc<Live>>;

/// What `admit` gives a create.
pub(super) struct Admission<'a> {
    pub admitted: Admitted<'a>,
    /// Its entry in the manager's map.
    pub creating: Arc<Live>,
    /// The pooled sandbox it takes over, if one of its template was waiting.
    pub pooled: Option<Pooled>,
    /// A pooled sandbox of another template taken out to make room, for the create to
    /// stop before its own VM starts (until then the two share one count).
    pub displaced: Option<Pooled>,
}

/// A `Creating` sandbox in the manager's map: taken out again when this drops, unless
/// its creation succeeded (`keep`).
pub(super) struct Admitted<'a> {
    manager: &'a SandboxManager,
    id: String,
    kept: bool,
}

impl Admitted<'_> {
    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.manager.live.lock().remove(&self.id);
        }
    }
}

impl SandboxManager {
    /// Admits a sandbox of `key_id` as `make(id)` makes it. With `pool`, a waiting
    /// sandbox of that template is taken in the same lock when there is one (it moves
    /// from the pool's count to the map's, so it needs no room) and the new sandbox
    /// takes its id; otherwise the id is new and the server must have room. The pools
    /// give way to it: when the server is at its limit, or the host short of memory, a
    /// sandbox waiting in a pool is taken out (`Admission::displaced`) for the create to
    /// stop before it starts its own VM.
    pub(super) fn admit(&self, key_id: &str, pool: Option<&str>, make: impl FnOnce(&str) -> Arc<Live>) -> Result<Admission<'_>, ManagerError> {
        let memory_short = self.memory_short();
        let starting = self.starting.lock();
        let mut live = self.live.lock();
        let mut pools = self.pools.lock();
        self.room_for_key(&live, &starting, key_id)?;
        let pooled = pool.and_then(|t| pools.take_current(t));
        let mut displaced = None;
        if pooled.is_none() {
            if memory_short || self.room_for_vm(&live, &starting, pools.waiting()).is_err() {
                displaced = pools.take_to_make_room(pool);
            }
            // One taken out of a pool leaves the count where its VM's place is the
            // create's: the two are never running at once.
            self.room_for_vm(&live, &starting, pools.waiting())?;
        }
        let id = pooled.as_ref().map_or_else(|| crate::ids::SandboxId::generate().to_string(), |p| p.sandbox.id().to_string());
        let creating = make(&id);
        live.insert(id.clone(), creating.clone());
        Ok(Admission { admitted: Admitted { manager: self, id, kept: false }, creating, pooled, displaced })
    }

    /// Reserves a slot for a VM about to start, for `key`'s running quota too when it is
    /// a key's (a resume); the slot is released when the returned guard drops.
    pub(super) fn reserve_slot(&self, key: Option<&str>) -> Result<SlotGuard<'_>, ManagerError> {
        let mut starting = self.starting.lock();
        let live = self.live.lock();
        self.room_for_vm(&live, &starting, self.pools.lock().waiting())?;
        if let Some(key) = key {
            self.room_for_key(&live, &starting, key)?;
        }
        drop(live);
        Ok(SlotGuard::take(&self.starting, &mut starting, key))
    }

    /// Room under `--max-sandboxes` for one more VM: the map's VMs, the pools' and
    /// those starting (read under the caller's locks).
    fn room_for_vm(&self, live: &Lives, starting: &Starting, waiting: usize) -> Result<(), ManagerError> {
        let held = live.values().filter(|l| l.holds_vm()).count() + waiting + starting.total();
        match held < self.config.max_sandboxes {
            true => Ok(()),
            false => Err(ManagerError::AtCapacity { max: self.config.max_sandboxes }),
        }
    }

    /// Room in `key`'s running quota for one more: its VMs in the map and those it is
    /// starting (read under the caller's locks).
    fn room_for_key(&self, live: &Lives, starting: &Starting, key: &str) -> Result<(), ManagerError> {
        let held = live.values().filter(|l| l.row.key_id == key && l.holds_vm()).count() + starting.of_key(key);
        match held < self.config.quota.running {
            true => Ok(()),
            false => Err(super::quota::over_running(self.config.quota.running)),
        }
    }
}
