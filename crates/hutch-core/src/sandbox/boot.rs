//! Bringing a guest up: the options a sandbox is made with, QEMU started with its
//! network stack, the agent's first answer, its init, and the template's service port.

use super::errors::CreateError;
use super::layout::console_tail;
use hutch_envd::{AgentClient};
use crate::ids::MemMib;
use hutch_proto::agent::InitRequest;
use hutch_vmm::{Accel, CpuShare, VmBackend, VmHandle, VmSpec};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct SandboxOptions {
    /// The id it takes (the manager names it before the VM starts); a new one if None.
    pub id: Option<crate::ids::SandboxId>,
    pub cpus: u32,
    pub memory: MemMib,
    pub accel: Accel,
    /// Environment for every process in the sandbox.
    pub envs: BTreeMap<String, String>,
    pub boot_timeout: Duration,
    /// End the VM if this process dies (local mode: no daemon will adopt it).
    pub die_with_parent: bool,
    /// When set, the agent requires it in `X-Access-Token` (E2B's secure sandboxes).
    pub access_token: Option<String>,
    /// Handed to the guest (/run/hutch/sandbox.json).
    pub metadata: BTreeMap<String, String>,
    /// Boot the kernel instead of restoring the template's memory snapshot.
    pub cold: bool,
    /// Where the sandbox may connect (none unless given).
    pub network: hutch_net::Settings,
    /// The operator's network settings and the seam every stack reaches the world by.
    pub net_env: std::sync::Arc<hutch_net::Environment>,
    /// Its VM's weight on a contended CPU from its start (a pool's sandboxes warm up
    /// in the background).
    pub cpu_share: CpuShare,
    /// The CA of its TLS inspection, when its network rules set headers: saved in its
    /// directory, its certificate handed to the guest at `/init`.
    pub inspect_ca: Option<std::sync::Arc<hutch_net::inspect::SandboxCa>>,
}

impl Default for SandboxOptions {
    fn default() -> Self {
        SandboxOptions {
            id: None,
            cpus: 1,
            memory: MemMib::DEFAULT,
            accel: Accel::Tcg,
            envs: BTreeMap::new(),
            boot_timeout: Duration::from_secs(60),
            die_with_parent: true,
            access_token: None,
            metadata: BTreeMap::new(),
            cold: false,
            network: hutch_net::Settings::default(),
            net_env: std::sync::Arc::new(hutch_net::Environment::default()),
            cpu_share: CpuShare::Foreground,
            inspect_ca: None,
        }
    }
}

/// Starts QEMU and gets an agent session: after a boot, or after loading saved state.
pub(crate) async fn start_vm(
    backend: &dyn VmBackend,
    spec: &VmSpec,
    network: &hutch_net::Settings,
    opts: &SandboxOptions,
    started: Instant,
) -> Result<(Box<dyn VmHandle>, AgentClient, Option<hutch_net::NetHandle>), CreateError> {
    let limit = opts.boot_timeout;
    let mut vm = backend.start(spec).await.map_err(CreateError::Start)?;
    // A pool VM left at the default only gives way less.
    if opts.cpu_share != CpuShare::Foreground {
        set_cpu_share(vm.as_ref(), &spec.id, opts.cpu_share);
    }
    let agent = if spec.incoming.is_some() {
        vm.load().await.map_err(CreateError::Restore)?;
        vm.resume().await.map_err(CreateError::Restore)?;
        connect_restored(vm.as_mut(), limit, started).await?
    } else {
        wait_for_agent(vm.as_mut(), limit, started).await?
    };
    // Only now: a stack connected while a restored guest loads and takes its first
    // agent session stalled that session (measured: the first /init timed out after
    // 10 s in most restores, none once the stack connects after it). The guest's
    // packets until now are dropped, as on a cable not yet plugged in.
    let net = start_net(spec, network, &opts.net_env, opts.inspect_ca.as_ref()).await?;
    Ok((vm, agent, net))
}

/// Sets a VM's CPU share; false (and said) if it could not.
pub(crate) fn set_cpu_share(vm: &dyn VmHandle, id: &str, share: CpuShare) -> bool {
    match vm.set_cpu_share(share) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(sandbox = id, ?share, "{e}");
            false
        }
    }
}

/// Starts the sandbox's network stack on its VM's NIC (none without one). QEMU's
/// netdev listens on a socket hutch bound before starting it, so the connection is
/// queued at once and QEMU takes it when it is ready (after an adoption: once it has
/// seen the dead server's connection end).
pub(crate) async fn start_net(spec: &VmSpec, settings: &hutch_net::Settings, env: &hutch_net::Environment, ca: Option<&std::sync::Arc<hutch_net::inspect::SandboxCa>>) -> Result<Option<hutch_net::NetHandle>, CreateError> {
    if spec.nic.is_none() {
        return Ok(None);
    }
    let inspector = inspector(&spec.dir, settings, env, ca)?;
    let link = tokio::net::UnixStream::connect(spec.net_socket()).await.map_err(CreateError::Net)?;
    let extras = hutch_net::stack::Extras { inspector, proxy: settings.egress_proxy.clone() };
    Ok(Some(hutch_net::NetHandle::start_with(link, settings.policy.clone(), extras, env.reach.clone(), env.seam.clone(), env.limits.clone())))
}

/// The TLS inspection for `settings`' header rules (None without rules), with `ca`
/// when the caller holds the sandbox's CA already, else the one saved in the sandbox's
/// directory `dir`. Rules without a CA are an error, never rules left unapplied.
pub(crate) fn inspector(
    dir: &Path,
    settings: &hutch_net::Settings,
    env: &hutch_net::Environment,
    ca: Option<&std::sync::Arc<hutch_net::inspect::SandboxCa>>,
) -> Result<Option<std::sync::Arc<hutch_net::inspect::Inspector>>, CreateError> {
    if settings.transforms.is_empty() {
        return Ok(None);
    }
    let ca = match ca {
        Some(ca) => ca.clone(),
        None => std::sync::Arc::new(hutch_net::inspect::SandboxCa::load(dir).map_err(CreateError::Inspection)?.ok_or(CreateError::NoInspectionCa)?),
    };
    Ok(Some(std::sync::Arc::new(hutch_net::inspect::Inspector::new(ca, settings.transforms.clone(), env.upstream.clone(), env.vault.clone()))))
}

/// Connects to the agent and initializes the guest, retrying on a fresh session when
/// a session does not answer (a guest starved of CPU can miss a reconnect). `/init` is
/// idempotent. Before each retry the old session is released: the guest must see the
/// host leave before a new hello, or the hello would land in the old session.
/// `held` is the access token the guest's agent holds now (none after a boot), which
/// it wants on `/init`.
pub(crate) async fn init_with_retry(
    vm: &mut dyn VmHandle,
    mut agent: AgentClient,
    id: &str,
    opts: &SandboxOptions,
    restored: bool,
    held: Option<&str>,
) -> Result<AgentClient, CreateError> {
    let started = Instant::now();
    let mut attempt = 0;
    let (mut presented, given) = (held, opts.access_token.as_deref());
    loop {
        attempt += 1;
        match init_guest(&agent.with_token(presented), id, opts).await {
            Ok(agent) => return Ok(agent),
            Err(e @ CreateError::InitTimeout { .. }) if restored && attempt < 3 && started.elapsed() < opts.boot_timeout => {
                tracing::warn!(sandbox = id, "{e}; reconnecting (attempt {attempt})");
                let _ = crate::snapshot::release_agent(&agent, &vm.agent_socket(), Duration::from_secs(5)).await;
                agent = connect_restored(vm, opts.boot_timeout, Instant::now()).await?;
            }
            // The init that timed out may have landed, and its answer alone been lost:
            // the guest then holds the token it gave.
            Err(CreateError::Init(hutch_envd::AgentError::Http { status, .. })) if attempt > 1 && status == http::StatusCode::UNAUTHORIZED && presented != given => presented = given,
            Err(e) => return Err(e),
        }
    }
}

/// Hands the guest its identity, the host's clock and fresh randomness: after a
/// restore, all three are the snapshot's. `agent` presents the token the guest holds
/// (its agent refuses an `/init` without it once it has one); the client returned
/// presents the one `opts` gives it, which the host's own calls from here on (/sync,
/// /tunnel, /metrics) need.
pub(crate) async fn init_guest(agent: &AgentClient, id: &str, opts: &SandboxOptions) -> Result<AgentClient, CreateError> {
    let entropy: [[u8; 32]; 2] = rand::random();
    let entropy = entropy.concat();
    let init = InitRequest {
        env_vars: opts.envs.clone(),
        timestamp_ns: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok().map(|d| d.as_nanos()),
        hostname: Some("hutch".into()),
        access_token: opts.access_token.clone(),
        sandbox_id: Some(id.to_string()),
        metadata: opts.metadata.clone(),
        entropy: Some(hutch_proto::b64::encode(&entropy)),
        ca_bundle: opts.inspect_ca.as_ref().map(|ca| ca.cert_pem().to_string()),
        ..InitRequest::default()
    };
    // Bounded: a guest that lost the session must not hang the create.
    match tokio::time::timeout(INIT_WAIT, agent.post_json("/init", &init)).await {
        Ok(r) => r.map_err(CreateError::Init)?,
        Err(_) => return Err(CreateError::InitTimeout { secs: INIT_WAIT.as_secs() }),
    }
    let agent = agent.with_token(opts.access_token.as_deref());
    // The time /init set is late by that first request's delay; fix it off the create's path.
    crate::clock_sync::spawn_correct(&agent);
    Ok(agent)
}

const INIT_WAIT: Duration = Duration::from_secs(10);

/// Connects to a restored guest's agent: it is already serving (it was when saved), so
/// there is no console line to wait for; the first hello may race the guest's wake-up.
/// The echoed hello proves the agent serves; the `/init` that follows is the first
/// request (no separate health check: every round trip is slow in a fresh TCG).
pub(crate) async fn connect_restored(vm: &mut dyn VmHandle, limit: Duration, started: Instant) -> Result<AgentClient, CreateError> {
    let socket = vm.agent_socket();
    let mut last = String::from("no attempt");
    while started.elapsed() < limit {
        if let Some(status) = vm.exit_status() {
            return Err(CreateError::VmExited { status, console: console_tail(&vm.console_log(), 30) });
        }
        match tokio::time::timeout(Duration::from_secs(5), hutch_envd::connect(&socket)).await {
            Ok(Ok(client)) => return Ok(client),
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = "no answer within 5 s".into(),
        }
        // Long enough for the guest to see this host leave before the next hello.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(CreateError::RestoreTimeout { secs: limit.as_secs(), last })
}

/// `connect_restored`, counted only once the agent has answered a request over the
/// session: for a guest whose agent another host may have left in any state (an
/// adoption after a crash, a save that failed), an echoed hello is not enough. A
/// session that does not serve is closed, which ends it in the guest, and the next is
/// tried after a pause (a guest that fails every request at once must not make this a
/// busy loop), within `limit`.
pub(crate) async fn connect_serving(vm: &mut dyn VmHandle, id: &str, limit: Duration, started: Instant) -> Result<AgentClient, CreateError> {
    loop {
        let agent = connect_restored(vm, limit, started).await?;
        let last = match tokio::time::timeout(SERVING_WAIT, agent.health()).await {
            Ok(Ok(())) => return Ok(agent),
            // The guest's words, bounded and on one line: they go to the host's log.
            Ok(Err(e)) => format!("the agent took the hello, then failed a request: {:?}", truncated(&hutch_proto::error_chain(&e), 200)),
            Err(_) => format!("the agent took the hello, then did not answer a request within {} s", SERVING_WAIT.as_secs()),
        };
        tracing::warn!(sandbox = %id, "{last}; connecting again");
        agent.close();
        if started.elapsed() >= limit {
            return Err(CreateError::RestoreTimeout { secs: limit.as_secs(), last });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// At most `max` bytes of `text`, cut at a character boundary.
fn truncated(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// How long a new session's first request may take (a health check: milliseconds when
/// the guest serves, even under TCG).
const SERVING_WAIT: Duration = Duration::from_secs(5);

pub use hutch_proto::agent::READY_LINE;

/// Waits for the booting guest's agent. An idle probe over the channel says when the
/// agent serves it, so the host then connects once and waits: reconnecting while the
/// guest is mid-session (slow under TCG) would hand the new hello to the old session.
pub(crate) async fn wait_for_agent(vm: &mut dyn VmHandle, limit: Duration, started: Instant) -> Result<AgentClient, CreateError> {
    let console = vm.console_log();
    let exited = |vm: &mut dyn VmHandle| vm.exit_status().map(|status| CreateError::VmExited { status, console: console_tail(&console, 30) });
    let timed_out = || CreateError::BootTimeout { secs: limit.as_secs(), console: console_tail(&console, 30) };
    let socket = vm.agent_socket();
    let probe = hutch_envd::wait_idle(&socket);
    tokio::pin!(probe);
    loop {
        if let Some(e) = exited(vm) {
            return Err(e);
        }
        let left = limit.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Err(timed_out());
        }
        // The bound is for noticing an exit or the deadline while the guest boots.
        match tokio::time::timeout(left.min(Duration::from_millis(100)), &mut probe).await {
            Ok(Ok(())) => break,
            // QEMU closed the socket: it is ending; the next turn reports how.
            Ok(Err(e)) => {
                tracing::debug!("idle probe: {e}");
                probe.set(hutch_envd::wait_idle(&socket));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(_) => {}
        }
    }
    let socket = vm.agent_socket();
    loop {
        let left = limit.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Err(timed_out());
        }
        let attempt = async {
            let client = hutch_envd::connect(&socket).await.map_err(|e| e.to_string())?;
            client.health().await.map_err(|e| e.to_string())?;
            Ok::<_, String>(client)
        };
        match tokio::time::timeout(left.min(Duration::from_secs(10)), attempt).await {
            Ok(Ok(client)) => return Ok(client),
            Ok(Err(e)) => tracing::debug!("agent not ready: {e}"),
            Err(_) => tracing::debug!("agent did not answer in time; reconnecting"),
        }
        if let Some(e) = exited(vm) {
            return Err(e);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the template's service accepts connections on `port` in the guest.
pub(crate) async fn wait_for_port(agent: &AgentClient, port: u16, limit: Duration, started: Instant, dir: &Path) -> Result<(), CreateError> {
    loop {
        if agent.tunnel(port).await.is_ok() {
            return Ok(());
        }
        if started.elapsed() >= limit {
            return Err(CreateError::ServiceTimeout { port, secs: limit.as_secs(), console: console_tail(&dir.join("console.log"), 30) });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
