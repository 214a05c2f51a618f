//! Corrects the guest clock after `/init`, NTP-style. `/init` carries the host's time,
//! but in a freshly restored guest the first request takes tens of milliseconds to be
//! handled (TCG translates its whole path anew), so the clock it sets is late by that
//! much: up to -50 ms was seen with a host core busy, -80 to -210 under TCG while
//! other restores ran. By the first `/clock` after `/init` the path is warm (2-15 ms
//! round trips here): that reading gives the guest's offset within half its round
//! trip, and one more call steps the clock by it. A second reading, to keep the
//! tighter of two, cost every create a third call sharing the guest's one vCPU with
//! its first command (a third of the correction's ~2% of `hutch run -- true`,
//! docs/BENCHMARKS.md) for a few milliseconds of precision.

use hutch_envd::AgentClient;
use hutch_proto::agent::{ClockReply, ClockRequest};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Readings taken; the tightest counts.
const READINGS: usize = 1;
/// Each call's deadline: a guest that does not answer is left as `/init` set it.
const CALL_WAIT: Duration = Duration::from_secs(2);
/// Offsets under this are left alone (they are within the measurement's own error).
const NEGLIGIBLE_NS: i128 = 2_000_000;

fn host_ns() -> i128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as i128).unwrap_or(0)
}

async fn call(agent: &AgentClient, step_ns: i64) -> Option<ClockReply> {
    tokio::time::timeout(CALL_WAIT, agent.unary::<_, ClockReply>("/clock", &ClockRequest { step_ns })).await.ok()?.ok()
}

/// The guest clock minus the host's, from the reading with the shortest round trip,
/// and that round trip.
async fn measure(agent: &AgentClient) -> Option<(i128, i128)> {
    let mut best: Option<(i128, i128)> = None;
    for _ in 0..READINGS {
        let sent = host_ns();
        let reply = call(agent, 0).await?;
        let back = host_ns();
        let rtt = back - sent;
        let offset = reply.unix_ns - (sent + back) / 2;
        if best.is_none_or(|(_, r)| rtt < r) {
            best = Some((offset, rtt));
        }
    }
    best
}

/// Measures the guest's clock offset and steps it away; returns the step (ns), if
/// one was made. Errors leave the clock as it was: this only ever improves it.
pub async fn correct(agent: &AgentClient) -> Option<i64> {
    let (offset, rtt) = measure(agent).await?;
    if offset.abs() < NEGLIGIBLE_NS.max(rtt / 2) {
        return None;
    }
    let step = i64::try_from(-offset).ok()?;
    call(agent, step).await?;
    tracing::debug!(step_ms = step as f64 / 1e6, rtt_ms = rtt as f64 / 1e6, "corrected the guest clock");
    Some(step)
}

/// `correct` in the background: a create does not wait for it (it costs 2 round trips).
pub fn spawn_correct(agent: &AgentClient) {
    let agent = agent.clone();
    tokio::spawn(async move { correct(&agent).await });
}
