//! How long-running builds report what they are doing.

use std::time::Duration;

/// Receives progress from artifact builds; the CLI draws it, tests ignore it.
pub trait Progress: Send + Sync {
    /// A new step begins ("downloading the kernel").
    fn step(&self, what: &str);
    /// A line of detail within the current step (a tool's output line).
    fn detail(&self, line: &str);
    /// The current step ended, with a summary ("41 MB in 12.3 s").
    fn done(&self, summary: &str, took: Duration);
}

/// Discards progress.
pub struct Quiet;

impl Progress for Quiet {
    fn step(&self, _: &str) {}
    fn detail(&self, _: &str) {}
    fn done(&self, _: &str, _: Duration) {}
}

pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// Bytes a directory tree occupies (apparent sizes, symlinks not followed).
pub fn tree_size(path: &std::path::Path) -> u64 {
    let Ok(meta) = std::fs::symlink_metadata(path) else { return 0 };
    if !meta.is_dir() {
        return meta.len();
    }
    std::fs::read_dir(path)
        .map(|rd| rd.flatten().map(|e| tree_size(&e.path())).sum())
        .unwrap_or(0)
}
