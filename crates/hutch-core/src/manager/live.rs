//! A sandbox the manager knows, as every lookup finds it: what never changes (its row
//! as created) and the handle to its owner, which holds the rest.

use super::{owner, state};
use crate::sandbox::Sandbox;
use crate::store::{SandboxRow, Store};
use std::path::Path;
use std::sync::Arc;

/// A sandbox the manager knows: running (a VM and an agent) or paused (files only).
/// Its VM and lifecycle state belong to its owner task (`owner.rs`), which runs pause,
/// resume, snapshot and kill one at a time, each to its end.
pub(super) struct Live {
    /// What does not change while it lives (its state, QEMU and end are its owner's).
    pub row: SandboxRow,
    /// Shared by the entries it has had: the one made when it was admitted, and the
    /// one with its row once created.
    pub owner: Arc<owner::Owner>,
}

impl Live {
    /// A sandbox being created (`create.rs`): no VM yet, and hidden from clients.
    pub(super) fn creating(row: SandboxRow, store: &Store) -> Arc<Live> {
        Self::owned(row, state::SandboxState::Creating, None, store)
    }

    pub(super) fn running(row: SandboxRow, sandbox: Sandbox, store: &Store) -> Arc<Live> {
        Self::owned(row, state::SandboxState::Running, Some(sandbox), store)
    }

    pub(super) fn paused(row: SandboxRow, store: &Store) -> Arc<Live> {
        Self::owned(row, state::SandboxState::Paused, None, store)
    }

    pub(super) fn owned(row: SandboxRow, state: state::SandboxState, sandbox: Option<Sandbox>, store: &Store) -> Arc<Live> {
        let record = owner::Record { store: store.clone(), id: row.id.clone() };
        let owner = owner::Owner::spawn(state, sandbox, row.end_at, record);
        Arc::new(Live { row, owner: Arc::new(owner) })
    }

    /// Whether it runs a VM the reaper looks after (ended VMs, expiry, full disks).
    pub(super) fn is_running(&self) -> bool {
        use state::SandboxState::*;
        matches!(self.owner.state(), Running | Pausing | Snapshotting)
    }

    /// Whether it is still being created: no client has been told its id, so no
    /// lookup finds it.
    pub(super) fn is_creating(&self) -> bool {
        self.owner.state() == state::SandboxState::Creating
    }

    /// Whether it may hold a VM: what the server's limit and the running quota count.
    /// One being created will; a failed sandbox's VM may still run (a wedged guest)
    /// until it is killed, and one being killed holds its VM until it is gone.
    pub(super) fn holds_vm(&self) -> bool {
        use state::SandboxState::*;
        self.is_running() || matches!(self.owner.state(), Creating | Failed | Stopping)
    }

    /// Whether it is paused (its files hold it; no VM): what the paused quota counts.
    pub(super) fn is_paused(&self) -> bool {
        matches!(self.owner.state(), state::SandboxState::Paused | state::SandboxState::Resuming)
    }

    /// Its record as clients see it: the state, failure, QEMU and end are its owner's.
    pub(super) fn row(&self) -> SandboxRow {
        let mut row = self.row.clone();
        row.state = self.owner.state().api_name().to_string();
        row.failure = self.owner.failure();
        row.qemu_pid = self.owner.pid();
        row.end_at = self.owner.end_at();
        row.pause_mode = if self.owner.state() == state::SandboxState::Paused { crate::sandbox::layout::paused_mode(Path::new(&row.dir)) } else { None };
        row
    }
}
