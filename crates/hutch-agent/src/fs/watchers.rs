//! The polled watchers (CreateWatcher / GetWatcherEvents / RemoveWatcher) by id: each a
//! buffer of events its watch task fills until the client takes them or removes it.

use hutch_proto::filesystem::FilesystemEvent;
use std::collections::HashMap;
use parking_lot::{Mutex, MutexGuard};
use std::sync::Arc;
use tokio::task::JoinHandle;

pub struct Polled {
    pub events: Arc<Mutex<Vec<FilesystemEvent>>>,
    pub task: JoinHandle<()>,
}

#[derive(Default, Clone)]
pub struct Watchers {
    polled: Arc<Mutex<HashMap<String, Polled>>>,
}

impl Watchers {
    fn polled(&self) -> MutexGuard<'_, HashMap<String, Polled>> {
        // A panic while holding the map leaves it consistent (every write is one insert
        // or remove), so a poisoned lock is still good to use.
        self.polled.lock()
    }

    pub fn add(&self, id: String, watcher: Polled) {
        self.polled().insert(id, watcher);
    }

    /// The events buffered since the last call; None if no watcher has this id.
    pub fn take_events(&self, id: &str) -> Option<Vec<FilesystemEvent>> {
        let events = self.polled().get(id)?.events.clone();
        let taken = std::mem::take(&mut *events.lock());
        Some(taken)
    }

    /// Stops and forgets the watcher; false if no watcher has this id.
    pub fn remove(&self, id: &str) -> bool {
        match self.polled().remove(id) {
            Some(w) => {
                w.task.abort();
                true
            }
            None => false,
        }
    }
}
