//! One QEMU process: spawn, wait for QMP, stop, kill. Dropping a `QemuVm` kills the
//! process (tokio's kill_on_drop), and with `die_with_parent` the kernel kills it if
//! hutch itself dies (PR_SET_PDEATHSIG), so neither a panic nor a SIGKILL leaks QEMU.

use crate::backend::{StartError, StopError, VmHandle, VmSpec};
use crate::qmp::Qmp;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

const QMP_WAIT: Duration = Duration::from_secs(10);
const MAX_SOCKET_PATH: usize = 107;

pub struct QemuVm {
    spec: VmSpec,
    child: Child,
    qmp: Option<Qmp>,
    exit: Option<String>,
}

fn stderr_of(spec: &VmSpec) -> String {
    std::fs::read_to_string(spec.dir.join("qemu.log")).unwrap_or_default().trim().to_string()
}

impl QemuVm {
    pub async fn start(binary: &str, spec: &VmSpec) -> Result<QemuVm, StartError> {
        for sock in [spec.agent_socket(), spec.qmp_socket()] {
            if sock.as_os_str().len() > MAX_SOCKET_PATH {
                return Err(StartError::PathTooLong(sock.display().to_string()));
            }
        }
        let log = std::fs::File::create(spec.dir.join("qemu.log")).map_err(StartError::Spawn)?;
        let mut cmd = Command::new(binary);
        cmd.args(super::command_line(spec))
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(StartError::Spawn)?)
            .stderr(log)
            .kill_on_drop(true)
            // Its own process group: a Ctrl-C at hutch's terminal is hutch's to handle.
            .process_group(0);
        if spec.die_with_parent {
            // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let child = cmd.spawn().map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => StartError::QemuMissing { binary: binary.into() },
            _ => StartError::Spawn(e),
        })?;
        let mut vm = QemuVm { spec: spec.clone(), child, qmp: None, exit: None };
        std::fs::write(spec.dir.join("qemu.pid"), vm.child.id().map(|p| p.to_string()).unwrap_or_default())
            .map_err(StartError::Spawn)?;
        vm.qmp = Some(vm.connect_qmp().await?);
        Ok(vm)
    }

    async fn connect_qmp(&mut self) -> Result<Qmp, StartError> {
        let started = Instant::now();
        loop {
            if let Some(status) = self.exit_status() {
                return Err(StartError::Exited { status, stderr: stderr_of(&self.spec) });
            }
            if self.spec.qmp_socket().exists() {
                match Qmp::connect(&self.spec.qmp_socket()).await {
                    Ok(q) => return Ok(q),
                    Err(e) if started.elapsed() > QMP_WAIT => return Err(StartError::Qmp(e)),
                    Err(_) => {}
                }
            }
            if started.elapsed() > QMP_WAIT {
                return Err(StartError::QmpTimeout { secs: QMP_WAIT.as_secs() });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn wait_exit(&mut self, limit: Duration) -> bool {
        match tokio::time::timeout(limit, self.child.wait()).await {
            Ok(Ok(status)) => {
                self.exit = Some(status.to_string());
                true
            }
            Ok(Err(_)) => true,
            Err(_) => false,
        }
    }
}

#[async_trait::async_trait]
impl VmHandle for QemuVm {
    fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    fn agent_socket(&self) -> PathBuf {
        self.spec.agent_socket()
    }

    fn console_log(&self) -> PathBuf {
        self.spec.console_log()
    }

    fn exit_status(&mut self) -> Option<String> {
        if self.exit.is_none() {
            if let Ok(Some(status)) = self.child.try_wait() {
                self.exit = Some(status.to_string());
            }
        }
        self.exit.clone()
    }

    async fn stop(&mut self, grace: Duration) -> Result<(), StopError> {
        if self.exit_status().is_some() {
            return Ok(());
        }
        if let Some(qmp) = self.qmp.as_mut() {
            let _ = tokio::time::timeout(grace, qmp.execute("quit", None)).await;
        }
        if self.wait_exit(grace).await {
            return Ok(());
        }
        self.kill().await
    }

    async fn kill(&mut self) -> Result<(), StopError> {
        if self.exit_status().is_some() {
            return Ok(());
        }
        let pid = self.child.id().unwrap_or(0);
        match self.child.kill().await {
            Ok(()) => {
                self.exit = Some("killed".into());
                Ok(())
            }
            Err(source) if self.exit_status().is_some() => {
                let _ = source;
                Ok(())
            }
            Err(source) => Err(StopError::Kill { pid, source }),
        }
    }
}
