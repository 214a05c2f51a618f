//! Choosing the accelerator. `/dev/kvm` existing is not enough: on nested setups (PVM,
//! for one) a KVM guest runs under emulation at about a microsecond per instruction,
//! slower than QEMU's TCG. So `auto` runs a tiny KVM guest, a loop of a million
//! instructions in long mode, and picks KVM only when it finishes at native speed.

use std::sync::mpsc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AccelChoice {
    #[default]
    Auto,
    Kvm,
    Tcg,
}

impl std::str::FromStr for AccelChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(AccelChoice::Auto),
            "kvm" => Ok(AccelChoice::Kvm),
            "tcg" => Ok(AccelChoice::Tcg),
            other => Err(format!("unknown accelerator '{other}': use auto, kvm or tcg")),
        }
    }
}

/// What the probe found, in words a user can act on.
#[derive(Debug, Clone)]
pub struct Probe {
    pub kvm_usable: bool,
    pub reason: String,
}

#[derive(Debug, thiserror::Error)]
#[error("KVM was requested but is not usable here: {reason}. Use --accel tcg (or auto), or run on a host with hardware virtualization")]
pub struct KvmUnusable {
    pub reason: String,
}

/// The decision and why it was made.
#[derive(Debug, Clone)]
pub struct Selected {
    pub accel: Accel,
    pub why: String,
}

/// A guest loop this fast is running natively; emulated KVM takes seconds.
const NATIVE_LIMIT: Duration = Duration::from_millis(100);
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Picks the accelerator; `cache` (a file) keeps the probe's answer until the host
/// reboots, so each `hutch run` does not pay for the probe again.
pub fn select(choice: AccelChoice, cache: Option<&std::path::Path>) -> Result<Selected, KvmUnusable> {
    let probe = || match cache {
        Some(file) => probe_cached(file),
        None => probe(),
    };
    match choice {
        AccelChoice::Tcg => Ok(Selected { accel: Accel::Tcg, why: "TCG requested".into() }),
        AccelChoice::Kvm => {
            let p = probe();
            if p.kvm_usable {
                Ok(Selected { accel: Accel::Kvm, why: p.reason })
            } else {
                Err(KvmUnusable { reason: p.reason })
            }
        }
        AccelChoice::Auto => {
            let p = probe();
            let accel = if p.kvm_usable { Accel::Kvm } else { Accel::Tcg };
            Ok(Selected { accel, why: p.reason })
        }
    }
}

pub(crate) fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default().trim().to_string()
}

/// The probe's answer from `file` if it was made since the host booted, else a new probe
/// (written back to `file`).
pub fn probe_cached(file: &std::path::Path) -> Probe {
    let boot = boot_id();
    if let Ok(text) = std::fs::read_to_string(file) {
        let mut lines = text.lines();
        if let (Some(b), Some(usable), Some(reason)) = (lines.next(), lines.next(), lines.next()) {
            if b == boot && !boot.is_empty() {
                return Probe { kvm_usable: usable == "kvm", reason: reason.to_string() };
            }
        }
    }
    let p = probe();
    let usable = if p.kvm_usable { "kvm" } else { "tcg" };
    let _ = std::fs::write(file, format!("{boot}\n{usable}\n{}\n", p.reason.replace('\n', " ")));
    p
}

/// Probes KVM once per process (the answer does not change while we run).
pub fn probe() -> Probe {
    static CACHE: std::sync::OnceLock<Probe> = std::sync::OnceLock::new();
    CACHE.get_or_init(run_probe).clone()
}

fn run_probe() -> Probe {
    if !std::path::Path::new("/dev/kvm").exists() {
        return Probe { kvm_usable: false, reason: "/dev/kvm does not exist".into() };
    }
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(kvm_loop::run());
    });
    match rx.recv_timeout(PROBE_TIMEOUT) {
        Ok(Ok(took)) if took <= NATIVE_LIMIT => Probe {
            kvm_usable: true,
            reason: format!("KVM runs a test guest at native speed ({} µs for 10^6 instructions)", took.as_micros()),
        },
        Ok(Ok(took)) => Probe {
            kvm_usable: false,
            reason: format!(
                "KVM is emulated here (nested or PVM): a test guest took {} ms for 10^6 instructions, native takes under {} ms",
                took.as_millis(),
                NATIVE_LIMIT.as_millis()
            ),
        },
        Ok(Err(e)) => Probe { kvm_usable: false, reason: format!("KVM cannot run a test guest: {e}") },
        Err(_) => Probe {
            kvm_usable: false,
            reason: format!("KVM is emulated here (nested or PVM): a test guest did not finish 10^6 instructions in {} s", PROBE_TIMEOUT.as_secs()),
        },
    }
}

mod kvm_loop {
    use kvm_bindings::{kvm_segment, kvm_userspace_memory_region};
    use kvm_ioctls::{Kvm, VcpuExit};
    use std::time::{Duration, Instant};

    const MEM_SIZE: usize = 0x10000;
    const PML4: usize = 0x1000;
    const PDPT: usize = 0x2000;
    const PD: usize = 0x3000;
    const CODE: usize = 0x8000;
    /// mov ecx, 1000000; l: dec ecx; jnz l; hlt
    const LOOP: [u8; 10] = [0xB9, 0x40, 0x42, 0x0F, 0x00, 0xFF, 0xC9, 0x75, 0xFC, 0xF4];

    struct Mapping(*mut libc::c_void);

    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: unmaps exactly the mapping created in `run`, after the VM is gone.
            unsafe { libc::munmap(self.0, MEM_SIZE) };
        }
    }

    fn put_u64(mem: &mut [u8], at: usize, v: u64) {
        mem[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }

    pub fn run() -> Result<Duration, String> {
        let kvm = Kvm::new().map_err(|e| format!("opening /dev/kvm: {e}"))?;
        let vm = kvm.create_vm().map_err(|e| format!("creating a VM: {e}"))?;
        // SAFETY: an anonymous private mapping; the result is checked before use.
        let addr = unsafe {
            libc::mmap(std::ptr::null_mut(), MEM_SIZE, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        if addr == libc::MAP_FAILED {
            return Err("mmap failed".into());
        }
        let mapping = Mapping(addr);
        // SAFETY: the mapping is MEM_SIZE bytes, readable and writable, and lives in `mapping`.
        let mem = unsafe { std::slice::from_raw_parts_mut(mapping.0 as *mut u8, MEM_SIZE) };
        put_u64(mem, PML4, PDPT as u64 | 3);
        put_u64(mem, PDPT, PD as u64 | 3);
        put_u64(mem, PD, 0x83); // 2 MiB page at 0, present + writable + huge
        mem[CODE..CODE + LOOP.len()].copy_from_slice(&LOOP);
        let region = kvm_userspace_memory_region {
            slot: 0,
            guest_phys_addr: 0,
            memory_size: MEM_SIZE as u64,
            userspace_addr: mapping.0 as u64,
            flags: 0,
        };
        // SAFETY: the region points at our mapping, which outlives the VM (dropped after `vm`).
        unsafe { vm.set_user_memory_region(region) }.map_err(|e| format!("mapping guest memory: {e}"))?;
        let mut vcpu = vm.create_vcpu(0).map_err(|e| format!("creating a vCPU: {e}"))?;
        let mut sregs = vcpu.get_sregs().map_err(|e| format!("reading sregs: {e}"))?;
        let code = kvm_segment { base: 0, limit: 0xffff_ffff, selector: 8, type_: 11, present: 1, dpl: 0, db: 0, s: 1, l: 1, g: 1, avl: 0, unusable: 0, padding: 0 };
        let data = kvm_segment { selector: 16, type_: 3, l: 0, db: 1, ..code };
        sregs.cs = code;
        (sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss) = (data, data, data, data, data);
        sregs.cr3 = PML4 as u64;
        sregs.cr4 |= 1 << 5; // PAE
        sregs.cr0 |= 0x8000_0001; // PG | PE
        sregs.efer |= 0x500; // LME | LMA
        vcpu.set_sregs(&sregs).map_err(|e| format!("entering long mode: {e}"))?;
        let mut regs = vcpu.get_regs().map_err(|e| format!("reading regs: {e}"))?;
        regs.rip = CODE as u64;
        regs.rflags = 2;
        regs.rsp = 0x7000;
        vcpu.set_regs(&regs).map_err(|e| format!("setting regs: {e}"))?;
        let started = Instant::now();
        loop {
            match vcpu.run().map_err(|e| format!("running the vCPU: {e}"))? {
                VcpuExit::Hlt => return Ok(started.elapsed()),
                VcpuExit::IrqWindowOpen | VcpuExit::Intr => continue,
                other => return Err(format!("unexpected exit {other:?}")),
            }
        }
    }
}

/// Runs the probe now (uncached) and returns how long it took, for `hutch doctor`.
pub fn probe_timed() -> (Probe, Duration) {
    let started = Instant::now();
    let p = run_probe();
    (p, started.elapsed())
}
