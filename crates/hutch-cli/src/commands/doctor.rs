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
    let binary = hutch_vmm::qemu::QemuBackend::default().binary;
    match hutch_vmm::qemu::version(&binary) {
        Ok(v) => line(true, "qemu", v),
        Err(e) => {
            healthy = false;
            line(false, "qemu", e);
        }
    }
    let qemu_img = std::process::Command::new("qemu-img").arg("--version").output().is_ok();
    line(qemu_img, "qemu-img", if qemu_img { "found" } else { "missing; install it with: apt-get install qemu-utils" });
    healthy &= qemu_img;

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
    let templates = hutch_image::rootfs::list(&home);
    line(true, "templates", if templates.is_empty() { "none built yet (base is built on first use)".to_string() } else { templates.join(", ") });
    let sandboxes = std::fs::read_dir(home.sandboxes()).map(|d| d.count()).unwrap_or(0);
    line(true, "sandboxes", format!("{sandboxes} on disk"));
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
