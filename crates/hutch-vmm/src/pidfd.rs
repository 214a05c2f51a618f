//! A process hutch did not start: a QEMU left running by an earlier `hutch serve`,
//! which this one adopts. Its parent is gone, so it cannot be waited for; a pidfd
//! names that one process for as long as the fd is open (a recycled pid never
//! matches it), becomes readable when the process exits, and can signal it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;
use tokio::io::unix::AsyncFd;

#[derive(Debug)]
pub struct PidFd {
    pid: u32,
    fd: AsyncFd<OwnedFd>,
}

impl PidFd {
    /// Opens the process `pid`, which must run now.
    pub fn open(pid: u32) -> std::io::Result<PidFd> {
        let raw_pid = libc::pid_t::try_from(pid).map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))?;
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1; it reads
        // and writes no memory of ours.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw_pid, libc::PIDFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the syscall returned a fresh fd that nothing else owns.
        let owned = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        // SAFETY: the AsyncFd takes ownership of the fd, so it stays open for as long
        // as it is registered and is closed only after deregistering.
        let fd = unsafe { AsyncFd::register_with_interest(owned, tokio::io::Interest::READABLE)? };
        Ok(PidFd { pid, fd })
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the process has exited (a pidfd polls readable from then on).
    pub fn has_exited(&self) -> bool {
        let mut poll = libc::pollfd { fd: self.fd.get_ref().as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd on our stack, valid for the call; timeout 0 never blocks.
        let ready = unsafe { libc::poll(&mut poll, 1, 0) };
        ready > 0 && poll.revents & libc::POLLIN != 0
    }

    /// Waits up to `limit` for the process to exit; true if it has.
    pub async fn wait(&self, limit: Duration) -> bool {
        if self.has_exited() {
            return true;
        }
        let exited = async {
            loop {
                match self.fd.readable().await {
                    Ok(mut guard) if self.has_exited() => {
                        guard.retain_ready();
                        return;
                    }
                    Ok(mut guard) => guard.clear_ready(),
                    // Not pollable: fall back to asking now and then.
                    Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
        };
        tokio::time::timeout(limit, exited).await.is_ok()
    }

    /// Sends SIGKILL to this process (never to another that took its pid).
    pub fn kill(&self) -> std::io::Result<()> {
        // SAFETY: pidfd_send_signal on our own fd with no siginfo (null) and no flags;
        // it reads no memory of ours.
        let r = unsafe { libc::syscall(libc::SYS_pidfd_send_signal, self.fd.get_ref().as_raw_fd(), libc::SIGKILL, std::ptr::null::<libc::siginfo_t>(), 0) };
        match r {
            0 => Ok(()),
            _ => match std::io::Error::last_os_error() {
                // It has exited already.
                e if e.raw_os_error() == Some(libc::ESRCH) => Ok(()),
                e => Err(e),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn follows_a_process_it_did_not_start_until_it_is_killed() {
        let mut child = std::process::Command::new("sleep").arg("60").spawn().expect("sleep");
        let pidfd = PidFd::open(child.id()).expect("pidfd_open");
        assert!(!pidfd.has_exited());
        assert!(!pidfd.wait(Duration::from_millis(50)).await, "sleep 60 ended early");
        pidfd.kill().expect("kill");
        // Readable once it is a zombie, before anyone reaps it.
        assert!(pidfd.wait(Duration::from_secs(10)).await, "the killed process did not end");
        assert!(pidfd.has_exited());
        assert!(child.wait().expect("wait").code().is_none());
        // Signalling a process that has gone is not an error.
        pidfd.kill().expect("kill after exit");
    }

    #[tokio::test]
    async fn a_process_that_does_not_run_cannot_be_opened() {
        let gone = std::process::Command::new("true").spawn().and_then(|mut c| c.wait().map(|_| c.id())).expect("true");
        assert!(PidFd::open(gone).is_err());
    }
}
