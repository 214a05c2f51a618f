//! `hutch bench --suite snapshots`: start paths (cold boot, snapshot restore, warm
//! pool) next to a bare QEMU restore of the same snapshot, pause/resume by memory
//! dirtied, memory per idle sandbox, and create throughput (method in
//! docs/BENCHMARKS.md); `start`, `pause` and `memory` run one part alone.

use super::bench_measure::{exec_once, ms, true_request, Series};
use crate::local::Local;
use hutch_core::snapshot::MemorySnapshot;
use hutch_core::{Sandbox, SandboxOptions};
use hutch_vmm::qemu::QemuBackend;
use hutch_vmm::VmSpec;
use std::time::{Duration, Instant};

/// Which parts of the suite run: `snapshots` all of them, `start`, `pause` or
/// `memory` that part alone.
pub async fn run(local: &Local, runs: usize, suite: &str) -> anyhow::Result<()> {
    let backend = local.backend();
    let opts = SandboxOptions { accel: local.accel.accel, ..SandboxOptions::default() };
    let snapshot = super::run::ensure_snapshot(local, &opts).await?;
    if suite == "snapshots" || suite == "start" {
        start_paths(local, &backend, &opts, &snapshot, runs).await?;
    }
    if suite == "snapshots" || suite == "pause" {
        println!("\n### Pause and resume (5 runs each, 512 MiB guests; a guest dirties memory by writing a file into its page cache)\n");
        println!("| memory dirtied since the restore | pause p50 ms | pause max ms | resume p50 ms | resume max ms | saved state MiB |");
        println!("|---|---:|---:|---:|---:|---:|");
        for (name, dirty) in [("none (idle)", 0u32), ("64 MiB", 64), ("256 MiB", 256)] {
            let (pause, resume, state) = pause_resume(local, &backend, &opts, dirty, 5).await?;
            println!("| {name} | {} | {} | {} | {} | {} |", ms(pause.pct(0.5)), ms(pause.pct(1.0)), ms(resume.pct(0.5)), ms(resume.pct(1.0)), state >> 20);
        }
    }
    if suite == "snapshots" || suite == "memory" {
        let (per_restored, per_resumed, per_cold) = memory_per_sandbox(local, &backend, &opts, 20).await?;
        println!("\n### Host memory per idle sandbox (PSS of its QEMU, 512 MiB guests)\n");
        println!("| sandboxes | PSS per sandbox MiB |");
        println!("|---|---:|");
        println!("| 20 restored from one snapshot | {:.1} |", per_restored);
        println!("| the same 20, each paused and resumed | {:.1} |", per_resumed);
        println!("| 3 cold-booted (reference) | {:.1} |", per_cold);
    }
    if suite == "snapshots" {
        let (rate, n) = creates_per_second(local, &backend, &opts, 2, 10).await?;
        println!("\n### Throughput\n");
        println!("| clients | creates (restore + `true` + destroy) | creates per second |");
        println!("|---|---:|---:|");
        println!("| 2 concurrent | {n} | {rate:.2} |");
    }
    Ok(())
}

/// Each start path `runs` times, interleaved, next to a bare QEMU restore.
async fn start_paths(local: &Local, backend: &QemuBackend, opts: &SandboxOptions, snapshot: &MemorySnapshot, runs: usize) -> anyhow::Result<()> {
    let req = true_request();

    let mut hello = Series { name: "bare QEMU restore of the same snapshot: spawn -> agent session open (hello echoed, HTTP/2 up)", samples: vec![] };
    let mut bare = Series { name: "bare QEMU restore + raw agent session: spawn -> first command result", samples: vec![] };
    let mut restored = Series { name: "snapshot restore: create -> first command result", samples: vec![] };
    let mut cli = Series { name: "hutch run -- true (wall: a new process restores, runs, destroys)", samples: vec![] };
    let mut pooled = Series { name: "warm pool: take (identity, clock, entropy) -> first command result", samples: vec![] };
    let mut cold = Series { name: "cold boot: create -> first command result", samples: vec![] };
    let mut restored_ready = Series { name: "snapshot restore: create -> ready (agent answered /init)", samples: vec![] };
    let mut cold_ready = Series { name: "cold boot: create -> ready (agent answered /init)", samples: vec![] };
    let cold_opts = SandboxOptions { cold: true, ..opts.clone() };
    for i in 0..runs {
        eprint!("\rstart paths: run {}/{runs}", i + 1);
        let (echo, first) = bare_restore(local, backend, snapshot).await?;
        hello.samples.push(echo);
        bare.samples.push(first);
        let started = Instant::now();
        let mut sb = Sandbox::create(&local.home, &local.artifacts, backend, opts).await?;
        restored_ready.samples.push(sb.boot_time());
        exec_once(&sb, &req).await?;
        restored.samples.push(started.elapsed());
        // A pool holds restored sandboxes; taking one re-initializes it.
        let started = Instant::now();
        sb.reinit(opts).await?;
        exec_once(&sb, &req).await?;
        pooled.samples.push(started.elapsed());
        sb.destroy().await?;
        let started = Instant::now();
        let status = tokio::process::Command::new(std::env::current_exe()?)
            .args(["run", "--accel", local.accel.accel.as_str(), "--", "true"])
            .status()
            .await?;
        anyhow::ensure!(status.success(), "hutch run -- true failed: {status}");
        cli.samples.push(started.elapsed());
        let started = Instant::now();
        let sb = Sandbox::create(&local.home, &local.artifacts, backend, &cold_opts).await?;
        cold_ready.samples.push(sb.boot_time());
        exec_once(&sb, &req).await?;
        cold.samples.push(started.elapsed());
        sb.destroy().await?;
    }
    eprintln!();
    let floor = bare.pct(0.5);
    println!("### Start paths ({runs} runs each, base template, 512 MiB)\n");
    println!("| path | p50 ms | p95 ms | p50 / bare restore + first command | cold p50 / this p50 |");
    println!("|---|---:|---:|---:|---:|");
    for s in [&hello, &bare, &restored, &cli, &pooled, &cold] {
        let ratio = s.pct(0.5).as_secs_f64() / floor.as_secs_f64().max(1e-9);
        let speedup = cold.pct(0.5).as_secs_f64() / s.pct(0.5).as_secs_f64().max(1e-9);
        println!("| {} | {} | {} | {ratio:.2} | {speedup:.1}x |", s.name, ms(s.pct(0.5)), ms(s.pct(0.95)));
    }
    // Each run's paths follow each other within seconds: the median of the runs' own
    // ratios is not moved by the host's speed drifting between runs (it does, by a
    // third within an hour here), as the ratio of two medians is.
    let paired = |s: &Series| {
        let mut r: Vec<f64> = s.samples.iter().zip(&bare.samples).map(|(a, b)| a.as_secs_f64() / b.as_secs_f64().max(1e-9)).collect();
        r.sort_by(f64::total_cmp);
        r.get(r.len() / 2).copied().unwrap_or_default()
    };
    println!("\nMedian of each run's own ratio to that run's bare restore + first command: snapshot restore {:.2}, `hutch run -- true` {:.2}.", paired(&restored), paired(&cli));
    println!("\n| until the sandbox is ready, before any command | p50 ms | p95 ms | cold p50 / this p50 |");
    println!("|---|---:|---:|---:|");
    for s in [&restored_ready, &cold_ready] {
        let speedup = cold_ready.pct(0.5).as_secs_f64() / s.pct(0.5).as_secs_f64().max(1e-9);
        println!("| {} | {} | {} | {speedup:.1}x |", s.name, ms(s.pct(0.5)), ms(s.pct(0.95)));
    }
    Ok(())
}

/// The snapshot restored by hutch's VM layer alone: its command line (and jail) for the
/// same snapshot (on an overlay made beforehand), `migrate-incoming` from an fd, `cont`; timed to an agent
/// session being open (hello echoed, HTTP/2 handshake) and to the first command's
/// result on it: what any client of the guest must do at least. No sandbox directory,
/// record, overlay creation or /init.
async fn bare_restore(local: &Local, backend: &QemuBackend, snapshot: &MemorySnapshot) -> anyhow::Result<(Duration, Duration)> {
    let dir = local.home.tmp().join(format!("bench-restore-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let disk = dir.join("disk.qcow2");
    hutch_vmm::disk::create_overlay(&snapshot.disk(), &disk).await?;
    let (memory, incoming) = snapshot.restore_memory();
    let spec = VmSpec {
        id: "bench".into(),
        dir: dir.clone(),
        kernel: local.artifacts.kernel.vmlinuz(),
        initrd: local.artifacts.initramfs.clone(),
        disk,
        base: Some(snapshot.disk()),
        cpus: snapshot.manifest.cpus,
        memory_mib: snapshot.manifest.memory_mib,
        accel: snapshot.manifest.accel,
        memory,
        incoming: Some(incoming),
        die_with_parent: true,
        agent_channel: hutch_proto::AGENT_PORT_NAME.into(),
        // The saved machine's devices, NIC included; nothing connects to its host end.
        nic: snapshot.manifest.nic.then(hutch_core::sandbox::layout::guest_nic),
    };
    let started = Instant::now();
    let mut vm = hutch_vmm::VmBackend::start(backend, &spec).await?;
    vm.load().await?;
    vm.resume().await?;
    // What any client of the restored guest must do: hello, HTTP/2, Process.Start.
    let agent = hutch_sdk::envd::connect(&spec.agent_socket()).await?;
    let session = started.elapsed();
    let mut stream = agent.start(&true_request()).await?;
    while let Some(ev) = stream.next().await {
        if let hutch_proto::process::ProcessEvent::End(_) = ev? {
            break;
        }
    }
    let first_command = started.elapsed();
    agent.close();
    vm.kill().await?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok((session, first_command))
}

/// A sandbox restored at the default size dirties `dirty_mib` of its memory (a file of
/// random bytes in its page cache), then is paused and resumed `runs` times.
async fn pause_resume(local: &Local, backend: &QemuBackend, opts: &SandboxOptions, dirty_mib: u32, runs: usize) -> anyhow::Result<(Series, Series, u64)> {
    let mut sb = Sandbox::create(&local.home, &local.artifacts, backend, opts).await?;
    if dirty_mib > 0 {
        let ballast = hutch_proto::process::StartRequest {
            process: hutch_proto::process::ProcessConfig {
                cmd: "/bin/sh".into(),
                args: vec!["-c".into(), format!("head -c {dirty_mib}M /dev/urandom > /tmp/ballast")],
                ..Default::default()
            },
            stdin: Some(false),
            ..Default::default()
        };
        exec_once(&sb, &ballast).await?;
    }
    let mut pause = Series { name: "pause", samples: vec![] };
    let mut resume = Series { name: "resume", samples: vec![] };
    let mut state_bytes = 0;
    for i in 0..runs {
        eprint!("\rpause/resume, {dirty_mib} MiB dirtied: run {}/{runs}", i + 1);
        let dir = sb.dir().to_path_buf();
        let started = Instant::now();
        sb.pause(hutch_core::sandbox::layout::PauseMode::Full).await?;
        pause.samples.push(started.elapsed());
        state_bytes = std::fs::metadata(dir.join(hutch_core::sandbox::layout::PAUSED_STATE))?.len();
        drop(sb);
        let started = Instant::now();
        sb = Sandbox::resume(&dir, backend, opts).await?;
        resume.samples.push(started.elapsed());
    }
    eprintln!();
    exec_once(&sb, &true_request()).await?;
    sb.destroy().await?;
    Ok((pause, resume, state_bytes))
}

/// Proportional set size of a process, in MiB (shared pages split among sharers).
fn pss_mib(pid: u32) -> f64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let kib: u64 = text.lines().find(|l| l.starts_with("Pss:")).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok()).unwrap_or(0);
    kib as f64 / 1024.0
}

async fn mean_pss(sandboxes: &[Sandbox]) -> f64 {
    tokio::time::sleep(Duration::from_secs(3)).await; // let them settle idle
    let total: f64 = sandboxes.iter().filter_map(|s| s.pid()).map(pss_mib).sum();
    total / sandboxes.len().max(1) as f64
}

async fn memory_per_sandbox(local: &Local, backend: &QemuBackend, opts: &SandboxOptions, n: usize) -> anyhow::Result<(f64, f64, f64)> {
    let mut restored = Vec::new();
    for i in 0..n {
        eprint!("\rmemory: restoring sandbox {}/{n}", i + 1);
        let sb = Sandbox::create(&local.home, &local.artifacts, backend, opts).await?;
        exec_once(&sb, &true_request()).await?;
        restored.push(sb);
    }
    eprintln!();
    let per_restored = mean_pss(&restored).await;
    // Paused and resumed, each maps its snapshot again (with the pages it had changed
    // on top), so it should cost what it did before.
    let mut resumed = Vec::new();
    for (i, mut sb) in restored.into_iter().enumerate() {
        eprint!("\rmemory: pausing and resuming sandbox {}/{n}", i + 1);
        let dir = sb.dir().to_path_buf();
        sb.pause(hutch_core::sandbox::layout::PauseMode::Full).await?;
        drop(sb);
        let sb = Sandbox::resume(&dir, backend, opts).await?;
        exec_once(&sb, &true_request()).await?;
        resumed.push(sb);
    }
    eprintln!();
    let per_resumed = mean_pss(&resumed).await;
    for sb in resumed {
        sb.destroy().await?;
    }
    let cold_opts = SandboxOptions { cold: true, ..opts.clone() };
    let mut cold = Vec::new();
    for _ in 0..3 {
        let sb = Sandbox::create(&local.home, &local.artifacts, backend, &cold_opts).await?;
        exec_once(&sb, &true_request()).await?;
        cold.push(sb);
    }
    let per_cold = mean_pss(&cold).await;
    for sb in cold {
        sb.destroy().await?;
    }
    Ok((per_restored, per_resumed, per_cold))
}

async fn creates_per_second(local: &Local, backend: &QemuBackend, opts: &SandboxOptions, clients: usize, each: usize) -> anyhow::Result<(f64, usize)> {
    let started = Instant::now();
    let one_client = || async {
        for _ in 0..each {
            let sb = Sandbox::create(&local.home, &local.artifacts, backend, opts).await?;
            exec_once(&sb, &true_request()).await?;
            sb.destroy().await?;
        }
        Ok::<_, anyhow::Error>(())
    };
    let results = futures::future::join_all((0..clients).map(|_| one_client())).await;
    for r in results {
        r?;
    }
    let n = clients * each;
    Ok((n as f64 / started.elapsed().as_secs_f64(), n))
}
