//! Being PID 1: the early boot (mounts, modules, switching into the root disk), the
//! clock, the hostname, the loopback interface, power-off and resource metrics.

use nix::mount::{mount, MsFlags};
use std::path::Path;
use std::time::{Duration, Instant};

const ROOT_DEVICE: &str = "/dev/vda";
const NEW_ROOT: &str = "/newroot";
/// Module load order written by hutch-image (dependencies first).
const MODULE_ORDER: &str = "/lib/modules/hutch.order";

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("mounting {what} on {target}")]
    Mount { what: String, target: String, #[source] source: nix::Error },
    #[error("loading kernel module {module}")]
    Module { module: String, #[source] source: std::io::Error },
    #[error("the root disk {0} did not appear within 10 s (is the virtio-blk module in the initramfs?)")]
    NoRootDisk(String),
    #[error("switching into the root disk")]
    SwitchRoot(#[source] nix::Error),
}

fn mount_fs(src: &str, target: &str, fstype: &str, flags: MsFlags, data: Option<&str>) -> Result<(), BootError> {
    let _ = std::fs::create_dir_all(target);
    mount(Some(src), target, Some(fstype), flags, data).map_err(|source| BootError::Mount {
        what: format!("{fstype} ({src})"),
        target: target.to_string(),
        source,
    })
}

/// Everything between the kernel starting us and serving the agent channel.
pub fn boot() -> Result<(), BootError> {
    let nodev = MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC | MsFlags::MS_NODEV;
    mount_fs("devtmpfs", "/dev", "devtmpfs", MsFlags::MS_NOSUID, Some("mode=0755"))?;
    reopen_console();
    mount_fs("proc", "/proc", "proc", nodev, None)?;
    mount_fs("sysfs", "/sys", "sysfs", nodev, None)?;
    load_modules()?;
    wait_for(ROOT_DEVICE, Duration::from_secs(10)).then_some(()).ok_or_else(|| BootError::NoRootDisk(ROOT_DEVICE.into()))?;
    mount_fs(ROOT_DEVICE, NEW_ROOT, "ext4", MsFlags::empty(), None)?;
    for dir in ["/dev", "/proc", "/sys"] {
        let target = format!("{NEW_ROOT}{dir}");
        let _ = std::fs::create_dir_all(&target);
        mount(Some(dir), target.as_str(), None::<&str>, MsFlags::MS_MOVE, None::<&str>)
            .map_err(|source| BootError::Mount { what: dir.into(), target, source })?;
    }
    switch_root()?;
    mount_fs("devpts", "/dev/pts", "devpts", MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC, Some("gid=5,mode=620,ptmxmode=666"))?;
    mount_fs("tmpfs", "/dev/shm", "tmpfs", MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some("mode=1777"))?;
    // /tmp is the root disk's, as in Docker and on E2B, not a tmpfs: what a template
    // build's RUN leaves there stays in the template, a filesystem snapshot keeps it,
    // and it does not eat the guest's RAM. It is 1777 as the tmpfs was (an image may
    // have none, or one its unpacking made 0755); a symlink is left as the image has it.
    let tmp = Path::new("/tmp");
    if std::fs::symlink_metadata(tmp).is_err() {
        let _ = std::fs::create_dir(tmp);
    }
    if std::fs::symlink_metadata(tmp).is_ok_and(|m| m.is_dir()) {
        let _ = std::fs::set_permissions(tmp, std::os::unix::fs::PermissionsExt::from_mode(0o1777));
    }
    mount_fs("tmpfs", "/run", "tmpfs", MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some("mode=0755"))?;
    let _ = std::fs::create_dir(IDENTITY_DIR);
    for (link, target) in [("/dev/fd", "/proc/self/fd"), ("/dev/stdin", "/proc/self/fd/0"), ("/dev/stdout", "/proc/self/fd/1"), ("/dev/stderr", "/proc/self/fd/2")] {
        let _ = std::os::unix::fs::symlink(target, link);
    }
    set_hostname("hutch");
    if let Err(e) = crate::net::loopback_up() {
        eprintln!("hutch-agent: cannot bring up lo: {e}");
    }
    if crate::net::has_nic() {
        if let Err(e) = crate::net::configure_nic() {
            eprintln!("hutch-agent: cannot configure the network: {e}");
        }
    }
    Ok(())
}

fn reopen_console() {
    use std::os::fd::AsRawFd;
    if let Ok(console) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/console") {
        for fd in 0..3 {
            let _ = nix::unistd::dup2(console.as_raw_fd(), fd);
        }
    }
}

fn load_modules() -> Result<(), BootError> {
    let order = std::fs::read_to_string(MODULE_ORDER).unwrap_or_default();
    for name in order.lines().filter(|l| !l.trim().is_empty()) {
        let path = format!("/lib/modules/{name}");
        let file = std::fs::File::open(&path).map_err(|source| BootError::Module { module: name.into(), source })?;
        match nix::kmod::finit_module(&file, c"", nix::kmod::ModuleInitFlags::empty()) {
            Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
            Err(e) => return Err(BootError::Module { module: name.into(), source: e.into() }),
        }
        // The module stays in the kernel; its file in RAM is no longer needed.
        let _ = std::fs::remove_file(&path);
    }
    Ok(())
}

pub fn wait_for(path: &str, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if Path::new(path).exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// `switch_root` while staying PID 1: move the new root over `/` and chroot into it.
fn switch_root() -> Result<(), BootError> {
    std::env::set_current_dir(NEW_ROOT).map_err(|e| BootError::SwitchRoot(nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(0))))?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>).map_err(BootError::SwitchRoot)?;
    nix::unistd::chroot(".").map_err(BootError::SwitchRoot)?;
    nix::unistd::chdir("/").map_err(BootError::SwitchRoot)
}

/// The guest's wall clock, nanoseconds since the Unix epoch.
pub fn clock_ns() -> i128 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_REALTIME).map(|t| i128::from(t.tv_sec()) * 1_000_000_000 + i128::from(t.tv_nsec())).unwrap_or(0)
}

/// Moves the wall clock by `step_ns` (read, add, set: the few µs between are noise
/// next to what the host measures).
pub fn step_clock(step_ns: i64) {
    if step_ns != 0 {
        if let Ok(ns) = u128::try_from(clock_ns() + i128::from(step_ns)) {
            set_clock(ns);
        }
    }
}

pub fn set_clock(unix_ns: u128) {
    let ts = nix::sys::time::TimeSpec::new((unix_ns / 1_000_000_000) as i64, (unix_ns % 1_000_000_000) as i64);
    if let Err(e) = nix::time::clock_settime(nix::time::ClockId::CLOCK_REALTIME, ts) {
        tracing::warn!("cannot set the clock: {e}");
    }
}

/// Mixes `seed` into the kernel's entropy pool, credited, and forces the CRNG to
/// reseed now, so a restored clone's random numbers diverge from its siblings' at once.
pub fn reseed_rng(seed: &[u8]) {
    use std::os::fd::AsRawFd;
    // <linux/random.h>: RNDADDENTROPY = _IOW('R', 0x03, int[2]), RNDRESEEDCRNG = _IO('R', 0x07).
    const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
    const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
    // Opened once and kept (close-on-exec, as std opens every file): a restored guest's
    // agent then holds it from its snapshot and skips the open, which costs a restored
    // guest ~5 ms under TCG.
    static URANDOM: std::sync::OnceLock<std::fs::File> = std::sync::OnceLock::new();
    let urandom = match URANDOM.get() {
        Some(f) => f,
        None => match std::fs::OpenOptions::new().write(true).open("/dev/urandom") {
            Ok(f) => URANDOM.get_or_init(|| f),
            Err(e) => {
                eprintln!("hutch-agent: opening /dev/urandom to reseed the RNG: {e}");
                return;
            }
        },
    };
    // struct rand_pool_info { int entropy_count; int buf_size; u32 buf[]; }
    let mut info = Vec::with_capacity(8 + seed.len());
    info.extend_from_slice(&((seed.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(seed.len() as i32).to_ne_bytes());
    info.extend_from_slice(seed);
    // SAFETY: the buffer is a complete rand_pool_info whose buf_size matches the bytes
    // that follow the header; the kernel only reads it. The fd is open for the call.
    let added = unsafe { libc::ioctl(urandom.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) };
    // SAFETY: RNDRESEEDCRNG takes no argument.
    let reseeded = unsafe { libc::ioctl(urandom.as_raw_fd(), RNDRESEEDCRNG as _) };
    if added < 0 || reseeded < 0 {
        eprintln!("hutch-agent: reseeding the RNG: {}", std::io::Error::last_os_error());
    }
}

/// Where processes can read which sandbox they are in (a restored clone learns it
/// here), its metadata and its environment: processes that outlive a restore (the code
/// interpreter's kernels, started in the template's snapshot) take the sandbox's
/// environment from it. Every process of the sandbox gets that environment anyway.
pub const IDENTITY_FILE: &str = "/run/hutch/sandbox.json";
const IDENTITY_DIR: &str = "/run/hutch";

pub fn write_identity(id: &str, metadata: &std::collections::BTreeMap<String, String>, env_vars: &std::collections::BTreeMap<String, String>) {
    #[derive(serde::Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Identity<'a> {
        sandbox_id: &'a str,
        metadata: &'a std::collections::BTreeMap<String, String>,
        env_vars: &'a std::collections::BTreeMap<String, String>,
    }
    let json = match serde_json::to_vec(&Identity { sandbox_id: id, metadata, env_vars }) {
        Ok(json) => json,
        Err(e) => return tracing::warn!("writing {IDENTITY_FILE}: {e}"),
    };
    // Replaced whole (a reader never sees half of it).
    let partial = format!("{IDENTITY_FILE}.partial");
    let replace = || std::fs::write(&partial, &json).and_then(|()| std::fs::rename(&partial, IDENTITY_FILE));
    // Its directory is made at boot (`mount_basics`): looking for it first on every
    // `/init` cost a restored guest ~4 ms under TCG. Made again if something removed it.
    let written = replace().or_else(|e| match e.kind() {
        std::io::ErrorKind::NotFound => std::fs::create_dir_all(IDENTITY_DIR).and_then(|()| replace()),
        _ => Err(e),
    });
    if let Err(e) = written {
        tracing::warn!("writing {IDENTITY_FILE}: {e}");
    }
}

/// The hostname this agent last set and found in /etc/hostname: every `/init` names
/// the same one, and a restored guest's agent remembers it from its snapshot.
static HOSTNAME_SET: parking_lot::Mutex<Option<String>> = parking_lot::Mutex::new(None);

/// Sets the hostname, and /etc/hostname when it differs: a restored guest usually has
/// the right one, and a disk write costs ~30 ms under TCG on the restore path. Done
/// once per name: after that, a later `/init` (a restore, a pool take) leaves the
/// hostname as it is, saving the 13-15 ms its checks cost a restored guest under TCG
/// (the first file read after a restore translates the kernel's whole read path).
pub fn set_hostname(name: &str) {
    if nix::unistd::getpid().as_raw() != 1 {
        return;
    }
    let mut set = HOSTNAME_SET.lock();
    if set.as_deref() == Some(name) {
        return;
    }
    let mut done = true;
    if nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).as_deref() != Some(name) {
        done &= nix::unistd::sethostname(name).is_ok();
    }
    let line = format!("{name}\n");
    if std::fs::read_to_string("/etc/hostname").ok().as_deref() != Some(line.as_str()) {
        done &= std::fs::write("/etc/hostname", line).is_ok();
    }
    // A step that failed is tried again by the next /init.
    if done {
        *set = Some(name.to_string());
    }
}

pub fn power_off() {
    nix::unistd::sync();
    if nix::unistd::getpid().as_raw() == 1 {
        // QEMU runs with -no-reboot, so a reset ends the VM at once.
        let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_AUTOBOOT);
    }
    std::process::exit(0);
}

fn cpu_times() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat.lines().next()?.split_whitespace().skip(1).filter_map(|v| v.parse().ok()).collect();
    let idle = fields.get(3)? + fields.get(4).unwrap_or(&0);
    Some((fields.iter().sum(), idle))
}

pub fn metrics() -> hutch_proto::agent::Metrics {
    let before = cpu_times();
    std::thread::sleep(Duration::from_millis(100));
    let after = cpu_times();
    let cpu_used_pct = match (before, after) {
        (Some((t0, i0)), Some((t1, i1))) if t1 > t0 => 100.0 * (1.0 - (i1 - i0) as f32 / (t1 - t0) as f32),
        _ => 0.0,
    };
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kib = |key: &str| -> u64 {
        meminfo
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
            * 1024
    };
    let (total, avail, cache) = (kib("MemTotal:"), kib("MemAvailable:"), kib("Cached:"));
    let (disk_total, disk_used) = match nix::sys::statvfs::statvfs("/") {
        Ok(s) => {
            let frag = s.fragment_size();
            (s.blocks() * frag, (s.blocks() - s.blocks_free()) * frag)
        }
        Err(_) => (0, 0),
    };
    hutch_proto::agent::Metrics {
        ts: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0),
        cpu_count: std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1),
        cpu_used_pct,
        mem_total: total,
        mem_used: total.saturating_sub(avail),
        mem_cache: cache,
        mem_total_mib: total >> 20,
        mem_used_mib: total.saturating_sub(avail) >> 20,
        disk_used,
        disk_total,
    }
}
