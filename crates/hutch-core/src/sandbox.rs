//! One sandbox: its directory, overlay disk, VM and agent session.
//!
//! Creation is all-or-nothing: a failure at any step kills the VM and removes the
//! directory. A `Sandbox` dropped without `destroy` (a panic, an early return) still
//! kills its VM and removes its directory.

use crate::agent::{self, AgentClient};
use crate::artifacts::Artifacts;
use crate::ids::{MemMib, SandboxId};
use hutch_image::HutchHome;
use hutch_proto::agent::InitRequest;
use hutch_vmm::{Accel, VmBackend, VmHandle, VmSpec};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct SandboxOptions {
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
}

impl Default for SandboxOptions {
    fn default() -> Self {
        SandboxOptions {
            cpus: 1,
            memory: MemMib::DEFAULT,
            accel: Accel::Tcg,
            envs: BTreeMap::new(),
            boot_timeout: Duration::from_secs(60),
            die_with_parent: true,
            access_token: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    #[error("creating the sandbox directory {0}")]
    Dir(PathBuf, #[source] std::io::Error),
    #[error("creating the sandbox disk")]
    Disk(#[source] hutch_vmm::disk::DiskError),
    #[error("starting the VM")]
    Start(#[source] hutch_vmm::StartError),
    #[error("the VM stopped while booting ({status}); last console lines:\n{console}")]
    VmExited { status: String, console: String },
    #[error("the sandbox did not become ready within {secs} s; last console lines:\n{console}")]
    BootTimeout { secs: u64, console: String },
    #[error("initializing the agent")]
    Init(#[source] agent::AgentError),
    #[error("the template's service did not open port {port} within {secs} s; last console lines:\n{console}")]
    ServiceTimeout { port: u16, secs: u64, console: String },
}

pub struct Sandbox {
    id: SandboxId,
    dir: PathBuf,
    vm: Option<Box<dyn VmHandle>>,
    agent: AgentClient,
    boot_time: Duration,
}

/// Removes a half-made sandbox directory unless disarmed.
struct DirGuard(Option<PathBuf>);

impl Drop for DirGuard {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The last `lines` lines of a console log, for error messages.
pub fn console_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read(path).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    let tail = all[all.len().saturating_sub(lines)..].join("\n");
    if tail.trim().is_empty() {
        "(the console is empty)".into()
    } else {
        tail
    }
}

impl Sandbox {
    pub async fn create(
        home: &HutchHome,
        artifacts: &Artifacts,
        backend: &dyn VmBackend,
        opts: &SandboxOptions,
    ) -> Result<Sandbox, CreateError> {
        let started = Instant::now();
        let id = SandboxId::generate();
        let dir = home.sandboxes().join(id.as_str());
        std::fs::create_dir_all(&dir).map_err(|e| CreateError::Dir(dir.clone(), e))?;
        let guard = DirGuard(Some(dir.clone()));
        std::fs::write(dir.join("owner.pid"), std::process::id().to_string()).map_err(|e| CreateError::Dir(dir.clone(), e))?;
        let disk = dir.join("disk.qcow2");
        hutch_vmm::disk::create_overlay(&artifacts.template.image(), &disk).await.map_err(CreateError::Disk)?;
        let spec = VmSpec {
            id: id.to_string(),
            dir: dir.clone(),
            kernel: artifacts.kernel.vmlinuz(),
            initrd: artifacts.initramfs.clone(),
            disk,
            cpus: opts.cpus,
            memory_mib: opts.memory.get(),
            accel: opts.accel,
            die_with_parent: opts.die_with_parent,
        };
        let mut vm = backend.start(&spec).await.map_err(CreateError::Start)?;
        let agent = wait_for_agent(vm.as_mut(), opts.boot_timeout, started).await?;
        let init = InitRequest {
            env_vars: opts.envs.clone(),
            timestamp_ns: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok().map(|d| d.as_nanos()),
            hostname: Some("hutch".into()),
            access_token: opts.access_token.clone(),
            ..InitRequest::default()
        };
        agent.post_json("/init", &init).await.map_err(CreateError::Init)?;
        if let Some(port) = artifacts.template.ready_port() {
            wait_for_port(&agent, port, opts.boot_timeout, started, &dir).await?;
        }
        let mut guard = guard;
        guard.0 = None;
        Ok(Sandbox { id, dir, vm: Some(vm), agent, boot_time: started.elapsed() })
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

    pub fn console_tail(&self, lines: usize) -> String {
        console_tail(&self.dir.join("console.log"), lines)
    }

    /// Stops the VM and removes every file of the sandbox. The disk is thrown away, so
    /// there is nothing to flush: QEMU is told to quit and killed if it lingers.
    pub async fn destroy(mut self) -> Result<(), hutch_vmm::StopError> {
        let result = match self.vm.as_mut() {
            Some(vm) => vm.stop(Duration::from_secs(2)).await,
            None => Ok(()),
        };
        self.vm = None;
        let _ = std::fs::remove_dir_all(&self.dir);
        result
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        // Dropping the handle kills QEMU; then nothing holds the directory.
        self.vm = None;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The line the agent prints on the console once it serves the channel.
pub const READY_LINE: &str = "hutch-agent: ready";

/// Waits for the booting guest's agent. The console says when the agent serves the
/// channel, so the host connects once and then waits: reconnecting while the guest
/// is mid-session (slow under TCG) would hand the new hello to the old session.
async fn wait_for_agent(vm: &mut dyn VmHandle, limit: Duration, started: Instant) -> Result<AgentClient, CreateError> {
    let console = vm.console_log();
    let exited = |vm: &mut dyn VmHandle| vm.exit_status().map(|status| CreateError::VmExited { status, console: console_tail(&console, 30) });
    let timed_out = || CreateError::BootTimeout { secs: limit.as_secs(), console: console_tail(&console, 30) };
    loop {
        if let Some(e) = exited(vm) {
            return Err(e);
        }
        if started.elapsed() >= limit {
            return Err(timed_out());
        }
        if console_says_ready(&console) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let socket = vm.agent_socket();
    loop {
        let left = limit.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Err(timed_out());
        }
        let attempt = async {
            let client = agent::connect(&socket).await.map_err(|e| e.to_string())?;
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
async fn wait_for_port(agent: &AgentClient, port: u16, limit: Duration, started: Instant, dir: &Path) -> Result<(), CreateError> {
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

fn console_says_ready(console: &Path) -> bool {
    std::fs::read(console).map(|b| b.windows(READY_LINE.len()).any(|w| w == READY_LINE.as_bytes())).unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hutch_image::kernel::Kernel;
    use hutch_image::rootfs::Template;
    use hutch_vmm::fake::FakeBackend;

    fn fake_artifacts(root: &Path) -> Artifacts {
        Artifacts {
            kernel: Kernel { version: "6.1-test".into(), package: "p".into(), package_version: "1".into(), dir: root.join("k") },
            initramfs: root.join("initrd"),
            template: Template {
                name: "base".into(),
                suite: "bookworm".into(),
                packages: vec![],
                built_at: String::new(),
                disk_size: 1 << 20,
                build_id: "x".into(),
                dir: root.join("t"),
            },
        }
    }

    fn setup() -> (tempfile::TempDir, HutchHome, Artifacts) {
        let tmp = tempfile::tempdir().expect("tempdir");
        let home = HutchHome::at(tmp.path().join("home"));
        let artifacts = fake_artifacts(tmp.path());
        std::fs::create_dir_all(artifacts.template.dir.clone()).expect("dir");
        // A raw image qemu-img can stack an overlay on.
        std::fs::write(artifacts.template.image(), vec![0u8; 1 << 20]).expect("image");
        (tmp, home, artifacts)
    }

    #[tokio::test]
    async fn a_backend_failure_leaves_no_directory() {
        let (_tmp, home, artifacts) = setup();
        let backend = FakeBackend::default();
        *backend.fail_start.lock().expect("lock") = Some("no luck".into());
        let err = Sandbox::create(&home, &artifacts, &backend, &SandboxOptions::default()).await.err();
        assert!(matches!(err, Some(CreateError::Start(_))), "{err:?}");
        assert_eq!(std::fs::read_dir(home.sandboxes()).expect("dir").count(), 0);
    }

    #[tokio::test]
    async fn a_guest_that_never_answers_times_out_and_is_stopped() {
        let (_tmp, home, artifacts) = setup();
        let backend = FakeBackend::default();
        let opts = SandboxOptions { boot_timeout: Duration::from_millis(300), ..SandboxOptions::default() };
        let err = Sandbox::create(&home, &artifacts, &backend, &opts).await.err();
        assert!(matches!(&err, Some(CreateError::BootTimeout { console, .. }) if console.contains("empty")), "{err:?}");
        assert_eq!(backend.started.lock().expect("lock").len(), 1);
        assert_eq!(backend.stopped.lock().expect("lock").len(), 1, "the VM was not stopped");
        assert_eq!(std::fs::read_dir(home.sandboxes()).expect("dir").count(), 0);
    }
}
