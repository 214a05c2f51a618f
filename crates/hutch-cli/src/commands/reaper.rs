//! `hutch reaper` (hidden): the process `hutch serve` starts beside itself to end its
//! VMs at their end times should it end for good (hutch_core::orphans).

use clap::Args;
use hutch_image::HutchHome;

#[derive(Args, Debug)]
pub struct ReaperArgs {
    /// The server this reaper was started for; it lives at least as long.
    #[arg(long)]
    pub server_pid: i32,
}

pub async fn run(args: ReaperArgs) -> anyhow::Result<i32> {
    let home = HutchHome::from_env();
    hutch_core::orphans::run_reaper(&home, args.server_pid).await?;
    Ok(0)
}

/// Starts the reaper for `home` in a process group of its own (a Ctrl-C meant for the
/// server does not reach it), its output appended to `reaper.log` there.
pub fn spawn(home: &HutchHome) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().context("finding this hutch's executable to start its reaper")?;
    let log_path = home.root().join("reaper.log");
    let log = std::fs::OpenOptions::new().create(true).append(true).open(&log_path).with_context(|| format!("opening {}", log_path.display()))?;
    let mut child = std::process::Command::new(exe)
        .args(["reaper", "-v", "--server-pid", &std::process::id().to_string()])
        .env("HUTCH_HOME", home.root())
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .context("starting the reaper (hutch reaper)")?;
    // Collects its exit status if it ends first (a home's second server's reaper waits
    // for the first one's to finish, then takes over).
    std::thread::spawn(move || child.wait());
    Ok(())
}
