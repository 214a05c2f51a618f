//! The jail every QEMU enters, checked with a shell in QEMU's place, spawned as QEMU
//! is: the same namespaces, mounts, ids and cgroups, observed from inside and from the
//! host. Needs root, as confinement itself does (the test suite runs as root).

use hutch_vmm::qemu::jail::{ChildSide, Identity, JailConfig, Prepared};
use hutch_vmm::qemu::spawn::Launch;
use hutch_vmm::{Accel, Memory, VmSpec};
use std::os::fd::AsFd;
use std::path::Path;
use std::time::Duration;

fn spec(home: &Path) -> VmSpec {
    VmSpec {
        id: "jail-test".into(),
        dir: home.join("sandboxes/a"),
        kernel: home.join("kernel/vmlinuz"),
        initrd: home.join("initramfs/i.cpio.gz"),
        disk: home.join("sandboxes/a/disk.qcow2"),
        base: None,
        cpus: 1,
        memory_mib: 128,
        // KVM: the jail makes the VM its own /dev/kvm node (no VM is started here).
        accel: Accel::Kvm,
        memory: Memory::PrivateFile(home.join("snapshots/t/memory")),
        incoming: None,
        die_with_parent: true,
        agent_channel: "hutch.agent".into(),
        nic: None,
    }
}

#[test]
fn a_confined_process_sees_only_its_own_files_as_its_own_uid_in_its_own_cgroup() {
    assert!(nix::unistd::geteuid().is_root(), "confinement needs root; run the suite as root");
    assert!(Path::new("/dev/kvm").exists(), "this host has no /dev/kvm to make the VM's node from");
    let tmp = tempfile::tempdir_in("/var/lib").expect("jail test step");
    let home = tmp.path().join("home");
    for (path, body) in [
        ("kernel/vmlinuz", "kernel"),
        ("initramfs/i.cpio.gz", "initrd"),
        ("sandboxes/a/disk.qcow2", "disk"),
        ("sandboxes/a/vm.json", "record"),
        ("sandboxes/b/disk.qcow2", "another tenant's disk"),
        ("snapshots/t/memory", "memory"),
        ("hutch.db", "database"),
    ] {
        let p = home.join(path);
        std::fs::create_dir_all(p.parent().expect("jail test step")).expect("jail test step");
        std::fs::write(&p, body).expect("jail test step");
    }
    let spec = spec(&home);
    let mut prepared = Prepared::new(&spec, &JailConfig { hide: home.clone(), identity: Identity::Root }, "/bin/sh").expect("jail test step");
    let groups = prepared.group.as_ref().expect("as root every VM gets a cgroup").dirs().to_vec();
    assert!(!groups.is_empty());
    let h = home.display();
    let me = std::process::id();
    let script = format!(
        "id -u; id -G; grep NoNewPrivs /proc/self/status; cat /proc/self/cgroup; \
         stat -c '%u %a' /dev/kvm; find {h} | sort; cat {h}/sandboxes/a/disk.qcow2; echo; \
         echo more >> {h}/sandboxes/a/disk.qcow2 && echo disk-writable; \
         echo x >> {h}/snapshots/t/memory 2>/dev/null || echo memory-read-only; \
         echo x >> {h}/kernel/vmlinuz 2>/dev/null || echo kernel-read-only; \
         ls -A /tmp /run | tr '\\n' ' '; echo; touch /tmp/probe-{me} && echo tmp-writable; \
         readlink /proc/self/ns/net; readlink /proc/self/ns/pid; echo pid $$; \
         echo processes: $(ls /proc | grep -E '^[0-9]+$' | sort -n); \
         test -e /proc/{me} && echo sees-the-test; echo done"
    );
    let out_file = tempfile::tempfile().expect("jail test step");
    let err_file = tempfile::tempfile().expect("jail test step");
    let child = Launch::new(Path::new("/bin/sh"), ["-c", &script])
        .stdout(out_file.as_fd())
        .stderr(err_file.as_fd())
        .die_with_parent(true)
        .spawn(Some(&mut prepared))
        .expect("jail test step");
    let pid = child.pid;
    let status = child.wait_within(Duration::from_secs(60));
    let read = |mut f: &std::fs::File| {
        std::io::Seek::rewind(&mut f).expect("jail test step");
        let mut text = String::new();
        std::io::Read::read_to_string(&mut f, &mut text).expect("jail test step");
        text
    };
    let stdout = read(&out_file);
    assert_eq!(status.as_deref(), Some("exit status: 0"), "{stdout}\n{}", read(&err_file));
    let uid = ChildSide::uid_of(pid);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines[0], uid.to_string(), "{stdout}");
    assert_eq!(lines[1], uid.to_string(), "supplementary groups survived: {stdout}");
    assert!(stdout.contains("NoNewPrivs:\t1"), "{stdout}");
    for dir in &groups {
        let name = dir.file_name().expect("jail test step").to_str().expect("jail test step");
        assert!(stdout.lines().filter(|l| l.ends_with(name)).count() >= 1, "not in {}: {stdout}", dir.display());
    }
    assert!(stdout.contains(&format!("{uid} 600\n")), "/dev/kvm is not the VM's own: {stdout}");
    let seen: Vec<&str> = lines.iter().copied().filter(|l| l.starts_with(&*h.to_string())).collect();
    for path in ["sandboxes/a/disk.qcow2", "kernel/vmlinuz", "initramfs/i.cpio.gz", "snapshots/t/memory"] {
        assert!(seen.contains(&&*format!("{h}/{path}")), "{path} is not visible: {seen:?}");
    }
    for hidden in ["sandboxes/b", "sandboxes/a/vm.json", "hutch.db"] {
        assert!(!seen.iter().any(|l| l.starts_with(&format!("{h}/{hidden}"))), "{hidden} is visible: {seen:?}");
    }
    assert!(stdout.contains("\ndisk\n") && stdout.contains("disk-writable"), "{stdout}");
    assert!(stdout.contains("memory-read-only") && stdout.contains("kernel-read-only"), "{stdout}");
    assert!(stdout.contains("tmp-writable"), "{stdout}");
    let host_net = std::fs::read_link("/proc/self/ns/net").expect("jail test step");
    assert!(!stdout.contains(&*host_net.to_string_lossy()), "the jail shares the host's network namespace: {stdout}");
    // Its own PID namespace, where it is pid 1 and sees only itself and its children
    // (the shell's commands), nothing of the host's processes: not this test.
    let host_pid_ns = std::fs::read_link("/proc/self/ns/pid").expect("jail test step");
    assert!(!stdout.contains(&*host_pid_ns.to_string_lossy()), "the jail shares the host's PID namespace: {stdout}");
    assert!(stdout.contains("\npid 1\n"), "{stdout}");
    let seen = stdout.lines().find_map(|l| l.strip_prefix("processes:")).expect("jail test step");
    let seen: Vec<u32> = seen.split_whitespace().map(|p| p.parse().expect("jail test step")).collect();
    // 1 and the command substitution's pipeline: a subshell, ls, grep and sort.
    assert!(seen.first() == Some(&1) && seen.len() <= 5, "the jail sees other processes: {seen:?}");
    assert!(!stdout.contains("sees-the-test"), "{stdout}");
    // Nothing reached the host: its files are as they were, its /dev/kvm still root's.
    assert_eq!(std::fs::read_to_string(home.join("snapshots/t/memory")).expect("jail test step"), "memory");
    assert_eq!(std::fs::read_to_string(home.join("sandboxes/a/disk.qcow2")).expect("jail test step"), "diskmore\n");
    assert!(!Path::new(&format!("/tmp/probe-{me}")).exists(), "the jail's /tmp is the host's");
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/dev/kvm").expect("jail test step")), 0);
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("jail test step");
    assert!(!mountinfo.contains(&*h.to_string()), "the jail's mounts leaked to the host");
    // The cgroups go with the process.
    drop(prepared);
    for dir in &groups {
        assert!(!dir.exists(), "{} was left", dir.display());
    }
}

#[test]
fn limits_are_written_to_the_cgroup() {
    use hutch_vmm::qemu::cgroup::{Group, Limits};
    let limits = Limits { memory_bytes: 300 << 20, pids: 77, cpu_quota_us: 150_000 };
    let group = Group::create("limits-test", limits).expect("jail test step");
    let read = |dir: &Path, file: &str| std::fs::read_to_string(dir.join(file)).expect("jail test step").trim().to_string();
    let mut checked = 0;
    for dir in group.dirs() {
        if dir.join("memory.limit_in_bytes").exists() {
            assert_eq!(read(dir, "memory.limit_in_bytes"), (300u64 << 20).to_string());
            checked += 1;
        }
        if dir.join("memory.max").exists() {
            assert_eq!(read(dir, "memory.max"), (300u64 << 20).to_string());
            assert_eq!(read(dir, "cpu.max"), "150000 100000");
            checked += 2;
        }
        if dir.join("pids.max").exists() {
            assert_eq!(read(dir, "pids.max"), "77");
            checked += 1;
        }
        if dir.join("cpu.cfs_quota_us").exists() {
            assert_eq!(read(dir, "cpu.cfs_quota_us"), "150000");
            checked += 1;
        }
    }
    assert_eq!(checked, 3, "memory, pids and cpu limits were not all found in {:?}", group.dirs());
    let dirs = group.dirs().to_vec();
    drop(group);
    assert!(dirs.iter().all(|d| !d.exists()));
}
