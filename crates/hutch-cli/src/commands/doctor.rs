//! `hutch doctor`: what hutch found on this host and what it will use.

use clap::Args;
use hutch_image::progress::human_bytes;
use hutch_image::HutchHome;

#[derive(Args, Debug)]
pub struct DoctorArgs {}

fn line(ok: bool, what: &str, detail: impl std::fmt::Display) {
    println!("{} {what:<11} {detail}", if ok { "ok  " } else { "FAIL" });
}

pub async fn run(_args: DoctorArgs) -> anyhow::Result<i32> {
    let home = HutchHome::from_env();
    let mut healthy = true;
    let qemu = hutch_vmm::qemu::QemuBackend::default();
    let system = qemu.version();
    match &system {
        Ok(v) => line(true, "qemu", format!("{} ({})", v.line, qemu.binary)),
        Err(e) => {
            healthy = false;
            line(false, "qemu", e);
        }
    }
    // qemu-img makes the overlays; it must come from the same QEMU release.
    match hutch_vmm::qemu::version::probe("qemu-img", None) {
        Ok(img) => match &system {
            Ok(sys) if (sys.major, sys.minor) != (img.major, img.minor) => {
                healthy = false;
                line(false, "qemu-img", format!("{} is from another QEMU release than {}; install qemu-utils of the same release ({})", img.number(), sys.number(), hutch_vmm::qemu::version::install_hint()));
            }
            _ => line(true, "qemu-img", &img.line),
        },
        Err(hutch_vmm::qemu::QemuVersionError::Missing { .. }) => {
            healthy = false;
            line(false, "qemu-img", format!("missing (package qemu-utils); {}", hutch_vmm::qemu::version::install_hint()));
        }
        Err(e) => {
            healthy = false;
            line(false, "qemu-img", e);
        }
    }
    for (tool, package, purpose) in [("mkfs.ext4", "e2fsprogs", "template images"), ("mmdebstrap", "mmdebstrap", "template builds"), ("apt-get", "apt", "the guest kernel download"), ("dpkg-deb", "dpkg", "unpacking the guest kernel")] {
        let found = std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()));
        healthy &= found;
        line(found, tool, if found { format!("found (for {purpose})") } else { format!("missing; hutch needs it for {purpose}: apt-get install {package}") });
    }
    // As root each QEMU gets ids of hutch's choosing; as another user, ids of its
    // subordinate range in a user namespace; without either, seccomp only.
    match hutch_vmm::qemu::jail::JailConfig::for_home(home.root()) {
        Ok(config) => {
            let ids = match &config.identity {
                hutch_vmm::qemu::jail::Identity::Root => "its own uid".to_string(),
                hutch_vmm::qemu::jail::Identity::Subordinate(ids) => {
                    format!("its own uid of this user's range {}-{} (user namespace)", ids.uids.start, ids.uids.start + ids.uids.count - 1)
                }
            };
            let rooted = matches!(config.identity, hutch_vmm::qemu::jail::Identity::Root);
            match hutch_vmm::qemu::cgroup::summary() {
                Ok(groups) => line(true, "jail", format!("on: each QEMU as {ids}, in its own mount, network and IPC namespaces and {groups}")),
                Err(e) if rooted => {
                    healthy = false;
                    line(false, "jail", e);
                }
                Err(e) => println!("WARN jail        on: each QEMU as {ids}, in its own namespaces, but without cgroup limits: {e}"),
            }
        }
        Err(hutch_vmm::qemu::jail::Unconfined::Off) => println!("WARN jail        off (HUTCH_JAIL=off): QEMU runs as this user with seccomp only"),
        Err(why) => println!("WARN jail        off: QEMU runs as this user with seccomp only: {why}"),
    }
    let tsc = tokio::task::spawn_blocking(hutch_vmm::clock::measure).await?;
    match tsc {
        Some(khz) => line(true, "tsc", format!("{:.3} MHz: the guest kernel is told this rate, so its clock keeps the host's", khz as f64 / 1000.0)),
        None => line(true, "tsc", format!("cannot be measured here; guests assume {} MHz and their clocks may drift", hutch_vmm::clock::FALLBACK_TSC_KHZ / 1000)),
    }

    let (probe, took) = tokio::task::spawn_blocking(hutch_vmm::accel::probe_timed).await?;
    let accel = if probe.kvm_usable { "kvm" } else { "tcg" };
    line(true, "accel", format!("{accel} (auto): {} [probe took {} ms]", probe.reason, took.as_millis()));
    if !probe.kvm_usable {
        println!("WARN accel       TCG is software emulation and NOT a security boundary (QEMU's security policy); use a host with KVM for untrusted code");
    }

    match hutch_image::kernel::cached(&home) {
        Ok(Some(k)) => line(true, "kernel", format!("{} ({} {})", k.version, k.package, k.package_version)),
        Ok(None) => line(true, "kernel", "not downloaded yet (hutch setup, or the first run, fetches it)"),
        Err(e) => {
            healthy = false;
            line(false, "kernel", e);
        }
    }
    match hutch_core::artifacts::locate_agent() {
        Ok(p) => line(true, "agent", p.display()),
        Err(e) => {
            healthy = false;
            line(false, "agent", e);
        }
    }
    let templates = hutch_image::template_store::list(&home);
    line(true, "templates", if templates.is_empty() { "none built yet (base is built on first use)".to_string() } else { templates.join(", ") });
    let sandboxes = std::fs::read_dir(home.sandboxes()).map(|d| d.count()).unwrap_or(0);
    line(true, "sandboxes", format!("{sandboxes} on disk"));
    let db = home.root().join("hutch.db");
    if db.exists() {
        let store = hutch_core::store::Store::open_file(&db).await?;
        let orphans = hutch_core::orphans::find(&home, &store).await?;
        if orphans.is_empty() {
            line(true, "orphans", "none (every running VM has its server)");
        } else {
            let now = std::time::SystemTime::now();
            let each: Vec<String> = orphans
                .iter()
                .map(|o| match o.end_at.map(|end| end.duration_since(now)) {
                    Some(Ok(left)) => format!("{} (QEMU pid {}, ends in {} s)", o.id, o.qemu_pid, left.as_secs()),
                    Some(Err(_)) | None => format!("{} (QEMU pid {}, past its end time)", o.id, o.qemu_pid),
                })
                .collect();
            println!("WARN orphans     {} VM(s) no server owns: {}; the reaper `hutch serve` started ends each at its end time, and a new `hutch serve` adopts them before", orphans.len(), each.join(", "));
        }
    }
    match nix::sys::statvfs::statvfs(home.root().parent().unwrap_or(home.root())) {
        Ok(s) => {
            let free = s.blocks_available() * s.fragment_size();
            let enough = free > 2 << 30;
            healthy &= enough;
            line(enough, "disk", format!("{} free for {}", human_bytes(free), home.root().display()));
        }
        Err(e) => line(false, "disk", e),
    }
    Ok(if healthy { 0 } else { 1 })
}
