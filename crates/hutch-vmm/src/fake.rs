//! A backend that starts no VM, for unit tests of code above the VMM. It records what
//! was asked of it, can be told to fail, and can hold any step at a gate so a test can
//! act while an operation waits there (drop its caller, say).
//!
//! With a `FakeGuest` it also runs a stand-in guest per VM (the caller's: the VMM does
//! not know what a guest serves), which can save and load its memory like a real one:
//! `save` writes the guest's memory to the state file, `load` starts a guest from it.

use crate::backend::{CpuShare, CpuShareError, SnapshotError, StartError, StopError, VmBackend, VmHandle, VmSpec};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use parking_lot::Mutex;
use std::sync::Arc;

/// Stands in for the guest of a fake VM.
pub trait FakeGuest: Send + Sync {
    /// Starts the guest of `spec`: booted (`memory` None) or from a saved memory.
    fn run(&self, spec: &VmSpec, memory: Option<Vec<u8>>) -> Box<dyn RunningGuest>;
}

/// A guest while its VM lives; dropping it ends the guest.
pub trait RunningGuest: Send + Sync {
    /// What a save writes.
    fn memory(&self) -> Vec<u8>;
}

/// The VM operations a test can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    Start,
    Load,
    Save,
    Resume,
    Stop,
}

/// A held step: the next VM to reach it waits there until `release`.
pub struct Hold {
    reached: tokio::sync::Notify,
    released: tokio::sync::Semaphore,
}

impl Hold {
    /// Waits until a VM is waiting at the step.
    pub async fn reached(&self) {
        self.reached.notified().await;
    }

    /// Lets the waiting VM (and any later one) through.
    pub fn release(&self) {
        self.released.add_permits(1 << 20);
    }
}

/// What a save writes before the guest's memory, so a load can tell a fake state file.
const STATE_MAGIC: &[u8] = b"hutch-fake-vm-state\n";

#[derive(Default, Clone)]
pub struct FakeBackend {
    pub started: Arc<Mutex<Vec<VmSpec>>>,
    pub stopped: Arc<Mutex<Vec<String>>>,
    pub fail_start: Arc<Mutex<Option<String>>>,
    /// The next save fails with this detail.
    pub fail_save: Arc<Mutex<Option<String>>>,
    pub guest: Option<Arc<dyn FakeGuest>>,
    /// VMs (by spec id) that have ended on their own, as a guest panic would end them.
    crashed: Arc<Mutex<std::collections::HashSet<String>>>,
    holds: Arc<Mutex<HashMap<Step, Arc<Hold>>>>,
    /// The CPU share each VM (by spec id) was last given.
    pub cpu_shares: Arc<Mutex<HashMap<String, CpuShare>>>,
}

impl FakeBackend {
    /// A backend whose VMs run `guest`.
    pub fn with_guest(guest: Arc<dyn FakeGuest>) -> FakeBackend {
        FakeBackend { guest: Some(guest), ..FakeBackend::default() }
    }

    /// Holds the next VM that reaches `step` until the returned hold is released.
    pub fn hold(&self, step: Step) -> Arc<Hold> {
        let hold = Arc::new(Hold { reached: tokio::sync::Notify::new(), released: tokio::sync::Semaphore::new(0) });
        self.holds.lock().insert(step, hold.clone());
        hold
    }

    /// Ends the VM of sandbox `id` from outside, as a guest kernel panic would.
    pub fn crash(&self, id: &str) {
        self.crashed.lock().insert(id.to_string());
    }

    /// VMs started and not yet ended.
    pub fn live(&self) -> usize {
        self.started.lock().len() - self.stopped.lock().len()
    }
}

/// Where a fake VM's guest is.
enum Run {
    /// Started with `-incoming`: nothing runs until a load.
    Incoming,
    Running,
    /// Stopped for a save, or loaded and not yet resumed.
    Paused,
    Ended,
}

struct FakeVm {
    spec: VmSpec,
    stopped: Arc<Mutex<Vec<String>>>,
    holds: Arc<Mutex<HashMap<Step, Arc<Hold>>>>,
    fail_save: Arc<Mutex<Option<String>>>,
    crashed: Arc<Mutex<std::collections::HashSet<String>>>,
    cpu_shares: Arc<Mutex<HashMap<String, CpuShare>>>,
    factory: Option<Arc<dyn FakeGuest>>,
    guest: Option<Box<dyn RunningGuest>>,
    run: Run,
    /// The NIC's listening socket, as QEMU's stream netdev holds it: a stack's
    /// connection waits in its backlog, and ends with the VM.
    nic: Option<std::os::unix::net::UnixListener>,
}

#[async_trait::async_trait]
impl VmBackend for FakeBackend {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn snapshot_key(&self) -> String {
        "fake".into()
    }

    async fn start(&self, spec: &VmSpec) -> Result<Box<dyn VmHandle>, StartError> {
        pass(&self.holds, Step::Start).await;
        if let Some(msg) = self.fail_start.lock().clone() {
            return Err(StartError::Exited { status: "exit status: 1".into(), stderr: msg });
        }
        self.started.lock().push(spec.clone());
        let nic = match &spec.nic {
            Some(nic) if nic.listens() => {
                let _ = std::fs::remove_file(spec.net_socket());
                Some(std::os::unix::net::UnixListener::bind(spec.net_socket()).map_err(StartError::Spawn)?)
            }
            _ => None,
        };
        let mut vm = FakeVm {
            spec: spec.clone(),
            stopped: self.stopped.clone(),
            holds: self.holds.clone(),
            fail_save: self.fail_save.clone(),
            crashed: self.crashed.clone(),
            cpu_shares: self.cpu_shares.clone(),
            factory: self.guest.clone(),
            guest: None,
            run: Run::Incoming,
            nic,
        };
        if spec.incoming.is_none() {
            vm.guest = vm.factory.as_ref().map(|f| f.run(spec, None));
            vm.run = Run::Running;
        }
        Ok(Box::new(vm))
    }
}

/// Waits at `step` if a test holds it (once: the hold is used up).
async fn pass(holds: &Mutex<HashMap<Step, Arc<Hold>>>, step: Step) {
    let hold = holds.lock().remove(&step);
    if let Some(hold) = hold {
        hold.reached.notify_one();
        let _ = hold.released.acquire().await.map(|p| p.forget());
    }
}

impl FakeVm {
    fn end(&mut self) {
        if !matches!(self.run, Run::Ended) {
            self.run = Run::Ended;
            self.guest = None;
            self.nic = None;
            self.stopped.lock().push(self.spec.id.clone());
        }
    }

    fn notice_crash(&mut self) {
        if self.crashed.lock().contains(&self.spec.id) {
            self.end();
        }
    }

    fn failed(what: &'static str, detail: impl std::fmt::Display) -> SnapshotError {
        SnapshotError::Migration { what, detail: detail.to_string() }
    }
}

#[async_trait::async_trait]
impl VmHandle for FakeVm {
    fn pid(&self) -> Option<u32> {
        None
    }
    fn set_cpu_share(&self, share: CpuShare) -> Result<(), CpuShareError> {
        self.cpu_shares.lock().insert(self.spec.id.clone(), share);
        Ok(())
    }
    fn agent_socket(&self) -> PathBuf {
        self.spec.agent_socket()
    }
    fn console_log(&self) -> PathBuf {
        self.spec.console_log()
    }
    fn exit_status(&mut self) -> Option<String> {
        self.notice_crash();
        matches!(self.run, Run::Ended).then(|| "stopped".to_string())
    }
    async fn stop(&mut self, _grace: std::time::Duration) -> Result<(), StopError> {
        pass(&self.holds, Step::Stop).await;
        self.end();
        Ok(())
    }
    async fn kill(&mut self) -> Result<(), StopError> {
        // A kill waits for the process to go, as a stop does.
        pass(&self.holds, Step::Stop).await;
        self.end();
        Ok(())
    }
    async fn save(&mut self, state: &Path, _ignore_shared: bool) -> Result<(), SnapshotError> {
        if self.factory.is_none() {
            return Err(SnapshotError::Unsupported);
        }
        pass(&self.holds, Step::Save).await;
        self.notice_crash();
        if matches!(self.run, Run::Ended | Run::Incoming) {
            return Err(SnapshotError::NoQmp);
        }
        // A save stops the guest first, whether or not it then succeeds.
        self.run = Run::Paused;
        if let Some(detail) = self.fail_save.lock().take() {
            return Err(Self::failed("save", detail));
        }
        let mut bytes = STATE_MAGIC.to_vec();
        bytes.extend(self.guest.as_ref().map(|g| g.memory()).unwrap_or_default());
        std::fs::write(state, bytes).map_err(|e| Self::failed("save", e))
    }
    async fn load(&mut self) -> Result<(), SnapshotError> {
        let Some(factory) = self.factory.clone() else { return Err(SnapshotError::Unsupported) };
        pass(&self.holds, Step::Load).await;
        let Some(incoming) = &self.spec.incoming else { return Err(Self::failed("load", "the VM was not started to load a state")) };
        let bytes = std::fs::read(&incoming.state).map_err(|e| Self::failed("load", e))?;
        let memory = bytes.strip_prefix(STATE_MAGIC).ok_or_else(|| Self::failed("load", "not a fake VM's state"))?;
        self.guest = Some(factory.run(&self.spec, Some(memory.to_vec())));
        self.run = Run::Paused;
        Ok(())
    }
    async fn run_state(&mut self) -> Result<String, SnapshotError> {
        self.notice_crash();
        Ok(match self.run {
            Run::Incoming => "inmigrate",
            Run::Running => "running",
            Run::Paused => "paused",
            Run::Ended => "shutdown",
        }
        .to_string())
    }
    /// A fake VM lives in this process: nothing outlives it.
    fn release(self: Box<Self>) {}
    async fn resume(&mut self) -> Result<(), SnapshotError> {
        if self.factory.is_none() {
            return Err(SnapshotError::Unsupported);
        }
        pass(&self.holds, Step::Resume).await;
        self.notice_crash();
        match self.run {
            Run::Paused | Run::Running => {
                self.run = Run::Running;
                Ok(())
            }
            _ => Err(SnapshotError::NoQmp),
        }
    }
}

impl Drop for FakeVm {
    fn drop(&mut self) {
        self.end();
    }
}
