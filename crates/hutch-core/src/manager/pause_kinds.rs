//! What a pause or a resume is asked and answers: who asks for a pause, how a paused
//! sandbox comes back, what a connect did.

/// What a connect did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connected {
    AlreadyRunning,
    Resumed,
}

/// How a paused sandbox comes back (E2B's `on_resume`, `memory` of a connect).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnResume {
    /// From its saved memory when it has one, else booted on its disk.
    #[default]
    Restore,
    /// Booted on its disk, whatever memory it saved: the way out of a saved state that
    /// wedges the guest.
    Reboot,
}

/// Who asks for a pause. The paused-sandbox quota binds clients; a sandbox the key
/// asked to pause at its timeout (autoPause) is paused over it rather than destroyed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PausedBy {
    Client,
    AutoPause,
}
