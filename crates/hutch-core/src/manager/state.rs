//! A sandbox's lifecycle as a state machine. The owner task (`owner.rs`) is the only
//! one that moves it, and only along the edges `can_become` allows:
//!
//! ```text
//! Creating ─► Running ─► Pausing ─► Paused ─► Resuming ─► Running
//!               │ ▲                   │ ▲
//!               ▼ │                   ▼ │
//!           Snapshotting          Snapshotting
//!
//! rolled back:  Pausing ─► Running    Resuming ─► Paused
//! failed:       Creating, Running, Pausing, Resuming, Snapshotting ─► Failed
//! killed:       Creating, Running, Paused, Failed ─► Stopping ─► Stopped
//! ```
//!
//! Every operation's intermediate state (Pausing, Resuming, Snapshotting, Stopping) is
//! seen only by readers while it runs: the owner runs one operation at a time, so each
//! starts from a settled state and ends in one.

/// Where a sandbox is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SandboxState {
    Creating,
    Running,
    Pausing,
    Paused,
    Resuming,
    Snapshotting,
    Stopping,
    Stopped,
    /// Its VM ended or could not be brought back; it can only be killed.
    Failed,
}

impl SandboxState {
    /// Whether a sandbox in this state may move to `next`.
    pub fn can_become(self, next: SandboxState) -> bool {
        use SandboxState::*;
        matches!(
            (self, next),
            (Creating, Running | Failed | Stopping)
                | (Running, Pausing | Snapshotting | Stopping | Failed)
                | (Pausing, Paused | Running | Failed)
                | (Paused, Resuming | Snapshotting | Stopping)
                | (Resuming, Running | Paused | Failed)
                | (Snapshotting, Running | Paused | Failed)
                | (Failed, Stopping)
                | (Stopping, Stopped)
        )
    }

    /// How a client sees it, in E2B's two states: a sandbox being paused is already
    /// "paused" there (E2B lists it so), one being resumed still is.
    pub fn api_name(self) -> &'static str {
        use SandboxState::*;
        match self {
            Pausing | Paused | Resuming => "paused",
            _ => "running",
        }
    }

    fn verb(self) -> &'static str {
        use SandboxState::*;
        match self {
            Creating => "created",
            Running => "run",
            Pausing | Paused => "paused",
            Resuming => "resumed",
            Snapshotting => "snapshotted",
            Stopping | Stopped => "killed",
            Failed => "failed",
        }
    }

    fn adjective(self) -> &'static str {
        use SandboxState::*;
        match self {
            Creating => "being created",
            Running => "running",
            Pausing => "being paused",
            Paused => "paused",
            Resuming => "being resumed",
            Snapshotting => "being snapshotted",
            Stopping => "being killed",
            Stopped => "killed",
            Failed => "failed (its VM is gone; kill it)",
        }
    }
}

/// A move the state machine does not allow: the client's request does not fit the
/// sandbox's state (409).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the sandbox is {}, so it cannot be {}", from.adjective(), to.verb())]
pub struct TransitionError {
    pub from: SandboxState,
    pub to: SandboxState,
}

/// Moves `state` to `next` if the machine allows it.
pub fn advance(state: &mut SandboxState, next: SandboxState) -> Result<SandboxState, TransitionError> {
    if !state.can_become(next) {
        return Err(TransitionError { from: *state, to: next });
    }
    Ok(std::mem::replace(state, next))
}

#[cfg(test)]
mod tests {
    use super::SandboxState::*;
    use super::*;

    const ALL: [SandboxState; 9] = [Creating, Running, Pausing, Paused, Resuming, Snapshotting, Stopping, Stopped, Failed];

    #[test]
    fn every_edge_of_the_diagram_and_no_other() {
        let allowed = [
            (Creating, Running),
            (Creating, Failed),
            (Creating, Stopping),
            (Running, Pausing),
            (Running, Snapshotting),
            (Running, Stopping),
            (Running, Failed),
            (Pausing, Paused),
            (Pausing, Running),
            (Pausing, Failed),
            (Paused, Resuming),
            (Paused, Snapshotting),
            (Paused, Stopping),
            (Resuming, Running),
            (Resuming, Paused),
            (Resuming, Failed),
            (Snapshotting, Running),
            (Snapshotting, Paused),
            (Snapshotting, Failed),
            (Failed, Stopping),
            (Stopping, Stopped),
        ];
        for from in ALL {
            for to in ALL {
                assert_eq!(from.can_become(to), allowed.contains(&(from, to)), "{from:?} -> {to:?}");
            }
        }
    }

    #[test]
    fn a_stopped_sandbox_stays_stopped_and_says_why() {
        let mut state = Stopped;
        let refused = advance(&mut state, Resuming).expect_err("stopped is terminal");
        assert_eq!(state, Stopped);
        assert_eq!(refused.to_string(), "the sandbox is killed, so it cannot be resumed");
        let mut state = Failed;
        assert!(advance(&mut state, Pausing).expect_err("failed").to_string().contains("kill it"));
        assert_eq!(advance(&mut state, Stopping), Ok(Failed));
        assert_eq!(state, Stopping);
    }

    #[test]
    fn clients_see_e2bs_two_states() {
        assert_eq!(Pausing.api_name(), "paused");
        assert_eq!(Resuming.api_name(), "paused");
        assert_eq!(Snapshotting.api_name(), "running");
    }
}
