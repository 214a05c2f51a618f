//! Start slots: VMs being started that the manager's map does not count yet (pool
//! fills, resumes, a pooled VM being stopped), counted against the server's limit and,
//! for a key's resume, against that key's running quota. A sandbox being created is in
//! the map (`Creating`) and needs none.

use parking_lot::Mutex;
use std::collections::HashMap;

#[derive(Default)]
pub(super) struct Starting {
    total: usize,
    by_key: HashMap<String, usize>,
}

impl Starting {
    /// VMs starting for anyone.
    pub fn total(&self) -> usize {
        self.total
    }

    /// VMs starting for `key` (its resumes).
    pub fn of_key(&self, key: &str) -> usize {
        self.by_key.get(key).copied().unwrap_or(0)
    }

    fn give_back(&mut self, key: Option<&str>) {
        self.total -= 1;
        if let Some(key) = key {
            if let Some(n) = self.by_key.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    self.by_key.remove(key);
                }
            }
        }
    }
}

/// A slot taken (`Starting::take`), given back when this drops.
pub(super) struct SlotGuard<'a> {
    starting: &'a Mutex<Starting>,
    key: Option<String>,
}

impl<'a> SlotGuard<'a> {
    /// Counts one more in `held` (the locked `starting`, in which the caller checked
    /// the limits), for `key` if a key's: the one way a slot is taken, so every slot
    /// is given back exactly once.
    pub fn take(starting: &'a Mutex<Starting>, held: &mut Starting, key: Option<&str>) -> SlotGuard<'a> {
        held.total += 1;
        if let Some(key) = key {
            *held.by_key.entry(key.to_string()).or_default() += 1;
        }
        SlotGuard { starting, key: key.map(str::to_string) }
    }
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        self.starting.lock().give_back(self.key.as_deref());
    }
}
