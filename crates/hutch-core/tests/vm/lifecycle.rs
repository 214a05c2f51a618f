//! Sandboxes of their own: concurrency, and nothing left behind after destroy, drop or
//! a failed boot.

use crate::check;
use crate::support::{qemu_processes_of, qemus_since, run, Env};
use hutch_core::{CreateError, Sandbox};
use libtest_mimic::Trial;
use std::sync::Arc;
use std::time::Duration;

pub fn trials(env: &Arc<Env>) -> Vec<Trial> {
    vec![
        env.trial("lifecycle::three_sandboxes_at_once", three_at_once),
        env.trial("lifecycle::destroy_leaves_nothing", destroy_leaves_nothing),
        env.trial("lifecycle::dropping_a_sandbox_kills_its_vm", drop_kills),
        env.trial("lifecycle::failed_boot_cleans_up_and_shows_the_console", failed_boot),
    ]
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default().contains(") Z ")
}

async fn three_at_once(env: Arc<Env>) -> anyhow::Result<()> {
    let opts = Env::options();
    let (a, b, c) = tokio::join!(
        Sandbox::create(&env.home, &env.artifacts, &env.backend, &opts),
        Sandbox::create(&env.home, &env.artifacts, &env.backend, &opts),
        Sandbox::create(&env.home, &env.artifacts, &env.backend, &opts),
    );
    let all = [a?, b?, c?];
    for (i, sb) in all.iter().enumerate() {
        run(sb.agent(), &format!("echo {i} > /tmp/who")).await?;
    }
    for (i, sb) in all.iter().enumerate() {
        let out = run(sb.agent(), "cat /tmp/who; hostname").await?;
        check!(out.stdout_str() == format!("{i}\nhutch\n"), "sandbox {i} saw {:?}", out.stdout_str());
    }
    let ids: std::collections::HashSet<_> = all.iter().map(|s| s.id().to_string()).collect();
    check!(ids.len() == 3, "ids not unique: {ids:?}");
    for sb in all {
        sb.destroy().await?;
    }
    Ok(())
}

async fn destroy_leaves_nothing(env: Arc<Env>) -> anyhow::Result<()> {
    let sb = Sandbox::create(&env.home, &env.artifacts, &env.backend, &Env::options()).await?;
    let (dir, pid) = (sb.dir().to_path_buf(), sb.pid().unwrap_or(0));
    check!(dir.join("disk.qcow2").is_file() && dir.join("console.log").is_file(), "sandbox files missing in {dir:?}");
    check!(alive(pid), "QEMU {pid} not running");
    // Confined: seccomp in filter mode (2) for every thread of QEMU.
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    check!(status.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["Seccomp:", "2"]), "QEMU {pid} runs without a seccomp filter:\n{status}");
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))?;
    check!(!String::from_utf8_lossy(&cmdline).contains("exec:"), "QEMU was handed an exec: migration");
    // Jailed (jail.rs): its own uid, no capabilities, no new privileges, its own cgroups.
    let uid = hutch_vmm::qemu::jail::ChildSide::uid_of(pid).to_string();
    let field = |name: &str| status.lines().find(|l| l.starts_with(name)).map(|l| l.split_whitespace().skip(1).collect::<Vec<_>>()).unwrap_or_default();
    check!(field("Uid:") == [uid.as_str(); 4], "QEMU {pid} does not run as its own uid {uid}:\n{status}");
    check!(field("CapEff:") == ["0000000000000000"] && field("NoNewPrivs:") == ["1"], "QEMU {pid} kept privileges:\n{status}");
    // Pid 1 of a PID namespace of its own: its /proc lists no other process.
    check!(field("NSpid:") == [pid.to_string().as_str(), "1"], "QEMU {pid} shares a PID namespace:\n{status}");
    let groups = crate::support::cgroups_of(pid)?;
    check!(groups.len() >= 3 || groups.iter().any(|g| g.join("memory.max").exists()), "QEMU {pid} is not in hutch's cgroups: {groups:?}");
    sb.destroy().await?;
    check!(!dir.exists(), "{dir:?} left behind");
    check!(groups.iter().all(|g| !g.exists()), "cgroups left behind: {groups:?}");
    check!(!alive(pid), "QEMU {pid} still running");
    Ok(())
}

async fn drop_kills(env: Arc<Env>) -> anyhow::Result<()> {
    let sb = Sandbox::create(&env.home, &env.artifacts, &env.backend, &Env::options()).await?;
    let (dir, pid) = (sb.dir().to_path_buf(), sb.pid().unwrap_or(0));
    drop(sb); // as on a panic or an early return
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while alive(pid) && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await; // poll interval of the wait
    }
    check!(!alive(pid), "QEMU {pid} survived the drop by 30 s");
    check!(!dir.exists(), "{dir:?} left behind");
    Ok(())
}

async fn failed_boot(env: Arc<Env>) -> anyhow::Result<()> {
    let qemus_before = qemu_processes_of(&env.home);
    // A kernel that is not a kernel: QEMU refuses it, and nothing may remain.
    let mut broken = env.artifacts.clone();
    let bogus = env.home.tmp().join(format!("not-a-kernel-{}", std::process::id()));
    std::fs::create_dir_all(env.home.tmp())?;
    std::fs::write(&bogus, b"this is not a kernel")?;
    broken.kernel.dir = bogus.clone();
    let before: Vec<_> = std::fs::read_dir(env.home.sandboxes())?.flatten().map(|e| e.path()).collect();
    let result = Sandbox::create(&env.home, &broken, &env.backend, &Env::cold()).await;
    let _ = std::fs::remove_file(&bogus);
    let err = match result {
        Err(e) => e,
        Ok(sb) => {
            sb.destroy().await?;
            anyhow::bail!("a VM with no kernel booted");
        }
    };
    check!(matches!(err, CreateError::Start(_) | CreateError::VmExited { .. }), "unexpected error {err:?}");
    let after: Vec<_> = std::fs::read_dir(env.home.sandboxes())?.flatten().map(|e| e.path()).filter(|p| !before.contains(p)).collect();
    check!(after.is_empty(), "left behind: {after:?}");
    check!(qemus_since(&env.home, &qemus_before).is_empty(), "QEMU left running");

    // A guest that panics at boot: the error carries the console's last lines.
    let mut panicking = env.artifacts.clone();
    panicking.initramfs = env.home.tmp().join(format!("empty-initrd-{}", std::process::id()));
    std::fs::write(&panicking.initramfs, b"")?;
    let result = Sandbox::create(&env.home, &panicking, &env.backend, &Env::cold()).await;
    match result {
        Err(CreateError::VmExited { console, .. }) => {
            check!(console.contains("Kernel panic") || console.contains("VFS"), "console tail: {console}")
        }
        Err(e) => anyhow::bail!("unexpected error {e:?}"),
        Ok(sb) => {
            sb.destroy().await?;
            anyhow::bail!("a VM with an empty initramfs booted");
        }
    }

    // The same guest when a template snapshot has to be made first: the snapshot
    // fails with the console, and neither it nor a sandbox is left half-made.
    let snapshot_dir = hutch_core::template_snapshot::dir_for(&env.home, &panicking, &Env::options(), &env.backend);
    let result = Sandbox::create(&env.home, &panicking, &env.backend, &Env::options()).await;
    let _ = std::fs::remove_file(&panicking.initramfs);
    match result {
        Err(CreateError::TemplateSnapshot(e)) => check!(format!("{:#}", anyhow::Error::from(e)).contains("Kernel panic"), "no console in the error"),
        Err(e) => anyhow::bail!("unexpected error {e:?}"),
        Ok(sb) => {
            sb.destroy().await?;
            anyhow::bail!("a VM with an empty initramfs was snapshotted");
        }
    }
    let parent = snapshot_dir.parent().map(std::path::Path::to_path_buf).unwrap_or_default();
    let stray: Vec<_> = std::fs::read_dir(&parent)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().unwrap_or_default().to_string_lossy().into_owned();
            // The snapshot itself, its lock, or this process's half-made one.
            name.starts_with(&*snapshot_dir.file_name().unwrap_or_default().to_string_lossy()) || name.starts_with(&format!(".t{}-", std::process::id()))
        })
        .collect();
    check!(stray.is_empty(), "snapshot files left: {stray:?}");
    check!(qemus_since(&env.home, &qemus_before).is_empty(), "QEMU left running");
    Ok(())
}
