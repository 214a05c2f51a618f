//! The shared test environment: artifacts under a test HUTCH_HOME, one runtime, helpers.

use anyhow::Context;
use hutch_envd::{AgentClient, ProcessStream};
use hutch_core::{Artifacts, Sandbox, SandboxOptions};
use hutch_image::HutchHome;
use hutch_proto::process::{DataEvent, EndEvent, ProcessConfig, ProcessEvent, StartRequest};
use hutch_vmm::qemu::QemuBackend;
use libtest_mimic::{Failed, Trial};
use parking_lot::Mutex;
use std::future::Future;
use std::sync::Arc;
use tokio::runtime::Runtime;

pub struct Env {
    pub rt: Runtime,
    pub home: HutchHome,
    pub artifacts: Artifacts,
    pub backend: QemuBackend,
    /// Sandboxes handed out, destroyed at the end of their phase.
    shared: Mutex<Vec<Sandbox>>,
}

pub type Shared = Arc<SharedSandbox>;

/// A sandbox many trials use; only its agent client is shared.
pub struct SharedSandbox {
    pub agent: AgentClient,
}

impl Env {
    pub fn start() -> anyhow::Result<Env> {
        let home = HutchHome::from_env();
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let artifacts = Artifacts::prepare(&home, "base", &hutch_image::progress::Quiet).context("preparing artifacts")?;
        let backend = QemuBackend::with_cache_dir(home.root());
        Ok(Env { rt, home, artifacts, backend, shared: Mutex::new(Vec::new()) })
    }

    pub fn options() -> SandboxOptions {
        SandboxOptions { accel: hutch_vmm::Accel::Tcg, ..SandboxOptions::default() }
    }

    /// Options that boot the kernel instead of restoring the template snapshot.
    pub fn cold() -> SandboxOptions {
        SandboxOptions { cold: true, ..Self::options() }
    }

    pub fn boot(&self) -> anyhow::Result<Sandbox> {
        self.rt.block_on(Sandbox::create(&self.home, &self.artifacts, &self.backend, &Self::options())).context("booting a sandbox")
    }

    pub fn shared_sandbox(&self) -> Shared {
        let sandbox = match self.boot() {
            Ok(s) => s,
            Err(e) => {
                eprintln!("cannot boot the shared sandbox: {e:#}");
                std::process::exit(1);
            }
        };
        let shared = Arc::new(SharedSandbox { agent: sandbox.agent().clone() });
        self.shared.lock().push(sandbox);
        shared
    }

    pub fn destroy(&self, _shared: Shared) {
        let all = std::mem::take(&mut *self.shared.lock());
        for s in all {
            if let Err(e) = self.rt.block_on(s.destroy()) {
                eprintln!("destroying the shared sandbox: {e}");
            }
        }
    }

    /// What this test process left behind: its sandbox directories or QEMU children.
    pub fn leaks(&self) -> Option<String> {
        let me = std::process::id().to_string();
        let dirs: Vec<_> = std::fs::read_dir(self.home.sandboxes())
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|d| std::fs::read_to_string(d.join("owner.pid")).is_ok_and(|p| p.trim() == me))
            .collect();
        if !dirs.is_empty() {
            return Some(format!("sandbox directories left: {dirs:?}"));
        }
        let qemus = qemu_processes_of(&self.home);
        (!qemus.is_empty()).then(|| format!("QEMU processes left: {qemus:?}"))
    }

    /// A trial whose body runs on the shared runtime.
    pub fn trial<F, Fut>(self: &Arc<Self>, name: &str, body: F) -> Trial
    where
        F: FnOnce(Arc<Env>) -> Fut + Send + 'static,
        Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let env = self.clone();
        let label = name.to_string();
        Trial::test(name, move || {
            let started = std::time::Instant::now();
            let fut = body(env.clone());
            let result = env.rt.block_on(fut).map_err(|e| Failed::from(format!("{e:#}")));
            // One line per trial for scripts/suite_times.py (libtest-mimic reports no
            // per-test times of its own).
            eprintln!("trial-time {label} {:.2}s", started.elapsed().as_secs_f64());
            result
        })
    }
}

/// QEMU children of this process that `before` (taken when a trial began) did not
/// list: what that trial left running, whatever the clock check's sandbox, which runs
/// beside every trial, is doing.
pub fn qemus_since(home: &HutchHome, before: &[u32]) -> Vec<u32> {
    qemu_processes_of(home).into_iter().filter(|pid| !before.contains(pid)).collect()
}

/// PIDs of QEMU processes this test process started (its children, under this home).
pub fn qemu_processes_of(home: &HutchHome) -> Vec<u32> {
    let me = std::process::id();
    let needle = home.root().display().to_string();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()))
        .filter(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd);
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat.rsplit(')').next().and_then(|r| r.split_whitespace().nth(1)).and_then(|p| p.parse::<u32>().ok());
            cmd.starts_with("qemu-system") && cmd.contains(&needle) && ppid == Some(me)
        })
        .collect()
}

/// Output and end of a finished process.
#[derive(Debug, Default)]
pub struct Output {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub pty: Vec<u8>,
    pub end: EndEvent,
}

impl Output {
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

pub async fn collect(mut stream: ProcessStream) -> anyhow::Result<Output> {
    let mut out = Output::default();
    while let Some(ev) = stream.next().await {
        match ev? {
            ProcessEvent::Data(DataEvent::Stdout(b)) => out.stdout.extend_from_slice(&b),
            ProcessEvent::Data(DataEvent::Stderr(b)) => out.stderr.extend_from_slice(&b),
            ProcessEvent::Data(DataEvent::Pty(b)) => out.pty.extend_from_slice(&b),
            ProcessEvent::End(end) => {
                out.end = end;
                return Ok(out);
            }
            _ => {}
        }
    }
    anyhow::bail!("stream ended without an end event")
}

pub fn sh(script: &str) -> StartRequest {
    StartRequest {
        process: ProcessConfig { cmd: "/bin/sh".into(), args: vec!["-c".into(), script.into()], ..Default::default() },
        stdin: Some(false),
        ..Default::default()
    }
}

pub async fn run(agent: &AgentClient, script: &str) -> anyhow::Result<Output> {
    collect(agent.start(&sh(script)).await?).await
}

/// Fails the trial with a message unless `cond` holds.
#[macro_export]
macro_rules! check {
    ($cond:expr, $($fmt:tt)+) => {
        {
            let held: bool = $cond;
            if !held {
                anyhow::bail!($($fmt)+);
            }
        }
    };
}

/// Trials that all use the shared sandbox: `shared_trials!(env, sb, "name" => body, …)`.
#[macro_export]
macro_rules! shared_trials {
    ($env:expr, $sb:expr, $($name:literal => $body:path),* $(,)?) => {
        vec![$({
            let sb = $sb.clone();
            $env.trial($name, move |_env| $body(sb))
        }),*]
    };
}

/// The cgroup directories hutch put QEMU `pid` in (one per v1 controller, or one v2 group).
pub fn cgroups_of(pid: u32) -> anyhow::Result<Vec<std::path::PathBuf>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    Ok(text
        .lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            path.contains("/hutch/").then(|| match controllers.split(',').next().filter(|c| !c.is_empty()) {
                Some(c) => std::path::PathBuf::from(format!("/sys/fs/cgroup/{c}{path}")),
                None => std::path::PathBuf::from(format!("/sys/fs/cgroup{path}")),
            })
        })
        .collect())
}
