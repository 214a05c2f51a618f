//! The QEMU command line. The flags are the ones measured to boot reliably under TCG
//! (DESIGN.md): without `tsc_early_khz` about half the boots hang at "Marking TSC
//! unstable", and it must be the host's real TSC rate or the guest clock drifts
//! (`clock.rs`); `-nodefaults` drops microvm's serial, so the console is added back on
//! a socket hutch hands in as fd 3; `-no-reboot` turns the guest's reset (how the agent powers off) into an exit.

use crate::accel::Accel;
use crate::backend::{ram_mib, Memory, VmSpec};
use std::ffi::OsString;

/// The guest kernel's command line for a guest whose TSC runs at `tsc_khz`.
///
/// `tsc=reliable`: the guest's only other clocksource is jiffies, and under TCG on a
/// busy host timer ticks arrive late, so the kernel's clocksource watchdog declared the
/// TSC unstable ("skew is too large") and switched to `refined-jiffies`, whose clock
/// then lost ~10% of host time (seen: 0.53 s in 6 s). Under TCG the guest's TSC *is*
/// the host's, so it is the reliable one; under KVM the guest uses kvm-clock.
/// QEMU's seccomp filter for every VM.
pub const SECCOMP: &str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";

/// The fds QEMU finds its console socket and its listening QMP and agent sockets on
/// (set up between fork and exec): QEMU creates no files of its own.
pub const CONSOLE_FD: i32 = 3;
pub const QMP_FD: i32 = 4;
pub const AGENT_FD: i32 = 5;
/// The listening socket of the NIC's stream netdev, when the VM has one.
pub const NET_FD: i32 = 6;

/// NIC properties that differ from QEMU's defaults. `guest_announce=off`: after an
/// incoming migration QEMU asks a guest that offers it to announce itself (config
/// interrupts, control-queue acks, gratuitous ARPs) for half a second; the guest's
/// address never moves here, so nothing needs announcing.
pub const NIC_QUIRKS: &str = "guest_announce=off";

pub fn kernel_cmdline(tsc_khz: u32) -> String {
    format!("console=ttyS0 quiet panic=-1 reboot=t tsc_early_khz={tsc_khz} tsc=reliable lpj=6000000")
}

/// What QEMU is told about the stream it loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Loading {
    /// The stream has no configuration section (a device-state-only save, or a save by
    /// a QEMU that loaded one): QEMU must not expect it.
    pub no_configuration: bool,
}

pub fn command_line(spec: &VmSpec, loading: Loading) -> Vec<OsString> {
    let mut a: Vec<OsString> = Vec::new();
    let mut push = |parts: &[&str]| a.extend(parts.iter().map(OsString::from));
    // RAM is always an explicit backend named mem0: a migration stream names its RAM
    // blocks, so a VM saved with one backing can be restored with another.
    // suppress-vmdesc: no save carries the JSON description of its devices (for
    // analysis tools; nothing here reads it), and no load expects it, which a
    // device-state-only stream (`saved_state.rs`) does not have.
    let machine = format!("microvm,accel={},memory-backend=mem0,suppress-vmdesc=on", spec.accel.as_str());
    let cpu = match spec.accel {
        Accel::Kvm => "host",
        Accel::Tcg => "max",
    };
    push(&["-M", &machine, "-cpu", cpu]);
    push(&["-smp", &spec.cpus.to_string(), "-m", &format!("{}M", ram_mib(spec.memory_mib))]);
    push(&["-object", &memory_backend(spec)]);
    if spec.incoming.is_some() {
        // -S: the loaded guest waits for `cont`, so hutch decides when it runs.
        push(&["-incoming", "defer", "-S"]);
        if loading.no_configuration {
            push(&["-global", "migration.send-configuration=off"]);
        }
    } else if spec.nic.as_ref().is_some_and(crate::backend::Nic::listens) {
        // A booted guest too, when its NIC's netdev listens: it may run only once
        // that netdev is listening (see `QemuVm::start`).
        push(&["-S"]);
    }
    push(&["-no-user-config", "-nodefaults", "-display", "none", "-no-reboot"]);
    // seccomp: QEMU may not run programs (migrations go over fds hutch hands it, never
    // `exec:`), change its ids or priorities, or use obsolete syscalls.
    push(&["-sandbox", SECCOMP]);
    // A socket hutch reads into a bounded ring (`console.rs`), never a file QEMU grows.
    push(&["-chardev", &format!("socket,id=console,fd={CONSOLE_FD},server=on,wait=off")]);
    push(&["-serial", "chardev:console"]);
    push(&["-kernel", &spec.kernel.display().to_string()]);
    push(&["-initrd", &spec.initrd.display().to_string()]);
    // A restored guest booted long ago: its command line no longer matters, so a
    // restore does not pay for measuring the TSC.
    let tsc_khz = if spec.incoming.is_some() { crate::clock::FALLBACK_TSC_KHZ } else { crate::clock::host_tsc_khz(None) };
    push(&["-append", &kernel_cmdline(tsc_khz)]);
    push(&["-drive", &format!("id=root,file={},format=qcow2,if=none,discard=unmap", spec.disk.display())]);
    push(&["-device", "virtio-blk-device,drive=root"]);
    push(&["-device", "virtio-serial-device"]);
    push(&["-chardev", &format!("socket,id=agent,fd={AGENT_FD},server=on,wait=off")]);
    push(&["-device", &format!("virtserialport,chardev=agent,name={}", spec.agent_channel)]);
    if let Some(nic) = &spec.nic {
        // The stream netdev serves on a socket hutch bound: the sandbox's stack
        // connects as its client, and after a hutch restart the next one reconnects
        // (QEMU listens again once a client leaves). 4-byte length + Ethernet frame,
        // no vnet header, so no offloads; host_mtu lets the guest send 64 KiB frames.
        let netdev = match &nic.host_end {
            crate::backend::NicHostEnd::Stream => format!("stream,id=net0,server=on,addr.type=fd,addr.str={NET_FD}"),
            crate::backend::NicHostEnd::QemuUser { options } => format!("user,id=net0,{options}"),
        };
        push(&["-netdev", &netdev]);
        let mac = nic.mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":");
        push(&["-device", &format!("virtio-net-device,netdev=net0,mac={mac},host_mtu={},{NIC_QUIRKS}", nic.mtu)]);
    }
    push(&["-chardev", &format!("socket,id=qmp,fd={QMP_FD},server=on,wait=off")]);
    push(&["-mon", "chardev=qmp,mode=control"]);
    a
}

fn memory_backend(spec: &VmSpec) -> String {
    let size = format!("size={}M", ram_mib(spec.memory_mib));
    match &spec.memory {
        Memory::Anonymous => format!("memory-backend-ram,id=mem0,{size}"),
        Memory::SharedFile(f) => format!("memory-backend-file,id=mem0,{size},mem-path={},share=on", f.display()),
        // Opened read-only and mapped copy-on-write: a compromised QEMU cannot change
        // the snapshot every other sandbox of the template maps.
        Memory::PrivateFile(f) => format!("memory-backend-file,id=mem0,{size},mem-path={},share=off,readonly=on,rom=off", f.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A restored 2-vCPU TCG VM with a stream NIC.
    fn restored_spec() -> VmSpec {
        VmSpec {
            id: "x".into(),
            dir: "/s".into(),
            kernel: "/k".into(),
            initrd: "/i".into(),
            disk: "/s/disk.qcow2".into(),
            base: None,
            cpus: 2,
            memory_mib: 512,
            accel: Accel::Tcg,
            memory: Memory::PrivateFile("/snap/mem".into()),
            incoming: Some(crate::backend::Incoming { state: "/snap/state".into(), ignore_shared: true }),
            die_with_parent: true,
            agent_channel: "hutch.agent".into(),
            nic: Some(crate::backend::Nic { mac: [0x52, 0x54, 0, 1, 2, 3], mtu: 65520, host_end: Default::default() }),
        }
    }

    #[test]
    fn tcg_line_has_the_reliable_flags() {
        let spec = restored_spec();
        let line: Vec<String> = command_line(&spec, Loading::default()).into_iter().map(|s| s.to_string_lossy().into_owned()).collect();
        let joined = line.join(" ");
        assert!(joined.contains("-M microvm,accel=tcg,memory-backend=mem0,suppress-vmdesc=on -cpu max"));
        assert!(joined.contains("tsc_early_khz=") && joined.contains("tsc=reliable"));
        assert!(joined.contains("-smp 2 -m 512M"));
        assert!(joined.contains("socket,id=agent,fd=5,server=on,wait=off"));
        assert!(joined.contains("-chardev socket,id=qmp,fd=4,server=on,wait=off -mon chardev=qmp,mode=control"));
        assert!(joined.contains("-chardev socket,id=console,fd=3,server=on,wait=off -serial chardev:console"));
        assert!(joined.contains("microvm,accel=tcg,memory-backend=mem0"));
        assert!(joined.contains("memory-backend-file,id=mem0,size=512M,mem-path=/snap/mem,share=off"));
        assert!(joined.contains("-incoming defer"));
        assert!(joined.contains("-netdev stream,id=net0,server=on,addr.type=fd,addr.str=6"));
        assert!(joined.contains("-device virtio-net-device,netdev=net0,mac=52:54:00:01:02:03,host_mtu=65520,guest_announce=off"));
        assert!(!joined.contains("send-configuration"));
        let without = command_line(&spec, Loading { no_configuration: true }).into_iter().map(|s| s.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ");
        assert!(without.contains("-incoming defer -S -global migration.send-configuration=off"));
    }

    #[test]
    fn a_booted_guest_starts_paused_only_when_its_netdev_listens() {
        // Booted, not restored.
        let spec = |nic| VmSpec { incoming: None, memory: Memory::Anonymous, nic, ..restored_spec() };
        let paused = |spec: VmSpec| command_line(&spec, Loading::default()).iter().any(|a| a == "-S");
        let nic = |host_end| Some(crate::backend::Nic { mac: [0x52, 0x54, 0, 1, 2, 3], mtu: 1500, host_end });
        assert!(paused(spec(nic(crate::backend::NicHostEnd::Stream))));
        assert!(!paused(spec(nic(crate::backend::NicHostEnd::QemuUser { options: "restrict=on".into() }))));
        assert!(!paused(spec(None)));
    }

    #[test]
    fn exactly_two_gib_is_given_two_mib_more_so_the_initrd_is_moved_below_the_firmware() {
        assert_eq!((ram_mib(2047), ram_mib(2048), ram_mib(2049)), (2047, 2050, 2049));
    }
}
