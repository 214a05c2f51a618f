//! What every `hutch bench` suite measures with: a series of samples and its
//! percentiles, milliseconds as printed, and one command run to its end.

use hutch_core::Sandbox;
use hutch_proto::process::{ProcessConfig, ProcessEvent, StartRequest};
use std::time::{Duration, Instant};

pub struct Series {
    pub name: &'static str,
    pub samples: Vec<Duration>,
}

impl Series {
    pub fn pct(&self, p: f64) -> Duration {
        let mut s = self.samples.clone();
        s.sort();
        let idx = ((s.len() as f64 - 1.0) * p).round() as usize;
        s.get(idx).copied().unwrap_or_default()
    }
}

pub fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

/// `true`, run directly (no shell).
pub fn true_request() -> StartRequest {
    StartRequest { process: ProcessConfig { cmd: "true".into(), ..Default::default() }, stdin: Some(false), ..Default::default() }
}

/// Runs `req` in the sandbox to its end; fails unless it exits 0.
pub async fn exec_once(sb: &Sandbox, req: &StartRequest) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let mut stream = sb.agent().start(req).await?;
    while let Some(ev) = stream.next().await {
        if let ProcessEvent::End(end) = ev? {
            anyhow::ensure!(end.exit_code == 0, "{} failed: {end:?}", req.process.cmd);
            return Ok(started.elapsed());
        }
    }
    anyhow::bail!("no end event")
}
