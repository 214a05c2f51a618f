//! Host tools run with a deadline (`qemu-img`, `newuidmap`, `qemu --version`): a tool
//! that hangs (an NFS stall, a wedged lock) becomes a `TimedOut` error and is killed,
//! instead of holding a request, a sandbox's owner or a build forever.

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// How often a running tool is looked at: fine-grained for the quick ones, cheap for
/// the long ones.
const POLL: Duration = Duration::from_millis(5);

/// The program `binary` names, as exec would find it: a bare name is looked up in PATH.
pub fn find_program(binary: &str) -> Option<std::path::PathBuf> {
    if binary.contains('/') {
        return Some(std::path::PathBuf::from(binary));
    }
    std::env::var_os("PATH").and_then(|path| std::env::split_paths(&path).map(|d| d.join(binary)).find(|p| p.is_file()))
}

/// Runs `cmd` (stdin null, output captured) and waits at most `limit` for it.
pub fn output_within(cmd: &mut Command, limit: Duration) -> std::io::Result<Output> {
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let status = wait_within(&mut child, limit)?;
    Ok(Output { status, stdout: stdout.join().unwrap_or_default(), stderr: stderr.join().unwrap_or_default() })
}

/// Waits at most `limit` for `child`, killing it when the time is up.
pub fn wait_within(child: &mut Child, limit: Duration) -> std::io::Result<std::process::ExitStatus> {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if started.elapsed() >= limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("it did not finish within {} s and was killed", limit.as_secs())));
        }
        std::thread::sleep(POLL.min(limit / 10 + Duration::from_millis(1)).max(Duration::from_millis(1)));
    }
}

/// Whether process `pid`'s command line names `dir`: a VM process hutch started names
/// its sandbox directory (its sockets and disk live there), so a recycled pid is never
/// taken for that VM.
pub fn names_dir(pid: u32, dir: &Path) -> bool {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    String::from_utf8_lossy(&cmdline).contains(&dir.display().to_string())
}

/// QEMU processes whose command line names a file in `dir`: that sandbox directory's
/// VMs, whether or not one's pid was recorded (a server killed between spawning QEMU
/// and writing `qemu.pid` leaves one nobody else knows of). Only `qemu-system-*`
/// (never qemu-img or qemu-nbd reading a sandbox's files), and none for a `dir` that
/// is not a directory's path of its own (`/`, empty).
pub fn vms_naming(dir: &Path) -> Vec<u32> {
    if dir.file_name().is_none() {
        return Vec::new();
    }
    let inside = format!("{}/", dir.display());
    let pids = std::fs::read_dir("/proc").into_iter().flatten().flatten().filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok());
    pids.filter(|pid| {
        // comm is the program's file name, at most 15 bytes: "qemu-system-x86".
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        comm.starts_with("qemu-system") && names_dir(*pid, Path::new(&inside))
    })
    .collect()
}

/// Kills the VMs naming `dir` (`vms_naming`) and waits up to `limit` for them to go,
/// so their files (the disk's lock) are free when this returns. Each is held by a
/// pidfd and checked again before the signal: a pid recycled since the scan is spared.
pub fn kill_vms_naming(dir: &Path, limit: Duration) -> usize {
    use std::os::fd::AsFd;
    let held: Vec<std::os::fd::OwnedFd> = vms_naming(dir)
        .into_iter()
        .filter_map(|pid| crate::pidfd::open_fd(pid, 0).ok().filter(|_| names_dir(pid, &dir.join(""))))
        .filter(|fd| crate::pidfd::kill(fd.as_fd()).is_ok())
        .collect();
    for fd in &held {
        crate::pidfd::wait_within(fd.as_fd(), limit);
    }
    held.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vm_of_a_directory_is_found_by_its_command_line_alone() {
        let tmp = tempfile::tempdir().expect("tmp");
        let (dir, other) = (tmp.path().join("i1"), tmp.path().join("i10"));
        // A stand-in QEMU: a shell under a QEMU-like name whose command line names a
        // file in `dir` (its `$0`), as QEMU's names its disk and sockets.
        let fake = tmp.path().join("qemu-system-fake");
        std::fs::copy("/bin/sh", &fake).expect("copy sh");
        let mut child = Command::new(&fake).args(["-c", "sleep 30; true"]).arg(dir.join("disk.qcow2")).spawn().expect("spawn");
        let pid = child.id();
        let found = (0..200).find_map(|_| {
            let found = vms_naming(&dir);
            std::thread::sleep(Duration::from_millis(10));
            found.contains(&pid).then_some(found)
        });
        assert_eq!(found, Some(vec![pid]), "found by its command line");
        assert!(vms_naming(&other).is_empty(), "a directory whose name starts the same is another's");
        assert!(vms_naming(Path::new("/")).is_empty(), "never every VM at once");
        assert_eq!(kill_vms_naming(&other, Duration::from_secs(5)), 0);
        assert_eq!(kill_vms_naming(&dir, Duration::from_secs(5)), 1);
        // Waited for until it was gone (and, as this process's child, reaped).
        assert!(!Path::new(&format!("/proc/{pid}")).exists(), "killed and gone");
        // Already reaped by the wait above: this only tells std so.
        let _ = child.wait();
    }

    #[test]
    fn a_tool_that_finishes_gives_its_output() {
        let out = output_within(Command::new("sh").args(["-c", "echo out; echo err >&2; exit 3"]), Duration::from_secs(10)).expect("sh");
        assert_eq!((out.status.code(), &out.stdout[..], &out.stderr[..]), (Some(3), &b"out\n"[..], &b"err\n"[..]));
    }

    #[test]
    fn a_tool_that_hangs_is_killed_at_its_deadline() {
        let e = output_within(Command::new("sleep").arg("30"), Duration::from_millis(200)).expect_err("sleep outlives 200 ms");
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        assert!(e.to_string().contains("killed"), "{e}");
    }
}

