//! The guest clock against the host's. A guest reading is taken somewhere between two
//! host readings; only its distance *outside* that window is a certain error, so that
//! is what the checks bound (a slow round trip widens the window, never fails a check).

use crate::check;
use crate::support::{run, Env};
use hutch_envd::AgentClient;
use hutch_core::Sandbox;
use libtest_mimic::Trial;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The most the guest's wall clock may be off the host's (issue 9: 100 ms).
pub const MAX_SKEW: f64 = 0.100;

fn now_secs() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// The guest clock's certain error in seconds (negative: behind), and the host window.
pub struct Skew {
    pub error: f64,
    pub window: f64,
}

pub async fn skew(agent: &AgentClient) -> anyhow::Result<Skew> {
    let before = now_secs();
    let out = run(agent, "date +%s.%N").await?;
    let after = now_secs();
    let guest: f64 = out.stdout_str().trim().parse()?;
    let error = if guest < before {
        guest - before
    } else if guest > after {
        guest - after
    } else {
        0.0
    };
    Ok(Skew { error, window: after - before })
}

/// Checks the guest clock is within `MAX_SKEW` of the host's; `when` names the moment.
pub async fn check_skew(agent: &AgentClient, when: &str) -> anyhow::Result<()> {
    let s = skew(agent).await?;
    check!(s.error.abs() <= MAX_SKEW, "guest clock is {:.3} s off the host's {when} (host window {:.3} s)", s.error, s.window);
    Ok(())
}

pub fn trials(env: &Arc<Env>) -> Vec<Trial> {
    vec![env.trial("clock::the_guest_clock_keeps_the_hosts_while_a_core_is_busy", loaded_hold)]
}

/// How long the loaded check holds its sandbox: 2 minutes in the default run;
/// `HUTCH_CLOCK_HOLD_SECS` makes it a soak (scripts/clock-soak.sh).
fn hold() -> Duration {
    Duration::from_secs(std::env::var("HUTCH_CLOCK_HOLD_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(120))
}

/// Ends the busy loop when the check ends, however it ends.
struct Busy(std::process::Child);

impl Drop for Busy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The guest kernel's clocksource: under TCG it must be the TSC (the host's counter).
/// The watchdog once swapped it for `refined-jiffies` during a busy boot, and that
/// choice lived on in the template snapshot and every sandbox restored from it.
/// `tsc-early` is the same counter before the kernel's calibration work (about a second
/// after the TSC comes up) registers it as `tsc`: a guest asked right after a quick
/// cold boot may still be there (CI saw it once).
pub async fn check_clocksource(agent: &AgentClient) -> anyhow::Result<()> {
    let source = run(agent, "cat /sys/devices/system/clocksource/clocksource0/current_clocksource").await?.stdout_str();
    check!(matches!(source.trim(), "tsc" | "tsc-early"), "the guest's clocksource is {:?}, not the TSC", source.trim());
    Ok(())
}

async fn loaded_hold(env: Arc<Env>) -> anyhow::Result<()> {
    let sb = Sandbox::create(&env.home, &env.artifacts, &env.backend, &Env::options()).await?;
    check_clocksource(sb.agent()).await?;
    let _busy = Busy(std::process::Command::new("sh").args(["-c", "while :; do :; done"]).spawn()?);
    let (started, hold) = (Instant::now(), hold());
    let (mut worst, mut samples) = (0.0f64, 0u32);
    while started.elapsed() < hold {
        let s = skew(sb.agent()).await?;
        samples += 1;
        if s.error.abs() > worst.abs() {
            worst = s.error;
        }
        check!(
            s.error.abs() <= MAX_SKEW,
            "after {:.0} s with a core busy the guest clock is {:.3} s off the host's (sample {samples}, window {:.3} s)",
            started.elapsed().as_secs_f64(),
            s.error,
            s.window
        );
        // The interval between samples is the behaviour under test (time passing), not a wait.
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    eprintln!("clock: {samples} samples over {:.0} s with a core busy, worst certain skew {:.1} ms", started.elapsed().as_secs_f64(), worst * 1000.0);
    sb.destroy().await?;
    Ok(())
}
