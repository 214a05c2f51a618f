//! One sandbox: its directory, overlay disk, VM and agent session.
//!
//! Creation is all-or-nothing: a failure at any step kills the VM and removes the
//! directory. A `Sandbox` dropped without `destroy` (a panic, an early return) still
//! kills its VM and removes its directory.

pub mod boot;
pub mod errors;
pub mod layout;
mod start;

use self::boot::{connect_restored, connect_serving, init_guest, init_with_retry, start_net, start_vm, wait_for_port, SandboxOptions};
use self::errors::{AdoptError, CreateError, PauseError};
use self::layout::{console_tail, guest_nic, read_record, remove_sandbox_dir, write_record, DirGuard, PauseMode, VmRecord, PAUSED_DISK, PAUSED_STATE, SAVING_STATE, SERVER_OWNED};
use hutch_envd::AgentClient;
use crate::artifacts::Artifacts;
use crate::ids::{MemMib, SandboxId};
use crate::snapshot::{MemorySnapshot, SaveError};
use hutch_image::HutchHome;
use hutch_vmm::{Incoming, Memory, PauseSave, SnapshotError, VmBackend, VmHandle, VmSpec};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};


/// How a sandbox came to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartKind {
    /// The guest kernel booted.
    Cold,
    /// Restored from a memory snapshot (a template's, or a sandbox's for a fork).
    Snapshot,
    /// Resumed after a pause.
    Resumed,
    /// Taken over, running, from an earlier server.
    Adopted,
}

/// `opts` with the inspection CA saved in the sandbox's directory `dir`: a resumed or
/// rebooted guest is told the CA its stack inspects with (none if it has none).
fn with_saved_ca(dir: &Path, opts: &SandboxOptions) -> Result<SandboxOptions, CreateError> {
    let ca = hutch_net::inspect::SandboxCa::load(dir).map_err(CreateError::Inspection)?;
    Ok(SandboxOptions { inspect_ca: ca.map(std::sync::Arc::new), ..opts.clone() })
}

pub struct Sandbox {
    id: SandboxId,
    dir: PathBuf,
    vm: Option<Box<dyn VmHandle>>,
    agent: AgentClient,
    boot_time: Duration,
    record: VmRecord,
    /// The sandbox's network stack while its VM runs with a NIC.
    net: Option<hutch_net::NetHandle>,
    started: StartKind,
    /// Paused: the directory holds the sandbox's state and must outlive this value.
    keep_dir: bool,
}

impl Sandbox {
    /// A new sandbox that boots the guest kernel on an overlay of `disk` (a template
    /// image, or a filesystem snapshot's disk in `snapshot_dir`).
    pub async fn boot_on(
        home: &HutchHome,
        artifacts: &Artifacts,
        backend: &dyn VmBackend,
        opts: &SandboxOptions,
        disk: &Path,
        snapshot_dir: Option<PathBuf>,
    ) -> Result<Sandbox, CreateError> {
        let launch = Launch { seed: None, base: disk, memory: Memory::Anonymous, incoming: None, base_snapshot: snapshot_dir, kind: StartKind::Cold };
        Self::launch(home, artifacts, backend, opts, launch).await
    }

    /// A new sandbox restored from `snapshot`: its processes, memory and files as they
    /// were when it was taken, with this sandbox's own identity.
    pub async fn from_snapshot(
        home: &HutchHome,
        artifacts: &Artifacts,
        backend: &dyn VmBackend,
        snapshot: &MemorySnapshot,
        opts: &SandboxOptions,
    ) -> Result<Sandbox, CreateError> {
        let (memory, incoming) = snapshot.restore_memory();
        let opts = SandboxOptions { cpus: snapshot.manifest.cpus, memory: MemMib::new(snapshot.manifest.memory_mib).unwrap_or(opts.memory), accel: snapshot.manifest.accel, ..opts.clone() };
        let disk = snapshot.disk();
        let launch = Launch {
            seed: Some(snapshot),
            base: &disk,
            memory,
            incoming: Some(incoming),
            base_snapshot: Some(snapshot.dir.clone()),
            kind: StartKind::Snapshot,
        };
        Self::launch(home, artifacts, backend, &opts, launch).await
    }

    async fn launch(home: &HutchHome, artifacts: &Artifacts, backend: &dyn VmBackend, opts: &SandboxOptions, launch: Launch<'_>) -> Result<Sandbox, CreateError> {
        let started = Instant::now();
        let id = opts.id.clone().unwrap_or_else(SandboxId::generate);
        let dir = home.sandboxes().join(id.as_str());
        // Its own directory, never one that exists (an id given twice): the guard
        // below removes only what this call made.
        std::fs::create_dir_all(home.sandboxes()).and_then(|()| std::fs::create_dir(&dir)).map_err(|e| CreateError::Dir(dir.clone(), e))?;
        let guard = DirGuard(Some(dir.clone()));
        std::fs::write(dir.join("owner.pid"), std::process::id().to_string()).map_err(|e| CreateError::Dir(dir.clone(), e))?;
        let disk = dir.join("disk.qcow2");
        match launch.seed {
            Some(snapshot) => snapshot.new_overlay(&disk).await,
            None => hutch_vmm::disk::create_overlay(launch.base, &disk).await,
        }
        .map_err(CreateError::Disk)?;
        let overlaid = started.elapsed();
        if let Some(snapshot) = launch.seed {
            snapshot.seed_console(&dir.join("console.log"));
        }
        let spec = VmSpec {
            id: id.to_string(),
            dir: dir.clone(),
            kernel: artifacts.kernel.vmlinuz(),
            initrd: artifacts.initramfs.clone(),
            disk,
            base: Some(launch.base.to_path_buf()),
            cpus: opts.cpus,
            memory_mib: opts.memory.get(),
            accel: opts.accel,
            memory: launch.memory,
            incoming: launch.incoming,
            die_with_parent: opts.die_with_parent,
            agent_channel: hutch_proto::AGENT_PORT_NAME.into(),
            // A restored guest has a NIC only if its snapshot's VM had one.
            nic: launch.seed.is_none_or(|s| s.manifest.nic).then(guest_nic),
        };
        if let Some(ca) = &opts.inspect_ca {
            ca.save(&dir).map_err(CreateError::Inspection)?;
        }
        let record = VmRecord { spec, base_snapshot: launch.base_snapshot, network: opts.network.clone() };
        let (mut vm, agent, net) = start_vm(backend, &record.spec, &record.network, opts, started).await?;
        let connected = started.elapsed();
        // A restored guest's agent holds the token of the sandbox it was saved from.
        let held = launch.seed.and_then(|s| s.manifest.guest_token.as_deref());
        let agent = init_with_retry(vm.as_mut(), agent, id.as_str(), opts, record.spec.incoming.is_some(), held).await?;
        let initialized = started.elapsed();
        if launch.kind == StartKind::Cold {
            if let Some(port) = artifacts.template.ready_port() {
                wait_for_port(&agent, port, opts.boot_timeout, started, &dir).await?;
            }
        }
        write_record(&dir, &record)?;
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        tracing::debug!(
            "started sandbox {id} ({:?}) in {:.1} ms: directory and overlay {:.1}, VM up and agent connected {:.1}, /init {:.1}, the rest {:.1}",
            launch.kind,
            ms(started.elapsed()),
            ms(overlaid),
            ms(connected - overlaid),
            ms(initialized - connected),
            ms(started.elapsed() - initialized)
        );
        let mut guard = guard;
        guard.0 = None;
        Ok(Sandbox { id, dir, vm: Some(vm), agent, boot_time: started.elapsed(), record, net, started: launch.kind, keep_dir: false })
    }

    /// Brings back a paused sandbox from its directory: same id, memory, processes
    /// and files. On failure the directory is left as it was, still paused.
    pub async fn resume(dir: &Path, backend: &dyn VmBackend, opts: &SandboxOptions) -> Result<Sandbox, CreateError> {
        let started = Instant::now();
        let (mut record, id) = read_record(dir).map_err(CreateError::Record)?;
        let opts = &with_saved_ca(dir, opts)?;
        let state = dir.join(PAUSED_STATE);
        // A state of changed pages is loaded over the snapshot's memory file the guest
        // mapped when paused (its record still names it); a whole one into plain RAM.
        let changes = hutch_vmm::saved_state::needs_memory_file(&state, record.spec.ram_bytes()).map_err(|source| CreateError::Restore(SnapshotError::StateFile { path: state.display().to_string(), source }))?;
        if !changes {
            record.spec.memory = Memory::Anonymous;
        }
        record.spec.incoming = Some(Incoming { state, ignore_shared: false });
        record.spec.die_with_parent = opts.die_with_parent;
        std::fs::write(dir.join("owner.pid"), std::process::id().to_string()).map_err(|e| CreateError::Dir(dir.to_path_buf(), e))?;
        let mut vm = backend.start(&record.spec).await.map_err(CreateError::Start)?;
        let spawned = started.elapsed();
        vm.load().await.map_err(CreateError::Restore)?;
        let loaded = started.elapsed();
        if let Err(e) = vm.resume().await {
            // `cont` failed, or only its answer was lost: a guest QEMU still holds
            // stopped never ran, and its saved state is still the truth.
            let stopped = matches!(vm.run_state().await.as_deref(), Ok("paused" | "inmigrate" | "prelaunch" | "postmigrate" | "finish-migrate") | Err(_));
            if stopped {
                return Err(CreateError::Restore(e));
            }
            let _ = std::fs::remove_file(dir.join(PAUSED_STATE));
            return Err(CreateError::RanThenFailed(Box::new(CreateError::Restore(e))));
        }
        // The guest runs from here: its disk moves on from the saved state, so a
        // failure now cannot fall back to paused (loading that state again over the
        // changed disk would corrupt its filesystem).
        let ran = async {
            let agent = connect_restored(vm.as_mut(), opts.boot_timeout, started).await?;
            let connected = started.elapsed();
            // The paused guest holds its own token, the one the host gives it again.
            let agent = init_with_retry(vm.as_mut(), agent, id.as_str(), opts, true, opts.access_token.as_deref()).await?;
            let initialized = started.elapsed();
            let net = start_net(&record.spec, &record.network, &opts.net_env, opts.inspect_ca.as_ref()).await?;
            record.spec.incoming = None;
            write_record(dir, &record)?;
            let ms = |d: Duration| d.as_secs_f64() * 1000.0;
            tracing::debug!(
                "resumed sandbox {id} in {:.1} ms: QEMU started {:.1}, state loaded {:.1}, agent connected {:.1}, /init {:.1}, network and record {:.1}",
                ms(started.elapsed()),
                ms(spawned),
                ms(loaded - spawned),
                ms(connected - loaded),
                ms(initialized - connected),
                ms(started.elapsed() - initialized)
            );
            Ok((agent, net))
        }
        .await;
        let _ = std::fs::remove_file(dir.join(PAUSED_STATE));
        let (agent, net) = ran.map_err(|e| CreateError::RanThenFailed(Box::new(e)))?;
        // A reboot cut short between marking the disk and dropping the state leaves both.
        let _ = std::fs::remove_file(dir.join(PAUSED_DISK));
        Ok(Sandbox { id, dir: dir.to_path_buf(), vm: Some(vm), agent, boot_time: started.elapsed(), record, net, started: StartKind::Resumed, keep_dir: false })
    }

    /// Takes over the sandbox an earlier server left running in `dir`: the VM runs on
    /// with its processes, and this process answers for it from now on. A guest that
    /// server stopped for a save it never finished (a pause or snapshot cut short) runs
    /// again when `resume_stopped`; otherwise (a resume cut short: the paused files are
    /// the truth) such a VM is killed and `NeverRan` returned.
    pub async fn adopt(
        dir: &Path,
        backend: &dyn VmBackend,
        access_token: Option<&str>,
        resume_stopped: bool,
        net_env: &std::sync::Arc<hutch_net::Environment>,
    ) -> Result<Sandbox, AdoptError> {
        let started = Instant::now();
        let (mut record, id) = read_record(dir).map_err(AdoptError::Record)?;
        let pid = std::fs::read_to_string(dir.join("qemu.pid")).ok().and_then(|p| p.trim().parse().ok()).ok_or(AdoptError::NoPid)?;
        let mut vm = backend.adopt(&record.spec, pid).await?;
        let state = vm.run_state().await.map_err(AdoptError::State)?;
        // A boot on the disk of a paused sandbox, cut short (the store still says paused,
        // and only the disk is kept): the guest may not have had its identity and token
        // yet, so it goes, and the sandbox stays paused to boot again.
        if !resume_stopped && dir.join(PAUSED_DISK).exists() && !dir.join(PAUSED_STATE).exists() {
            return Err(AdoptError::NeverRan { state: format!("{state}, booting on its disk") });
        }
        match state.as_str() {
            "running" | "io-error" => {}
            // Stopped by a save (`paused`, then `postmigrate` once written).
            "paused" | "postmigrate" | "finish-migrate" if resume_stopped => {
                vm.resume().await.map_err(AdoptError::Resume)?;
                // The guest runs on from here and its disk moves: a saved state is stale
                // at once, and must not be kept for a resume if the adoption fails below
                // (its memory over the changed disk would corrupt the guest's files).
                for stale in [PAUSED_STATE, SAVING_STATE, PAUSED_DISK] {
                    let _ = std::fs::remove_file(dir.join(stale));
                }
            }
            _ => return Err(AdoptError::NeverRan { state }),
        }
        std::fs::write(dir.join("owner.pid"), std::process::id().to_string()).map_err(|e| AdoptError::Agent(CreateError::Dir(dir.to_path_buf(), e)))?;
        let agent = connect_serving(vm.as_mut(), id.as_str(), ADOPT_AGENT_WAIT, started).await.map_err(AdoptError::Agent)?;
        // The dead server's stack went with it (its flows reset in the guest); QEMU
        // listens again for this one's.
        let net = start_net(&record.spec, &record.network, net_env, None).await.map_err(AdoptError::Agent)?;
        // It runs: whatever a cut-short pause or resume left is stale.
        for stale in [PAUSED_STATE, SAVING_STATE, PAUSED_DISK] {
            let _ = std::fs::remove_file(dir.join(stale));
        }
        if record.spec.incoming.take().is_some() {
            write_record(dir, &record).map_err(AdoptError::Record)?;
        }
        let agent = agent.with_token(access_token);
        Ok(Sandbox { id, dir: dir.to_path_buf(), vm: Some(vm), agent, boot_time: started.elapsed(), record, net, started: StartKind::Adopted, keep_dir: false })
    }

    /// Lets go of the sandbox and leaves its VM running (a server shutting down): the
    /// next server adopts it.
    pub fn release(mut self) {
        self.keep_dir = true;
        if let Some(vm) = self.vm.take() {
            vm.release();
        }
    }

    /// Marks the sandbox as a server's (see `SERVER_OWNED`).
    pub fn mark_server_owned(&self) -> std::io::Result<()> {
        std::fs::write(self.dir.join(SERVER_OWNED), b"")
    }

    /// Saves memory and disk (or, `Filesystem`, the disk alone) under the sandbox's
    /// directory and stops the VM. After success the sandbox keeps its directory (see
    /// `resume` and `reboot`); after a failure it runs on.
    pub async fn pause(&mut self, mode: PauseMode) -> Result<(), PauseError> {
        if mode == PauseMode::Filesystem {
            return self.pause_disk_only().await;
        }
        let Some(vm) = self.vm.as_mut() else { return Err(PauseError::NotRunning) };
        let started = Instant::now();
        flush_guest(&self.agent).await;
        let synced = started.elapsed();
        if let Err(e) = crate::snapshot::release_agent(&self.agent, &vm.agent_socket(), RELEASE_WAIT).await {
            // Nothing was saved: the sandbox runs on, with a session again.
            self.reattach().await;
            return Err(e.into());
        }
        let Some(vm) = self.vm.as_mut() else { return Err(PauseError::NotRunning) };
        let released = started.elapsed();
        let saving = self.dir.join(SAVING_STATE);
        let saved = vm.save_for_pause(&saving).await.map_err(SaveError::Vm);
        let written = started.elapsed();
        let kept = match &saved {
            Ok(PauseSave::Changes { pages, page_size }) => format!("{:.1} MiB changed", (pages * page_size) as f64 / 1048576.0),
            Ok(PauseSave::Whole { why }) => format!("all memory ({why})"),
            Err(_) => String::new(),
        };
        let saved = saved.and_then(|_| std::fs::rename(&saving, self.dir.join(PAUSED_STATE)).map_err(|source| SaveError::File { what: "naming the saved state", path: saving.clone(), source }));
        if let Err(e) = saved {
            let _ = std::fs::remove_file(&saving);
            if let Some(vm) = self.vm.as_mut() {
                // The save stopped the guest; it runs on.
                let _ = vm.resume().await;
            }
            self.reattach().await;
            return Err(PauseError::Save(e));
        }
        self.keep_dir = true;
        // The state is saved whole: the sandbox is paused even if QEMU will not quit
        // (dropping the handle kills it).
        if let Err(e) = vm.stop(Duration::from_secs(5)).await {
            tracing::warn!(sandbox = %self.id, "stopping the paused VM: {e}");
        }
        self.vm = None;
        self.net = None;
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let total = started.elapsed();
        tracing::debug!(
            "paused sandbox {} in {:.1} ms: guest sync {:.1}, agent released {:.1}, state saved {:.1} ({kept}), QEMU quit {:.1}",
            self.id,
            ms(total),
            ms(synced),
            ms(released - synced),
            ms(written - released),
            ms(total - written)
        );
        Ok(())
    }

    /// The filesystem-only pause: the guest writes its page cache out (it must answer:
    /// the disk is all that is kept), the marker goes down, and the VM quits, which
    /// flushes QEMU's own writes. A crash before the quit leaves a running VM beside
    /// the marker; adoption takes the VM and drops the marker.
    async fn pause_disk_only(&mut self) -> Result<(), PauseError> {
        if self.vm.is_none() {
            return Err(PauseError::NotRunning);
        }
        match tokio::time::timeout(SYNC_WAIT, self.agent.post_json("/sync", &serde_json::json!({}))).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(PauseError::Sync(e.to_string())),
            Err(_) => return Err(PauseError::Sync(format!("no answer within {} s", SYNC_WAIT.as_secs()))),
        }
        let marker = self.dir.join(PAUSED_DISK);
        std::fs::write(&marker, b"").map_err(|source| SaveError::File { what: "marking the sandbox paused", path: marker.clone(), source })?;
        self.keep_dir = true;
        if let Some(mut vm) = self.vm.take() {
            if let Err(e) = vm.stop(Duration::from_secs(10)).await {
                tracing::warn!(sandbox = %self.id, "stopping the paused VM: {e}");
            }
        }
        self.net = None;
        Ok(())
    }

    /// Brings back a paused sandbox by booting its guest on its disk: same id, files
    /// and identity, no processes (a filesystem-only pause, or E2B's `memory: false`
    /// resume of any pause). A memory state is dropped first: it stops matching the
    /// disk the moment the guest boots on it. On failure the sandbox is left paused
    /// filesystem-only, and another boot may be tried.
    pub async fn reboot(dir: &Path, artifacts: &Artifacts, backend: &dyn VmBackend, opts: &SandboxOptions) -> Result<Sandbox, CreateError> {
        let started = Instant::now();
        let (mut record, id) = read_record(dir).map_err(CreateError::Record)?;
        let opts = &with_saved_ca(dir, opts)?;
        let file = |e| CreateError::Dir(dir.to_path_buf(), e);
        if dir.join(PAUSED_STATE).exists() {
            std::fs::write(dir.join(PAUSED_DISK), b"").map_err(file)?;
            std::fs::remove_file(dir.join(PAUSED_STATE)).map_err(file)?;
        }
        // This server's kernel and agent: the boot is a new one.
        record.spec.kernel = artifacts.kernel.vmlinuz();
        record.spec.initrd = artifacts.initramfs.clone();
        record.spec.memory = Memory::Anonymous;
        record.spec.incoming = None;
        record.spec.die_with_parent = opts.die_with_parent;
        // A new boot: the NIC too, whatever the paused VM had.
        record.spec.nic = Some(guest_nic());
        std::fs::write(dir.join("owner.pid"), std::process::id().to_string()).map_err(file)?;
        // The VM's record before the VM: an adopter must find the kernel it runs.
        write_record(dir, &record)?;
        let (mut vm, agent, net) = start_vm(backend, &record.spec, &record.network, opts, started).await?;
        let agent = init_with_retry(vm.as_mut(), agent, id.as_str(), opts, false, None).await?;
        if let Some(port) = artifacts.template.ready_port() {
            wait_for_port(&agent, port, opts.boot_timeout, started, dir).await?;
        }
        // Running from here on: a crash before this leaves it paused (see `adopt`).
        let _ = std::fs::remove_file(dir.join(PAUSED_DISK));
        Ok(Sandbox { id, dir: dir.to_path_buf(), vm: Some(vm), agent, boot_time: started.elapsed(), record, net, started: StartKind::Cold, keep_dir: false })
    }

    /// Whether the VM runs and its agent answers; why not, if not. Asked after an
    /// operation failed halfway, to tell a sandbox that runs on from a wedged one.
    pub async fn health(&mut self) -> Result<(), String> {
        let Some(vm) = self.vm.as_mut() else { return Err("it has no VM".into()) };
        if let Some(status) = vm.exit_status() {
            return Err(format!("its VM ended ({status})"));
        }
        // What the user is told names no host detail; the log has the cause.
        match vm.run_state().await {
            Ok(state) if state == "running" => {}
            Ok(state) => return Err(format!("its VM is stuck in QEMU's state '{state}'")),
            Err(e) => {
                tracing::warn!(sandbox = %self.id, "asking QEMU for the VM's state: {e}");
                return Err("its VM does not answer QEMU's monitor".into());
            }
        }
        match tokio::time::timeout(HEALTH_WAIT, self.agent.health()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                tracing::warn!(sandbox = %self.id, "the agent's health check: {e}");
                Err("its guest agent does not answer".into())
            }
            Err(_) => Err(format!("its guest agent did not answer within {} s", HEALTH_WAIT.as_secs())),
        }
    }

    /// Saves the running sandbox as a memory snapshot in `dir` (a fork's source, an
    /// E2B snapshot): the guest pauses for the save and then runs on.
    pub async fn snapshot(&mut self, dir: &Path, template: &str) -> Result<MemorySnapshot, PauseError> {
        let Some(vm) = self.vm.as_mut() else { return Err(PauseError::NotRunning) };
        flush_guest(&self.agent).await;
        if let Err(e) = crate::snapshot::release_agent(&self.agent, &vm.agent_socket(), RELEASE_WAIT).await {
            self.reattach().await;
            return Err(e.into());
        }
        let Some(vm) = self.vm.as_mut() else { return Err(PauseError::NotRunning) };
        let saved = crate::snapshot::save_vm(vm.as_mut(), &self.record.spec.disk, self.record.spec.base.as_deref(), dir, false).await;
        let resumed = vm.resume().await;
        self.reattach().await;
        saved?;
        resumed.map_err(|e| PauseError::Save(SaveError::Vm(e)))?;
        let manifest = crate::snapshot::Manifest {
            template: template.to_string(),
            cpus: self.record.spec.cpus,
            memory_mib: self.record.spec.memory_mib,
            accel: self.record.spec.accel,
            shared_memory: false,
            created_at: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
            source_sandbox: Some(self.id.to_string()),
            base: self.record.base_snapshot.clone(),
            nic: self.record.spec.nic.is_some(),
            guest_token: self.agent.access_token().map(String::from),
        };
        MemorySnapshot::write_manifest(dir, &manifest)?;
        Ok(MemorySnapshot { dir: dir.to_path_buf(), manifest })
    }

    /// A new agent session after the old one was released.
    async fn reattach(&mut self) {
        if let Some(vm) = self.vm.as_mut() {
            match connect_serving(vm.as_mut(), self.id.as_str(), Duration::from_secs(30), Instant::now()).await {
                Ok(agent) => self.agent = agent.with_token(self.agent.access_token()),
                Err(e) => tracing::warn!(sandbox = %self.id, "reconnecting to the agent: {e}"),
            }
        }
    }

    /// Sets its VM's weight on a contended CPU (a pooled sandbox taken by a request
    /// comes to the foreground); false if it could not (said in the log).
    pub fn set_cpu_share(&self, share: hutch_vmm::CpuShare) -> bool {
        self.vm.as_deref().is_none_or(|vm| boot::set_cpu_share(vm, self.id.as_str(), share))
    }

    /// Hands the guest a new identity, environment, clock and entropy (a pooled
    /// sandbox being taken by a request).
    pub async fn reinit(&mut self, opts: &SandboxOptions) -> Result<(), CreateError> {
        if let Some(ca) = &opts.inspect_ca {
            ca.save(&self.dir).map_err(CreateError::Inspection)?;
        }
        self.agent = init_guest(&self.agent, self.id.as_str(), opts).await?;
        Ok(())
    }

    pub fn cpus(&self) -> u32 {
        self.record.spec.cpus
    }

    /// The sandbox's network settings.
    pub fn network(&self) -> &hutch_net::Settings {
        &self.record.network
    }

    /// What the sandbox's stack refused, and its counters (None without a stack).
    pub fn net_log(&self) -> Option<hutch_net::LogView> {
        self.net.as_ref().map(|n| n.log())
    }

    /// Replaces the sandbox's network settings: its stack follows them at once (open
    /// connections stay), and they are kept for resumes and adoptions. `ca` is the
    /// sandbox's inspection CA when the caller holds it (else it is read from the directory).
    pub fn set_network(&mut self, settings: hutch_net::Settings, env: &hutch_net::Environment, ca: Option<&std::sync::Arc<hutch_net::inspect::SandboxCa>>) -> Result<(), CreateError> {
        let inspector = boot::inspector(&self.dir, &settings, env, ca)?;
        let mut record = self.record.clone();
        record.network = settings;
        write_record(&self.dir, &record)?;
        if let Some(net) = &self.net {
            // The policy last: a flow it newly allows already goes the new way.
            net.set_egress_proxy(record.network.egress_proxy.clone());
            net.set_inspector(inspector);
            net.set_policy(record.network.policy.clone());
        }
        self.record = record;
        Ok(())
    }

    pub fn memory_mib(&self) -> u32 {
        self.record.spec.memory_mib
    }

    pub fn started_from(&self) -> StartKind {
        self.started
    }

    pub fn base_snapshot(&self) -> Option<&Path> {
        self.record.base_snapshot.as_deref()
    }

    pub fn id(&self) -> &SandboxId {
        &self.id
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn agent(&self) -> &AgentClient {
        &self.agent
    }

    /// Wall time from `create` being called to the agent being ready.
    pub fn boot_time(&self) -> Duration {
        self.boot_time
    }

    pub fn pid(&self) -> Option<u32> {
        self.vm.as_ref().and_then(|v| v.pid())
    }

    /// How the VM ended, if it has (on its own: a guest panic, say).
    pub fn vm_ended(&mut self) -> Option<String> {
        self.vm.as_mut().and_then(|v| v.exit_status())
    }

    /// Resumes a VM that QEMU paused because a disk write found the host's disk full
    /// (`werror=enospc`, QEMU's default), once space is back; true if it did.
    pub async fn resume_after_io_error(&mut self) -> bool {
        let Some(vm) = self.vm.as_mut() else { return false };
        if vm.run_state().await.ok().as_deref() != Some("io-error") {
            return false;
        }
        if hutch_vmm::space::available(&self.dir).is_ok_and(|free| free >= hutch_vmm::space::RESUME_FREE) {
            return vm.resume().await.is_ok();
        }
        false
    }

    /// The running VM's agent socket.
    pub fn agent_socket(&self) -> Option<PathBuf> {
        self.vm.as_ref().map(|v| v.agent_socket())
    }

    pub fn console_tail(&self, lines: usize) -> String {
        console_tail(&self.dir.join("console.log"), lines)
    }

    /// Stops the VM and removes every file of the sandbox. The disk is thrown away, so
    /// there is nothing to flush: QEMU is killed at once (asking it to quit first cost
    /// ~4 ms more, for a clean shutdown of a disk deleted next).
    pub async fn destroy(mut self) -> Result<(), hutch_vmm::StopError> {
        let started = Instant::now();
        let result = match self.vm.as_mut() {
            Some(vm) => vm.kill().await,
            None => Ok(()),
        };
        self.vm = None;
        let stopped = started.elapsed();
        remove_sandbox_dir(&self.dir);
        tracing::debug!("destroyed sandbox {} in {:.1} ms: VM stopped {:.1}", self.id, started.elapsed().as_secs_f64() * 1000.0, stopped.as_secs_f64() * 1000.0);
        result
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        // Dropping the handle kills QEMU; then nothing holds the directory.
        self.vm = None;
        if !self.keep_dir {
            remove_sandbox_dir(&self.dir);
        }
    }
}

/// Asks the guest to write its dirty page cache to disk, so the disk saved beside the
/// memory is complete on its own (exports carry only the disk). Best effort: the memory
/// state is consistent either way.
async fn flush_guest(agent: &AgentClient) {
    if let Err(e) = tokio::time::timeout(Duration::from_secs(30), agent.post_json("/sync", &serde_json::json!({}))).await.unwrap_or_else(|_| Ok(())) {
        tracing::warn!("the guest did not flush its disk: {e}");
    }
}

/// How long a guest may take to write its page cache out for a filesystem-only pause.
const SYNC_WAIT: Duration = Duration::from_secs(60);

/// How long an adopted guest's agent may take to see the dead server's session end
/// and take a new one.
const ADOPT_AGENT_WAIT: Duration = Duration::from_secs(30);

/// How long a guest agent may take to answer a health check after a failed save.
const HEALTH_WAIT: Duration = Duration::from_secs(10);

/// How long a guest agent may take to end the host's session before a save.
const RELEASE_WAIT: Duration = Duration::from_secs(10);

struct Launch<'a> {
    /// The snapshot being restored, whose console the new one continues.
    seed: Option<&'a MemorySnapshot>,
    base: &'a Path,
    memory: Memory,
    incoming: Option<Incoming>,
    base_snapshot: Option<PathBuf>,
    kind: StartKind,
}

#[cfg(test)]
mod tests {
    use super::*;
    use super::errors::CreateError;
    use hutch_vmm::fake::FakeBackend;

    fn setup() -> (tempfile::TempDir, HutchHome, Artifacts) {
        let tmp = tempfile::tempdir().expect("tempdir");
        let home = HutchHome::at(tmp.path().join("home"));
        let artifacts = crate::fake_guest::artifacts(tmp.path());
        (tmp, home, artifacts)
    }

    #[tokio::test]
    async fn a_backend_failure_leaves_no_directory() {
        let (_tmp, home, artifacts) = setup();
        let backend = FakeBackend::default();
        *backend.fail_start.lock() = Some("no luck".into());
        let cold = SandboxOptions { cold: true, ..SandboxOptions::default() };
        let err = Sandbox::create(&home, &artifacts, &backend, &cold).await.err();
        assert!(matches!(err, Some(CreateError::Start(_))), "{err:?}");
        // The default path makes the template snapshot first: it fails the same way,
        // and leaves neither a sandbox nor snapshot files.
        let err = Sandbox::create(&home, &artifacts, &backend, &SandboxOptions::default()).await.err();
        assert!(matches!(err, Some(CreateError::TemplateSnapshot(_))), "{err:?}");
        let snapshots = home.template_snapshots();
        let left: Vec<_> = std::fs::read_dir(&snapshots).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
        assert!(left.is_empty(), "snapshot files left: {left:?}");
        assert_eq!(std::fs::read_dir(home.sandboxes()).expect("dir").count(), 0);
    }

    #[tokio::test]
    async fn a_guest_that_never_answers_times_out_and_is_stopped() {
        let (_tmp, home, artifacts) = setup();
        let backend = FakeBackend::default();
        let opts = SandboxOptions { boot_timeout: Duration::from_millis(300), cold: true, ..SandboxOptions::default() };
        let err = Sandbox::create(&home, &artifacts, &backend, &opts).await.err();
        assert!(matches!(&err, Some(CreateError::BootTimeout { console, .. }) if console.contains("empty")), "{err:?}");
        assert_eq!(backend.started.lock().len(), 1);
        assert_eq!(backend.stopped.lock().len(), 1, "the VM was not stopped");
        assert_eq!(std::fs::read_dir(home.sandboxes()).expect("dir").count(), 0);
    }
}
