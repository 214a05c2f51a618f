//! Child reaping. As PID 1 the agent inherits every orphan, so one task calls
//! `waitpid(-1)` for all children and hands our own processes' statuses to their waiters.
//!
//! The table lock is held across `spawn` and across each round of `waitpid`: std's spawn
//! waits for a child whose `exec` failed, and a reaper that took that zombie first would
//! make it panic; a pid reaped while not in the table is then certainly an orphan.

use hutch_proto::process::EndEvent;
use hutch_proto::signal::{status_for_exit, status_for_signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use std::collections::HashMap;
use parking_lot::{Mutex, MutexGuard};
use std::sync::Arc;
use tokio::sync::oneshot;

#[derive(Default, Clone)]
pub struct Reaper {
    waiters: Arc<Mutex<HashMap<i32, oneshot::Sender<EndEvent>>>>,
}

impl Reaper {
    /// Lock the table; spawn while holding the guard, then `register` the new pid.
    pub fn lock(&self) -> MutexGuard<'_, HashMap<i32, oneshot::Sender<EndEvent>>> {
        self.waiters.lock()
    }

    pub fn register(
        table: &mut HashMap<i32, oneshot::Sender<EndEvent>>,
        pid: i32,
    ) -> oneshot::Receiver<EndEvent> {
        let (tx, rx) = oneshot::channel();
        table.insert(pid, tx);
        rx
    }

    /// Runs forever: reaps on every SIGCHLD.
    pub async fn run(self) -> std::io::Result<()> {
        let mut sigchld = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child())?;
        loop {
            self.reap_all();
            sigchld.recv().await;
        }
    }

    fn reap_all(&self) {
        let mut table = self.lock();
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => deliver(&mut table, pid, exited(code)),
                Ok(WaitStatus::Signaled(pid, sig, _)) => deliver(&mut table, pid, signaled(sig as i32)),
                Ok(WaitStatus::StillAlive) | Err(_) => return,
                Ok(_) => {}
            }
        }
    }
}

fn deliver(table: &mut HashMap<i32, oneshot::Sender<EndEvent>>, pid: Pid, end: EndEvent) {
    if let Some(tx) = table.remove(&pid.as_raw()) {
        let _ = tx.send(end);
    }
}

pub fn exited(code: i32) -> EndEvent {
    EndEvent { exit_code: code, exited: true, status: status_for_exit(code), error: None }
}

pub fn signaled(sig: i32) -> EndEvent {
    EndEvent { exit_code: -1, exited: false, status: status_for_signal(sig), error: None }
}
