//! One cgroup per QEMU process, holding a VM to its memory, thread count and CPUs.
//!
//! cgroup v1 (one hierarchy per controller, what these machines have): the groups sit
//! under hutch's own group in each of the memory, pids and cpu hierarchies, so limits
//! set on hutch (a systemd unit's, a container's) still bind its VMs. cgroup v2: under
//! `/sys/fs/cgroup/hutch`, because v2 lets a group hand controllers to children only
//! while it holds no process itself, and hutch's own group holds hutch.
//!
//! A group is named `{hutch pid}-{n}-{vm id}`: it is removed when its VM ends, and a
//! group whose hutch has died (it was killed with its VMs) is removed by the next
//! hutch that makes one. A live hutch's empty groups are never touched by another,
//! so two hutch processes can share a machine.

use crate::backend::CpuShare;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

const V1_CONTROLLERS: [&str; 3] = ["memory", "pids", "cpu"];
const CPU_PERIOD_US: u64 = 100_000;

#[derive(Debug, thiserror::Error)]
#[error("{what} {}: {source}; hutch confines each VM in a cgroup of its own (run it as root on a host with the memory, pids and cpu controllers, or set HUTCH_JAIL=off to run QEMU unconfined)", path.display())]
pub struct CgroupError {
    what: &'static str,
    path: PathBuf,
    #[source]
    source: std::io::Error,
}

impl CgroupError {
    /// The groups are not this user's to make (not root, nothing delegated).
    pub fn is_denied(&self) -> bool {
        matches!(self.source.raw_os_error(), Some(libc::EACCES | libc::EPERM | libc::EROFS))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// What one VM may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: u64,
    pub pids: u32,
    /// CPU time per 100 ms period, in µs (200 000 = two CPUs' worth).
    pub cpu_quota_us: u64,
}

impl Limits {
    /// A VM's guest RAM plus QEMU's own needs, its vCPUs plus one for device emulation.
    pub fn for_vm(memory_mib: u32, cpus: u32, accel: crate::accel::Accel) -> Limits {
        // QEMU itself: ~100 MiB under KVM; TCG adds its translation cache, which grows
        // with the code the guest runs.
        let overhead_mib: u64 = match accel {
            crate::accel::Accel::Kvm => 256,
            crate::accel::Accel::Tcg => 768,
        };
        Limits {
            memory_bytes: (u64::from(memory_mib) + overhead_mib) << 20,
            // QEMU's threads: one per vCPU, its main loop, RCU and a pool of up to 64
            // block-I/O workers. Nothing in it forks.
            pids: 256,
            cpu_quota_us: u64::from(cpus + 1) * CPU_PERIOD_US,
        }
    }
}

/// Where this host keeps cgroups.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Layout {
    /// The directory under which hutch makes its groups, one per controller.
    V1(Vec<(&'static str, PathBuf)>),
    V2(PathBuf),
}

/// The groups one VM lives in (one per v1 controller, or one v2 group).
#[derive(Debug)]
pub struct Group {
    dirs: Vec<PathBuf>,
}

static NEXT: AtomicU64 = AtomicU64::new(0);
static SWEPT: std::sync::Once = std::sync::Once::new();

fn err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> CgroupError + 'a {
    move |source| CgroupError { what, path: path.to_path_buf(), source }
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    std::fs::OpenOptions::new().write(true).open(path).and_then(|mut f| f.write_all(value.as_bytes())).map_err(err("writing", path))
}

/// This process's group in the hierarchy that has `controller` (v1), from /proc/self/cgroup.
fn own_path(proc_cgroup: &str, controller: &str) -> Option<String> {
    proc_cgroup.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers.split(',').any(|c| c == controller).then(|| path.trim_start_matches('/').to_string())
    })
}

fn layout() -> Result<Layout, CgroupError> {
    let root = Path::new("/sys/fs/cgroup");
    if root.join("cgroup.controllers").exists() {
        return Ok(Layout::V2(root.join("hutch")));
    }
    let me = Path::new("/proc/self/cgroup");
    let proc_cgroup = std::fs::read_to_string(me).map_err(err("reading", me))?;
    let mut dirs = Vec::new();
    for controller in V1_CONTROLLERS {
        let mount = root.join(controller);
        let Some(own) = own_path(&proc_cgroup, controller).filter(|_| mount.is_dir()) else {
            let missing = std::io::Error::new(std::io::ErrorKind::NotFound, format!("no cgroup v1 hierarchy has the {controller} controller"));
            return Err(CgroupError { what: "finding", path: mount, source: missing });
        };
        dirs.push((controller, mount.join(own).join("hutch")));
    }
    Ok(Layout::V1(dirs))
}

/// Where VMs' groups go on this host, for `hutch doctor`.
pub fn summary() -> Result<String, CgroupError> {
    Ok(match layout()? {
        Layout::V1(dirs) => {
            let memory = dirs.first().map(|(_, d)| d.display().to_string()).unwrap_or_default();
            format!("cgroup v1: memory, pids and cpu, e.g. under {memory}")
        }
        Layout::V2(dir) => format!("cgroup v2: memory, pids and cpu under {}", dir.display()),
    })
}

fn name_for(vm_id: &str) -> String {
    let id: String = vm_id.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-').take(40).collect();
    format!("{}-{}-{id}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Removes the groups of hutch processes that no longer run (their VMs died with them).
fn sweep(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.split('-').next()).and_then(|p| p.parse::<i32>().ok()) else { continue };
        // EPERM: it runs, as another user.
        let alive = !matches!(nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None), Err(nix::errno::Errno::ESRCH));
        if !alive {
            // Fails (EBUSY) if a process is still in it: then it is not ours to remove.
            let _ = std::fs::remove_dir(entry.path());
        }
    }
}

impl Group {
    /// Makes the groups for one VM with `limits` set.
    pub fn create(vm_id: &str, limits: Limits) -> Result<Group, CgroupError> {
        let layout = layout()?;
        let name = name_for(vm_id);
        let mut group = Group { dirs: Vec::new() };
        let made = match &layout {
            Layout::V1(parents) => parents.iter().try_for_each(|(controller, parent)| {
                SWEPT.call_once(|| parents.iter().for_each(|(_, p)| sweep(p)));
                let dir = parent.join(&name);
                std::fs::create_dir_all(&dir).map_err(err("creating", &dir))?;
                group.dirs.push(dir.clone());
                match *controller {
                    "memory" => write(&dir.join("memory.limit_in_bytes"), &limits.memory_bytes.to_string()),
                    "pids" => write(&dir.join("pids.max"), &limits.pids.to_string()),
                    _ => {
                        write(&dir.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
                        match write(&dir.join("cpu.cfs_quota_us"), &limits.cpu_quota_us.to_string()) {
                            // v1 refuses a quota above an ancestor's (hutch in a limited
                            // container): the VM then shares the ancestor's limit.
                            Err(e) if e.source.raw_os_error() == Some(libc::EINVAL) => {
                                tracing::warn!("no CPU quota of its own for the VM: {e}");
                                Ok(())
                            }
                            other => other,
                        }
                    }
                }
            }),
            Layout::V2(parent) => (|| {
                std::fs::create_dir_all(parent).map_err(err("creating", parent))?;
                SWEPT.call_once(|| sweep(parent));
                for level in [Path::new("/sys/fs/cgroup"), parent.as_path()] {
                    write(&level.join("cgroup.subtree_control"), "+cpu +memory +pids")?;
                }
                let dir = parent.join(&name);
                std::fs::create_dir(&dir).map_err(err("creating", &dir))?;
                group.dirs.push(dir.clone());
                write(&dir.join("memory.max"), &limits.memory_bytes.to_string())?;
                write(&dir.join("pids.max"), &limits.pids.to_string())?;
                write(&dir.join("cpu.max"), &format!("{} {CPU_PERIOD_US}", limits.cpu_quota_us))
            })(),
        };
        made.map(|()| group)
    }

    /// Open `cgroup.procs` files: writing "0" to each moves the writer in.
    pub fn procs_files(&self) -> Result<Vec<OwnedFd>, CgroupError> {
        self.dirs
            .iter()
            .map(|d| {
                let procs = d.join("cgroup.procs");
                std::fs::OpenOptions::new().write(true).open(&procs).map(OwnedFd::from).map_err(err("opening", &procs))
            })
            .collect()
    }

    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// The groups hutch made for the running process `pid` (a VM an earlier hutch
    /// left running), read from /proc/PID/cgroup; None if it is in none of hutch's.
    pub fn of_process(pid: u32) -> Option<Group> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        let root = Path::new("/sys/fs/cgroup");
        let ours = |path: &str| Path::new(path).parent().and_then(Path::file_name).is_some_and(|n| n == "hutch");
        let dirs: Vec<PathBuf> = if root.join("cgroup.controllers").exists() {
            let path = own_path_v2(&text)?;
            ours(&path).then(|| root.join(path)).into_iter().collect()
        } else {
            V1_CONTROLLERS.iter().filter_map(|c| own_path(&text, c).filter(|p| ours(p)).map(|p| root.join(c).join(p))).collect()
        };
        (!dirs.is_empty()).then_some(Group { dirs })
    }

    /// Lets go of the groups without removing them: their VM runs on for another
    /// hutch to adopt.
    pub fn leave(mut self) {
        self.dirs.clear();
    }
}

impl Group {
    /// Sets the VM's CPU weight against its siblings, the other VMs' groups: v1's
    /// `cpu.shares` (1024 by default) or v2's `cpu.weight` (100). Weights only matter
    /// while the CPU is contended; the quota stays as it is. The background is an
    /// eighth of the default, not the least: a pool VM that a create may be waiting
    /// for still starts on a host busy with other sandboxes (~11% of a core against
    /// one busy VM), where the least weight (2) would leave it ~0.2%.
    pub fn set_cpu_share(&self, share: CpuShare) -> Result<(), CgroupError> {
        let (shares, weight) = match share {
            CpuShare::Foreground => ("1024", "100"),
            CpuShare::Background => ("128", "12"),
        };
        for dir in &self.dirs {
            for (file, value) in [("cpu.shares", shares), ("cpu.weight", weight)] {
                let path = dir.join(file);
                if path.exists() {
                    write(&path, value)?;
                }
            }
        }
        Ok(())
    }
}

/// The process's group in the v2 hierarchy (the `0::` line).
fn own_path_v2(proc_cgroup: &str) -> Option<String> {
    proc_cgroup.lines().find_map(|line| line.strip_prefix("0::")).map(|p| p.trim_start_matches('/').to_string())
}

impl Group {
    /// Removes the groups; false while a process is still in one (EBUSY).
    pub fn try_remove(&self) -> bool {
        // Every directory is tried, whichever fails.
        self.dirs.iter().fold(true, |all, dir| {
            let gone = match std::fs::remove_dir(dir) {
                Ok(()) => true,
                Err(e) => e.kind() == std::io::ErrorKind::NotFound,
            };
            all && gone
        })
    }
}

impl Drop for Group {
    /// Only an empty group can go: the owner drops it after its VM has exited.
    fn drop(&mut self) {
        self.try_remove();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The share goes to whichever CPU file the group has (v1's memory and pids
    /// groups have neither), and comes back.
    #[test]
    fn a_share_is_written_to_the_cpu_controllers_file() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (v1_cpu, v1_memory, v2) = (tmp.path().join("cpu"), tmp.path().join("memory"), tmp.path().join("v2"));
        // Empty: a cgroup file takes each write whole, a regular file would keep a tail.
        for (dir, file, text) in [(&v1_cpu, "cpu.shares", ""), (&v1_memory, "memory.limit_in_bytes", "default"), (&v2, "cpu.weight", "")] {
            std::fs::create_dir(dir).expect("dir");
            std::fs::write(dir.join(file), text).expect("file");
        }
        let group = Group { dirs: vec![v1_cpu.clone(), v1_memory.clone(), v2.clone()] };
        let read = |path: PathBuf| std::fs::read_to_string(path).expect("read");
        group.set_cpu_share(CpuShare::Background).expect("background");
        assert_eq!((read(v1_cpu.join("cpu.shares")), read(v2.join("cpu.weight"))), ("128".into(), "12".into()));
        for file in [v1_cpu.join("cpu.shares"), v2.join("cpu.weight")] {
            std::fs::write(file, "").expect("emptied");
        }
        group.set_cpu_share(CpuShare::Foreground).expect("foreground");
        assert_eq!((read(v1_cpu.join("cpu.shares")), read(v2.join("cpu.weight"))), ("1024".into(), "100".into()));
        assert_eq!(read(v1_memory.join("memory.limit_in_bytes")), "default");
        assert!(!v1_memory.join("cpu.shares").exists(), "a file was made where the controller has none");
        group.leave();
    }

    #[test]
    fn finds_its_own_group_per_controller() {
        let text = "9:name=systemd:/\n8:pids:/svc\n4:memory:/process_api/f9\n1:cpu,cpuacct:/\n0::/\n";
        assert_eq!(own_path(text, "memory").as_deref(), Some("process_api/f9"));
        assert_eq!(own_path(text, "pids").as_deref(), Some("svc"));
        assert_eq!(own_path(text, "cpu").as_deref(), Some(""));
        assert_eq!(own_path(text, "cpuacct").as_deref(), Some(""));
        assert_eq!(own_path(text, "blkio"), None);
        assert_eq!(own_path_v2("0::/hutch/12-0-sb\n").as_deref(), Some("hutch/12-0-sb"));
    }

    #[test]
    fn limits_leave_room_for_qemu_and_cap_cpus() {
        let l = Limits::for_vm(512, 2, crate::accel::Accel::Kvm);
        assert_eq!(l.memory_bytes, 768 << 20);
        assert_eq!(l.cpu_quota_us, 300_000);
    }

    #[test]
    fn names_carry_the_owner_pid_and_only_safe_characters() {
        let n = name_for("sb/../x y");
        assert!(n.starts_with(&format!("{}-", std::process::id())), "{n}");
        assert!(n.ends_with("-sbxy"), "{n}");
    }
}
