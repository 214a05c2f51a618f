//! Confinement of each QEMU process, after Firecracker's jailer. When hutch runs as
//! root, every QEMU starts
//! - as a uid of its own (`UID_BASE` + its pid, so unique among live processes), with
//!   no supplementary groups, no capabilities (a change from uid 0 drops them all) and
//!   `no_new_privs`;
//! - in a mount namespace of its own where `$HUTCH_HOME`, /root, /home, /tmp, /var/tmp,
//!   /dev/shm and /run are empty tmpfs, and only this VM's files are bound back at their
//!   usual paths: kernel, initrd, backing images and a snapshot's memory read-only, its
//!   overlay disk (and the memory file it fills, when it makes a snapshot) read-write.
//!   It cannot see, let alone change, any other sandbox's disk, memory or sockets, nor
//!   the database and tokens;
//! - with a private `/dev/kvm` node owned by that uid, the host's staying root's;
//! - in network and IPC namespaces of its own (no interfaces, no abstract sockets);
//! - as the only process (pid 1) of a PID namespace of its own, with a `/proc` of that
//!   namespace: it sees no other process, nor any command line but its own;
//! - in a cgroup of its own (`cgroup.rs`).
//!
//! QEMU needs no write access to a directory: its QMP and agent sockets are listening
//! sockets hutch binds and hands it as fds, like its console and migration streams.
//! Everything is computed here in the parent; between clone and exec the child only
//! makes syscalls on the values prepared (`ChildSide::enter`, called by `spawn.rs`).

use crate::accel::Accel;
use crate::backend::{Memory, StartError, VmSpec};
use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// The first of the uids confined QEMUs run as: far above the ids Debian gives users
/// (1000+) and the subordinate ranges of /etc/subuid (100000 + 65536 per user), and
/// pids stay below 2^22.
pub const UID_BASE: u32 = 1_500_000_000;

/// Directories hidden from every QEMU besides `$HUTCH_HOME`: where users, services and
/// other programs keep what a VM has no business reading, and the cgroup tree, whose
/// names are other VMs' sandbox ids.
const MASKED: [&str; 7] = ["/root", "/home", "/tmp", "/var/tmp", "/dev/shm", "/run", "/sys/fs/cgroup"];

/// Fds the child uses sit at or above this, clear of the ones QEMU is handed (3-5).
pub const FIRST_PRIVATE_FD: RawFd = 10;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JailConfig {
    /// hutch's home, hidden whole but for this VM's own files.
    pub hide: PathBuf,
    pub identity: Identity,
}

/// Whose ids the jail hands out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// hutch is root: each QEMU becomes `UID_BASE` + its pid.
    Root,
    /// hutch is an ordinary user: each QEMU gets a user namespace and one id of the
    /// user's subordinate range (`userns.rs`).
    Subordinate(super::userns::SubIds),
}

/// Why VMs run unconfined.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Unconfined {
    #[error("HUTCH_JAIL=off")]
    Off,
    #[error(transparent)]
    NoIds(#[from] super::userns::Unavailable),
}

impl JailConfig {
    /// Confinement for VMs whose files live in `home`: as root, ids of hutch's own
    /// choosing; as another user, ids of its subordinate range. Unless turned off with
    /// `HUTCH_JAIL=off`.
    pub fn for_home(home: &Path) -> Result<JailConfig, Unconfined> {
        if std::env::var("HUTCH_JAIL").is_ok_and(|v| v == "off" || v == "0") {
            return Err(Unconfined::Off);
        }
        let identity = match nix::unistd::geteuid().is_root() {
            true => Identity::Root,
            false => Identity::Subordinate(super::userns::SubIds::of_current_user()?),
        };
        Ok(JailConfig { hide: home.to_path_buf(), identity })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error(transparent)]
    Backing(#[from] crate::disk::backing::BackingError),
    #[error(transparent)]
    Cgroup(#[from] super::cgroup::CgroupError),
    #[error("preparing {} for the VM: {source}", path.display())]
    File { path: PathBuf, source: std::io::Error },
    #[error("the disk {} stacks on {}, which is outside hutch's templates, snapshots and build layers; refusing to bind it into the VM (its header was changed)", disk.display(), backing.display())]
    ForeignBacking { disk: PathBuf, backing: PathBuf },
    #[error("the disk {} stacks on {}, not on {} which hutch made it on; refusing to start the VM (its header was changed)", disk.display(), backing.display(), base.display())]
    ChangedBacking { disk: PathBuf, backing: PathBuf, base: PathBuf },
    #[error("QEMU ({}) is under {}, which confined VMs cannot see; install it elsewhere or set HUTCH_JAIL=off", binary.display(), mask.display())]
    HiddenBinary { binary: PathBuf, mask: PathBuf },
    #[error("leasing an id for the VM from this user's /etc/subuid range: {0}")]
    Lease(std::io::Error),
    #[error(transparent)]
    Map(#[from] super::userns::MapError),
}

impl JailError {
    /// Whether this is a disk whose header no longer names what hutch made it on: the
    /// VM's doing, so the sandbox must not start again.
    fn is_tampered_disk(&self) -> bool {
        match self {
            JailError::ForeignBacking { .. } | JailError::ChangedBacking { .. } => true,
            JailError::Backing(b) => b.is_tampered(),
            _ => false,
        }
    }

    /// As a start fails: a tampered disk says so in its own variant, which callers look
    /// for without knowing this backend (`StartError::tampered_disk_in`).
    pub(crate) fn into_start_error(self) -> StartError {
        if self.is_tampered_disk() {
            StartError::TamperedDisk(self.into())
        } else {
            StartError::Jail(self.into())
        }
    }
}

/// What the jail does, in order (paths as the host names them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// An empty tmpfs over a directory.
    Mask(PathBuf),
    /// A file bound back over a mask at its own path.
    Bind { path: PathBuf, writable: bool },
}

fn under_mask(steps: &[Step], path: &Path) -> Option<PathBuf> {
    steps.iter().find_map(|s| match s {
        Step::Mask(m) if path.starts_with(m) => Some(m.clone()),
        _ => None,
    })
}

/// The jail for `spec`, whose disk stacks on `backing`. `is_dir` says what exists on
/// this host, so tests can plan for any layout.
pub(crate) fn plan(spec: &VmSpec, config: &JailConfig, backing: &[PathBuf], is_dir: impl Fn(&Path) -> bool) -> Vec<Step> {
    let mut steps: Vec<Step> = Vec::new();
    for mask in MASKED.iter().map(PathBuf::from).chain([config.hide.clone()]) {
        if is_dir(&mask) && under_mask(&steps, &mask).is_none() {
            steps.push(Step::Mask(mask));
        }
    }
    let mut files: Vec<(PathBuf, bool)> = vec![(spec.kernel.clone(), false), (spec.initrd.clone(), false), (spec.disk.clone(), true)];
    files.extend(backing.iter().map(|b| (b.clone(), false)));
    match &spec.memory {
        Memory::Anonymous => {}
        Memory::SharedFile(f) => files.push((f.clone(), true)),
        Memory::PrivateFile(f) => files.push((f.clone(), false)),
    }
    for (path, writable) in files {
        let new = !steps.iter().any(|s| matches!(s, Step::Bind { path: p, .. } if *p == path));
        if new && under_mask(&steps, &path).is_some() {
            steps.push(Step::Bind { path, writable });
        }
    }
    steps
}

fn cstr(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).unwrap_or_default()
}

/// `fd` moved to `FIRST_PRIVATE_FD` or above.
pub fn lift(fd: OwnedFd) -> std::io::Result<OwnedFd> {
    use std::os::fd::FromRawFd;
    if fd.as_raw_fd() >= FIRST_PRIVATE_FD {
        return Ok(fd);
    }
    let moved = nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(FIRST_PRIVATE_FD)).map_err(std::io::Error::from)?;
    // SAFETY: fcntl just returned `moved` as a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(moved) })
}

/// One syscall-level action for the child, on values prepared in the parent.
#[derive(Debug, Clone)]
enum Op {
    Mkdir(CString),
    /// An empty file to bind a file onto.
    Touch(CString),
    Tmpfs { at: CString, options: CString, flags: libc::c_ulong },
    /// Attaches clone number `tree` (see `ChildSide::clones`) at `at`.
    Attach { tree: usize, at: CString, flags: libc::c_ulong },
    Bind { from: CString, at: CString, flags: libc::c_ulong },
    /// A private char device node, made and given to the VM's uid.
    Node { at: CString, dev: libc::dev_t },
}

/// What the child needs, all plain values: it must not allocate between fork and exec.
#[derive(Debug, Clone)]
pub struct ChildSide {
    /// Files to clone (open_tree) before the masks hide them: a bind mount cannot take
    /// its source from the parent's namespace, and after the masks the path is gone.
    clones: Vec<CString>,
    /// The clones' fds, filled in by the child (room made in the parent).
    trees: Vec<RawFd>,
    ops: Vec<Op>,
    cgroup_procs: Vec<RawFd>,
    chown: Vec<RawFd>,
    /// Set when hutch is not root: the child was cloned into a user namespace of its
    /// own, which hutch mapped before it went on (`userns.rs`).
    pub(crate) in_userns: bool,
    /// Keeps hutch's supplementary groups: in a user namespace, the `kvm` group is
    /// what lets the VM open the host's /dev/kvm.
    keep_groups: bool,
}

/// A prepared jail. The fds must stay open until the child has exec'd.
pub struct Prepared {
    pub child: ChildSide,
    _fds: Vec<OwnedFd>,
    /// None for a hutch that is not root and was given no cgroup to manage.
    pub group: Option<super::cgroup::Group>,
    /// The id slot the VM holds (not root), and the mapping still to be made for it.
    pub lease: Option<super::userns::Lease>,
    pub(crate) mapping: Option<super::userns::Mapping>,
}

const HIDDEN: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;

fn mkdirs(ops: &mut Vec<Op>, dir: &Path) {
    let mut acc = PathBuf::new();
    for part in dir.components() {
        acc.push(part);
        if acc != Path::new("/") {
            ops.push(Op::Mkdir(cstr(&acc)));
        }
    }
}

fn file_err(path: &Path) -> impl FnOnce(std::io::Error) -> JailError + '_ {
    move |source| JailError::File { path: path.to_path_buf(), source }
}

impl Prepared {
    pub fn new(spec: &VmSpec, config: &JailConfig, binary: &str) -> Result<Prepared, JailError> {
        let roots = crate::disk::backing::Roots::of_home(&config.hide, &spec.dir);
        let backing = crate::disk::backing::chain(&spec.disk, &roots)?;
        confined_chain(spec, &roots, &backing)?;
        let steps = plan(spec, config, &backing, |p| p.is_dir());
        if let Some(binary) = crate::process::find_program(binary) {
            if let Some(mask) = under_mask(&steps, &binary) {
                return Err(JailError::HiddenBinary { binary, mask });
            }
        }
        let mut ops = Vec::new();
        let mut clones = Vec::new();
        let mut fds = Vec::new();
        let mut chown = Vec::new();
        for step in &steps {
            match step {
                Step::Mask(dir) => {
                    mkdirs(&mut ops, dir.parent().unwrap_or(Path::new("/")));
                    // /tmp-like places stay writable to whoever uses them; the rest are empty.
                    let options = if dir.starts_with("/tmp") || dir.starts_with("/var/tmp") || dir.starts_with("/dev/shm") { "mode=1777,size=16m" } else { "mode=0755,size=1m" };
                    ops.push(Op::Tmpfs { at: cstr(dir), options: CString::new(options).unwrap_or_default(), flags: HIDDEN });
                }
                Step::Bind { path, writable } => {
                    if *writable {
                        // QEMU fills a new snapshot's memory file: it must exist to be bound.
                        std::fs::OpenOptions::new().create(true).append(true).open(path).map_err(file_err(path))?;
                    } else {
                        ensure_world_readable(path)?;
                    }
                    if *writable {
                        let file = std::fs::File::open(path).map_err(file_err(path))?;
                        if let Identity::Subordinate(ids) = &config.identity {
                            // Back to hutch's group (an earlier VM's may be left on it): in
                            // the VM's namespace only hutch's ids and the VM's own map.
                            std::os::unix::fs::fchown(&file, None, Some(ids.gid)).map_err(file_err(path))?;
                        }
                        let file = lift(file.into()).map_err(file_err(path))?;
                        chown.push(file.as_raw_fd());
                        fds.push(file);
                    }
                    clones.push(cstr(path));
                    mkdirs(&mut ops, path.parent().unwrap_or(Path::new("/")));
                    ops.push(Op::Touch(cstr(path)));
                    let flags = HIDDEN | atime_flags(path) | if *writable { 0 } else { libc::MS_RDONLY };
                    ops.push(Op::Attach { tree: clones.len() - 1, at: cstr(path), flags });
                }
            }
        }
        // A user namespace cannot make device nodes: there the VM opens the host's
        // /dev/kvm through hutch's kvm group.
        if spec.accel == Accel::Kvm && config.identity == Identity::Root {
            let kvm = Path::new("/dev/kvm");
            let dev = std::fs::metadata(kvm).map_err(file_err(kvm))?;
            let dir = config.hide.join(".dev");
            mkdirs(&mut ops, &dir);
            // Its own small tmpfs: device nodes work there, unlike in the masks.
            let options = CString::new("mode=0755,size=4k").unwrap_or_default();
            ops.push(Op::Tmpfs { at: cstr(&dir), options, flags: libc::MS_NOSUID | libc::MS_NOEXEC });
            let node = cstr(&dir.join("kvm"));
            ops.push(Op::Node { at: node.clone(), dev: std::os::unix::fs::MetadataExt::rdev(&dev) });
            ops.push(Op::Bind { from: node, at: cstr(kvm), flags: libc::MS_NOSUID | libc::MS_NOEXEC });
        }
        let limits = super::cgroup::Limits::for_vm(spec.memory_mib, spec.cpus, spec.accel);
        let group = match (super::cgroup::Group::create(&spec.id, limits), &config.identity) {
            (Ok(group), _) => Some(group),
            // Not root: cgroups are hutch's only where they were delegated to its user.
            (Err(e), Identity::Subordinate(_)) if e.is_denied() => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                let why = format!("this user may not create {}", e.path().display());
                WARNED.call_once(|| tracing::warn!("VMs run without memory, pids and cpu limits of their own: {why}; delegate a cgroup to this user (docs/SECURITY.md) or run hutch as root"));
                None
            }
            (Err(e), _) => return Err(e.into()),
        };
        let mut cgroup_procs = Vec::new();
        for fd in group.as_ref().map(|g| g.procs_files()).transpose()?.unwrap_or_default() {
            let fd = lift(fd).map_err(file_err(Path::new("cgroup.procs")))?;
            cgroup_procs.push(fd.as_raw_fd());
            fds.push(fd);
        }
        let (mut lease, mut mapping) = (None, None);
        if let Identity::Subordinate(ids) = &config.identity {
            let held = ids.lease().map_err(JailError::Lease)?;
            mapping = Some(super::userns::Mapping::new(ids, &held));
            lease = Some(held);
        }
        let trees = vec![-1; clones.len()];
        let in_userns = mapping.is_some();
        let keep_groups = in_userns && spec.accel == Accel::Kvm;
        let child = ChildSide { clones, trees, ops, cgroup_procs, chown, in_userns, keep_groups };
        Ok(Prepared { child, _fds: fds, group, lease, mapping })
    }
}

/// The backing names come from qcow2 headers, which a compromised QEMU can rewrite in
/// its own overlay (and which then travel into snapshots copied from it). Whatever they
/// say, only images in hutch's templates, snapshots and template-build layers, or the
/// VM's own directory, are bound into a jail: resolved through symlinks, so a name
/// cannot point elsewhere. (`backing::chain` checked each before opening it; this
/// holds for any list of names.)
fn confined_chain(spec: &VmSpec, roots: &crate::disk::backing::Roots, backing: &[PathBuf]) -> Result<(), JailError> {
    for image in backing {
        let real = std::fs::canonicalize(image).map_err(file_err(image))?;
        if !roots.holds(&real) {
            return Err(JailError::ForeignBacking { disk: spec.disk.clone(), backing: image.clone() });
        }
    }
    // Within them, the disk must still stack on the image hutch made it on: a rewritten
    // header could name another tenant's snapshot. Below that image, headers are
    // hutch's own (`disk::reset_backing` rewrites every stored copy's).
    if let Some(base) = &spec.base {
        let named = backing.first().map(|b| std::fs::canonicalize(b).map_err(file_err(b))).transpose()?;
        if named.as_ref() != Some(&std::fs::canonicalize(base).map_err(file_err(base))?) {
            let backing = backing.first().cloned().unwrap_or_default();
            return Err(JailError::ChangedBacking { disk: spec.disk.clone(), backing, base: base.clone() });
        }
    }
    Ok(())
}

/// Files bound read-only must be readable by the VM's uid. They live in `$HUTCH_HOME`,
/// which is 0700, so opening them to everyone there exposes them to no one else.
fn ensure_world_readable(path: &Path) -> Result<(), JailError> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).map_err(file_err(path))?.permissions().mode();
    if mode & 0o004 == 0 {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode | 0o444)).map_err(file_err(path))?;
    }
    Ok(())
}

/// The access-time flags of the mount holding `path`. A remount must repeat them: in
/// a user namespace the flags of mounts inherited from the host are locked, and a
/// remount that left them out would ask to change them.
fn atime_flags(path: &Path) -> libc::c_ulong {
    use nix::sys::statvfs::FsFlags;
    let Ok(stat) = nix::sys::statvfs::statvfs(path) else { return 0 };
    let flags = stat.flags();
    let mut out = 0;
    if flags.contains(FsFlags::ST_NOATIME) {
        out |= libc::MS_NOATIME;
    }
    if flags.contains(FsFlags::ST_NODIRATIME) {
        out |= libc::MS_NODIRATIME;
    }
    if flags.contains(FsFlags::ST_RELATIME) {
        out |= libc::MS_RELATIME;
    }
    out
}

/// From linux/mount.h.
const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 4;

/// Remounts the bind at `at` with `flags` (a bind's flags only take effect on a remount).
///
/// # Safety
/// As `ChildSide::enter`.
unsafe fn restrict(at: &CString, flags: libc::c_ulong) -> std::io::Result<()> {
    // SAFETY: a syscall on a C string the caller keeps alive.
    check(unsafe { libc::mount(std::ptr::null(), at.as_ptr(), std::ptr::null(), libc::MS_BIND | libc::MS_REMOUNT | flags, std::ptr::null()) })
}

fn check(ret: libc::c_int) -> std::io::Result<()> {
    if ret < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

impl ChildSide {
    /// The uid a confined child whose host pid is `pid` runs as when hutch is root.
    pub fn uid_of(pid: u32) -> u32 {
        UID_BASE + pid
    }

    /// Enters the jail, in the child `spawn.rs` cloned into a PID namespace of its own
    /// (and, when hutch is not root, into a user namespace hutch has mapped), between
    /// clone and exec. `host_pid` is the child's pid as the host sees it: inside it is 1.
    ///
    /// # Safety
    /// Only in a freshly cloned child: it changes the process's mounts and ids.
    pub(crate) unsafe fn enter(&mut self, host_pid: u32) -> std::io::Result<()> {
        // SAFETY: only async-signal-safe syscalls on C strings and fds prepared by the
        // parent and kept alive by `self`; nothing is allocated.
        unsafe {
            libc::umask(0o022);
            for &fd in &self.cgroup_procs {
                if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // Its own network namespace too: nothing but a downed loopback, so an escaped
            // QEMU has no network and no abstract unix sockets to reach.
            check(libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWNET | libc::CLONE_NEWIPC))?;
            // Nothing done below may reach the host's mount table.
            check(libc::mount(std::ptr::null(), c"/".as_ptr(), std::ptr::null(), libc::MS_REC | libc::MS_PRIVATE, std::ptr::null()))?;
            // Not root: in its user namespace hutch's user is root and the VM's leased id is 1.
            let uid = if self.in_userns { 1 } else { Self::uid_of(host_pid) };
            for (path, slot) in self.clones.iter().zip(self.trees.iter_mut()) {
                let flags = OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint;
                let fd = libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, path.as_ptr(), flags);
                check(fd as libc::c_int)?;
                *slot = fd as RawFd;
            }
            for op in &self.ops {
                match op {
                    Op::Mkdir(p) => {
                        if libc::mkdir(p.as_ptr(), 0o755) < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST) {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    Op::Touch(p) => {
                        let fd = libc::open(p.as_ptr(), libc::O_RDONLY | libc::O_CREAT | libc::O_CLOEXEC | libc::O_NOFOLLOW, 0o644);
                        check(fd)?;
                        libc::close(fd);
                    }
                    Op::Tmpfs { at, options, flags } => {
                        check(libc::mount(c"tmpfs".as_ptr(), at.as_ptr(), c"tmpfs".as_ptr(), *flags, options.as_ptr().cast()))?;
                    }
                    Op::Attach { tree, at, flags } => {
                        let moved = libc::syscall(libc::SYS_move_mount, self.trees[*tree], c"".as_ptr(), libc::AT_FDCWD, at.as_ptr(), MOVE_MOUNT_F_EMPTY_PATH);
                        check(moved as libc::c_int)?;
                        restrict(at, *flags)?;
                    }
                    Op::Bind { from, at, flags } => {
                        check(libc::mount(from.as_ptr(), at.as_ptr(), std::ptr::null(), libc::MS_BIND, std::ptr::null()))?;
                        restrict(at, *flags)?;
                    }
                    Op::Node { at, dev } => {
                        check(libc::mknod(at.as_ptr(), libc::S_IFCHR | 0o600, *dev))?;
                        check(libc::chown(at.as_ptr(), uid, uid))?;
                    }
                }
            }
            // The host's /proc lists every process and its command line. This one is
            // of the VM's own PID namespace, where QEMU is the only process (pid 1);
            // hidepid keeps it so should anything else ever run there as another id.
            // (hidepid=2 is "invisible" from Linux 5.8 on, and older kernels know it.)
            check(libc::mount(c"proc".as_ptr(), c"/proc".as_ptr(), c"proc".as_ptr(), HIDDEN, c"hidepid=2".as_ptr().cast()))?;
            for &fd in &self.chown {
                if self.in_userns {
                    // hutch stays the owner (it reads and copies the disk once the VM
                    // is gone, which it could not do as another user's 0600 file); the
                    // VM writes through the group that only it has.
                    check(libc::fchown(fd, u32::MAX, uid))?;
                    check(libc::fchmod(fd, 0o660))?;
                } else {
                    check(libc::fchown(fd, uid, uid))?;
                }
            }
            // The raw syscalls, not glibc's wrappers: those first signal every other
            // thread of the process (POSIX wants ids per process) and wait for them, and
            // this child, cloned rather than forked, still believes in hutch's threads:
            // it would wait forever. It has one thread, whose ids are the process's.
            if !self.keep_groups {
                check(libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) as libc::c_int)?;
            }
            check(libc::syscall(libc::SYS_setresgid, uid, uid, uid) as libc::c_int)?;
            check(libc::syscall(libc::SYS_setresuid, uid, uid, uid) as libc::c_int)?;
            check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
            // hutch's working directory may be under a mask: it stays reachable to a
            // process already in it, so leave it.
            check(libc::chdir(c"/".as_ptr()))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(memory: Memory) -> VmSpec {
        VmSpec {
            id: "sb1".into(),
            dir: "/h/sandboxes/sb1".into(),
            kernel: "/h/kernel/vmlinuz".into(),
            initrd: "/h/initramfs/i.cpio.gz".into(),
            disk: "/h/sandboxes/sb1/disk.qcow2".into(),
            base: None,
            cpus: 1,
            memory_mib: 256,
            accel: Accel::Tcg,
            memory,
            incoming: None,
            die_with_parent: true,
            agent_channel: "hutch.agent".into(),
            nic: None,
        }
    }

    #[test]
    fn hides_home_and_binds_back_only_the_vms_files() {
        let config = JailConfig { hide: "/h".into(), identity: Identity::Root };
        let backing = vec![PathBuf::from("/h/templates/base/rootfs.img")];
        let steps = plan(&spec(Memory::PrivateFile("/h/snapshots/t/memory".into())), &config, &backing, |p| p != Path::new("/run") && p != Path::new("/sys/fs/cgroup"));
        let bind = |p: &str, writable| Step::Bind { path: p.into(), writable };
        assert_eq!(
            steps,
            vec![
                Step::Mask("/root".into()),
                Step::Mask("/home".into()),
                Step::Mask("/tmp".into()),
                Step::Mask("/var/tmp".into()),
                Step::Mask("/dev/shm".into()),
                Step::Mask("/h".into()),
                bind("/h/kernel/vmlinuz", false),
                bind("/h/initramfs/i.cpio.gz", false),
                bind("/h/sandboxes/sb1/disk.qcow2", true),
                bind("/h/templates/base/rootfs.img", false),
                bind("/h/snapshots/t/memory", false),
            ]
        );
    }

    #[test]
    fn a_home_inside_a_mask_is_not_masked_twice_and_a_snapshot_source_writes_its_memory() {
        let config = JailConfig { hide: "/root/.local/share/hutch".into(), identity: Identity::Root };
        let mut s = spec(Memory::SharedFile("/root/.local/share/hutch/snapshots/t/memory".into()));
        s.kernel = "/usr/lib/vmlinuz".into();
        let steps = plan(&s, &config, &[], |_| true);
        assert!(!steps.contains(&Step::Mask("/root/.local/share/hutch".into())));
        assert!(!steps.iter().any(|s| matches!(s, Step::Bind { path, .. } if path.starts_with("/usr"))), "{steps:?}");
        assert!(steps.contains(&Step::Bind { path: "/root/.local/share/hutch/snapshots/t/memory".into(), writable: true }));
    }

    #[test]
    fn a_backing_name_outside_templates_and_snapshots_is_refused_even_through_a_symlink() {
        let tmp = tempfile::tempdir().expect("plan");
        let home = tmp.path().join("h");
        for d in ["templates/base", "snapshots/t", "sandboxes/sb1"] {
            std::fs::create_dir_all(home.join(d)).expect("plan");
        }
        let inside = home.join("templates/base/rootfs.ext4");
        let outside = tmp.path().join("secret");
        std::fs::write(&inside, "img").expect("plan");
        std::fs::write(&outside, "key").expect("plan");
        let link = home.join("snapshots/t/disk.qcow2");
        std::os::unix::fs::symlink(&outside, &link).expect("plan");
        let mut s = spec(Memory::Anonymous);
        s.dir = home.join("sandboxes/sb1");
        s.disk = s.dir.join("disk.qcow2");
        let roots = crate::disk::backing::Roots::of_home(&home, &s.dir);
        assert!(confined_chain(&s, &roots, std::slice::from_ref(&inside)).is_ok());
        assert!(matches!(confined_chain(&s, &roots, &[inside.clone(), outside]), Err(JailError::ForeignBacking { .. })));
        assert!(matches!(confined_chain(&s, &roots, &[link]), Err(JailError::ForeignBacking { .. })));
        // Inside hutch's snapshots but not the image hutch made the disk on: another
        // tenant's snapshot, named by a rewritten header.
        let theirs = home.join("snapshots/t/theirs.qcow2");
        std::fs::write(&theirs, "their disk").expect("plan");
        s.base = Some(inside.clone());
        assert!(confined_chain(&s, &roots, std::slice::from_ref(&inside)).is_ok());
        let changed = confined_chain(&s, &roots, std::slice::from_ref(&theirs)).expect_err("plan");
        assert!(matches!(changed, JailError::ChangedBacking { .. }));
        let tampered = |e: JailError| StartError::tampered_disk_in(&e.into_start_error());
        assert!(tampered(changed));
        // A name `backing::chain` refused before opening it keeps the sandbox down too.
        let refused = crate::disk::backing::BackingError::Outside { image: s.disk.clone(), name: "/dev/watchdog".into() };
        assert!(tampered(JailError::Backing(refused)));
        let unreadable = crate::disk::backing::BackingError::Io(s.disk.clone(), std::io::ErrorKind::NotFound.into());
        assert!(!tampered(JailError::Backing(unreadable)));
    }
}
