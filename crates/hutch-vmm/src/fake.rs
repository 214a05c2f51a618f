//! A backend that starts nothing, for unit tests of code above the VMM. It records what
//! was asked of it and can be told to fail.

use crate::backend::{SnapshotError, StartError, StopError, VmBackend, VmHandle, VmSpec};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

#[derive(Default, Clone)]
pub struct FakeBackend {
    pub started: Arc<Mutex<Vec<VmSpec>>>,
    pub stopped: Arc<Mutex<Vec<String>>>,
    pub fail_start: Arc<Mutex<Option<String>>>,
}

struct FakeVm {
    spec: VmSpec,
    stopped: Arc<Mutex<Vec<String>>>,
    ended: bool,
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
        if let Some(msg) = self.fail_start.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return Err(StartError::Exited { status: "exit status: 1".into(), stderr: msg });
        }
        self.started.lock().unwrap_or_else(|e| e.into_inner()).push(spec.clone());
        Ok(Box::new(FakeVm { spec: spec.clone(), stopped: self.stopped.clone(), ended: false }))
    }
}

impl FakeVm {
    fn end(&mut self) {
        if !self.ended {
            self.ended = true;
            self.stopped.lock().unwrap_or_else(|e| e.into_inner()).push(self.spec.id.clone());
        }
    }
}

#[async_trait::async_trait]
impl VmHandle for FakeVm {
    fn pid(&self) -> Option<u32> {
        None
    }
    fn agent_socket(&self) -> PathBuf {
        self.spec.agent_socket()
    }
    fn console_log(&self) -> PathBuf {
        self.spec.console_log()
    }
    fn exit_status(&mut self) -> Option<String> {
        self.ended.then(|| "stopped".to_string())
    }
    async fn stop(&mut self, _grace: std::time::Duration) -> Result<(), StopError> {
        self.end();
        Ok(())
    }
    async fn kill(&mut self) -> Result<(), StopError> {
        self.end();
        Ok(())
    }
    async fn save(&mut self, _state: &Path, _ignore_shared: bool) -> Result<(), SnapshotError> {
        Err(SnapshotError::Unsupported)
    }
    async fn load(&mut self) -> Result<(), SnapshotError> {
        Err(SnapshotError::Unsupported)
    }
    async fn run_state(&mut self) -> Result<String, SnapshotError> {
        Ok(if self.ended { "shutdown" } else { "running" }.to_string())
    }
    /// A fake VM lives in this process: nothing outlives it.
    fn release(self: Box<Self>) {}
    async fn resume(&mut self) -> Result<(), SnapshotError> {
        Err(SnapshotError::Unsupported)
    }
}

impl Drop for FakeVm {
    fn drop(&mut self) {
        self.end();
    }
}
