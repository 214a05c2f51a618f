//! Snapshots of sandboxes and forks. A snapshot (E2B's `create_snapshot`, `hutch
//! snapshot create`) saves a sandbox's memory and disk; new sandboxes start from it by
//! giving its id or name as the template. A fork is an unnamed snapshot restored N
//! times; its files go when the last sandbox stacked on them does.

use super::owner::Owned;
use super::state::SandboxState;
use super::config::{CreateSpec, MAX_FORKS};
use super::names::{validate_identifier, validate_name};
use super::error::ManagerError;
use super::live::Live;
use super::SandboxManager;
use hutch_formats::archive::{self, ArchiveError, ArchiveManifest};
use crate::artifacts::Artifacts;
use crate::sandbox::Sandbox;
use crate::sandbox::boot::SandboxOptions;
use crate::sandbox::layout::{VmRecord, PAUSED_STATE, VM_RECORD};
use crate::snapshot::{Manifest, MemorySnapshot};
use crate::store::{now_rfc3339, SandboxRow, SnapshotRow};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

impl SandboxManager {
    pub(super) fn snapshots_root(&self) -> PathBuf {
        self.home.root().join("snapshots").join("sandboxes")
    }

    /// Saves `id` (running: it pauses for the save and runs on; paused: its saved
    /// state is copied) as a snapshot in a new directory. Without `memory` only its
    /// disk is kept, and sandboxes started from it boot.
    async fn snapshot_sandbox(&self, id: &str, live: &Arc<Live>, prefix: &str, memory: bool) -> Result<MemorySnapshot, ManagerError> {
        // Asked before the directory and its pin exist: a failure here leaves neither.
        let (key_id, asked) = (live.row.key_id.clone(), live.row.template.clone());
        let template = self.base_template(&key_id, &asked).await?;
        let snap_id = format!("{prefix}{}", hex::encode(rand::random::<[u8; 8]>()));
        let dir = self.snapshots_root().join(&snap_id);
        std::fs::create_dir_all(&dir).map_err(|e| ManagerError::Internal(format!("creating {}: {e}", dir.display())))?;
        self.pinned.lock().insert(dir.clone());
        let made = {
            let (id, to, template) = (id.to_string(), dir.clone(), template.clone());
            self.in_owner(live, move |m, live, o| Box::pin(async move { m.snapshot_owned(&id, &live, o, &to, &template).await })).await
        };
        // Restored copies share the snapshot's RAM pages (see `share_memory`); if that
        // fails the full-state snapshot still works, each copy loading its own RAM.
        let made = match made {
            // The disk was saved with the memory, at one instant: the memory goes.
            Ok(snap) if !memory || !snap.has_memory() => snap.drop_memory().map(|()| snap).map_err(|e| ManagerError::Internal(format!("removing the memory from a disk-only snapshot: {e}"))),
            Ok(snap) => match self.prepare(&template).await {
                Ok(a) => match crate::snapshot::share_memory(&snap, self.backend.as_ref(), a.kernel.vmlinuz(), a.initramfs.clone()).await {
                    Ok(shared) => Ok(shared),
                    // A paused sandbox's changed pages alone are no state to load whole.
                    Err(e) if hutch_vmm::saved_state::is_changed_pages(&snap.dir.join("state")).unwrap_or(true) => Err(ManagerError::Internal(format!("making the snapshot's memory: {e}"))),
                    Err(e) => {
                        tracing::warn!(sandbox = id, "snapshot memory stays private to each restore: {e}");
                        Ok(snap)
                    }
                },
                Err(e) if hutch_vmm::saved_state::is_changed_pages(&snap.dir.join("state")).unwrap_or(true) => Err(e),
                Err(_) => Ok(snap),
            },
            Err(e) => Err(e),
        };
        if made.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
            self.pinned.lock().remove(&dir);
        }
        made
    }

    /// The built-in template a sandbox's template id stands for. A sandbox started from
    /// one of the key's snapshots carries that snapshot's id (as E2B shows it), but its
    /// own snapshots and forks boot with the snapshot's template: recorded as the
    /// snapshot's id, they would name a template nobody can prepare.
    pub(super) async fn base_template(&self, key_id: &str, template: &str) -> Result<String, ManagerError> {
        if hutch_image::recipes::recipe(template).is_some() {
            return Ok(template.to_string());
        }
        Ok(match self.store.snapshot(key_id, template).await? {
            Some(snapshot) => snapshot.template,
            None => template.to_string(),
        })
    }

    /// The save itself, in the sandbox's owner: a running sandbox pauses for it and runs
    /// on, a paused one has its saved state copied.
    async fn snapshot_owned(&self, id: &str, live: &Live, o: &mut Owned, dir: &Path, template: &str) -> Result<MemorySnapshot, ManagerError> {
        let Some(memory_mib) = o.sandbox().map(Sandbox::memory_mib) else {
            // Paused: its saved state is copied, and the guard moves it back to paused.
            let _step = o.begin(SandboxState::Snapshotting)?;
            let (sandbox_dir, token) = (PathBuf::from(&live.row.dir), live.row.envd_token.clone());
            let (to, t, sid) = (dir.to_path_buf(), template.to_string(), id.to_string());
            return tokio::task::spawn_blocking(move || copy_paused(&sandbox_dir, &to, &t, &sid, token))
                .await
                .unwrap_or_else(|e| Err(ManagerError::Internal(e.to_string())));
        };
        self.room_for_memory(memory_mib)?;
        // No agent is published while it is saved.
        let mut o = o.begin(SandboxState::Snapshotting)?;
        let Some(sandbox) = o.sandbox_mut() else { return Err(ManagerError::Internal("the running sandbox has no VM".into())) };
        let made = sandbox.snapshot(dir, template).await.map_err(ManagerError::Pause);
        if made.is_err() {
            o.settle_after_failure().await?;
            return made;
        }
        o.advance(SandboxState::Running)?;
        made
    }

    /// E2B's `create_snapshot`: returns the snapshot's record (its id works as a
    /// template id; so does its name).
    /// Without `memory` (or of a sandbox paused without it), only the disk is kept.
    pub async fn create_snapshot(&self, key_id: &str, id: &str, name: Option<String>, memory: bool) -> Result<SnapshotRow, ManagerError> {
        let (key_id, id) = (key_id.to_string(), id.to_string());
        self.detached(move |m| async move { m.create_snapshot_now(&key_id, &id, name, memory).await }).await
    }

    async fn create_snapshot_now(&self, key_id: &str, id: &str, name: Option<String>, memory: bool) -> Result<SnapshotRow, ManagerError> {
        // Said once the operation is its own task (`detached`): from here a client that
        // hangs up no longer stops it.
        tracing::info!(sandbox = %id, "snapshotting");
        if let Some(n) = &name {
            validate_name(n)?;
            if self.store.snapshot(key_id, n).await?.is_some() {
                return Err(ManagerError::Conflict(format!("a snapshot named '{n}' exists; delete it or pick another name")));
            }
        }
        let live = self.find(key_id, id)?;
        self.quota_snapshots(key_id).await?;
        let snap = self.snapshot_sandbox(id, &live, "snap_", memory).await?;
        let row = SnapshotRow {
            id: snap.dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            key_id: key_id.to_string(),
            name,
            template: snap.manifest.template.clone(),
            source_sandbox: Some(id.to_string()),
            memory: snap.has_memory(),
            dir: snap.dir.display().to_string(),
            created_at: now_rfc3339(),
        };
        let stored = self.store.insert_snapshot(&row).await;
        self.pinned.lock().remove(&snap.dir);
        if let Err(e) = stored {
            let _ = std::fs::remove_dir_all(&snap.dir);
            return Err(name_conflict(e));
        }
        Ok(row)
    }

    pub async fn list_snapshots(&self, key_id: &str) -> Result<Vec<SnapshotRow>, ManagerError> {
        Ok(self.store.snapshots(key_id).await?)
    }

    /// Deletes a snapshot; sandboxes already started from it keep working (its files
    /// stay until the last of them is gone).
    pub async fn delete_snapshot(&self, key_id: &str, id_or_name: &str) -> Result<(), ManagerError> {
        let Some(row) = self.store.snapshot(key_id, id_or_name).await? else {
            return Err(ManagerError::NotFound(format!("snapshot {id_or_name}")));
        };
        self.store.delete_snapshot(&row.id).await?;
        self.prune_snapshot_files().await;
        Ok(())
    }

    /// Writes the portable archive of a key's snapshot (its filesystem) to a new file
    /// under `$HUTCH_HOME/tmp`, for the caller to stream and remove.
    pub async fn export_snapshot(&self, key_id: &str, id_or_name: &str) -> Result<(PathBuf, ArchiveManifest), ManagerError> {
        let Some(row) = self.store.snapshot(key_id, id_or_name).await? else {
            return Err(ManagerError::NotFound(format!("snapshot {id_or_name}")));
        };
        let work = self.home.tmp().join(format!("export-{}", hex::encode(rand::random::<[u8; 8]>())));
        std::fs::create_dir_all(&work).map_err(|e| ManagerError::Internal(format!("creating {}: {e}", work.display())))?;
        let out = work.with_extension("tar");
        let dir = PathBuf::from(&row.dir);
        self.pinned.lock().insert(dir.clone());
        let (w, o) = (work.clone(), out.clone());
        let made = tokio::task::spawn_blocking(move || -> Result<ArchiveManifest, ArchiveError> {
            let file = std::fs::File::create(&o).map_err(|source| ArchiveError::Io { what: "creating", path: o.clone(), source })?;
            archive::export(&dir.join("disk.qcow2"), row.name.as_deref(), &row.template, &w, std::io::BufWriter::new(file))
        })
        .await;
        self.pinned.lock().remove(&PathBuf::from(&row.dir));
        let _ = std::fs::remove_dir_all(&work);
        match made {
            Ok(Ok(manifest)) => Ok((out, manifest)),
            Ok(Err(e)) => {
                let _ = std::fs::remove_file(&out);
                Err(ManagerError::Internal(format!("exporting the snapshot: {e}")))
            }
            Err(e) => Err(ManagerError::Internal(e.to_string())),
        }
    }

    /// Imports an archive (verified: content hash, standalone disk) as a snapshot of
    /// this key, named `name` or as the archive says.
    pub async fn import_snapshot(&self, key_id: &str, archive_file: &Path, name: Option<String>) -> Result<SnapshotRow, ManagerError> {
        if let Some(n) = &name {
            validate_name(n)?;
        }
        self.quota_snapshots(key_id).await?;
        let id = format!("snap_{}", hex::encode(rand::random::<[u8; 8]>()));
        let dir = self.snapshots_root().join(&id);
        std::fs::create_dir_all(&dir).map_err(|e| ManagerError::Internal(format!("creating {}: {e}", dir.display())))?;
        self.pinned.lock().insert(dir.clone());
        let (d, a) = (dir.clone(), archive_file.to_path_buf());
        let unpacked = tokio::task::spawn_blocking(move || {
            let file = std::fs::File::open(&a).map_err(|source| ArchiveError::Io { what: "reading", path: a.clone(), source })?;
            archive::import(std::io::BufReader::new(file), &d)
        })
        .await
        .map_err(|e| ManagerError::Internal(e.to_string()));
        let result = match unpacked {
            Ok(Ok(imported)) => self.register_import(key_id, &id, &dir, imported, name).await,
            Ok(Err(ArchiveError::QemuImg { .. })) => {
                Err(ManagerError::InvalidArgument("the archive's disk.qcow2 is not a usable qcow2 image; nothing was imported".into()))
            }
            Ok(Err(ArchiveError::NoSpace(m))) => Err(ManagerError::NoSpace(m)),
            Ok(Err(e @ ArchiveError::Io { .. })) => Err(ManagerError::Internal(format!("importing the archive: {e}"))),
            Ok(Err(e)) => Err(ManagerError::InvalidArgument(format!("{e}; nothing was imported"))),
            Err(e) => Err(e),
        };
        self.pinned.lock().remove(&dir);
        if result.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        result
    }

    async fn register_import(&self, key_id: &str, id: &str, dir: &Path, imported: archive::Imported, name: Option<String>) -> Result<SnapshotRow, ManagerError> {
        let manifest = imported.manifest;
        let name = name.or(manifest.name.clone());
        if let Some(n) = &name {
            validate_name(n)?;
            if self.store.snapshot(key_id, n).await?.is_some() {
                return Err(ManagerError::Conflict(format!("a snapshot named '{n}' exists; import under another name (?name=) or delete it first")));
            }
        }
        // The disk boots with its template's kernel and agent; check the template is one
        // this server has or can build, before accepting it.
        validate_identifier("the archive's template", &manifest.template)?;
        let artifacts = self.prepare(&manifest.template).await?;
        // Exports keep the template's size; a bigger disk would let the guest grow it
        // past what any sandbox of the template can.
        let allowed = artifacts.template.disk_size;
        if imported.virtual_size > allowed {
            return Err(ManagerError::InvalidArgument(format!(
                "the archive's disk is {} bytes to the guest, more than the {allowed} of template '{}'; nothing was imported",
                imported.virtual_size, manifest.template
            )));
        }
        let row = SnapshotRow {
            id: id.to_string(),
            key_id: key_id.to_string(),
            name,
            template: manifest.template,
            source_sandbox: None,
            memory: false,
            dir: dir.display().to_string(),
            created_at: now_rfc3339(),
        };
        self.store.insert_snapshot(&row).await.map_err(name_conflict)?;
        Ok(row)
    }

    /// A sandbox started from a key's snapshot (its memory when it has one, else a
    /// boot on its disk), and the artifacts of the template it descends from.
    pub(super) async fn start_from_named_snapshot(&self, snap: &SnapshotRow, opts: &SandboxOptions) -> Result<(Sandbox, Artifacts), ManagerError> {
        let artifacts = self.prepare(&snap.template).await?;
        let dir = PathBuf::from(&snap.dir);
        self.pinned.lock().insert(dir.clone());
        let started = match MemorySnapshot::open(&dir) {
            Some(memory) if snap.memory => Sandbox::from_snapshot(&self.home, &artifacts, self.backend.as_ref(), &memory, opts).await,
            _ => Sandbox::boot_on(&self.home, &artifacts, self.backend.as_ref(), opts, &dir.join("disk.qcow2"), Some(dir.clone())).await,
        };
        self.pinned.lock().remove(&dir);
        Ok((started.map_err(ManagerError::Create)?, artifacts))
    }

    /// E2B's fork: `count` new sandboxes, each continuing from the source's state as
    /// it is now (memory, processes, files), independently. One result per fork.
    pub async fn fork(&self, key_id: &str, id: &str, count: u32, timeout: Option<u64>) -> Result<Vec<Result<SandboxRow, ManagerError>>, ManagerError> {
        let (key_id, id) = (key_id.to_string(), id.to_string());
        self.detached(move |m| async move { m.fork_now(&key_id, &id, count, timeout).await }).await
    }

    async fn fork_now(&self, key_id: &str, id: &str, count: u32, timeout: Option<u64>) -> Result<Vec<Result<SandboxRow, ManagerError>>, ManagerError> {
        // Before the source is snapshotted (its guest stops for that): no fork would start.
        if self.shutting_down() {
            return Err(ManagerError::ShuttingDown);
        }
        if !(1..=MAX_FORKS).contains(&count) {
            return Err(ManagerError::InvalidArgument(format!("count must be between 1 and {MAX_FORKS}, got {count}")));
        }
        let live = self.find(key_id, id)?;
        let source = live.row();
        if source.state != "running" {
            return Err(ManagerError::Paused(id.to_string()));
        }
        self.quota_running(key_id, count as usize)?;
        // Pooled sandboxes give way to the forks (`admit`), so they do not count here.
        if self.in_use_count() + count as usize > self.config.max_sandboxes {
            return Err(ManagerError::AtCapacity { max: self.config.max_sandboxes });
        }
        let artifacts = self.prepare(&self.base_template(key_id, &source.template).await?).await?;
        let snap = self.snapshot_sandbox(id, &live, "fork_", true).await?;
        let mut results = Vec::new();
        for _ in 0..count {
            results.push(self.start_fork(key_id, &source, &artifacts, &snap, timeout).await);
        }
        self.pinned.lock().remove(&snap.dir);
        self.prune_snapshot_files().await;
        Ok(results)
    }

    async fn start_fork(&self, key_id: &str, source: &SandboxRow, artifacts: &Artifacts, snap: &MemorySnapshot, timeout: Option<u64>) -> Result<SandboxRow, ManagerError> {
        let token = source.envd_token.as_ref().map(|_| crate::ids::random_token());
        let mut opts = self.options(&source.template, &source.env_vars, &source.metadata, token.clone());
        // A fork may reach what its parent may.
        let network = crate::sandbox::layout::recorded_network(std::path::Path::new(&source.dir)).map_err(|e| ManagerError::Create(e.into()))?;
        opts.network = network.clone();
        let spec = CreateSpec {
            template: source.template.clone(),
            timeout,
            metadata: source.metadata.clone(),
            env_vars: source.env_vars.clone(),
            secure: token.is_some(),
            auto_pause: source.auto_pause,
            auto_resume: source.auto_resume,
            auto_pause_mode: if source.auto_pause_memory { crate::sandbox::layout::PauseMode::Full } else { crate::sandbox::layout::PauseMode::Filesystem },
            cold: false,
            private_ports: source.traffic_token.is_some(),
            network: Some(network),
        };
        let timeout = Duration::from_secs(timeout.unwrap_or(self.config.default_timeout.as_secs()));
        let origin = super::create::Origin::Fork(Box::new((snap.clone(), artifacts.clone())));
        let new = super::create::NewSandbox { key_id: key_id.to_string(), template: source.template.clone(), spec, token, timeout, opts, origin };
        self.create_sandbox(new).await
    }

    /// Removes sandbox snapshot directories nothing needs: not a stored snapshot, not
    /// under a sandbox's disk, not under another kept snapshot, not in use right now.
    pub(super) async fn prune_snapshot_files(&self) {
        let Ok(stored) = self.store.snapshot_dirs().await else { return };
        let mut keep: HashSet<PathBuf> = stored.into_iter().map(PathBuf::from).collect();
        keep.extend(self.pinned.lock().iter().cloned());
        keep.extend(crate::sandbox::layout::base_snapshots_in_use(&self.home));
        // Snapshots stack on snapshots (a fork of a fork): keep every base of a kept one.
        let mut frontier: Vec<PathBuf> = keep.iter().cloned().collect();
        while let Some(dir) = frontier.pop() {
            if let Some(base) = MemorySnapshot::open(&dir).and_then(|s| s.manifest.base) {
                if keep.insert(base.clone()) {
                    frontier.push(base);
                }
            }
        }
        for entry in std::fs::read_dir(self.snapshots_root()).into_iter().flatten().flatten() {
            let dir = entry.path();
            if !keep.contains(&dir) {
                tracing::info!(dir = %dir.display(), "removing snapshot files no sandbox or snapshot uses");
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
        crate::pruning::prune_template_builds(&self.home);
    }
}

/// A snapshot of a paused sandbox: its saved state and disk, copied. `token` is the
/// sandbox's access token, which its saved guest holds.
fn copy_paused(sandbox_dir: &Path, dir: &Path, template: &str, id: &str, token: Option<String>) -> Result<MemorySnapshot, ManagerError> {
    let io = |what: &str, e: std::io::Error| ManagerError::Internal(format!("{what}: {e}"));
    let record: VmRecord = hutch_image::record::read(&sandbox_dir.join(VM_RECORD), hutch_image::record::Kind::Vm).map_err(|e| ManagerError::Internal(e.to_string()))?;
    // Paused without memory: the disk alone, booted by its restores (no token held).
    let memory = sandbox_dir.join(PAUSED_STATE).exists();
    if memory {
        // Checked before it is copied: QEMU wrote it, and decided its length.
        let changes = hutch_vmm::saved_state::needs_memory_file(&sandbox_dir.join(PAUSED_STATE), record.spec.ram_bytes()).map_err(|e| ManagerError::Internal(format!("reading the paused state: {e}")))?;
        std::fs::copy(sandbox_dir.join(PAUSED_STATE), dir.join("state")).map_err(|e| io("copying the memory state", e))?;
        // A pause that kept only the pages it changed needs the memory file they were
        // changed from: the snapshot gets its own copy, which `share_memory` then fills
        // with those pages (as a snapshot's shared memory file).
        match (&record.spec.memory, changes) {
            (_, false) => {}
            (hutch_vmm::Memory::PrivateFile(base), true) => crate::snapshot::copy_sparse(base, &dir.join("memory")).map_err(|e| io("copying the memory the paused state was saved against", e))?,
            (_, true) => return Err(ManagerError::Internal("the paused state holds changed pages, and its record names no memory file they were changed from".into())),
        }
    }
    std::fs::copy(&record.spec.disk, dir.join("disk.qcow2")).map_err(|e| io("copying the disk", e))?;
    if let Some(base) = &record.spec.base {
        // The copy's header is the paused VM's to have rewritten: make it hutch's.
        hutch_vmm::disk::reset_backing(&dir.join("disk.qcow2"), base).map_err(|e| ManagerError::Internal(e.to_string()))?;
    }
    let _ = hutch_vmm::console::copy(&record.spec.console_log(), &dir.join(crate::snapshot::CONSOLE));
    let manifest = Manifest {
        template: template.to_string(),
        cpus: record.spec.cpus,
        memory_mib: record.spec.memory_mib,
        accel: record.spec.accel,
        shared_memory: false,
        created_at: now_rfc3339(),
        source_sandbox: Some(id.to_string()),
        base: record.base_snapshot,
        nic: record.spec.nic.is_some(),
        guest_token: token.filter(|_| memory),
    };
    MemorySnapshot::write_manifest(dir, &manifest).map_err(|e| ManagerError::Internal(e.to_string()))?;
    Ok(MemorySnapshot { dir: dir.to_path_buf(), manifest })
}

/// A name another request took between the check and the insert is the same 409 as
/// one taken before.
fn name_conflict(e: crate::store::StoreError) -> ManagerError {
    match e {
        crate::store::StoreError::NameTaken(_) => ManagerError::Conflict(e.to_string()),
        e => e.into(),
    }
}
