//! Running the host tools the builds need (apt-get, dpkg-deb, mmdebstrap, mkfs.ext4).

use crate::Progress;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error("'{tool}' is not installed; install it with: apt-get install {package}")]
    Missing { tool: String, package: String },
    #[error("'{command}' failed ({status}): {output}")]
    Failed { command: String, status: String, output: String },
    #[error("running '{command}'")]
    Io { command: String, #[source] source: std::io::Error },
    #[error("'{command}' did not finish within {minutes} minutes and was stopped; check the host's network and disk, then try again")]
    Timeout { command: String, minutes: u64 },
}

/// How long a tool may run: far beyond what each takes on a slow host (mmdebstrap with
/// its downloads a few minutes), so only a wedged one meets it.
fn deadline_of(tool: &str) -> std::time::Duration {
    let minutes = match tool {
        "mmdebstrap" | "unshare" => 60,
        "apt-get" | "python3" => 20,
        _ => 10,
    };
    std::time::Duration::from_secs(minutes * 60)
}

fn package_of(tool: &str) -> &str {
    match tool {
        "apt-get" => "apt",
        "dpkg-deb" => "dpkg",
        "mkfs.ext4" => "e2fsprogs",
        "unshare" => "util-linux",
        other => other,
    }
}

fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Makes the command's process die with the thread that spawns it (hutch killed, or
/// a build's thread gone), instead of building on for nobody. Only that process: what
/// it started must go with it by other means (a PID namespace, for mmdebstrap).
#[allow(unsafe_code)]
pub fn die_with_thread(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id() as i32;
    // SAFETY: the closure runs in the forked child before exec and only calls prctl(2)
    // and getppid(2), both async-signal-safe; it allocates nothing and takes no lock.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)?;
            // hutch died between the fork and the prctl: no signal will come.
            if nix::unistd::getppid().as_raw() != parent {
                return Err(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
            }
            Ok(())
        });
    }
}

/// Runs a command, streaming its output lines to `progress` and keeping the last ones
/// for the error message.
pub fn run(cmd: Command, cwd: Option<&Path>, progress: &dyn Progress) -> Result<String, ToolError> {
    let limit = deadline_of(&cmd.get_program().to_string_lossy());
    run_within(cmd, cwd, progress, limit)
}

/// `run`, stopping the tool once `limit` has passed.
pub fn run_within(mut cmd: Command, cwd: Option<&Path>, progress: &dyn Progress, limit: std::time::Duration) -> Result<String, ToolError> {
    if let Some(dir) = cwd {
        cmd.current_dir(dir);
    }
    let command = describe(&cmd);
    let tool = cmd.get_program().to_string_lossy().into_owned();
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => ToolError::Missing { package: package_of(&tool).into(), tool: tool.clone() },
        _ => ToolError::Io { command: command.clone(), source },
    })?;
    let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
    // A watchdog stops the tool at its deadline; its pipes then close and the reads end.
    let (finished, watch) = std::sync::mpsc::channel::<()>();
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let watchdog = std::thread::spawn(move || {
        let expired = matches!(watch.recv_timeout(limit), Err(std::sync::mpsc::RecvTimeoutError::Timeout));
        // The child is reaped only after `finished` is sent, so the pid is still its.
        // Its descendants go too, found before it dies (then they would be init's):
        // a grandchild holding the pipes would keep the reads below from ending.
        if expired {
            for p in descendants(pid).into_iter().chain([pid]) {
                let _ = nix::sys::signal::kill(p, nix::sys::signal::Signal::SIGKILL);
            }
        }
        expired
    });
    let collect = |stream: Option<Box<dyn std::io::Read + Send>>| {
        let mut lines = Vec::new();
        if let Some(s) = stream {
            for line in BufReader::new(s).lines().map_while(Result::ok) {
                progress.detail(&line);
                lines.push(line);
            }
        }
        lines
    };
    let (out, err) = std::thread::scope(|scope| {
        let err = scope.spawn(|| collect(stderr.map(|e| Box::new(e) as Box<dyn std::io::Read + Send>)));
        let out = collect(stdout.map(|o| Box::new(o) as Box<dyn std::io::Read + Send>));
        (out, err.join().unwrap_or_default())
    });
    // Waits for the exit without reaping (WNOWAIT), then stops the watchdog, then reaps.
    let flags = nix::sys::wait::WaitPidFlag::WEXITED | nix::sys::wait::WaitPidFlag::WNOWAIT;
    let _ = nix::sys::wait::waitid(nix::sys::wait::Id::Pid(pid), flags);
    let _ = finished.send(());
    let expired = watchdog.join().unwrap_or(false);
    let status = child.wait().map_err(|source| ToolError::Io { command: command.clone(), source })?;
    if expired {
        return Err(ToolError::Timeout { command, minutes: limit.as_secs() / 60 });
    }
    if !status.success() {
        let lines = if err.iter().any(|l| !l.trim().is_empty()) { &err } else { &out };
        let output = lines[lines.len().saturating_sub(8)..].join("\n");
        return Err(ToolError::Failed { command, status: status.to_string(), output });
    }
    Ok(out.join("\n"))
}

/// Every live descendant of `root`, from /proc's parent links.
fn descendants(root: nix::unistd::Pid) -> Vec<nix::unistd::Pid> {
    let parents: Vec<(i32, i32)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            // The command name in parentheses may hold spaces; the fields follow its ')'.
            let ppid = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()?;
            Some((pid, ppid))
        })
        .collect();
    let mut found = vec![root.as_raw()];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(parents.iter().filter(|(_, pp)| *pp == parent).map(|(p, _)| *p));
        i += 1;
    }
    found.into_iter().skip(1).map(nix::unistd::Pid::from_raw).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_whose_child_holds_its_output_is_stopped_with_that_child() {
        let mut cmd = Command::new("sh");
        // The background sleep keeps stdout open after sh itself is killed.
        cmd.args(["-c", "sleep 30 & sleep 30; wait"]);
        let started = std::time::Instant::now();
        let e = run_within(cmd, None, &crate::progress::Quiet, std::time::Duration::from_millis(300)).expect_err("sleep outlives it");
        assert!(matches!(e, ToolError::Timeout { .. }), "{e}");
        assert!(started.elapsed() < std::time::Duration::from_secs(20), "the grandchild kept the tool's output open");
    }

    #[test]
    fn a_tool_past_its_deadline_is_stopped_with_a_clear_error() {
        let mut cmd = Command::new("sleep");
        cmd.arg("30");
        let e = run_within(cmd, None, &crate::progress::Quiet, std::time::Duration::from_millis(300)).expect_err("sleep outlives it");
        assert!(matches!(e, ToolError::Timeout { .. }), "{e}");
    }

    #[test]
    fn a_tool_that_fails_in_time_says_how() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo broken >&2; exit 2"]);
        let e = run_within(cmd, None, &crate::progress::Quiet, std::time::Duration::from_secs(10)).expect_err("exit 2");
        assert!(e.to_string().contains("broken"), "{e}");
    }
}
