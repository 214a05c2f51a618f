//! A QEMU process, named by a pidfd: one hutch spawned (`qemu/spawn.rs`), or one an
//! earlier `hutch serve` left running, which this one adopts. A pidfd names that one
//! process for as long as the fd is open (a recycled pid never matches it), becomes
//! readable when the process exits, and can signal it; for hutch's own child it also
//! collects the exit status (an adopted one's goes to whoever is its parent now).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};
use tokio::io::unix::AsyncFd;

#[derive(Debug)]
pub struct PidFd {
    pid: u32,
    fd: AsyncFd<OwnedFd>,
}

impl PidFd {
    /// Opens the process `pid`, which must run now.
    pub fn open(pid: u32) -> std::io::Result<PidFd> {
        PidFd::of(pid, open_fd(pid, libc::PIDFD_NONBLOCK)?)
    }

    /// The process of pidfd `fd`, whose pid is `pid`.
    pub fn of(pid: u32, fd: OwnedFd) -> std::io::Result<PidFd> {
        // SAFETY: the AsyncFd takes ownership of the fd, so it stays open for as long
        // as it is registered and is closed only after deregistering.
        let fd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)? };
        Ok(PidFd { pid, fd })
    }

    /// The pidfd, for a waiter off the runtime (see `wait_within`).
    pub fn try_clone_fd(&self) -> std::io::Result<OwnedFd> {
        self.fd.get_ref().try_clone()
    }

    /// The exit status of the process, once it has exited; reaps hutch's own child.
    pub fn exit_status(&self) -> Option<String> {
        match self.has_exited() {
            true => reap(self.fd.get_ref().as_fd()).or_else(|| Some("exited".into())),
            false => None,
        }
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
        kill(self.fd.get_ref().as_fd())
    }
}

/// A pidfd for the running process `pid`, opened with `flags`.
pub fn open_fd(pid: u32, flags: libc::c_uint) -> std::io::Result<OwnedFd> {
    let raw_pid = libc::pid_t::try_from(pid).map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1; it reads
    // and writes no memory of ours.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw_pid, flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the syscall returned a fresh fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Sends SIGKILL to the process of pidfd `fd` (never to another that took its pid).
pub fn kill(fd: BorrowedFd) -> std::io::Result<()> {
    // SAFETY: pidfd_send_signal on a pidfd we hold, no siginfo, no flags.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_send_signal, fd.as_raw_fd(), libc::SIGKILL, std::ptr::null::<libc::siginfo_t>(), 0) };
    match r {
        0 => Ok(()),
        _ => match std::io::Error::last_os_error() {
            // It has exited already.
            e if e.raw_os_error() == Some(libc::ESRCH) => Ok(()),
            e => Err(e),
        },
    }
}

/// Reaps the exited child of pidfd `fd`: its exit status, None while it runs. A
/// process that is not hutch's child (adopted) cannot be reaped or waited for: ask
/// only once the pidfd is readable, and its status is "exited".
pub fn reap(fd: BorrowedFd) -> Option<String> {
    // SAFETY: siginfo_t is plain data; zeroed means "nothing reported".
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: waitid on a pidfd we hold, writing into our own siginfo_t.
        let r = unsafe { libc::waitid(libc::P_PIDFD, fd.as_raw_fd() as libc::id_t, &mut info, libc::WEXITED | libc::WNOHANG) };
        if r == 0 {
            break;
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::ECHILD) => return Some("exited".into()),
            _ => return None,
        }
    }
    // SAFETY: waitid filled the child fields (si_pid 0: it has not exited yet).
    let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
    if pid == 0 {
        return None;
    }
    Some(match info.si_code {
        libc::CLD_EXITED => format!("exit status: {status}"),
        _ => match nix::sys::signal::Signal::try_from(status) {
            Ok(signal) => format!("signal: {status} ({signal})"),
            Err(_) => format!("signal: {status}"),
        },
    })
}

/// Blocks until the process of pidfd `fd` exits (at most `limit`; `Duration::MAX`
/// waits for good, for a process already sent SIGKILL), then reaps it.
pub fn wait_within(fd: BorrowedFd, limit: Duration) -> Option<String> {
    let deadline = Instant::now().checked_add(limit);
    loop {
        let timeout = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()).as_millis().min(i32::MAX as u128) as i32,
            None => -1,
        };
        let mut poll = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd on our stack, valid for the call.
        let ready = unsafe { libc::poll(&mut poll, 1, timeout) };
        if ready > 0 {
            return reap(fd);
        }
        if ready == 0 || deadline.is_some_and(|d| Instant::now() >= d) {
            return None;
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
