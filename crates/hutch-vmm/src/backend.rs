//! The backend seam: what the sandbox manager needs from a VM, whatever runs it.

use crate::accel::Accel;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Where guest RAM lives. Memory snapshots need it in a file: a VM whose RAM is a
/// shared mapping of a file can be saved with `x-ignore-shared`, writing only device
/// state; clones map the same file privately, so its pages are shared copy-on-write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Memory {
    Anonymous,
    /// A shared mapping of the file (writes go to the file): a snapshot's source VM.
    SharedFile(PathBuf),
    /// A private (copy-on-write) mapping of a snapshot's memory file.
    PrivateFile(PathBuf),
}

/// A saved migration stream to load before the guest runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Incoming {
    pub state: PathBuf,
    /// The stream left out RAM that lives in a shared file (`x-ignore-shared`).
    pub ignore_shared: bool,
}

/// Everything needed to start one VM. All of its files live in `dir`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmSpec {
    pub id: String,
    pub dir: PathBuf,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    /// The root disk (a qcow2 overlay), attached as the first virtio-blk device.
    pub disk: PathBuf,
    /// The image hutch made `disk` on. The disk's header, which the VM's QEMU can
    /// rewrite, must still name it (`qemu/jail.rs`). None in records from before it was
    /// kept, and for a VM run on a snapshot's own disk.
    #[serde(default)]
    pub base: Option<PathBuf>,
    pub cpus: u32,
    pub memory_mib: u32,
    pub accel: Accel,
    pub memory: Memory,
    /// Start from a saved state instead of booting (`-incoming defer`, then load it).
    pub incoming: Option<Incoming>,
    /// Kill the VM when the process that started it dies (no daemon to adopt it).
    pub die_with_parent: bool,
    /// The name of the virtio-serial port the guest's agent serves on (the agent's
    /// protocol is the caller's business; the VMM only wires the port to `agent_socket`).
    #[serde(default = "default_agent_channel")]
    pub agent_channel: String,
    /// A NIC whose host end is `net_socket`, where QEMU's stream netdev listens for
    /// the sandbox's network stack. False in records from before sandboxes had one
    /// (their saved states have no NIC to load into).
    #[serde(default)]
    pub nic: Option<Nic>,
}

/// The guest's NIC: its MAC and MTU (the stack on the host end must agree on both).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Nic {
    pub mac: [u8; 6],
    pub mtu: u32,
    /// What is on the host end (records from before it was kept: the stream netdev).
    #[serde(default)]
    pub host_end: NicHostEnd,
}

/// The NIC's host end.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum NicHostEnd {
    /// QEMU's stream netdev listens on `net_socket`, and whoever connects carries the
    /// guest's frames: hutch's stack for every sandbox (or passt, in the benchmark).
    #[default]
    Stream,
    /// QEMU's own user-mode network (libslirp) with these `-netdev user` options: the
    /// reference in the network benchmark, never a sandbox's network (it has no policy,
    /// and a confined QEMU has no network namespace to reach anything from).
    QemuUser { options: String },
}

impl Nic {
    /// Whether QEMU needs the listening socket at `net_socket`.
    pub fn listens(&self) -> bool {
        self.host_end == NicHostEnd::Stream
    }
}

/// The channel of records from before it was kept.
/// The RAM a VM asked for `memory_mib` gets, in MiB: the same, but for exactly 2 GiB.
/// There QEMU's `linuxboot_dma` option ROM leaves the initrd at the very top of low RAM
/// (it moves it below the firmware's data only when the initrd does not end on the
/// page of the kernel's `initrd_addr_max`, which at exactly 2 GiB it always does), on
/// top of SeaBIOS's ACPI tables and virtio queues: the guest sees "no cpio magic" and
/// never starts. 2 MiB more keeps hugepage alignment and moves the top off that page.
pub fn ram_mib(memory_mib: u32) -> u32 {
    if memory_mib == 2048 {
        2050
    } else {
        memory_mib
    }
}

/// `ram_mib` in bytes.
pub fn ram_bytes(memory_mib: u32) -> u64 {
    u64::from(ram_mib(memory_mib)) << 20
}

fn default_agent_channel() -> String {
    "hutch.agent".into()
}

impl VmSpec {
    /// The bytes of guest RAM the VM has (`ram_bytes`).
    pub fn ram_bytes(&self) -> u64 {
        ram_bytes(self.memory_mib)
    }

    pub fn agent_socket(&self) -> PathBuf {
        self.dir.join("agent.sock")
    }
    pub fn qmp_socket(&self) -> PathBuf {
        self.dir.join("qmp.sock")
    }
    /// Where QEMU serves the serial console (hutch reads it into `console_log`).
    pub fn console_socket(&self) -> PathBuf {
        self.dir.join("console.sock")
    }
    pub fn console_log(&self) -> PathBuf {
        self.dir.join("console.log")
    }
    /// Where QEMU's stream netdev listens for the network stack (with `nic`).
    pub fn net_socket(&self) -> PathBuf {
        self.dir.join("net.sock")
    }
}

/// A backend's own reason, kept whole for the error's chain and its sentence; boxed so
/// this trait's file names no backend.
pub type BackendCause = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The VMM itself cannot run here (QEMU missing or too old).
    #[error(transparent)]
    Unavailable(BackendCause),
    #[error("starting QEMU")]
    Spawn(#[source] std::io::Error),
    /// The stand-ins for the kernel and initramfs of a VM that loads a saved state
    /// (`qemu/boot_stand_ins.rs`) could not be made.
    #[error("preparing the boot files of a VM that loads a saved state, from the kernel {kernel}")]
    StandIns { kernel: String, #[source] source: std::io::Error },
    #[error("confining QEMU")]
    Jail(#[source] BackendCause),
    /// The sandbox's disk header no longer names what hutch made it on: its VM rewrote
    /// it, so it must never start again.
    #[error("confining QEMU")]
    TamperedDisk(#[source] BackendCause),
    #[error("QEMU could not enter its confinement (mount namespace, cgroup, uid): {0}; set HUTCH_JAIL=off to run it unconfined")]
    Confine(std::io::Error),
    #[error("QEMU exited while starting ({status}): {stderr}")]
    Exited { status: String, stderr: String },
    #[error("QEMU did not open its QMP socket within {secs} s")]
    QmpTimeout { secs: u64 },
    #[error("connecting to QEMU's QMP socket")]
    Qmp(#[source] crate::qmp::QmpError),
    #[error("QEMU's network backend did not start listening: {0}")]
    NetBackend(String),
    #[error("asking QEMU whether its network backend listens")]
    NetQuery(#[source] SnapshotError),
    #[error("starting the guest (QMP `cont`)")]
    Cont(#[source] SnapshotError),
    #[error("reading the saved state {path} to load")]
    State { path: String, #[source] source: crate::saved_state::StateFileError },
    #[error("the socket path {0} is longer than a unix socket allows (108 bytes); use a shorter HUTCH_HOME")]
    PathTooLong(String),
}

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("the VM has no QMP connection (it has ended)")]
    NoQmp,
    #[error("QMP")]
    Qmp(#[source] crate::qmp::QmpError),
    #[error("migration {what} failed: {detail}")]
    Migration { what: &'static str, detail: String },
    #[error("migration {what} did not finish within {secs} s")]
    Timeout { what: &'static str, secs: u64 },
    #[error("this backend cannot save or restore VMs")]
    Unsupported,
    #[error("the saved state {path}")]
    StateFile { path: String, #[source] source: crate::saved_state::StateFileError },
    #[error("guest memory")]
    GuestRam(#[source] crate::guest_ram::GuestRamError),
}

/// What a pause's save wrote (`VmHandle::save_for_pause`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PauseSave {
    /// The pages that differ from the memory file the VM maps, then device state.
    Changes { pages: u64, page_size: u64 },
    /// RAM and devices whole, and why not only the changes.
    Whole { why: String },
}

#[derive(Debug, thiserror::Error)]
pub enum StopError {
    #[error("killing QEMU (pid {pid})")]
    Kill { pid: u32, #[source] source: std::io::Error },
}

#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error("its QEMU (pid {pid}) no longer runs")]
    Gone { pid: u32 },
    #[error("pid {pid} is not this VM's QEMU")]
    NotOurs { pid: u32 },
    #[error("QEMU did not answer on its QMP socket within {secs} s")]
    QmpTimeout { secs: u64 },
    #[error("the VM's id: {0}")]
    Lease(std::io::Error),
    #[error("ending the save an earlier hutch left running in the VM: {0}")]
    Migration(String),
    #[error("watching QEMU (pid {pid})")]
    Watch { pid: u32, #[source] source: std::io::Error },
    #[error("this backend cannot adopt VMs it did not start")]
    Unsupported,
}

/// A running VM. Dropping it kills the VM (a panic must not leak QEMU), unless it was
/// `release`d for another hutch to adopt.
impl StartError {
    /// Whether `e`, or an error under it, is a start refused for a tampered disk.
    pub fn tampered_disk_in(e: &(dyn std::error::Error + 'static)) -> bool {
        let mut current = Some(e);
        while let Some(err) = current {
            if let Some(StartError::TamperedDisk(_)) = err.downcast_ref::<StartError>() {
                return true;
            }
            current = err.source();
        }
        false
    }
}

/// How much of the host's CPU a VM gets while the CPU is contended (it never limits
/// a VM on an idle host): a VM warming up in a warm pool gives way to the VMs in use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CpuShare {
    #[default]
    Foreground,
    Background,
}

#[derive(Debug, thiserror::Error)]
#[error("changing the VM's CPU share: {0}")]
pub struct CpuShareError(#[source] pub Box<dyn std::error::Error + Send + Sync>);

#[async_trait::async_trait]
pub trait VmHandle: Send + Sync {
    fn pid(&self) -> Option<u32>;
    /// Sets the VM's weight against other VMs. Backends that cannot (no CPU controller
    /// of their own, or unconfined) leave it as it is.
    fn set_cpu_share(&self, share: CpuShare) -> Result<(), CpuShareError> {
        let _ = share;
        Ok(())
    }
    /// The host end of the agent channel (a unix socket).
    fn agent_socket(&self) -> PathBuf;
    fn console_log(&self) -> PathBuf;
    /// Whether the VM has ended, and how.
    fn exit_status(&mut self) -> Option<String>;
    /// Asks the VM to end (QMP `quit`), killing it if it does not within `grace`.
    async fn stop(&mut self, grace: std::time::Duration) -> Result<(), StopError>;
    /// Ends the VM at once.
    async fn kill(&mut self) -> Result<(), StopError>;
    /// Pauses the guest and writes its state to `state` (with `ignore_shared`, RAM in
    /// a shared file is left out). The guest stays paused; `resume` or `stop` follows.
    async fn save(&mut self, state: &Path, ignore_shared: bool) -> Result<(), SnapshotError>;
    /// Stops the guest and writes what a pause keeps to `state`: when its RAM maps a
    /// snapshot's memory file privately, only the pages that differ from that file and
    /// the device state (`saved_state.rs`), else all of it as `save` does. The guest
    /// stays paused; `load` reads either.
    async fn save_for_pause(&mut self, state: &Path) -> Result<PauseSave, SnapshotError> {
        self.save(state, false).await?;
        Ok(PauseSave::Whole { why: "this backend saves whole states only".into() })
    }
    /// Loads the state named by the spec's `incoming`; the guest stays paused.
    async fn load(&mut self) -> Result<(), SnapshotError>;
    /// Runs a paused guest (after `save` or `load`).
    async fn resume(&mut self) -> Result<(), SnapshotError>;
    /// QEMU's run state (`running`, `paused`, `io-error`…).
    async fn run_state(&mut self) -> Result<String, SnapshotError>;
    /// Lets go of the VM and leaves it running, for a later hutch to `adopt`.
    fn release(self: Box<Self>);
}

#[async_trait::async_trait]
pub trait VmBackend: Send + Sync {
    fn name(&self) -> &'static str;
    async fn start(&self, spec: &VmSpec) -> Result<Box<dyn VmHandle>, StartError>;
    /// What a state this backend saves depends on besides the guest (for QEMU, its
    /// version, the guest kernel's flags and the NIC's device options): part of every
    /// memory snapshot's key, so another VMM or device set gets a new one.
    fn snapshot_key(&self) -> String;
    /// Takes over the VM of `spec` that an earlier hutch started and left running as
    /// process `pid`: the VM keeps running, and the handle drives it from now on.
    async fn adopt(&self, spec: &VmSpec, pid: u32) -> Result<Box<dyn VmHandle>, AdoptError> {
        let _ = (spec, pid);
        Err(AdoptError::Unsupported)
    }
}
