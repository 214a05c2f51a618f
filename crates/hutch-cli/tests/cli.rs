//! The `hutch` binary as a user runs it, booting real VMs. Each test gets its own
//! HUTCH_HOME whose artifact folders link to the shared cache, so leak checks see only
//! that test's sandboxes.

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

struct Home {
    dir: tempfile::TempDir,
}

impl Home {
    fn new() -> Home {
        let dir = tempfile::Builder::new().prefix("hutch-cli-").tempdir_in("/tmp").expect("temp home");
        common::link_shared_artifacts(dir.path());
        Home { dir }
    }

    fn hutch(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_hutch"));
        c.env("HUTCH_HOME", self.dir.path()).env_remove("HUTCH_LOG");
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        self.hutch().args(args).stdin(Stdio::null()).output().expect("run hutch")
    }

    /// Nothing of this home's sandboxes may remain: no directory, no QEMU.
    fn assert_clean(&self) {
        let sandboxes = self.dir.path().join("sandboxes");
        let left: Vec<_> = std::fs::read_dir(&sandboxes).into_iter().flatten().flatten().map(|e| e.path()).collect();
        let contents: Vec<Vec<_>> = left.iter().map(|d| std::fs::read_dir(d).into_iter().flatten().flatten().map(|e| e.file_name()).collect()).collect();
        assert!(left.is_empty(), "sandbox directories left: {left:?} holding {contents:?}");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !qemus_under(self.dir.path()).is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50)); // poll interval of the wait
        }
        assert!(qemus_under(self.dir.path()).is_empty(), "QEMU still running 30 s after hutch ended");
    }
}

fn qemus_under(home: &Path) -> Vec<u32> {
    let needle = home.display().to_string();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse().ok()))
        .filter(|pid: &u32| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd);
            cmd.starts_with("qemu-system") && cmd.contains(&needle)
        })
        .collect()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn run_uses_the_guest_kernel_and_keeps_streams_apart() {
    let home = Home::new();
    let out = home.run(&["run", "--", "sh", "-c", "uname -r; echo out; echo err >&2; exit 7"]);
    let stdout = text(&out.stdout);
    let host = text(&Command::new("uname").arg("-r").output().expect("uname").stdout);
    let mut lines = stdout.lines();
    let guest = lines.next().unwrap_or_default();
    assert!(guest.ends_with("-cloud-amd64") && guest != host.trim(), "guest kernel {guest:?}, host {host:?}; stderr: {}", text(&out.stderr));
    assert_eq!(lines.collect::<Vec<_>>(), ["out"], "stdout: {stdout:?}");
    assert_eq!(text(&out.stderr), "err\n");
    assert_eq!(out.status.code(), Some(7));
    home.assert_clean();
}

#[test]
fn run_forwards_stdin_and_reports_signals() {
    let home = Home::new();
    let mut child = home
        .hutch()
        .args(["run", "-i", "--env", "SUFFIX=!", "--", "sh", "-c", "tr a-z A-Z; echo \"$SUFFIX\"; kill -KILL $$"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    child.stdin.take().expect("stdin").write_all(b"hello sandbox\n").expect("write");
    let out = child.wait_with_output().expect("wait");
    assert_eq!(text(&out.stdout), "HELLO SANDBOX\n!\n", "stderr: {}", text(&out.stderr));
    assert_eq!(out.status.code(), Some(137));
    home.assert_clean();
}

#[test]
fn missing_commands_and_timeouts_have_their_exit_codes() {
    let home = Home::new();
    let out = home.run(&["run", "--", "definitely-not-installed"]);
    assert_eq!(out.status.code(), Some(127));
    assert!(text(&out.stderr).contains("command not found in the sandbox: definitely-not-installed"), "{}", text(&out.stderr));
    let started = Instant::now();
    let out = home.run(&["run", "--timeout", "2", "--", "sleep", "60"]);
    assert_eq!(out.status.code(), Some(124), "stderr: {}", text(&out.stderr));
    assert!(text(&out.stderr).contains("timed out after 2 s"), "{}", text(&out.stderr));
    assert!(started.elapsed() < Duration::from_secs(40));
    home.assert_clean();
}

#[test]
fn bad_input_is_one_clear_error() {
    let home = Home::new();
    let out = home.run(&["run", "--memory", "12", "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("memory must be between 128 and 65536 MiB"), "{}", text(&out.stderr));
    let out = home.run(&["run", "--accel", "warp", "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("unknown accelerator 'warp'"), "{}", text(&out.stderr));
    let out = home.run(&["run", "--template", "nope", "--", "true"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("unknown template 'nope'"), "{}", text(&out.stderr));
    let out = home.run(&["run", "--env", "NOEQUALS", "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    let out = home.run(&["run", "--accel", "kvm", "--", "true"]);
    if out.status.code() != Some(0) {
        assert!(text(&out.stderr).contains("KVM was requested but is not usable here"), "{}", text(&out.stderr));
    }
    assert!(!text(&out.stderr).contains("panicked"));
    home.assert_clean();
}

#[test]
fn tty_mode_gives_a_terminal() {
    let home = Home::new();
    // `script` gives hutch a terminal of its own, as a user's shell would.
    let cmd = format!("{} run -t -- sh -c 'tty; stty size; exit 3'", env!("CARGO_BIN_EXE_hutch"));
    let out = Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .env("HUTCH_HOME", home.dir.path())
        .env("COLUMNS", "90")
        .env("LINES", "33")
        .stdin(Stdio::null())
        .output()
        .expect("script (util-linux) is needed");
    let stdout = text(&out.stdout);
    assert!(stdout.contains("/dev/pts/"), "not a terminal: {stdout:?}");
    assert_eq!(out.status.code(), Some(3), "{stdout:?} {}", text(&out.stderr));
    home.assert_clean();
}

#[test]
fn ctrl_c_and_sigkill_leave_nothing_behind() {
    let home = Home::new();
    let sandboxes = home.dir.path().join("sandboxes");
    let wait_for_vm = |child: &mut std::process::Child| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while qemus_under(home.dir.path()).is_empty() || !console_ready(&sandboxes) {
            assert!(Instant::now() < deadline, "the sandbox never booted");
            assert!(child.try_wait().expect("try_wait").is_none(), "hutch exited early");
            std::thread::sleep(Duration::from_millis(50)); // poll interval of the wait
        }
    };
    let mut child = home.hutch().args(["run", "--", "sleep", "600"]).stdin(Stdio::null()).spawn().expect("spawn");
    wait_for_vm(&mut child);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGINT).expect("SIGINT");
    let status = child.wait().expect("wait");
    assert_eq!(status.code(), Some(130));
    home.assert_clean();

    // SIGKILL gives hutch no chance to clean up: the kernel ends QEMU (PDEATHSIG) and
    // the next hutch sweeps the directory.
    let mut child = home.hutch().args(["run", "--", "sleep", "600"]).stdin(Stdio::null()).spawn().expect("spawn");
    wait_for_vm(&mut child);
    child.kill().expect("SIGKILL");
    child.wait().expect("wait");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !qemus_under(home.dir.path()).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50)); // poll interval of the wait
    }
    assert!(qemus_under(home.dir.path()).is_empty(), "QEMU outlived a SIGKILLed hutch by 30 s");
    let out = home.run(&["run", "--", "true"]);
    assert_eq!(out.status.code(), Some(0));
    home.assert_clean();
}

fn console_ready(sandboxes: &Path) -> bool {
    std::fs::read_dir(sandboxes).into_iter().flatten().flatten().any(|e| {
        std::fs::read_to_string(e.path().join("console.log")).is_ok_and(|c| c.contains("hutch-agent: ready"))
    })
}
