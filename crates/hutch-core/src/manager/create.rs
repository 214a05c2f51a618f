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
use super::SandboxManager;
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
    /// A stored snapshot (a create from a snapshot's name).
    Named(SnapshotRow),
    /// The template: a sandbox waiting in its pool when `pooled` and there is one, else
    /// its memory snapshot, or a boot (`opts.cold`).
    Template { template: String, pooled: bool },
    /// A fork: the source's memory as it was just now.
    Fork(Box<(MemorySnapshot, Artifacts)>),
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
        opts.network.transforms.check_env("envVars", &spec.env_vars).map_err(|e| ManagerError::InvalidArgument(e.to_string()))?;
        self.check_rules(key_id, &mut opts.network).await?;
        let named = self.store.snapshot(key_id, &template).await?;
        // A template another API key built is not this one's to start (nor to learn of).
        if named.is_none() && self.template_owner(&name).is_some_and(|o| o != key_id) {
            return Err(super::unknown_template(&template));
        }
        let origin = match named {
            Some(snap) => Origin::Named(snap),
            None => Origin::Template { template, pooled: !spec.cold },
        };
        let new = NewSandbox { key_id: key_id.to_string(), template: name, spec, token, timeout, opts, origin };
        self.create_sandbox(new).await
    }

    /// Makes `new` a sandbox, in its own owner.
    pub(super) async fn create_sandbox(&self, new: NewSandbox) -> Result<SandboxRow, ManagerError> {
        if self.shutting_down() {
            return Err(ManagerError::ShuttingDown);
        }
        let NewSandbox { key_id, template, spec, token, timeout, mut opts, origin } = new;
        if !opts.network.transforms.is_empty() && opts.inspect_ca.is_none() {
            // Its own CA: no other sandbox's guest trusts it.
            let ca = hutch_net::inspect::SandboxCa::generate().map_err(|e| ManagerError::Internal(format!("making the sandbox's inspection CA: {e}")))?;
            opts.inspect_ca = Some(Arc::new(ca));
        }
        let pool = match &origin {
            Origin::Template { template, pooled: true } => Some(super::canonical(template)),
            _ => None,
        };
        // A template not built here is proven (prepared) before it may stop a pooled
        // sandbox: a made-up name gets its 400, never a pooled VM stopped for nothing.
        let unproven = match &origin {
            Origin::Template { template, .. } if !self.is_built(template) => Some(template.clone()),
            _ => None,
        };
        let asked = std::time::Instant::now();
        let row = |id: &str| self.creating_row(id, &key_id, &template, &spec, token.clone(), &opts);
        let super::admission::Admission { admitted, creating, pooled, displaced } = self.admit_waiting_for_pools(&key_id, pool.as_deref(), unproven.as_deref(), |id| Live::creating(row(id), &self.store)).await?;
        let id = admitted.id().to_string();
        let mut phases = Phases { asked, admitted: asked.elapsed(), from: if pooled.is_some() { "a pool" } else { origin.name(opts.cold) }, vm: Duration::ZERO };
        opts.id = SandboxId::parse(&id);
        let (m, owner, demand) = (self.arc()?, creating.owner.clone(), pool.clone());
        let pool = pool.unwrap_or_default();
        let admitted_row = creating.row.clone();
        let ran = creating
            .owner
            .run(move |o: &mut Owned| -> BoxFuture<'_, Result<SandboxRow, ManagerError>> {
                Box::pin(async move {
                    let handed = match (pooled, displaced) {
                        (Some(pooled), _) => m.hand_over(&pool, pooled, &opts).await,
                        (None, Some(displaced)) => displaced.make_room().await.map(|()| None),
                        (None, None) => Ok(None),
                    };
                    let started = match handed {
                        Ok(Some((sandbox, artifacts))) => start_pooled(sandbox, artifacts, &opts).await,
                        Ok(None) => {
                            phases.from = origin.name(opts.cold);
                            m.start_origin(origin, &opts).await
                        }
                        Err(e) => Err(e),
                    };
                    phases.vm = phases.asked.elapsed();
                    let created = match started {
                        Ok((sandbox, artifacts)) => m.register(o, owner, admitted_row, &artifacts, sandbox, timeout).await,
                        Err(e) => Err(e),
                    };
                    if created.is_ok() {
                        phases.log(&id);
                    }
                    if created.is_err() {
                        // Never seen by a client: out of every lookup first, then it ends
                        // as a kill would.
                        m.live.lock().remove(&id);
                        let _ = o.advance(SandboxState::Stopping).and_then(|_| o.advance(SandboxState::Stopped));
                    }
                    created
                })
            })
            .await;
        match ran {
            Ok(Ok(created)) => {
                admitted.keep();
                if let Some(template) = demand {
                    self.record_demand(&template);
                }
                Ok(created)
            }
            Ok(Err(e)) | Err(e) => {
                // Its owner may have ended after recording it (a panic): no row outlives it.
                if let Err(store) = self.store.delete_sandbox(admitted.id()).await {
                    tracing::warn!(sandbox = %admitted.id(), "removing the record of a create that failed: {store}");
                }
                Err(e)
            }
        }
    }

    /// `admit`; when the server is full while a pool VM starts, waits for that VM (it
    /// will be waiting to be taken or to make room) and tries again, and when it is
    /// full with sandboxes waiting in pools but the template (`unproven`) is not built
    /// here, prepares it first (its error, or its build) and tries again: a pool never
    /// makes a create fail.
    async fn admit_waiting_for_pools<'a>(&'a self, key_id: &str, pool: Option<&str>, mut unproven: Option<&str>, make: impl Fn(&str) -> Arc<Live>) -> Result<super::admission::Admission<'a>, ManagerError> {
        let deadline = tokio::time::Instant::now() + POOL_START_WAIT;
        loop {
            let started = self.pool_started.notified();
            match self.admit(key_id, pool, unproven.is_none(), &make) {
                Err(ManagerError::AtCapacity { .. }) if unproven.is_some() && self.pooled_count() > 0 => {
                    self.prepare(unproven.take().unwrap_or_default()).await?;
                }
                Err(ManagerError::AtCapacity { .. }) if self.pools.lock().starting > 0 && tokio::time::Instant::now() < deadline => {
                    // Woken when it is pooled (or stopped again); the deadline bounds a
                    // start that hangs.
                    let _ = tokio::time::timeout_at(deadline, started).await;
                }
                admitted => return admitted,
            }
        }
    }

    /// Starts the VM `origin` names (a pool's is handed over before this).
    async fn start_origin(&self, origin: Origin, opts: &SandboxOptions) -> Result<(Sandbox, Artifacts), ManagerError> {
        match origin {
            Origin::Named(snap) => self.start_from_named_snapshot(&snap, opts).await,
            Origin::Template { template, .. } => {
                let artifacts = self.prepare(&template).await?;
                let sandbox = Sandbox::create(&self.home, &artifacts, self.backend.as_ref(), opts).await.map_err(ManagerError::Create)?;
                Ok((sandbox, artifacts))
            }
            Origin::Fork(fork) => {
                let (snapshot, artifacts) = *fork;
                let sandbox = Sandbox::from_snapshot(&self.home, &artifacts, self.backend.as_ref(), &snapshot, opts).await.map_err(ManagerError::Create)?;
                Ok((sandbox, artifacts))
            }
        }
    }

    /// The row of a sandbox about to start: what it will be once its VM runs (its
    /// tokens too), but for what only the VM tells (its size from a snapshot, its disk,
    /// its QEMU, its times).
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
            traffic_token: spec.private_ports.then(crate::ids::random_token),
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

    /// Records a freshly started sandbox and moves it to `Running` (in its owner, `o`):
    /// its row is the one it was admitted with, completed by what only its VM tells.
    async fn register(
        &self,
        o: &mut Owned,
        owner: Arc<Owner>,
        admitted: SandboxRow,
        artifacts: &Artifacts,
        sandbox: Sandbox,
        timeout: Duration,
    ) -> Result<SandboxRow, ManagerError> {
        if sandbox.id().as_str() != admitted.id {
            // Every start takes the admitted id (`SandboxOptions::id`); one that did not
            // would leave its admission behind, counted and reachable under the other.
            let started_as = sandbox.id().to_string();
            let _ = sandbox.destroy().await;
            return Err(ManagerError::Internal(format!("a sandbox admitted as {} started as {started_as}", admitted.id)));
        }
        let started = Timestamp::now();
        let end_at = self.end_at(started, timeout);
        let row = SandboxRow {
            state: SandboxState::Running.api_name().into(),
            cpu_count: i64::from(sandbox.cpus()),
            memory_mb: i64::from(sandbox.memory_mib()),
            disk_mb: (artifacts.template.disk_size >> 20) as i64,
            started_at: started,
            end_at,
            qemu_pid: sandbox.pid().map(i64::from),
            dir: sandbox.dir().display().to_string(),
            ..admitted
        };
        if let Err(e) = self.store.insert_sandbox(&row).await {
            let _ = sandbox.destroy().await;
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

impl Origin {
    /// Where a VM started from this origin comes from, for the create's trace.
    fn name(&self, cold: bool) -> &'static str {
        match self {
            Origin::Named(_) => "a stored snapshot",
            Origin::Template { .. } if cold => "a boot",
            Origin::Template { .. } => "the template's snapshot",
            Origin::Fork(_) => "a fork",
        }
    }
}

/// A create's phases, logged when it has succeeded (`HUTCH_LOG=hutch_core=debug`): what
/// `bench/tti.py` splits a create's time by.
struct Phases {
    asked: std::time::Instant,
    /// Until it was admitted (a wait for a starting pool VM included).
    admitted: Duration,
    /// Where its VM came from.
    from: &'static str,
    /// Until its VM answered (taken from a pool and re-initialized, restored or booted).
    vm: Duration,
}

impl Phases {
    fn log(&self, id: &str) {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let total = self.asked.elapsed();
        tracing::debug!(
            "created sandbox {id} from {} in {:.1} ms: admission {:.1}, VM {:.1}, record {:.1}",
            self.from,
            ms(total),
            ms(self.admitted),
            ms(self.vm - self.admitted),
            ms(total - self.vm)
        );
    }
}

/// How long a create at the server's limit waits for pool VMs being started.
const POOL_START_WAIT: Duration = Duration::from_secs(60);

/// A pooled sandbox handed over (`hand_over`), with this create's network settings:
/// pooled sandboxes wait with no egress.
async fn start_pooled(mut sandbox: Sandbox, artifacts: Artifacts, opts: &SandboxOptions) -> Result<(Sandbox, Artifacts), ManagerError> {
    if let Err(e) = sandbox.set_network(opts.network.clone(), &opts.net_env, opts.inspect_ca.as_ref()) {
        let _ = sandbox.destroy().await;
        return Err(ManagerError::Create(e));
    }
    Ok((sandbox, artifacts))
}
