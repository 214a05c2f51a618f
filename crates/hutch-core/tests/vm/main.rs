//! Integration tests that boot real microVMs (the default test run: the VM is the
//! product). Most checks share one booted sandbox to keep the suite fast; the lifecycle
//! checks boot their own, one phase after the other, so no more than two VMs boot at once
//! on a 2-core machine (three for the test that runs three sandboxes at once).

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
    let mut args = Arguments::from_args();
    if args.test_threads.is_none() {
        args.test_threads = Some(2);
    }
    let env = match Env::start() {
        Ok(env) => Arc::new(env),
        Err(e) => {
            eprintln!("cannot prepare the test environment: {e:#}");
            std::process::exit(1);
        }
    };

    let shared = env.shared_sandbox();
    let mut trials: Vec<Trial> = Vec::new();
    trials.extend(process::trials(&env, &shared));
    trials.extend(files::trials(&env, &shared));
    // Its own sandbox, held for minutes beside the shared phase's trials.
    trials.extend(clock::trials(&env));
    let first = libtest_mimic::run(&args, trials);
    env.destroy(shared);

    let mut serial = args.clone();
    serial.test_threads = Some(1);
    let mut own = lifecycle::trials(&env);
    own.extend(snapshots::trials(&env));
    let second = libtest_mimic::run(&serial, own);
    let leaks = env.leaks();
    if let Some(leak) = &leaks {
        eprintln!("LEAK: {leak}");
    }
    if first.has_failed() || second.has_failed() || leaks.is_some() {
        std::process::exit(101);
    }
}
