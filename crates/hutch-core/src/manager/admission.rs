//! Admission: whether the server and the key have room for one more VM, decided and
//! recorded in one lock (starting, then live, then pools: the one order every holder
//! of more than one of them takes), so requests racing each other never pass a limit
//! together. A create is admitted into the map as `Creating`; a resume or a pool fill
//! takes a start slot (`slots.rs`).

use super::error::ManagerError;
use super::live::Live;
use super::pools::{Pooled, Pools};
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
    /// Only a create that `may_displace` does that: one whose origin is known to exist
    /// (a template built here, a stored snapshot, a fork's source), so a made-up name
    /// never stops a waiting sandbox.
    pub(super) fn admit(&self, key_id: &str, pool: Option<&str>, may_displace: bool, make: impl FnOnce(&str) -> Arc<Live>) -> Result<Admission<'_>, ManagerError> {
        if self.shutting_down() {
            return Err(ManagerError::ShuttingDown);
        }
        let memory_short = self.memory_short();
        let starting = self.starting.lock();
        let mut live = self.live.lock();
        let mut pools = self.pools.lock();
        self.room_for_key(&live, &starting, key_id)?;
        let pooled = pool.and_then(|t| pools.take_current(t));
        let displaced = match pooled {
            Some(_) => None,
            None => self.make_room(&live, &starting, &mut pools, memory_short, may_displace, pool)?,
        };
        let id = pooled.as_ref().map_or_else(|| crate::ids::SandboxId::generate().to_string(), |p| p.sandbox.id().to_string());
        let creating = make(&id);
        live.insert(id.clone(), creating.clone());
        Ok(Admission { admitted: Admitted { manager: self, id, kept: false }, creating, pooled, displaced })
    }

    /// Reserves a slot for a pool VM about to start; the slot is released when the
    /// returned guard drops.
    pub(super) fn reserve_slot(&self) -> Result<SlotGuard<'_>, ManagerError> {
        let mut starting = self.starting.lock();
        let live = self.live.lock();
        self.room_for_vm(&live, &starting, self.pools.lock().waiting())?;
        drop(live);
        Ok(SlotGuard::take(&self.starting, &mut starting, None))
    }

    /// Reserves a slot for `key`'s resume, within its running quota too. The pools give
    /// way to it as to a create: at the limit, or with the host short of memory, a
    /// waiting sandbox is taken out and stopped before this returns (its place is the
    /// resume's, so the two VMs never run at once).
    pub(super) async fn reserve_resume_slot(&self, key: &str) -> Result<SlotGuard<'_>, ManagerError> {
        let memory_short = self.memory_short();
        let (slot, displaced) = {
            let mut starting = self.starting.lock();
            let live = self.live.lock();
            let mut pools = self.pools.lock();
            self.room_for_key(&live, &starting, key)?;
            let displaced = self.make_room(&live, &starting, &mut pools, memory_short, true, None)?;
            drop((live, pools));
            (SlotGuard::take(&self.starting, &mut starting, Some(key)), displaced)
        };
        if let Some(displaced) = displaced {
            displaced.make_room().await?;
        }
        Ok(slot)
    }

    /// Room for one more VM (read and changed under the caller's locks). With `displace`,
    /// a waiting sandbox is taken out of the pools when the server is at its limit or
    /// `memory_short`, preferring another template than `keep`'s; the caller stops it
    /// before its own VM starts (its place is the new VM's: the two never run at once).
    fn make_room(&self, live: &Lives, starting: &Starting, pools: &mut Pools, memory_short: bool, displace: bool, keep: Option<&str>) -> Result<Option<Pooled>, ManagerError> {
        let mut displaced = None;
        if displace && (memory_short || self.room_for_vm(live, starting, pools.waiting()).is_err()) {
            displaced = pools.take_to_make_room(keep);
        }
        if let Err(full) = self.room_for_vm(live, starting, pools.waiting()) {
            // Over the limit even so (it was lowered under adopted sandboxes): the
            // waiting sandbox stays, rather than being stopped under these locks.
            if let Some(d) = displaced {
                pools.put_back(d);
            }
            return Err(full);
        }
        Ok(displaced)
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
