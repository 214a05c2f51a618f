//! Pseudo-terminals: the master side as an async reader/writer, resize, and the
//! controlling-terminal setup of the child.

use hutch_proto::process::PtySize;
use nix::fcntl::{fcntl, FcntlArg, FdFlag, OFlag};
use nix::pty::{openpty, Winsize};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use tokio::io::unix::AsyncFd;

pub struct PtyMaster {
    fd: AsyncFd<OwnedFd>,
}

pub struct PtyPair {
    pub master: PtyMaster,
    pub slave: OwnedFd,
}

nix::ioctl_write_ptr_bad!(set_winsize, libc::TIOCSWINSZ, Winsize);

fn winsize(size: PtySize) -> Winsize {
    Winsize { ws_row: size.rows.clamp(1, 1000) as u16, ws_col: size.cols.clamp(1, 1000) as u16, ws_xpixel: 0, ws_ypixel: 0 }
}

pub fn open(size: PtySize) -> io::Result<PtyPair> {
    let pair = openpty(Some(&winsize(size)), None)?;
    for fd in [&pair.master, &pair.slave] {
        fcntl(fd.as_raw_fd(), FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))?;
    }
    let flags = OFlag::from_bits_truncate(fcntl(pair.master.as_raw_fd(), FcntlArg::F_GETFL)?);
    fcntl(pair.master.as_raw_fd(), FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
    Ok(PtyPair { master: PtyMaster { fd: register(pair.master)? }, slave: pair.slave })
}

/// Registers an owned fd with the reactor.
fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an OwnedFd is a valid open descriptor that stays open, and always returns the
    // same raw fd, until the AsyncFd that owns it is dropped.
    unsafe { AsyncFd::register(fd) }.map_err(io::Error::from)
}

impl PtyMaster {
    /// Reads output; `Ok(0)` once the child side is closed (Linux reports EIO then).
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let mut guard = self.fd.readable().await?;
            match guard.try_io(|fd| nix::unistd::read(fd.as_raw_fd(), buf).map_err(io::Error::from)) {
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Ok(0),
                Ok(result) => return result,
                Err(_would_block) => continue,
            }
        }
    }

    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let mut guard = self.fd.writable().await?;
            match guard.try_io(|fd| nix::unistd::write(fd.get_ref(), data).map_err(io::Error::from)) {
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }

    pub fn resize(&self, size: PtySize) -> io::Result<()> {
        let ws = winsize(size);
        // SAFETY: TIOCSWINSZ reads one Winsize from the valid pointer; the fd is our open master.
        unsafe { set_winsize(self.fd.as_raw_fd(), &ws) }?;
        Ok(())
    }
}
