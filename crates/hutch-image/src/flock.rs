//! Waiting a moment for an exclusive flock.
//!
//! A lock its holder has just dropped can still be held for an instant: any process
//! the holder's process forks shares the lock's open file until it execs (the
//! descriptor is close-on-exec), and servers spawn QEMU and tools from other threads
//! all the time. So "someone holds it" is only true of a holder for longer than a
//! moment. flock has no timeout of its own, hence the poll.

use std::time::{Duration, Instant};

/// Takes `file`'s exclusive lock if it comes free within `patience`; false if it
/// stays held.
pub fn lock_within(file: &std::fs::File, patience: Duration) -> std::io::Result<bool> {
    let deadline = Instant::now() + patience;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(true),
            Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Err(std::fs::TryLockError::WouldBlock) => return Ok(false),
            Err(std::fs::TryLockError::Error(e)) => return Err(e),
        }
    }
}
