//! Creating a sandbox is its owner's first operation. The id is named first and the
//! sandbox enters the manager `Creating`: counted against the server's limit and its
//! key's quota from that moment, in the same lock that admits it, and hidden from
//! clients (none has been told its id). Its owner then starts the VM, records the row
//! and moves it to `Running`; if anything fails, it leaves the manager as if it had
//! never been there.

use super::config::CreateSpec;
use super::error::ManagerError;
use super::live::Live;
use super::owner::{Owned, Owner};
use super::state::SandboxState;
use super::{SandboxManager, SlotGuard};
use crate::artifacts::Artifacts;
use crate::ids::SandboxId;
use crate::sandbox::boot::SandboxOptions;
use crate::sandbox::layout::PauseMode;
use crate::sandbox::Sandbox;
use crate::snapshot::MemorySnapshot;
use crate::store::{SandboxRow, SnapshotRow};
use crate::time::Timestamp;
use futures::future::BoxFuture;
use std::sync::Arc;
use std::time::Duration;

/// Where a new sandbox's VM comes from.
pub(super) enum Origin {
    /// A warm pool's VM, running already under its own id.
    Pooled { sandbox: Box<Sandbox>, artifacts: Artifacts },
    /// A stored snapshot (a create from a snapshot's name).
    Named(SnapshotRow),
    /// The template's memory snapshot, or a boot (`opts.cold`).
    Template(String),
    /// A fork: the source's memory as it was just now.
    Fork { snapshot: MemorySnapshot, artifacts: Artifacts },
}

/// Everything a new sandbox is made from.
pub(super) struct NewSandbox {
    pub key_id: String,
    /// What its row names: the template, never a tag (later operations need its
    /// kernel and disk, not the tag, which may be gone by then).
    pub template: String,
    pub spec: CreateSpec,
    pub token: Option<String>,
    pub timeout: Duration,
    pub opts: SandboxOptions,
    pub origin: Origin,
}

/// A `Creating` sandbox in the manager's map: taken out again when this drops, unless
/// its creation succeeded (`keep`).
struct Admitted<'a> {
    manager: &'a SandboxManager,
    id: String,
    kept: bool,
}

impl Admitted<'_> {
    fn keep(mut self) {
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
    /// A new sandbox for `key_id`, running when this returns; the create goes on to its
    /// end if the caller leaves.
    pub async fn create(&self, key_id: &str, spec: CreateSpec) -> Result<SandboxRow, ManagerError> {
        let key_id = key_id.to_string();
        self.detached(move |m| async move { m.create_now(&key_id, spec).await }).await
    }

    async fn create_now(&self, key_id: &str, spec: CreateSpec) -> Result<SandboxRow, ManagerError> {
        let asked = if spec.template.is_empty() { "base" } else { spec.template.as_str() };
        // `name:tag` starts the build the tag names. Normal form (`NAME:V1` is
        // `name:v1`... for the tag; `name:default` is `name`), so one template is one key
        // for prepared artifacts, pools and shapes.
        let (name, tag) = hutch_image::tags::split(asked);
        super::names::validate_identifier("templateID", name)?;
        let tag = tag.map(hutch_image::tags::check).transpose().map_err(super::error::tag_error)?;
        let name = name.to_string();
        let template = match &tag {
            Some(tag) => format!("{name}:{tag}"),
            None => name.clone(),
        };
        let timeout = Duration::from_secs(spec.timeout.unwrap_or(self.config.default_timeout.as_secs()));
        let token = spec.secure.then(crate::ids::random_token);
        let mut opts = self.options(&template, &spec.env_vars, &spec.metadata, token.clone());
        opts.cold = spec.cold;
        opts.network = spec.network.clone().unwrap_or_default();
        let named = self.store.snapshot(key_id, &template).await?;
        // A template another API key built is not this one's to start (nor to learn of).
        if named.is_none() && self.template_owner(&name).is_some_and(|o| o != key_id) {
            return Err(super::unknown_template(&template));
        }
        // Before a pooled VM is taken for it (admission counts again, exactly).
        self.quota_running(key_id, 1)?;
        let pooled = match named.is_none() && !spec.cold {
            true => self.take_pooled(&super::canonical(&template), &opts).await,
            false => None,
        };
        let (origin, reserved) = match (named, pooled) {
            (_, Some((sandbox, artifacts, slot))) => (Origin::Pooled { sandbox: Box::new(sandbox), artifacts }, Some(slot)),
            (Some(snap), None) => (Origin::Named(snap), None),
            (None, None) => (Origin::Template(template.clone()), None),
        };
        let from_pool = reserved.is_some();
        let new = NewSandbox { key_id: key_id.to_string(), template: name, spec, token, timeout, opts, origin };
        let created = self.create_sandbox(new, reserved).await;
        if from_pool {
            self.refill(&super::canonical(&template));
        }
        created
    }

    /// Makes `new` a sandbox, in its own owner (`reserved`: a slot held for its VM
    /// already, which the sandbox takes over once admitted).
    pub(super) async fn create_sandbox(&self, new: NewSandbox, reserved: Option<SlotGuard<'_>>) -> Result<SandboxRow, ManagerError> {
        let NewSandbox { key_id, template, spec, token, timeout, mut opts, origin } = new;
        let id = match &origin {
            Origin::Pooled { sandbox, .. } => sandbox.id().to_string(),
            _ => SandboxId::generate().to_string(),
        };
        opts.id = SandboxId::parse(&id);
        let creating = Live::creating(self.creating_row(&id, &key_id, &template, &spec, token.clone(), &opts), &self.store);
        let admitted = self.admit(&creating, reserved.is_none())?;
        drop(reserved);
        let (m, owner) = (self.arc()?, creating.owner.clone());
        let created = creating
            .owner
            .run(move |o: &mut Owned| -> BoxFuture<'_, Result<SandboxRow, ManagerError>> {
                Box::pin(async move {
                    let started = m.start_origin(origin, &opts).await;
                    match started {
                        Ok((sandbox, artifacts)) => m.register(o, owner, &key_id, &template, &artifacts, sandbox, spec, token, timeout).await,
                        Err(e) => {
                            // Never seen by a client: it ends as a kill would.
                            let _ = o.advance(SandboxState::Stopping).and_then(|_| o.advance(SandboxState::Stopped));
                            Err(e)
                        }
                    }
                })
            })
            .await??;
        admitted.keep();
        Ok(created)
    }

    /// Puts `creating` in the map if the server has room for one more VM (when `check`)
    /// and its key has quota: both counted in the one lock that inserts it, so creates
    /// racing each other never pass a limit together.
    fn admit(&self, creating: &Arc<Live>, check: bool) -> Result<Admitted<'_>, ManagerError> {
        // Lock order as `reserve_slot`'s: starting, then live.
        let starting = self.starting.lock();
        let mut live = self.live.lock();
        if check && live.values().filter(|l| l.holds_vm()).count() + self.pooled_count() + *starting >= self.config.max_sandboxes {
            return Err(ManagerError::AtCapacity { max: self.config.max_sandboxes });
        }
        let key = &creating.row.key_id;
        if live.values().filter(|l| l.row.key_id == *key && l.holds_vm()).count() >= self.config.quota.running {
            return Err(super::quota::over_running(self.config.quota.running));
        }
        live.insert(creating.row.id.clone(), creating.clone());
        Ok(Admitted { manager: self, id: creating.row.id.clone(), kept: false })
    }

    /// Starts the VM `origin` names.
    async fn start_origin(&self, origin: Origin, opts: &SandboxOptions) -> Result<(Sandbox, Artifacts), ManagerError> {
        match origin {
            Origin::Pooled { mut sandbox, artifacts } => {
                // Pooled sandboxes wait with no egress; this one's settings apply now.
                if let Err(e) = sandbox.set_network(opts.network.clone()) {
                    let _ = sandbox.destroy().await;
                    return Err(ManagerError::Create(e));
                }
                Ok((*sandbox, artifacts))
            }
            Origin::Named(snap) => self.start_from_named_snapshot(&snap, opts).await,
            Origin::Template(template) => {
                let artifacts = self.prepare(&template).await?;
                let sandbox = Sandbox::create(&self.home, &artifacts, self.backend.as_ref(), opts).await.map_err(ManagerError::Create)?;
                Ok((sandbox, artifacts))
            }
            Origin::Fork { snapshot, artifacts } => {
                let sandbox = Sandbox::from_snapshot(&self.home, &artifacts, self.backend.as_ref(), &snapshot, opts).await.map_err(ManagerError::Create)?;
                Ok((sandbox, artifacts))
            }
        }
    }

    /// The row of a sandbox about to start: what it will be once its VM runs, but for
    /// what only the VM tells (its size from a snapshot, its disk, its QEMU, its times).
    fn creating_row(&self, id: &str, key_id: &str, template: &str, spec: &CreateSpec, token: Option<String>, opts: &SandboxOptions) -> SandboxRow {
        let now = Timestamp::now();
        SandboxRow {
            id: id.to_string(),
            key_id: key_id.to_string(),
            template: template.to_string(),
            state: SandboxState::Creating.api_name().into(),
            cpu_count: i64::from(opts.cpus),
            memory_mb: i64::from(opts.memory.get()),
            disk_mb: 0,
            metadata: spec.metadata.clone(),
            env_vars: spec.env_vars.clone(),
            envd_token: token,
            traffic_token: None,
            started_at: now,
            end_at: now,
            qemu_pid: None,
            dir: self.home.sandboxes().join(id).display().to_string(),
            auto_pause: spec.auto_pause,
            auto_resume: spec.auto_resume,
            auto_pause_memory: spec.auto_pause_mode == PauseMode::Full,
            pause_mode: None,
            failure: None,
        }
    }

    /// Records a freshly started sandbox and moves it to `Running` (in its owner, `o`).
    #[allow(clippy::too_many_arguments)]
    async fn register(
        &self,
        o: &mut Owned,
        owner: Arc<Owner>,
        key_id: &str,
        template: &str,
        artifacts: &Artifacts,
        sandbox: Sandbox,
        spec: CreateSpec,
        token: Option<String>,
        timeout: Duration,
    ) -> Result<SandboxRow, ManagerError> {
        let started = Timestamp::now();
        let end_at = self.end_at(started, timeout);
        let row = SandboxRow {
            id: sandbox.id().to_string(),
            key_id: key_id.to_string(),
            template: template.to_string(),
            state: SandboxState::Running.api_name().into(),
            cpu_count: i64::from(sandbox.cpus()),
            memory_mb: i64::from(sandbox.memory_mib()),
            disk_mb: (artifacts.template.disk_size >> 20) as i64,
            metadata: spec.metadata,
            env_vars: spec.env_vars,
            envd_token: token,
            traffic_token: spec.private_ports.then(crate::ids::random_token),
            started_at: started,
            end_at,
            qemu_pid: sandbox.pid().map(i64::from),
            dir: sandbox.dir().display().to_string(),
            auto_pause: spec.auto_pause,
            auto_resume: spec.auto_resume,
            auto_pause_memory: spec.auto_pause_mode == PauseMode::Full,
            pause_mode: None,
            failure: None,
        };
        if let Err(e) = self.store.insert_sandbox(&row).await {
            let _ = sandbox.destroy().await;
            let _ = o.advance(SandboxState::Stopping).and_then(|_| o.advance(SandboxState::Stopped));
            return Err(e.into());
        }
        if let Err(e) = sandbox.mark_server_owned() {
            tracing::warn!(sandbox = %row.id, "marking the sandbox as the server's (a local command's sweep may end it while no server runs): {e}");
        }
        // The row as it is from now on, then the state clients see it by: until this
        // move it is hidden, so nobody reads the row it was admitted with.
        let live = Arc::new(Live { row, owner });
        self.live.lock().insert(live.row.id.clone(), live.clone());
        o.start_running(sandbox, end_at)?;
        Ok(live.row())
    }
}
