//! `hutch bench`: boot and exec latency, next to a bare QEMU boot of the same kernel and
//! initramfs measured in the same run (method in docs/BENCHMARKS.md).

use super::bench_measure::{exec_once, ms, true_request, Series};
use crate::local::Local;
use anyhow::Context;
use clap::Args;
use hutch_core::{Sandbox, SandboxOptions};
use hutch_proto::process::{ProcessConfig, StartRequest};
use hutch_vmm::qemu::QemuBackend;
use hutch_vmm::{AccelChoice, VmSpec};
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Runs per measurement (at least 10 for meaningful p95).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(3..=1000))]
    pub runs: u32,
    /// Accelerator: `auto` (KVM when it runs at native speed, else TCG), `kvm` or `tcg`.
    #[arg(long, default_value = "auto")]
    pub accel: AccelChoice,
    /// What to measure: `boot` (cold boot and exec against a bare QEMU boot),
    /// `snapshots` (start paths, pause/resume, memory, throughput) or one of its parts
    /// alone (`start`, `pause`, `memory`) or `net` (iperf3 and TCP connects through hutch's stack,
    /// passt and QEMU's user-mode network; needs HUTCH_JAIL=off, iperf3 and passt).
    #[arg(long, default_value = "boot", value_parser = ["boot", "snapshots", "start", "pause", "memory", "net"])]
    pub suite: String,
}

pub async fn run(args: BenchArgs) -> anyhow::Result<i32> {
    let local = Local::prepare("base", args.accel).await?;
    let runs = args.runs as usize;
    eprintln!("hutch bench: {runs} runs each, accel {} ({})", local.accel.accel.as_str(), local.accel.why);
    if args.suite == "net" {
        super::bench_net::run(&local, runs).await?;
        return Ok(0);
    }
    if ["snapshots", "start", "pause", "memory"].contains(&args.suite.as_str()) {
        super::bench_snapshots::run(&local, runs, &args.suite).await?;
        return Ok(0);
    }
    let backend = local.backend();
    // The boot suite measures booting: no template snapshot.
    let opts = SandboxOptions { accel: local.accel.accel, cold: true, ..SandboxOptions::default() };

    let mut bare = Series { name: "bare QEMU: start -> agent ready on console", samples: vec![] };
    let mut boot = Series { name: "hutch: create -> agent ready (API usable)", samples: vec![] };
    let mut cli = Series { name: "hutch run -- true (wall)", samples: vec![] };
    let mut exec = Series { name: "exec round trip of `true` (live sandbox)", samples: vec![] };
    let mut exec_sdk = Series { name: "exec round trip of `bash -l -c true`, as SDKs start commands", samples: vec![] };

    for i in 0..runs {
        eprint!("\rrun {}/{runs}", i + 1);
        bare.samples.push(bare_boot(&local, &backend).await?);
        let sb = Sandbox::create(&local.home, &local.artifacts, &backend, &opts).await?;
        boot.samples.push(sb.boot_time());
        sb.destroy().await?;
        let started = Instant::now();
        let status = tokio::process::Command::new(std::env::current_exe()?)
            .args(["run", "--cold", "--accel", local.accel.accel.as_str(), "--", "true"])
            .status()
            .await?;
        anyhow::ensure!(status.success(), "hutch run -- true failed: {status}");
        cli.samples.push(started.elapsed());
    }
    let sb = Sandbox::create(&local.home, &local.artifacts, &backend, &opts).await?;
    let req = true_request();
    for _ in 0..3 {
        exec_once(&sb, &req).await?; // warm up TCG's translation of the exec path
    }
    let login = StartRequest {
        process: ProcessConfig { cmd: "/bin/bash".into(), args: vec!["-l".into(), "-c".into(), "true".into()], ..Default::default() },
        ..req.clone()
    };
    exec_once(&sb, &login).await?;
    for _ in 0..runs.max(20) {
        exec.samples.push(exec_once(&sb, &req).await?);
        exec_sdk.samples.push(exec_once(&sb, &login).await?);
    }
    sb.destroy().await?;
    eprintln!();

    let floor = bare.pct(0.5);
    println!("| measurement | p50 ms | p95 ms | p50 / bare QEMU boot p50 |");
    println!("|---|---:|---:|---:|");
    for s in [&bare, &boot, &cli, &exec, &exec_sdk] {
        let ratio = s.pct(0.5).as_secs_f64() / floor.as_secs_f64().max(1e-9);
        println!("| {} | {} | {} | {ratio:.2} |", s.name, ms(s.pct(0.5)), ms(s.pct(0.95)));
    }
    Ok(0)
}

/// QEMU started by hutch's VM layer alone (its command line, jail and QMP): from spawn
/// to the agent's first answer on its channel (an idle probe). No sandbox directory,
/// overlay creation, session or init call.
async fn bare_boot(local: &Local, backend: &QemuBackend) -> anyhow::Result<Duration> {
    let dir = local.home.tmp().join(format!("bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let disk = dir.join("disk.qcow2");
    hutch_vmm::disk::create_overlay(&local.artifacts.template.image(), &disk).await?;
    let spec = VmSpec {
        id: "bench".into(),
        dir: dir.clone(),
        kernel: local.artifacts.kernel.vmlinuz(),
        initrd: local.artifacts.initramfs.clone(),
        disk,
        base: Some(local.artifacts.template.image()),
        cpus: 1,
        memory_mib: SandboxOptions::default().memory.get(),
        accel: local.accel.accel,
        memory: hutch_vmm::Memory::Anonymous,
        incoming: None,
        die_with_parent: true,
        agent_channel: hutch_proto::AGENT_PORT_NAME.into(),
        nic: None,
    };
    let started = Instant::now();
    let mut vm = hutch_vmm::VmBackend::start(backend, &spec).await?;
    tokio::time::timeout(Duration::from_secs(60), hutch_sdk::envd::wait_idle(&spec.agent_socket()))
        .await
        .context("the bare VM's agent did not answer within 60 s")??;
    let took = started.elapsed();
    vm.kill().await?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(took)
}
