//! One owner per sandbox: a task that holds the sandbox's VM (`Sandbox`, absent while
//! paused) and its lifecycle state, and runs the operations asked of it one at a time,
//! each to its end. Callers send an operation over a channel and await its result;
//! a caller that goes away (a client that hangs up, a request timeout) cancels only
//! its wait, never the operation, so no pause is left between QMP `stop` and `cont`.
//! Like Firecracker's `VmmAction`s into its event loop, with hutch's own state machine
//! (`state.rs`).

use super::state::{advance, SandboxState, TransitionError};
use super::error::ManagerError;
use hutch_envd::AgentClient;
use crate::sandbox::Sandbox;
use crate::store::{Store, StoreError};
use crate::time::Timestamp;
use futures::future::BoxFuture;
use std::sync::atomic::{AtomicBool, Ordering};
use parking_lot::Mutex;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// What readers see of the owner, written by it alone on every change: its state, why
/// it failed, the data plane's way in (the agent, only while it runs), its QEMU and
/// its end.
#[derive(Clone)]
struct Published {
    state: SandboxState,
    failure: Option<String>,
    agent: Option<AgentClient>,
    pid: Option<i64>,
    end_at: Timestamp,
}

/// Where the owner keeps what must outlive the server: the sandbox's row.
#[derive(Clone)]
pub(super) struct Record {
    pub store: Store,
    pub id: String,
}

/// What the owner holds; operations get it exclusively while they run.
pub(super) struct Owned {
    state: SandboxState,
    sandbox: Option<Sandbox>,
    end_at: Timestamp,
    record: Record,
    /// The state published to readers, updated on every move.
    published: Arc<Mutex<Published>>,
}

impl Owned {
    pub fn state(&self) -> SandboxState {
        self.state
    }

    pub fn sandbox(&self) -> Option<&Sandbox> {
        self.sandbox.as_ref()
    }

    pub fn sandbox_mut(&mut self) -> Option<&mut Sandbox> {
        self.sandbox.as_mut()
    }

    /// Takes the VM out (a pause that saved it, a kill, a shutdown letting it go).
    pub fn take_sandbox(&mut self) -> Option<Sandbox> {
        let taken = self.sandbox.take();
        self.publish();
        taken
    }

    /// Holds `sandbox` (a resumed VM) from now on.
    pub fn put_sandbox(&mut self, sandbox: Sandbox) {
        self.sandbox = Some(sandbox);
        self.publish();
    }

    /// What readers see, from what the owner holds: the agent only while the sandbox
    /// runs, so no data-plane request reaches a guest being saved, killed or failed.
    fn publish(&self) {
        let mut p = self.published.lock();
        p.state = self.state;
        p.agent = self.sandbox.as_ref().filter(|_| self.state == SandboxState::Running).map(|s| s.agent().clone());
        p.pid = self.sandbox.as_ref().and_then(Sandbox::pid).map(i64::from);
        p.end_at = self.end_at;
    }

    /// Moves to `next` (readers see it at once), or says why the machine refuses.
    pub fn advance(&mut self, next: SandboxState) -> Result<SandboxState, TransitionError> {
        let previous = advance(&mut self.state, next)?;
        self.publish();
        Ok(previous)
    }

    /// Ends creation (`Creating`): holds `sandbox`, ending at `end_at`, and runs. Its
    /// row was just written whole, so nothing is written here.
    pub fn start_running(&mut self, sandbox: Sandbox, end_at: Timestamp) -> Result<(), TransitionError> {
        if self.state != SandboxState::Creating {
            return Err(TransitionError { from: self.state, to: SandboxState::Running });
        }
        self.sandbox = Some(sandbox);
        self.end_at = end_at;
        self.advance(SandboxState::Running).map(drop)
    }

    /// Moves to an intermediate state (`Pausing`, `Resuming`, `Snapshotting`) for the
    /// guard's life: if the operation returns early (a `?`, a missing VM) without
    /// moving on, the guard moves it back where it began. Moving on is the operation's.
    pub fn begin(&mut self, during: SandboxState) -> Result<Step<'_>, TransitionError> {
        let from = self.advance(during)?;
        Ok(Step { owned: self, from, during })
    }

    /// Moves to `next` and records it: the one place a sandbox's state is written to
    /// the store (`persist`).
    pub async fn settle(&mut self, next: SandboxState) -> Result<SandboxState, ManagerError> {
        let previous = self.advance(next)?;
        self.persist().await?;
        Ok(previous)
    }

    /// Writes the state (as E2B's two states), its QEMU and its end to the sandbox's row:
    /// what the next server adopts. The only writer of the `state` column.
    pub async fn persist(&self) -> Result<(), StoreError> {
        let pid = self.sandbox.as_ref().and_then(Sandbox::pid).map(i64::from);
        self.record.store.set_state(&self.record.id, self.state.api_name(), pid, self.end_at).await
    }

    /// Sets when the sandbox ends, for readers and in its row.
    pub async fn set_end_at(&mut self, end_at: Timestamp) -> Result<(), StoreError> {
        self.end_at = end_at;
        self.publish();
        self.record.store.set_end_at(&self.record.id, end_at).await
    }

    /// Moves to `next` with a new end, both written to the row at once (`persist`).
    pub async fn settle_until(&mut self, next: SandboxState, end_at: Timestamp) -> Result<SandboxState, ManagerError> {
        self.end_at = end_at;
        self.settle(next).await
    }

    /// After a save that failed halfway (a pause or snapshot): back to running (its
    /// agent published again) if the VM runs and its agent answers, else failed with
    /// the reason, for the user to see and kill.
    pub async fn settle_after_failure(&mut self) -> Result<(), TransitionError> {
        let health = match self.sandbox.as_mut() {
            Some(sandbox) => sandbox.health().await,
            None => Err("it has no VM".to_string()),
        };
        match health {
            Ok(()) => self.advance(SandboxState::Running).map(drop),
            Err(why) => {
                tracing::warn!("a sandbox failed: {why}");
                self.fail(why).map(drop)
            }
        }
    }

    /// Moves to `Failed`, saying why: what the user sees until they kill it.
    pub fn fail(&mut self, why: String) -> Result<SandboxState, TransitionError> {
        if !self.state.can_become(SandboxState::Failed) {
            return Err(TransitionError { from: self.state, to: SandboxState::Failed });
        }
        // The reason first: a reader that sees Failed finds why.
        self.published.lock().failure = Some(why);
        self.advance(SandboxState::Failed)
    }
}

/// An operation's intermediate state (`Owned::begin`): rolled back by `Drop` unless the
/// operation moved on from it. Derefs to what the owner holds.
pub(super) struct Step<'a> {
    owned: &'a mut Owned,
    from: SandboxState,
    during: SandboxState,
}

impl std::ops::Deref for Step<'_> {
    type Target = Owned;
    fn deref(&self) -> &Owned {
        self.owned
    }
}

impl std::ops::DerefMut for Step<'_> {
    fn deref_mut(&mut self) -> &mut Owned {
        self.owned
    }
}

impl Drop for Step<'_> {
    fn drop(&mut self) {
        if self.owned.state != self.during {
            return;
        }
        // A panic mid-operation leaves the VM in an unknown state (and the owner task
        // ends with it): failed, never shown running again.
        if std::thread::panicking() {
            let _ = self.owned.fail("an operation on it panicked; kill it".into());
            return;
        }
        // Every intermediate state may go back to where it came from (`state.rs`).
        if let Err(e) = self.owned.advance(self.from) {
            tracing::error!("rolling back an operation cut short: {e}");
        }
    }
}

type Operation = Box<dyn for<'a> FnOnce(&'a mut Owned) -> BoxFuture<'a, ()> + Send>;

/// The handle to a sandbox's owner task. Dropping the last one ends the task, which
/// drops what it holds (a running VM is killed, a paused sandbox's files stay).
pub(super) struct Owner {
    operations: mpsc::UnboundedSender<Operation>,
    state: Arc<Mutex<Published>>,
    busy: Arc<AtomicBool>,
}

impl Owner {
    /// Starts the owner of `sandbox` (None: paused) in `state`, ending at `end_at`, its
    /// row in `record`.
    pub fn spawn(state: SandboxState, sandbox: Option<Sandbox>, end_at: Timestamp, record: Record) -> Owner {
        let published = Arc::new(Mutex::new(Published { state, failure: None, agent: None, pid: None, end_at }));
        let busy = Arc::new(AtomicBool::new(false));
        let (operations, mut queue) = mpsc::unbounded_channel::<Operation>();
        let mut owned = Owned { state, sandbox, end_at, record, published: published.clone() };
        owned.publish();
        let running = busy.clone();
        tokio::spawn(async move {
            while let Some(operation) = queue.recv().await {
                running.store(true, Ordering::SeqCst);
                operation(&mut owned).await;
                running.store(false, Ordering::SeqCst);
            }
        });
        Owner { operations, state: published, busy }
    }

    /// The state as of the last move.
    pub fn state(&self) -> SandboxState {
        self.state.lock().state
    }

    /// Why it failed, once it has.
    pub fn failure(&self) -> Option<String> {
        self.state.lock().failure.clone()
    }

    /// The agent of the running sandbox (None unless it runs).
    pub fn agent(&self) -> Option<AgentClient> {
        self.state.lock().agent.clone()
    }

    /// Its QEMU's pid, while it has a VM.
    pub fn pid(&self) -> Option<i64> {
        self.state.lock().pid
    }

    /// When it ends.
    pub fn end_at(&self) -> Timestamp {
        self.state.lock().end_at
    }

    /// Whether an operation is running now (the reaper leaves such sandboxes alone).
    pub fn is_busy(&self) -> bool {
        self.busy.load(Ordering::SeqCst)
    }

    /// Runs `operation` in the owner, after those asked before it, and returns its
    /// result. Dropping this future does not stop the operation.
    pub async fn run<T: Send + 'static>(&self, operation: impl for<'a> FnOnce(&'a mut Owned) -> BoxFuture<'a, T> + Send + 'static) -> Result<T, ManagerError> {
        let (reply, answer) = oneshot::channel();
        let wrapped: Operation = Box::new(move |owned| {
            Box::pin(async move {
                // The caller may be gone: the operation ran all the same.
                let _ = reply.send(operation(owned).await);
            })
        });
        self.operations.send(wrapped).map_err(|_| ManagerError::Internal("the sandbox's owner task has ended".into()))?;
        answer.await.map_err(|_| ManagerError::Internal("the sandbox's owner task ended during the operation".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A record in a store of its own (the owner writes to it only when it settles).
    async fn record() -> (tempfile::TempDir, Record) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open_file(&dir.path().join("hutch.db")).await.expect("store");
        (dir, Record { store, id: "sbx".into() })
    }

    #[tokio::test]
    async fn operations_run_one_at_a_time_in_order_and_finish_when_their_caller_leaves() {
        let (_dir, record) = record().await;
        let owner = Arc::new(Owner::spawn(SandboxState::Running, None, Timestamp::now(), record));
        let log = Arc::new(Mutex::new(Vec::new()));
        let (release, wait) = oneshot::channel::<()>();
        // A pause whose caller gives up halfway: it still runs to its end.
        let first = {
            let log = log.clone();
            owner.run(move |o: &mut Owned| -> BoxFuture<'_, ()> {
                Box::pin(async move {
                    o.advance(SandboxState::Pausing).expect("running may pause");
                    let _ = wait.await;
                    o.advance(SandboxState::Paused).expect("pausing may end paused");
                    log.lock().push("paused");
                })
            })
        };
        let abandoned = tokio::time::timeout(Duration::from_millis(50), first).await;
        assert!(abandoned.is_err(), "the operation waits for its release");
        assert_eq!(owner.state(), SandboxState::Pausing);
        assert!(owner.is_busy());
        let second = {
            let (owner, log) = (owner.clone(), log.clone());
            tokio::spawn(async move {
                owner.run(move |o: &mut Owned| -> BoxFuture<'_, Result<SandboxState, TransitionError>> {
                    Box::pin(async move {
                        log.lock().push("second");
                        o.advance(SandboxState::Resuming)
                    })
                }).await
            })
        };
        let _ = release.send(());
        let resumed = second.await.expect("task").expect("owner");
        assert_eq!(resumed, Ok(SandboxState::Paused), "the second started from the first's end");
        assert_eq!(*log.lock(), vec!["paused", "second"]);
        assert_eq!(owner.state(), SandboxState::Resuming);
    }

    #[tokio::test]
    async fn a_refused_move_leaves_the_state_and_says_why() {
        let (_dir, record) = record().await;
        let owner = Owner::spawn(SandboxState::Paused, None, Timestamp::now(), record);
        let refused = owner.run(|o: &mut Owned| -> BoxFuture<'_, _> { Box::pin(async move { o.advance(SandboxState::Pausing) }) }).await.expect("owner");
        assert_eq!(refused, Err(TransitionError { from: SandboxState::Paused, to: SandboxState::Pausing }));
        assert_eq!(owner.state(), SandboxState::Paused);
    }

    #[tokio::test]
    async fn an_operation_cut_short_goes_back_to_where_it_began() {
        let (_dir, record) = record().await;
        let owner = Owner::spawn(SandboxState::Running, None, Timestamp::now(), record);
        // A pause that returns early (here: it finds no VM) after it began.
        let cut_short = owner
            .run(|o: &mut Owned| -> BoxFuture<'_, Result<(), ManagerError>> {
                Box::pin(async move {
                    let step = o.begin(SandboxState::Pausing)?;
                    assert_eq!(step.state(), SandboxState::Pausing);
                    step.sandbox().ok_or_else(|| ManagerError::Internal("no VM".into()))?;
                    Ok(())
                })
            })
            .await
            .expect("owner");
        assert!(cut_short.is_err());
        assert_eq!(owner.state(), SandboxState::Running, "rolled back by the guard");
        // One that moved on keeps where it went.
        let moved_on = owner
            .run(|o: &mut Owned| -> BoxFuture<'_, Result<(), TransitionError>> {
                Box::pin(async move {
                    let mut step = o.begin(SandboxState::Pausing)?;
                    step.advance(SandboxState::Paused)?;
                    Ok(())
                })
            })
            .await
            .expect("owner");
        assert_eq!(moved_on, Ok(()));
        assert_eq!(owner.state(), SandboxState::Paused);
    }
}
