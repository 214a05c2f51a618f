//! Pause and resume (E2B semantics): a paused sandbox keeps its memory, processes and
//! files on disk under its directory (or, paused filesystem-only, its files alone),
//! holds no VM, and survives server restarts; a connect (or resume) brings it back under
//! the same id, restoring its memory or booting on its disk.

use super::owner::Owned;
use super::state::SandboxState;
use super::error::ManagerError;
use super::live::Live;
use super::pause_kinds::{Connected, OnResume, PausedBy};
use super::SandboxManager;
use crate::sandbox::layout::{paused_mode, PauseMode};
use crate::sandbox::Sandbox;
use crate::store::SandboxRow;
use crate::time::Timestamp;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

fn is_paused_dir(dir: &Path) -> bool {
    paused_mode(dir).is_some()
}

impl SandboxManager {
    /// At start: takes over what earlier server runs left. A sandbox whose VM still
    /// runs is adopted with its processes (its QEMU outlived that server); a paused one
    /// is kept and resumes on connect. Whatever an operation cut short by a crash left
    /// is settled one way: a finished pause whose record was not updated is paused, a
    /// resume that ran its guest is running, one that never ran it is still paused.
    /// The rest (a VM that ended, a record without files) is removed, each logged.
    pub(super) async fn adopt_earlier(&self) -> Result<(), ManagerError> {
        let mut kept = std::collections::HashSet::new();
        for row in self.store.sandbox_records().await? {
            let row = match row {
                Ok(row) => row,
                Err(e) => {
                    // Neither adopted nor removed: its files and VM are left as they are
                    // for the operator, and every other sandbox is served.
                    tracing::error!("a sandbox's record cannot be read, so it is left alone: {}", hutch_proto::error_chain(&e));
                    if let crate::store::StoreError::BadTime { id, .. } = &e {
                        kept.insert(self.home.sandboxes().join(id).display().to_string());
                    }
                    continue;
                }
            };
            let dir = Path::new(&row.dir).to_path_buf();
            let was_paused = row.state == SandboxState::Paused.api_name();
            let (live, moved) = match Sandbox::adopt(&dir, self.backend.as_ref(), row.envd_token.as_deref(), !was_paused, &self.config.net_env).await {
                Ok(sandbox) => {
                    tracing::info!(sandbox = %row.id, "running sandbox from an earlier server run: adopted, its VM and processes ran on");
                    (Live::running(row, sandbox, &self.store), true)
                }
                Err(e) if is_paused_dir(&dir) => {
                    // Paused means no VM: one started by a resume the earlier server
                    // did not finish (its pid perhaps never written) goes now.
                    crate::sweep::kill_qemu(&dir);
                    if !was_paused {
                        // Its pause finished but the store did not hear of it.
                        tracing::info!(sandbox = %row.id, "its pause finished as the earlier server stopped ({e}); paused");
                    } else {
                        tracing::info!(sandbox = %row.id, "paused sandbox from an earlier server run: kept, resumes on connect");
                    }
                    (Live::paused(row, &self.store), !was_paused)
                }
                Err(e) => {
                    tracing::warn!(sandbox = %row.id, state = %row.state, "sandbox from an earlier server run cannot be taken over ({e}); removing its record and files");
                    crate::sweep::kill_qemu(&dir);
                    let _ = std::fs::remove_dir_all(&row.dir);
                    self.store.delete_sandbox(&row.id).await?;
                    continue;
                }
            };
            // Its row records where it is now (a new QEMU pid too), in its owner.
            if moved {
                self.in_owner(&live, |_, _, o| Box::pin(async move { Ok(o.persist().await?) })).await?;
            }
            kept.insert(live.row.dir.clone());
            self.live.lock().insert(live.row.id.clone(), live);
        }
        // Paused directories without a record (a crash between the save and the
        // store update) cannot be resumed by anyone: remove them.
        for entry in std::fs::read_dir(self.home.sandboxes()).into_iter().flatten().flatten() {
            let dir = entry.path();
            if is_paused_dir(&dir) && !kept.contains(&dir.display().to_string()) {
                tracing::warn!(dir = %dir.display(), "paused sandbox files without a record; removing them");
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
        Ok(())
    }

    /// E2B's pause: saves the sandbox (its memory too, or only its disk) and stops its VM.
    pub async fn pause(&self, key_id: &str, id: &str, mode: PauseMode) -> Result<(), ManagerError> {
        let live = self.find(key_id, id)?;
        let id = id.to_string();
        self.detached(move |m| async move { m.pause_live(&id, &live, PausedBy::Client, mode).await }).await
    }

    /// Pauses in the sandbox's owner: to its end, whoever waits for it.
    pub(super) async fn pause_live(&self, id: &str, live: &Arc<Live>, by: PausedBy, mode: PauseMode) -> Result<(), ManagerError> {
        tracing::info!(sandbox = %id, "pausing ({by:?}, {mode:?})");
        let owned_id = id.to_string();
        let paused = self.in_owner(live, move |m, live, o| Box::pin(async move { m.pause_owned(&owned_id, &live, o, by, mode).await })).await;
        // Said here too: a client that hung up never reads the answer.
        if let Err(e) = &paused {
            tracing::info!(sandbox = %id, "not paused: {}", hutch_proto::error_chain(e));
        }
        paused?;
        // Its VM's slot is free: the pools may fill it (they give it back to creates).
        self.fill_pools();
        Ok(())
    }

    async fn pause_owned(&self, id: &str, live: &Live, o: &mut Owned, by: PausedBy, mode: PauseMode) -> Result<(), ManagerError> {
        let Some(memory_mib) = o.sandbox().map(Sandbox::memory_mib) else {
            return Err(match o.state() {
                SandboxState::Paused => ManagerError::AlreadyPaused(id.to_string()),
                from => super::state::TransitionError { from, to: SandboxState::Pausing }.into(),
            });
        };
        if by == PausedBy::Client {
            self.quota_paused(&live.row.key_id)?;
        }
        if mode == PauseMode::Full {
            self.room_for_memory(memory_mib)?;
        }
        // New data-plane requests see "paused" from here on (no agent is published).
        let mut o = o.begin(SandboxState::Pausing)?;
        let Some(sandbox) = o.sandbox_mut() else { return Err(ManagerError::Internal("the paused sandbox has no VM".into())) };
        if let Err(e) = sandbox.pause(mode).await {
            // Refused or failed before the VM stopped for good: it runs on, with its
            // session back, unless the VM or its agent no longer answers.
            o.settle_after_failure().await?;
            return Err(ManagerError::Pause(e));
        }
        // Dropping a paused Sandbox keeps its directory.
        o.take_sandbox();
        o.settle(SandboxState::Paused).await?;
        Ok(())
    }

    /// E2B's connect: resumes a paused sandbox; extends the timeout (never shortens
    /// it) to `secs` from now.
    pub async fn connect(&self, key_id: &str, id: &str, secs: Option<u64>, on_resume: OnResume) -> Result<(SandboxRow, Connected), ManagerError> {
        let (key_id, id) = (key_id.to_string(), id.to_string());
        self.detached(move |m| async move { m.connect_now(&key_id, &id, secs, on_resume).await }).await
    }

    async fn connect_now(&self, key_id: &str, id: &str, secs: Option<u64>, on_resume: OnResume) -> Result<(SandboxRow, Connected), ManagerError> {
        let live = self.find(key_id, id)?;
        let how = {
            let id = id.to_string();
            self.in_owner(&live, move |m, live, o| Box::pin(async move { m.resume_owned(&id, &live, o, secs, on_resume).await })).await?
        };
        let row = live.row();
        let Some(secs) = secs else { return Ok((row, how)) };
        let wanted = Timestamp::now().after(Duration::from_secs(secs));
        if wanted > row.end_at {
            return Ok((self.set_timeout(key_id, id, secs).await?, how));
        }
        Ok((row, how))
    }

    async fn resume_owned(&self, id: &str, live: &Live, o: &mut Owned, secs: Option<u64>, on_resume: OnResume) -> Result<Connected, ManagerError> {
        match o.state() {
            SandboxState::Running => return Ok(Connected::AlreadyRunning),
            SandboxState::Failed => return Err(ManagerError::Failed { id: id.to_string(), why: live.owner.failure().unwrap_or_default() }),
            _ => {}
        }
        // Only a paused sandbox resumes: a failed or killed one says so (409).
        if !o.state().can_become(SandboxState::Resuming) {
            return Err(super::state::TransitionError { from: o.state(), to: SandboxState::Resuming }.into());
        }
        let row = &live.row;
        let _reserved = self.reserve_resume_slot(&row.key_id).await?;
        let mut opts = self.options(&row.template, &row.env_vars, &row.metadata, row.envd_token.clone());
        // A reboot keeps the sandbox's own size, whatever the server's (or the
        // template's current build's) is now.
        if let Some(mib) = u32::try_from(row.memory_mb).ok().and_then(|m| crate::MemMib::new(m).ok()) {
            opts.memory = mib;
        }
        if let Some(cpus) = u32::try_from(row.cpu_count).ok().filter(|c| *c > 0) {
            opts.cpus = cpus;
        }
        let dir = Path::new(&row.dir);
        let boot = on_resume == OnResume::Reboot || paused_mode(dir) == Some(PauseMode::Filesystem);
        // Prepared before the state moves: a template that cannot be had leaves it paused.
        let artifacts = match boot {
            true => {
                let template = match crate::snapshot::descends_from(dir) {
                    Some(template) => template,
                    None => self.base_template(&row.key_id, &row.template).await?,
                };
                Some(self.prepare(&template).await?)
            }
            false => None,
        };
        let mut o = o.begin(SandboxState::Resuming)?;
        let resumed = match &artifacts {
            Some(artifacts) => Sandbox::reboot(dir, artifacts, self.backend.as_ref(), &opts).await,
            None => Sandbox::resume(dir, self.backend.as_ref(), &opts).await,
        };
        let sandbox = match resumed {
            Ok(sandbox) => sandbox,
            Err(e @ crate::sandbox::errors::CreateError::RanThenFailed(_)) => {
                tracing::warn!(sandbox = %id, "{}", hutch_proto::error_chain(&e));
                o.fail("its guest stopped answering right after it was resumed, so its saved state no longer matches its disk and it cannot be resumed again".into())?;
                // Seen, and killable, for a while: a paused sandbox's end is often past,
                // and the reaper would otherwise remove it before anyone saw why.
                if let Err(store) = o.set_end_at(Timestamp::now().after(self.config.default_timeout)).await {
                    tracing::warn!(sandbox = %id, "recording the failed sandbox's new end: {store}");
                }
                return Err(ManagerError::Resume(e));
            }
            Err(e) => {
                // Its saved state is still on disk (a resume removes it only once the VM
                // runs; a failed boot leaves the disk to boot again): paused, as before
                // (the guard moves it back).
                return Err(ManagerError::Resume(e));
            }
        };
        let timeout = Duration::from_secs(secs.unwrap_or(self.config.default_timeout.as_secs()));
        let end_at = self.end_at(row.started_at, timeout).max(Timestamp::now().after(Duration::from_secs(1)));
        // The VM runs and its saved state is gone: it is running whatever the store says,
        // and dropping it now would lose it.
        o.put_sandbox(sandbox);
        match o.settle_until(SandboxState::Running, end_at).await {
            Ok(_) => {}
            Err(ManagerError::Store(e)) => tracing::error!(sandbox = %id, "the sandbox was resumed, but its record still says paused: {e}"),
            Err(e) => return Err(e),
        }
        Ok(Connected::Resumed)
    }
}
