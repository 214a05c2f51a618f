//! One owner per sandbox: a task that holds the sandbox's VM (`Sandbox`, absent while
//! paused) and its lifecycle state, and runs the operations asked of it one at a time,
//! each to its end. Callers send an operation over a channel and await its result;
//! a caller that goes away (a client that hangs up, a request timeout) cancels only
//! its wait, never the operation, so no pause is left between QMP `stop` and `cont`.
//! Like Firecracker's `VmmAction`s into its event loop, with hutch's own state machine
//! (`state.rs`).

use super::state::{advance, SandboxState, TransitionError};
use super::{lock, ManagerError};
use crate::agent::AgentClient;
use crate::sandbox::Sandbox;
use futures::future::BoxFuture;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, oneshot};

/// What readers see of the owner: its state, and why it failed if it did.
#[derive(Debug, Clone)]
struct Published {
    state: SandboxState,
    failure: Option<String>,
}

/// What the owner holds; operations get it exclusively while they run.
pub(super) struct Owned {
    state: SandboxState,
    pub sandbox: Option<Sandbox>,
    /// The state published to readers, updated on every move.
    published: Arc<Mutex<Published>>,
}

impl Owned {
    pub fn state(&self) -> SandboxState {
        self.state
    }

    /// Moves to `next` (readers see it at once), or says why the machine refuses.
    pub fn advance(&mut self, next: SandboxState) -> Result<SandboxState, TransitionError> {
        let previous = advance(&mut self.state, next)?;
        lock(&self.published).state = next;
        Ok(previous)
    }

    /// After a save that failed halfway (a pause or snapshot): back to running with the
    /// data plane's agent restored if the VM runs and its agent answers, else failed
    /// with the reason, for the user to see and kill.
    pub async fn settle_after_failure(&mut self, agent: &Mutex<Option<AgentClient>>) -> Result<(), TransitionError> {
        let health = match self.sandbox.as_mut() {
            Some(sandbox) => sandbox.health().await,
            None => Err("it has no VM".to_string()),
        };
        match health {
            Ok(()) => {
                if let Some(sandbox) = self.sandbox.as_ref() {
                    *lock(agent) = Some(sandbox.agent().clone());
                }
                self.advance(SandboxState::Running).map(drop)
            }
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
        lock(&self.published).failure = Some(why);
        self.advance(SandboxState::Failed)
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
    /// Starts the owner of `sandbox` (None: paused) in `state`.
    pub fn spawn(state: SandboxState, sandbox: Option<Sandbox>) -> Owner {
        let published = Arc::new(Mutex::new(Published { state, failure: None }));
        let busy = Arc::new(AtomicBool::new(false));
        let (operations, mut queue) = mpsc::unbounded_channel::<Operation>();
        let mut owned = Owned { state, sandbox, published: published.clone() };
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
        lock(&self.state).state
    }

    /// Why it failed, once it has.
    pub fn failure(&self) -> Option<String> {
        lock(&self.state).failure.clone()
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

    #[tokio::test]
    async fn operations_run_one_at_a_time_in_order_and_finish_when_their_caller_leaves() {
        let owner = Arc::new(Owner::spawn(SandboxState::Running, None));
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
                    lock(&log).push("paused");
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
                        lock(&log).push("second");
                        o.advance(SandboxState::Resuming)
                    })
                }).await
            })
        };
        let _ = release.send(());
        let resumed = second.await.expect("task").expect("owner");
        assert_eq!(resumed, Ok(SandboxState::Paused), "the second started from the first's end");
        assert_eq!(*lock(&log), vec!["paused", "second"]);
        assert_eq!(owner.state(), SandboxState::Resuming);
    }

    #[tokio::test]
    async fn a_refused_move_leaves_the_state_and_says_why() {
        let owner = Owner::spawn(SandboxState::Paused, None);
        let refused = owner.run(|o: &mut Owned| -> BoxFuture<'_, _> { Box::pin(async move { o.advance(SandboxState::Pausing) }) }).await.expect("owner");
        assert_eq!(refused, Err(TransitionError { from: SandboxState::Paused, to: SandboxState::Pausing }));
        assert_eq!(owner.state(), SandboxState::Paused);
    }
}
