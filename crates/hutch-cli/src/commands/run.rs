//! `hutch run`: an ephemeral sandbox for one command.

use super::exec::{exec, ExecFlags};
use crate::local::Local;
use anyhow::Context;
use clap::Args;
use hutch_core::{MemMib, Sandbox, SandboxOptions};
use hutch_vmm::AccelChoice;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Template whose root filesystem the sandbox boots.
    #[arg(long, default_value = "base")]
    pub template: String,
    /// Virtual CPUs.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub cpus: u32,
    /// Guest memory in MiB (or with a unit: 512M, 2G).
    #[arg(long, default_value = "512")]
    pub memory: MemMib,
    /// Accelerator: auto picks KVM only when it runs at native speed.
    #[arg(long, default_value = "auto")]
    pub accel: AccelChoice,
    #[command(flatten)]
    pub exec: ExecFlags,
}

pub async fn run(args: RunArgs) -> anyhow::Result<i32> {
    let local = Local::prepare(&args.template, args.accel).await?;
    let opts = SandboxOptions {
        cpus: args.cpus,
        memory: args.memory,
        accel: local.accel.accel,
        ..SandboxOptions::default()
    };
    let backend = hutch_vmm::qemu::QemuBackend::default();
    let create = Sandbox::create(&local.home, &local.artifacts, &backend, &opts);
    let sandbox = tokio::select! {
        s = create => s.context("creating the sandbox")?,
        _ = tokio::signal::ctrl_c() => return Ok(130),
    };
    let outcome = tokio::select! {
        r = exec(sandbox.agent(), &args.exec) => r,
        _ = tokio::signal::ctrl_c() => Ok(130),
    };
    let destroyed = sandbox.destroy().await;
    let code = outcome?;
    destroyed.context("stopping the sandbox")?;
    Ok(code)
}
