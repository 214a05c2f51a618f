//! VM backends. Owns: the `VmBackend` trait, the QEMU `microvm` backend (process, QMP,
//! disks, command line), the accelerator probe, and a fake backend for unit tests.
//! Must not know about sandboxes, users or the agent's API: it starts, stops and kills VMs.
#![allow(unsafe_code)] // KVM probe, prctl, rdtsc and the jail's syscalls; each block has a SAFETY note.

pub mod accel;
pub mod backend;
pub mod clock;
pub mod console;
pub mod disk;
pub mod guest_ram;
pub mod pidfd;
pub mod process;
pub mod space;
#[cfg(any(test, feature = "fake"))]
pub mod fake;
pub mod qemu;
pub mod qmp;
pub mod saved_state;

pub use accel::{Accel, AccelChoice};
pub use backend::{AdoptError, CpuShare, CpuShareError, Incoming, Memory, Nic, NicHostEnd, PauseSave, SnapshotError, StartError, StopError, VmBackend, VmHandle, VmSpec};
