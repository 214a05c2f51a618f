//! The local terminal for `hutch run -t`: raw mode (restored on drop, also on panic) and
//! its size.

use nix::sys::termios::{self, SetArg, Termios};
use std::os::fd::AsFd;

pub struct RawMode {
    saved: Termios,
}

impl RawMode {
    pub fn enable() -> Option<RawMode> {
        let stdin = std::io::stdin();
        let saved = termios::tcgetattr(stdin.as_fd()).ok()?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw).ok()?;
        Some(RawMode { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = termios::tcsetattr(std::io::stdin().as_fd(), SetArg::TCSANOW, &self.saved);
    }
}

nix::ioctl_read_bad!(get_winsize, libc::TIOCGWINSZ, libc::winsize);

/// (cols, rows) of the terminal on stdout, or 80x24.
pub fn size() -> (u32, u32) {
    let mut ws = libc::winsize { ws_row: 0, ws_col: 0, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCGWINSZ writes one winsize into the valid pointer we pass.
    let ok = unsafe { get_winsize(libc::STDOUT_FILENO, &mut ws) }.is_ok();
    if ok && ws.ws_col > 0 && ws.ws_row > 0 {
        (ws.ws_col as u32, ws.ws_row as u32)
    } else {
        (80, 24)
    }
}

pub fn stdin_is_tty() -> bool {
    nix::unistd::isatty(libc::STDIN_FILENO).unwrap_or(false)
}
