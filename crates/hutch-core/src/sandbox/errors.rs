//! What can go wrong making, adopting or pausing a sandbox, and making the template
//! memory snapshot a new sandbox is restored from. The two creation errors live
//! together because each can carry the other: a template snapshot is made by booting a
//! sandbox, and a sandbox is made from a template snapshot.

use crate::snapshot::SaveError;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    #[error("the sandbox's TLS inspection CA")]
    Inspection(#[source] hutch_net::inspect::ca::CaError),
    #[error("the sandbox has network rules that set headers but no inspection CA (it was made without rules; create a sandbox with the rules it needs)")]
    NoInspectionCa,
    #[error("creating the sandbox directory {0}")]
    Dir(PathBuf, #[source] std::io::Error),
    #[error("creating the sandbox disk")]
    Disk(#[source] hutch_vmm::disk::DiskError),
    #[error("starting the VM")]
    Start(#[source] hutch_vmm::StartError),
    #[error("the VM stopped while booting ({status}); last console lines:\n{console}")]
    VmExited { status: String, console: String },
    #[error("the sandbox did not become ready within {secs} s; last console lines:\n{console}")]
    BootTimeout { secs: u64, console: String },
    #[error("initializing the agent")]
    Init(#[source] hutch_envd::AgentError),
    #[error("the guest agent did not answer its init within {secs} s")]
    InitTimeout { secs: u64 },
    #[error("the template's service did not open port {port} within {secs} s; last console lines:\n{console}")]
    ServiceTimeout { port: u16, secs: u64, console: String },
    #[error("restoring the VM from its saved state")]
    Restore(#[source] hutch_vmm::SnapshotError),
    #[error("the restored guest's agent did not answer within {secs} s: {last}")]
    RestoreTimeout { secs: u64, last: String },
    #[error("making the template's memory snapshot")]
    TemplateSnapshot(#[source] Box<TemplateSnapshotError>),
    #[error("the template's start command failed: {detail}; last console lines:\n{console}")]
    StartCmd { detail: String, console: String },
    #[error("the sandbox's record")]
    Record(#[from] hutch_image::record::RecordError),
    #[error("connecting the sandbox's network stack to its VM's NIC")]
    Net(#[source] std::io::Error),
    /// A resumed guest ran and then failed: its saved state is gone with it.
    #[error("the resumed guest ran, then failed, so its saved state no longer matches its disk")]
    RanThenFailed(#[source] Box<CreateError>),
}

/// Why a sandbox an earlier server left running could not be taken over.
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error("its record")]
    Record(#[source] hutch_image::record::RecordError),
    #[error("it has no QEMU pid on record")]
    NoPid,
    #[error(transparent)]
    Vm(#[from] hutch_vmm::AdoptError),
    #[error("asking QEMU for its state")]
    State(#[source] hutch_vmm::SnapshotError),
    /// The VM holds a loaded guest that has not run since (a resume cut short): the
    /// paused sandbox's files are still the truth.
    #[error("its guest was loaded but never ran ({state})")]
    NeverRan { state: String },
    #[error("running its stopped guest again")]
    Resume(#[source] hutch_vmm::SnapshotError),
    #[error("its agent")]
    Agent(#[source] CreateError),
}

#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    #[error("the sandbox is not running")]
    NotRunning,
    #[error(transparent)]
    Save(#[from] SaveError),
    /// A filesystem-only pause keeps nothing but the disk: the guest must flush it.
    #[error("the guest agent did not write its files to disk ({0}), so a pause without memory would lose them; the sandbox runs on")]
    Sync(String),
}

/// Why a template's memory snapshot could not be made.
#[derive(Debug, thiserror::Error)]
pub enum TemplateSnapshotError {
    #[error("creating {0}")]
    Dir(PathBuf, #[source] std::io::Error),
    #[error("booting the template VM")]
    Boot(#[source] CreateError),
    #[error("warming up the template's service on port {port}: {detail}")]
    WarmUp { port: u16, detail: String },
    #[error("the template's start command: {0}")]
    StartCmd(String),
    #[error(transparent)]
    Save(#[from] SaveError),
    #[error("stopping the template VM")]
    Stop(#[source] hutch_vmm::StopError),
    #[error("another hutch has been making this template snapshot for {mins} min (it holds {}); wait for it or end it", lock.display())]
    LockTimeout { lock: PathBuf, mins: u64 },
}
