//! `hutch bench`: boot and exec latency next to a bare QEMU boot (see docs/BENCHMARKS.md).

use clap::Args;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Runs per measurement.
    #[arg(long, default_value_t = 10)]
    pub runs: usize,
}

pub async fn run(_args: BenchArgs) -> anyhow::Result<i32> {
    anyhow::bail!("not yet")
}
