//! Cleaning up after hutch processes that died without cleaning up (SIGKILL, power
//! loss): their sandbox directories stay behind, and QEMU would too without
//! PR_SET_PDEATHSIG. A directory whose owner is gone is swept.

use hutch_image::HutchHome;
use std::path::Path;

/// Whether `pid` runs. A zombie does not: it has ended and only waits for its parent
/// to collect its status (a server SIGKILLed by a supervisor is one for a moment).
pub(crate) fn alive(pid: i32) -> bool {
    if pid <= 0 || nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_err() {
        return false;
    }
    // The state follows the command name, which is in parentheses and may hold spaces.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    !stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
}

pub(crate) fn read_pid(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// A directory without an owner file may be one being created right now.
fn recently_made(dir: &Path) -> bool {
    let age = std::fs::metadata(dir).and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok());
    age.is_none_or(|a| a < std::time::Duration::from_secs(60))
}

/// The pid of the sandbox's QEMU if it is still running (checked against its command
/// line, so a recycled pid is not taken for it).
pub(crate) fn running_qemu(dir: &Path) -> Option<i32> {
    let pid = read_pid(&dir.join("qemu.pid")).filter(|p| alive(*p))?;
    hutch_vmm::process::names_dir(pid as u32, dir).then_some(pid)
}

/// Kills the sandbox's QEMU if it is still running, and waits (a few seconds at most)
/// for it to go. Found by its command line, which names the directory: the one
/// `qemu.pid` records, and one started as its server died, before the pid was written.
pub(crate) fn kill_qemu(dir: &Path) {
    hutch_vmm::process::kill_vms_naming(dir, std::time::Duration::from_secs(5));
}

/// Who sweeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sweeper {
    /// A local command (`hutch run`): a server's sandbox whose VM runs on after that
    /// server ended is left for the next server to adopt.
    Local,
    /// A server that has adopted all it could: the rest is swept.
    Server,
}

/// Removes sandboxes whose owning process is gone; returns how many.
pub fn sweep_orphans(home: &HutchHome, by: Sweeper) -> usize {
    let mut swept = 0;
    for entry in std::fs::read_dir(home.sandboxes()).into_iter().flatten().flatten() {
        let dir = entry.path();
        let owner = read_pid(&dir.join("owner.pid"));
        // A paused sandbox has no process; the server's store owns it.
        let paused = crate::sandbox::layout::paused_mode(&dir).is_some();
        let adoptable = by == Sweeper::Local && dir.join(crate::sandbox::layout::SERVER_OWNED).is_file() && running_qemu(&dir).is_some();
        if paused || adoptable || owner.is_some_and(alive) || (owner.is_none() && recently_made(&dir)) {
            continue;
        }
        kill_qemu(&dir);
        if std::fs::remove_dir_all(&dir).is_ok() {
            swept += 1;
        }
    }
    swept
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_zombie_is_not_alive() {
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let pid = child.id() as i32;
        // Until it is waited for, the ended child is a zombie: kill(pid, 0) still succeeds.
        let ended = |pid: i32| std::fs::read_to_string(format!("/proc/{pid}/stat")).map(|s| s.contains(") Z")).unwrap_or(true);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !ended(pid) {
            assert!(std::time::Instant::now() < deadline, "true did not end within 10 s");
            std::thread::yield_now();
        }
        assert!(!super::alive(pid));
        child.wait().expect("wait");
        assert!(super::alive(std::process::id() as i32));
    }
}
