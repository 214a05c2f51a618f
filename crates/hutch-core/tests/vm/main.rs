//! Integration tests that boot real microVMs (the default test run: the VM is the
//! product). Most checks share one booted sandbox to keep the suite fast; the lifecycle
//! checks boot their own, one phase after the other, so no more than two VMs boot at once
//! on a 2-core machine (three for the test that runs three sandboxes at once).
//!
//! The clock check holds a sandbox of its own for two minutes with a host core busy. It
//! runs on a thread of its own beside both phases: its sandbox is idle between samples,
//! and the phases' VMs on the other core are load the check is meant to withstand.

mod clock;
mod files;
mod lifecycle;
mod process;
mod snapshots;
mod support;

use libtest_mimic::{Arguments, Trial};
use std::sync::Arc;
use support::Env;

fn main() {
    let args = Arguments::from_args();
    let started = std::time::Instant::now();
    let env = match Env::start() {
        Ok(env) => Arc::new(env),
        Err(e) => {
            eprintln!("cannot prepare the test environment: {e:#}");
            std::process::exit(1);
        }
    };

    // Booted before the clock check starts: a failed boot exits the process, which must
    // not happen while the clock check's busy loop runs (nothing would end it).
    let shared = env.shared_sandbox();
    eprintln!("trial-time (setup: artifacts and the shared sandbox's boot) {:.2}s", started.elapsed().as_secs_f64());
    let mut serial = args.clone();
    serial.test_threads = Some(1);
    let clock = {
        let (args, trials) = (serial.clone(), clock::trials(&env));
        std::thread::spawn(move || libtest_mimic::run(&args, trials))
    };
    let mut trials: Vec<Trial> = Vec::new();
    trials.extend(process::trials(&env, &shared));
    trials.extend(files::trials(&env, &shared));
    let mut two = args.clone();
    if two.test_threads.is_none() {
        two.test_threads = Some(2);
    }
    let first = libtest_mimic::run(&two, trials);
    env.destroy(shared);

    let mut own = lifecycle::trials(&env);
    own.extend(snapshots::trials(&env));
    let second = libtest_mimic::run(&serial, own);
    let clock = clock.join().unwrap_or_else(|_| {
        eprintln!("the clock check's thread panicked");
        std::process::exit(101);
    });
    let leaks = env.leaks();
    if let Some(leak) = &leaks {
        eprintln!("LEAK: {leak}");
    }
    if first.has_failed() || second.has_failed() || clock.has_failed() || leaks.is_some() {
        std::process::exit(101);
    }
}
