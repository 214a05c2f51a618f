//! Starting a guest process: user, environment, cwd, stdio (pipes or a PTY).

use super::pty::{self, PtyMaster};
use super::reaper::Reaper;
use super::user::GuestUser;
use hutch_proto::process::{EndEvent, PtySize};
use std::collections::BTreeMap;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use tokio::net::unix::pipe;
use tokio::sync::oneshot;

pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

pub struct SpawnRequest {
    pub cmd: String,
    pub args: Vec<String>,
    /// Sandbox-wide variables first, then the request's own (which win).
    pub envs: BTreeMap<String, String>,
    pub cwd: Option<String>,
    /// Where to start when `cwd` is none: the image's `WorkingDir`, if it exists.
    pub default_cwd: Option<String>,
    pub user: GuestUser,
    pub pty: Option<PtySize>,
    pub stdin: bool,
}

pub enum ProcessIo {
    Pipes { stdin: Option<pipe::Sender>, stdout: pipe::Receiver, stderr: pipe::Receiver },
    Pty { master: Arc<PtyMaster> },
}

pub struct Spawned {
    pub pid: u32,
    pub io: ProcessIo,
    pub exit: oneshot::Receiver<EndEvent>,
}

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("working directory '{0}' does not exist in the sandbox")]
    CwdMissing(String),
    #[error("command not found in the sandbox: {0}")]
    NotFound(String),
    #[error("permission denied executing {0}")]
    PermissionDenied(String),
    #[error("cannot start {cmd}: {source}")]
    Io { cmd: String, source: io::Error },
}

fn environment(req: &SpawnRequest, cwd: &str) -> BTreeMap<String, String> {
    let mut env = BTreeMap::from([
        ("PATH".to_string(), DEFAULT_PATH.to_string()),
        ("HOME".to_string(), req.user.home.display().to_string()),
        ("USER".to_string(), req.user.name.clone()),
        ("LOGNAME".to_string(), req.user.name.clone()),
        ("SHELL".to_string(), req.user.shell.clone()),
        ("PWD".to_string(), cwd.to_string()),
        ("LANG".to_string(), "C.UTF-8".to_string()),
    ]);
    if req.pty.is_some() {
        env.insert("TERM".into(), "xterm-256color".into());
    }
    env.extend(req.envs.iter().map(|(k, v)| (k.clone(), v.clone())));
    env
}

fn resolve_cwd(req: &SpawnRequest) -> Result<PathBuf, SpawnError> {
    let cwd = match (&req.cwd, &req.default_cwd) {
        (Some(c), _) if !c.is_empty() => crate::fs::path::resolve(c, &req.user),
        (_, Some(d)) if Path::new(d).is_dir() => PathBuf::from(d),
        _ => req.user.home.clone(),
    };
    if cwd.is_dir() {
        Ok(cwd)
    } else if req.cwd.is_none() {
        Ok(PathBuf::from("/"))
    } else {
        Err(SpawnError::CwdMissing(cwd.display().to_string()))
    }
}

pub fn spawn(req: SpawnRequest, reaper: &Reaper) -> Result<Spawned, SpawnError> {
    let cwd = resolve_cwd(&req)?;
    let mut cmd = Command::new(&req.cmd);
    cmd.args(&req.args).env_clear().envs(environment(&req, &cwd.display().to_string())).current_dir(&cwd);

    let pty = match req.pty {
        Some(size) => Some(pty::open(size).map_err(|source| SpawnError::Io { cmd: req.cmd.clone(), source })?),
        None => None,
    };
    let io_err = |source| SpawnError::Io { cmd: req.cmd.clone(), source };
    match &pty {
        Some(pair) => {
            let dup = |fd: &OwnedFd| fd.try_clone().map(Stdio::from).map_err(io_err);
            cmd.stdin(dup(&pair.slave)?).stdout(dup(&pair.slave)?).stderr(dup(&pair.slave)?);
        }
        None => {
            cmd.stdin(if req.stdin { Stdio::piped() } else { Stdio::null() })
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
        }
    }

    let (uid, gid, with_tty) = (req.user.uid, req.user.gid, pty.is_some());
    // Collected here: the child must not allocate (another thread may hold the
    // allocator's lock at the fork, and the child would wait for it forever).
    let gids: Vec<libc::gid_t> = req.user.groups.iter().map(|g| *g as libc::gid_t).collect();
    // SAFETY: the closure runs between fork and exec and only makes async-signal-safe
    // syscalls (setsid, ioctl, setgroups, setgid, setuid) on data prepared before the
    // fork; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            if with_tty && libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::setgroups(gids.len(), gids.as_ptr()) < 0
                || libc::setgid(gid) < 0
                || libc::setuid(uid) < 0
            {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }

    let mut table = reaper.lock();
    let mut child = cmd.spawn().map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => SpawnError::NotFound(req.cmd.clone()),
        io::ErrorKind::PermissionDenied => SpawnError::PermissionDenied(req.cmd.clone()),
        _ => SpawnError::Io { cmd: req.cmd.clone(), source: e },
    })?;
    let pid = child.id();
    let exit = Reaper::register(&mut table, pid as i32);
    drop(table);
    drop(cmd); // closes our copies of the PTY slave

    let io = match pty {
        Some(pair) => {
            drop(pair.slave);
            ProcessIo::Pty { master: Arc::new(pair.master) }
        }
        None => {
            let take = |fd: Option<OwnedFd>| -> io::Result<OwnedFd> {
                fd.ok_or_else(|| io::Error::other("missing child pipe"))
            };
            let stdout = pipe::Receiver::from_owned_fd(take(child.stdout.take().map(OwnedFd::from)).map_err(io_err)?)
                .map_err(io_err)?;
            let stderr = pipe::Receiver::from_owned_fd(take(child.stderr.take().map(OwnedFd::from)).map_err(io_err)?)
                .map_err(io_err)?;
            let stdin = match child.stdin.take() {
                Some(s) => Some(pipe::Sender::from_owned_fd(OwnedFd::from(s)).map_err(io_err)?),
                None => None,
            };
            ProcessIo::Pipes { stdin, stdout, stderr }
        }
    };
    // The reaper owns the exit status; std's Child has nothing left to do.
    drop(child);
    Ok(Spawned { pid, io, exit })
}
