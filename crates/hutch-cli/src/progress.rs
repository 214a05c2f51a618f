//! Draws build progress on the terminal: a spinner with the latest detail line, then a
//! summary line per step with its duration. Without a terminal, plain step lines.

use indicatif::{ProgressBar, ProgressStyle};
use parking_lot::Mutex;
use std::time::Duration;

pub struct TermProgress {
    bar: Mutex<Option<ProgressBar>>,
    step: Mutex<String>,
}

impl TermProgress {
    pub fn new() -> Self {
        TermProgress { bar: Mutex::new(None), step: Mutex::new(String::new()) }
    }
}

impl hutch_image::Progress for TermProgress {
    fn step(&self, what: &str) {
        *self.step.lock() = what.to_string();
        let bar = ProgressBar::new_spinner();
        bar.set_style(
            ProgressStyle::with_template("{spinner} {prefix} [{elapsed}] {wide_msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.set_prefix(what.to_string());
        bar.enable_steady_tick(Duration::from_millis(120));
        if bar.is_hidden() {
            eprintln!("hutch: {what} ...");
        }
        *self.bar.lock() = Some(bar);
    }

    fn detail(&self, line: &str) {
        if let Some(bar) = &*self.bar.lock() {
            let line: String = line.chars().take(120).collect();
            bar.set_message(line);
        }
    }

    fn done(&self, summary: &str, took: Duration) {
        if let Some(bar) = self.bar.lock().take() {
            bar.finish_and_clear();
        }
        let step = self.step.lock().clone();
        eprintln!("hutch: {step}: {summary} in {:.1} s", took.as_secs_f64());
    }
}
