//! Starting QEMU. A confined QEMU is cloned (`clone3`) into a PID namespace of its own,
//! where it is pid 1 and the only process, and, when hutch is not root, into a user
//! namespace of its own too: neither can be entered by `fork` + `unshare`, which move
//! only the caller's children. So hutch spawns QEMU itself rather than through
//! `std::process::Command`, in the same order that does: stdio and inherited fds, a
//! session of its own, default signal handling, exec, and the exec's errno back to the
//! parent over a close-on-exec pipe. QEMU inherits no other fd and, of hutch's
//! environment, only `PATH`: hutch's may hold an API key.
//!
//! The child waits for the parent's word (its host pid, which it cannot learn inside
//! its namespace) before it does anything: by then the parent has mapped its user
//! namespace, and the jail gives it the uid that goes with that pid. The parent gets a
//! pidfd for the child from the clone itself, so it never names the process by a pid
//! that could be reused, and it reaps the child through that pidfd (`Child`).

use super::jail::{lift, Prepared, FIRST_PRIVATE_FD};
use std::ffi::{CString, OsString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Duration;

/// What to start and what it inherits. The fds handed over must stay open until
/// `spawn` has returned.
pub struct Launch<'a> {
    program: CString,
    argv: Vec<CString>,
    env: Vec<CString>,
    /// An argument that holds a NUL (which exec would cut short), or a handed fd
    /// numbered among hutch's private ones: refused at `spawn`.
    invalid: Option<String>,
    stdout: Option<BorrowedFd<'a>>,
    stderr: Option<BorrowedFd<'a>>,
    /// (an open fd of hutch's, the number the child gets it as).
    handed: Vec<(BorrowedFd<'a>, RawFd)>,
    die_with_parent: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("{program} was not found (not a path, and not in PATH)")]
    NotFound { program: String },
    #[error("preparing the child: {0}")]
    Prepare(std::io::Error),
    #[error("the kernel refused to clone QEMU into namespaces of its own (clone3, Linux 5.3+; a container's seccomp profile may forbid it): {0}; set HUTCH_JAIL=off to run it unconfined")]
    Clone(std::io::Error),
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Map(#[from] super::userns::MapError),
    /// The child failed before or at exec; the errno it reported.
    #[error("{0}")]
    Child(std::io::Error),
}

impl<'a> Launch<'a> {
    /// `program` with `args`, with only hutch's `PATH` for an environment, stdin from
    /// /dev/null, stdout and stderr to /dev/null unless set.
    pub fn new(program: &Path, args: impl IntoIterator<Item = impl Into<OsString>>) -> Launch<'a> {
        let mut invalid = None;
        let mut cstring = |s: &std::ffi::OsStr| {
            CString::new(s.as_bytes()).unwrap_or_else(|_| {
                invalid = Some(format!("the argument {s:?} holds a NUL byte, which would cut it short"));
                CString::default()
            })
        };
        let program_c = cstring(program.as_os_str());
        let mut argv = vec![program_c.clone()];
        argv.extend(args.into_iter().map(|a| cstring(&a.into())));
        let env = std::env::var_os("PATH").map(|path| {
            let mut pair = OsString::from("PATH=");
            pair.push(path);
            cstring(&pair)
        });
        Launch { program: program_c, argv, env: env.into_iter().collect(), invalid, stdout: None, stderr: None, handed: Vec::new(), die_with_parent: false }
    }

    pub fn stdout(mut self, fd: BorrowedFd<'a>) -> Self {
        self.stdout = Some(fd);
        self
    }

    pub fn stderr(mut self, fd: BorrowedFd<'a>) -> Self {
        self.stderr = Some(fd);
        self
    }

    /// The child gets `fd` as number `as_fd`, from 3 up to below `FIRST_PRIVATE_FD`.
    pub fn hand(mut self, fd: BorrowedFd<'a>, as_fd: RawFd) -> Self {
        if !(3..FIRST_PRIVATE_FD).contains(&as_fd) {
            self.invalid = Some(format!("fd {as_fd} cannot be handed over: only 3 to {} can", FIRST_PRIVATE_FD - 1));
        }
        self.handed.push((fd, as_fd));
        self
    }

    /// The child's `argv[0]`, as `std::process::Command` gives the name it was asked
    /// to run (`qemu-system-x86_64`), not the path it was found at.
    pub fn arg0(mut self, name: &str) -> Self {
        match CString::new(name) {
            Ok(name) => self.argv[0] = name,
            Err(_) => self.invalid = Some(format!("the program name {name:?} holds a NUL byte")),
        }
        self
    }

    /// The kernel kills the child when hutch dies (PR_SET_PDEATHSIG).
    pub fn die_with_parent(mut self, on: bool) -> Self {
        self.die_with_parent = on;
        self
    }

    /// Starts the child, confined by `jail` if given, and returns once it has exec'd
    /// (or failed to).
    pub fn spawn(self, jail: Option<&mut Prepared>) -> Result<Child, SpawnError> {
        let prepare = SpawnError::Prepare;
        if let Some(why) = self.invalid {
            return Err(SpawnError::Invalid(why));
        }
        if !self.program.as_bytes().contains(&b'/') {
            return Err(SpawnError::NotFound { program: self.program.to_string_lossy().into_owned() });
        }
        let argv: Vec<*const libc::c_char> = self.argv.iter().map(|a| a.as_ptr()).chain([std::ptr::null()]).collect();
        let envp: Vec<*const libc::c_char> = self.env.iter().map(|e| e.as_ptr()).chain([std::ptr::null()]).collect();
        let null = lift(std::fs::OpenOptions::new().read(true).write(true).open("/dev/null").map_err(prepare)?.into()).map_err(prepare)?;
        // Every fd the child dup2s from sits at 10 or above, clear of the numbers it
        // dup2s onto (0-2 and the handed ones).
        let lifted = |fd: Option<BorrowedFd>| -> Result<OwnedFd, SpawnError> {
            match fd {
                Some(fd) => lift(fd.try_clone_to_owned().map_err(prepare)?).map_err(prepare),
                None => lift(null.try_clone().map_err(prepare)?).map_err(prepare),
            }
        };
        let (stdout, stderr) = (lifted(self.stdout)?, lifted(self.stderr)?);
        let mut handed_own = Vec::new();
        for (fd, to) in &self.handed {
            handed_own.push((lift(fd.try_clone_to_owned().map_err(prepare)?).map_err(prepare)?, *to));
        }
        let handed: Vec<(RawFd, RawFd)> = handed_own.iter().map(|(fd, to)| (fd.as_raw_fd(), *to)).collect();
        let (go_read, go_write) = pipe().map_err(prepare)?;
        let (report_read, report_write) = pipe().map_err(prepare)?;
        // The child polls this after its id change (which clears the parent-death
        // signal it then sets again) to catch a parent that died before that.
        let parent = match self.die_with_parent {
            true => Some(lift(crate::pidfd::open_fd(std::process::id(), 0).map_err(prepare)?).map_err(prepare)?),
            false => None,
        };
        let (in_userns, confined) = match &jail {
            Some(j) => (j.child.in_userns, true),
            None => (false, false),
        };
        let mut child_side = jail.as_ref().map(|j| j.child.clone());
        let plan = ChildPlan {
            program: self.program.as_ptr(),
            argv: argv.as_ptr(),
            envp: envp.as_ptr(),
            stdio: [null.as_raw_fd(), stdout.as_raw_fd(), stderr.as_raw_fd()],
            handed: &handed,
            inherit_below: handed.iter().map(|(_, to)| to + 1).max().unwrap_or(3).max(3),
            go: go_read.as_raw_fd(),
            go_parent_end: go_write.as_raw_fd(),
            report: report_write.as_raw_fd(),
            report_parent_end: report_read.as_raw_fd(),
            parent: parent.as_ref().map(|p| p.as_raw_fd()),
            die_with_parent: self.die_with_parent,
        };
        let mut flags = libc::CLONE_PIDFD as u64;
        if confined {
            flags |= libc::CLONE_NEWPID as u64;
        }
        if in_userns {
            flags |= libc::CLONE_NEWUSER as u64;
        }
        let mut pidfd: libc::c_int = -1;
        // SAFETY: clone_args is plain data; all-zero is its "nothing asked" value.
        let mut args: libc::clone_args = unsafe { std::mem::zeroed() };
        args.flags = flags;
        args.pidfd = (&mut pidfd as *mut libc::c_int) as u64;
        args.exit_signal = libc::SIGCHLD as u64;
        // SAFETY: clone3 with no CLONE_VM and no stack: the child runs on a copy of this
        // thread's stack and memory, as after fork. It calls only `child_main`, which
        // makes async-signal-safe syscalls on values prepared above and never returns.
        let ret = unsafe { libc::syscall(libc::SYS_clone3, &mut args as *mut libc::clone_args, std::mem::size_of::<libc::clone_args>()) };
        let gone = |child: &Child| {
            let _ = child.kill();
            child.wait_within(Duration::MAX);
        };
        if ret == 0 {
            // SAFETY: we are the freshly cloned child (see above).
            unsafe { child_main(&plan, child_side.as_mut()) }
        }
        if ret < 0 {
            return Err(SpawnError::Clone(std::io::Error::last_os_error()));
        }
        drop((go_read, report_write));
        // SAFETY: clone3 stored a new pidfd that nothing else owns.
        let child = Child { pid: ret as u32, fd: unsafe { OwnedFd::from_raw_fd(pidfd) } };
        if let Some(mapping) = jail.and_then(|j| j.mapping.take()) {
            if let Err(e) = mapping.map(child.pid) {
                gone(&child);
                return Err(e.into());
            }
        }
        // A child that died meanwhile makes this EPIPE; its report says why.
        let _ = nix::unistd::write(&go_write, &child.pid.to_ne_bytes());
        drop(go_write);
        let mut errno = [0u8; 4];
        let mut got = 0;
        let report = std::fs::File::from(report_read);
        while got < errno.len() {
            match std::io::Read::read(&mut &report, &mut errno[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    gone(&child);
                    return Err(SpawnError::Prepare(e));
                }
            }
        }
        drop((stdout, stderr, handed_own, null, parent));
        match got {
            // The pipe closed on exec.
            0 => Ok(child),
            _ => {
                // It is on its way out (_exit): collect it.
                child.wait_within(Duration::MAX);
                Err(SpawnError::Child(std::io::Error::from_raw_os_error(i32::from_ne_bytes(errno))))
            }
        }
    }
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    Ok((lift(read)?, lift(write)?))
}

/// From linux/close_range.h.
const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;

/// What the child reads, all prepared by the parent: it must not allocate.
struct ChildPlan<'a> {
    program: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    stdio: [RawFd; 3],
    handed: &'a [(RawFd, RawFd)],
    /// Fds from here up are closed on exec (all but stdio and the handed ones).
    inherit_below: RawFd,
    go: RawFd,
    go_parent_end: RawFd,
    report: RawFd,
    report_parent_end: RawFd,
    parent: Option<RawFd>,
    die_with_parent: bool,
}

/// The child's whole life before exec; reports the errno of what failed and exits.
///
/// # Safety
/// Only in a freshly cloned child.
unsafe fn child_main(plan: &ChildPlan, jail: Option<&mut super::jail::ChildSide>) -> ! {
    // SAFETY: async-signal-safe calls on the plan's prepared values (see `steps`).
    unsafe {
        let error = steps(plan, jail);
        let errno = error.raw_os_error().unwrap_or(libc::EINVAL).to_ne_bytes();
        libc::write(plan.report, errno.as_ptr().cast(), errno.len());
        libc::_exit(127)
    }
}

/// # Safety
/// As `child_main`.
unsafe fn steps(plan: &ChildPlan, jail: Option<&mut super::jail::ChildSide>) -> std::io::Error {
    let fail = std::io::Error::last_os_error;
    // SAFETY: close, prctl, read, sigprocmask, signal, setpgid, dup2, poll and execve
    // are async-signal-safe; every pointer is into the plan, alive in the parent's
    // copied memory.
    unsafe {
        // Without these the parent's ends would stay open in here: its death would
        // not end the wait below, nor would a successful exec be seen.
        libc::close(plan.go_parent_end);
        libc::close(plan.report_parent_end);
        if plan.die_with_parent && libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) < 0 {
            return fail();
        }
        let mut pid = [0u8; 4];
        let read = loop {
            let n = libc::read(plan.go, pid.as_mut_ptr().cast(), pid.len());
            if n >= 0 || *libc::__errno_location() != libc::EINTR {
                break n;
            }
        };
        if read != pid.len() as isize {
            // The parent died, or could not map this child's user namespace.
            return std::io::Error::from_raw_os_error(libc::ESRCH);
        }
        libc::close(plan.go);
        let host_pid = u32::from_ne_bytes(pid);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
        // Rust ignores SIGPIPE, and an ignored signal stays ignored across exec.
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        // A session of its own: a Ctrl-C at hutch's terminal is hutch's to handle, and
        // with no controlling terminal an escaped QEMU cannot type into hutch's
        // (TIOCSTI on /dev/tty).
        if libc::setsid() < 0 {
            return fail();
        }
        for (to, &from) in plan.stdio.iter().enumerate() {
            if libc::dup2(from, to as RawFd) < 0 {
                return fail();
            }
        }
        for &(from, to) in plan.handed {
            if libc::dup2(from, to) < 0 {
                return fail();
            }
        }
        // Whatever else hutch had open without close-on-exec stays behind. (Before
        // Linux 5.11 this fails, and hutch's own fds are close-on-exec anyway.)
        libc::syscall(libc::SYS_close_range, plan.inherit_below as libc::c_uint, libc::c_uint::MAX, CLOSE_RANGE_CLOEXEC);
        if let Some(jail) = jail {
            if let Err(e) = jail.enter(host_pid) {
                return e;
            }
        }
        if plan.die_with_parent {
            // An id change clears the parent-death signal: set it (again), then catch a
            // parent that died before it was.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) < 0 {
                return fail();
            }
            if let Some(parent) = plan.parent {
                let mut poll = libc::pollfd { fd: parent, events: libc::POLLIN, revents: 0 };
                if libc::poll(&mut poll, 1, 0) != 0 {
                    return std::io::Error::from_raw_os_error(libc::ESRCH);
                }
            }
        }
        libc::execve(plan.program, plan.argv, plan.envp);
        fail()
    }
}

/// A child hutch spawned, named by its pidfd. hutch is its parent and must reap it
/// (`reap`, `wait_within`); `vm.rs` does so as it sees QEMU exit.
#[derive(Debug)]
pub struct Child {
    pub pid: u32,
    pub fd: OwnedFd,
}

impl Child {
    pub fn kill(&self) -> std::io::Result<()> {
        crate::pidfd::kill(self.fd.as_fd())
    }

    /// Blocks until the child exits (at most `limit`) and reaps it; its exit status.
    pub fn wait_within(&self, limit: Duration) -> Option<String> {
        crate::pidfd::wait_within(self.fd.as_fd(), limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_a_program_with_its_fds_and_reports_its_status() {
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe");
        let out = tempfile::tempfile().expect("tempfile");
        // Set for hutch, never passed on: only PATH is.
        std::env::set_var("HUTCH_SPAWN_TEST_SECRET", "x");
        let child = Launch::new(Path::new("/bin/sh"), ["-c", "echo out; env | grep -v ^PWD= | cut -d= -f1; echo handed >&5; exit 3"])
            .stdout(out.as_fd())
            .hand(write.as_fd(), 5)
            .spawn(None)
            .expect("spawn");
        drop(write);
        assert_eq!(child.wait_within(Duration::from_secs(30)).as_deref(), Some("exit status: 3"));
        let mut handed = String::new();
        std::io::Read::read_to_string(&mut std::fs::File::from(read), &mut handed).expect("read");
        assert_eq!(handed, "handed\n");
        let mut printed = String::new();
        std::io::Seek::rewind(&mut &out).expect("rewind");
        std::io::Read::read_to_string(&mut &out, &mut printed).expect("read");
        assert_eq!(printed, "out\nPATH\n");
    }

    #[test]
    fn a_missing_program_is_the_childs_error_and_a_kill_is_a_signal() {
        let missing = Launch::new(Path::new("/nonexistent/qemu"), ["-h"]).spawn(None).expect_err("spawned nothing");
        assert!(matches!(&missing, SpawnError::Child(e) if e.kind() == std::io::ErrorKind::NotFound), "{missing}");
        assert!(matches!(Launch::new(Path::new("sh"), ["-c", "true"]).spawn(None), Err(SpawnError::NotFound { .. })));
        assert!(matches!(Launch::new(Path::new("/bin/true"), ["a\0b"]).spawn(None), Err(SpawnError::Invalid(_))));
        let null = std::fs::File::open("/dev/null").expect("open");
        let private = Launch::new(Path::new("/bin/true"), [""; 0]).hand(null.as_fd(), FIRST_PRIVATE_FD);
        assert!(matches!(private.spawn(None), Err(SpawnError::Invalid(_))));
        let child = Launch::new(Path::new("/bin/sleep"), ["60"]).die_with_parent(true).spawn(None).expect("spawn");
        assert_eq!(crate::pidfd::reap(child.fd.as_fd()), None, "sleep 60 ended at once");
        child.kill().expect("kill");
        assert_eq!(child.wait_within(Duration::from_secs(30)).as_deref(), Some("signal: 9 (SIGKILL)"));
        // Reaped: nothing is left of it, and killing it again is no error.
        assert!(!Path::new(&format!("/proc/{}", child.pid)).exists());
        child.kill().expect("kill after exit");
    }
}
