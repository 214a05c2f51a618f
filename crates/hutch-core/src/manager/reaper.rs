//! The reaper: every half second it ends expired sandboxes (pausing those that asked
//! for it), removes those whose VM ended on its own, and every 2 s resumes VMs QEMU
//! paused on a full host disk once there is room.

use super::error::ManagerError;
use super::live::Live;
use super::pause_kinds::PausedBy;
use super::{Removal, SandboxManager};
use crate::sandbox::errors::PauseError;
use crate::sandbox::layout::PauseMode;
use crate::time::Timestamp;
use std::sync::Arc;
use std::time::Duration;

impl SandboxManager {
    /// Starts this manager's reaper; it ends when the manager does or shuts down.
    pub(super) fn start_reaper(self: &Arc<Self>) {
        let reaper = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = 0u64;
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let Some(m) = reaper.upgrade() else { return };
                // Shutdown lets sandboxes go for the next server: nothing may end them now.
                if m.shutting_down() {
                    return;
                }
                m.kill_expired().await;
                m.remove_ended().await;
                // Every 2 s: a QMP round trip per sandbox.
                tick = (tick + 1) % 4;
                if tick == 0 {
                    m.resume_disk_full().await;
                }
            }
        });
    }

    /// The running sandboxes, taken out of the map's lock so each can be locked alone.
    fn running_lives(&self) -> Vec<(String, Arc<Live>)> {
        self.live.lock().iter().filter(|(_, l)| l.is_running()).map(|(id, l)| (id.clone(), l.clone())).collect()
    }

    /// Removes running sandboxes whose VM ended on its own (a guest kernel panic or
    /// power-off, QEMU killed from outside), so the API stops calling them running.
    /// A sandbox whose lock is held is mid-operation (a pause stops its VM on purpose)
    /// and is looked at next time.
    async fn remove_ended(&self) {
        for (id, live) in self.running_lives() {
            if live.owner.is_busy() {
                continue;
            }
            let ended = live.owner.run(|o: &mut super::owner::Owned| -> futures::future::BoxFuture<'_, Option<(String, String)>> {
                Box::pin(async move {
                    let sandbox = o.sandbox_mut()?;
                    let ended = sandbox.vm_ended().map(|status| (status, sandbox.console_tail(5)))?;
                    let _ = o.fail(format!("its VM ended ({})", ended.0));
                    Some(ended)
                })
            });
            let Ok(Some((status, console))) = ended.await else { continue };
            tracing::warn!(sandbox = %id, "the VM ended on its own ({status}); removing the sandbox. Last console lines:\n{console}");
            if let Err(e) = self.remove(&id, &live).await {
                tracing::warn!(sandbox = %id, "removing a sandbox whose VM ended: {e}");
            }
        }
    }

    /// Resumes VMs QEMU paused on a full host disk once there is room again: a full
    /// disk pauses every writing tenant at once, and nothing else would wake them.
    async fn resume_disk_full(&self) {
        for (id, live) in self.running_lives() {
            if live.owner.is_busy() {
                continue;
            }
            let resumed = live.owner.run(|o: &mut super::owner::Owned| -> futures::future::BoxFuture<'_, bool> {
                Box::pin(async move {
                    match o.sandbox_mut() {
                        Some(sandbox) => sandbox.resume_after_io_error().await,
                        None => false,
                    }
                })
            });
            if resumed.await.unwrap_or(false) {
                tracing::warn!(sandbox = %id, "resumed the VM QEMU had paused when the host's disk was full (it is no longer)");
            }
        }
    }

    /// Running sandboxes past their end: paused when they asked for it, else killed.
    /// Paused sandboxes do not expire.
    pub(super) async fn kill_expired(&self) {
        let now = Timestamp::now();
        let expired: Vec<(String, Arc<Live>)> = self.live.lock()
            .iter()
            .filter(|(_, l)| l.holds_vm() && !l.is_creating() && l.owner.end_at() <= now)
            .map(|(id, l)| (id.clone(), l.clone()))
            .collect();
        for (id, live) in expired {
            if live.row.auto_pause && live.is_running() {
                tracing::info!(sandbox = %id, "timeout reached; pausing the sandbox (autoPause)");
                let mode = if live.row.auto_pause_memory { PauseMode::Full } else { PauseMode::Filesystem };
                let mut paused = self.pause_live(&id, &live, PausedBy::AutoPause, mode).await;
                if let Err(ManagerError::Pause(PauseError::Sync(why))) = &paused {
                    // Its files are what the user asked to keep: with its memory, then.
                    tracing::warn!(sandbox = %id, "the guest did not write its files out for a pause without memory ({why}); pausing with its memory");
                    paused = self.pause_live(&id, &live, PausedBy::AutoPause, PauseMode::Full).await;
                }
                match paused {
                    // A client's pause got there first: paused is what was asked.
                    Ok(()) | Err(ManagerError::AlreadyPaused(_)) => continue,
                    Err(ManagerError::NoSpace(e)) => {
                        // Killing it would lose what autoPause is for: keep it a minute, try again.
                        tracing::warn!(sandbox = %id, "cannot pause the expired sandbox yet: {e}");
                        let later = Timestamp::now().after(Duration::from_secs(60));
                        let extended = self.in_owner(&live, move |_, _, o| Box::pin(async move { Ok(o.set_end_at(later).await?) }));
                        if let Err(e) = extended.await {
                            tracing::warn!(sandbox = %id, "keeping the expired sandbox a minute longer: {e}");
                        }
                        continue;
                    }
                    Err(e) => tracing::warn!(sandbox = %id, "pausing an expired sandbox failed, killing it: {e}"),
                }
            } else {
                tracing::info!(sandbox = %id, "timeout reached; killing the sandbox");
            }
            if let Err(e) = self.remove_if(&id, &live, Removal::Expired).await {
                tracing::warn!(sandbox = %id, "removing an expired sandbox: {e}");
            }
        }
    }
}
