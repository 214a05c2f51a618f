//! hutch-agent: PID 1 of every hutch guest.
//!
//! It boots the guest (mounts, modules, switching into the root disk), reaps orphans, and
//! serves the E2B envd API (processes, files, watchers) over HTTP/2 on the virtio-serial
//! agent channel. It owns nothing on the host and must not trust the host's input more
//! than the API allows. Run outside a VM with `--listen ADDR` to serve over TCP instead,
//! which the tests use to check the API without booting.
#![allow(unsafe_code)] // syscalls: pre_exec, ioctls, adopting fds; each block has a SAFETY note.

mod channel;
mod fs;
mod guest;
mod http;
mod net;
mod process;
mod state;
mod trust;

use std::time::Duration;

fn main() {
    let pid1 = nix::unistd::getpid().as_raw() == 1;
    if pid1 {
        if let Err(e) = guest::boot() {
            eprintln!("hutch-agent: boot failed: {}", hutch_proto::error_chain(&e));
            // Let the console carry the message out before the VM ends.
            std::thread::sleep(Duration::from_millis(200));
            guest::power_off();
        }
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("HUTCH_AGENT_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .without_time()
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("hutch-agent: cannot start the runtime: {e}");
            guest::power_off();
            return;
        }
    };
    let code = runtime.block_on(run(pid1));
    if pid1 {
        guest::power_off();
    }
    std::process::exit(code);
}

/// A template's own services (the code interpreter's server, say) start from this
/// script at boot, as root; it drops privileges itself.
const TEMPLATE_START: &str = "/etc/hutch/start";

fn start_template_services(state: &state::AgentState) {
    if !std::path::Path::new(TEMPLATE_START).is_file() {
        return;
    }
    let req = process::spawn::SpawnRequest {
        cmd: "/bin/sh".into(),
        args: vec![TEMPLATE_START.into()],
        envs: Default::default(),
        cwd: Some("/".into()),
        default_cwd: None,
        user: process::user::GuestUser::root(),
        pty: None,
        stdin: false,
    };
    match process::spawn::spawn(req, &state.reaper) {
        Ok(spawned) => {
            let config = hutch_proto::process::ProcessConfig { cmd: "/bin/sh".into(), args: vec![TEMPLATE_START.into()], ..Default::default() };
            // Nobody subscribes: its output is read and dropped (the script logs itself).
            drop(state.processes.insert(spawned, config, Some("template-start".into())));
        }
        Err(e) => eprintln!("hutch-agent: starting {TEMPLATE_START}: {e}"),
    }
}

async fn run(pid1: bool) -> i32 {
    let state = state::AgentState::default();
    tokio::spawn(state.reaper.clone().run());
    if pid1 {
        start_template_services(&state);
    }
    let app = http::router(state);
    let listen = std::env::args().skip_while(|a| a != "--listen").nth(1);
    match (pid1, listen) {
        (false, Some(addr)) => serve_tcp(&addr, app).await,
        (false, None) => {
            eprintln!("hutch-agent runs as PID 1 in a hutch guest; outside one, pass --listen ADDR");
            2
        }
        (true, _) => {
            let Some(port) = tokio::task::block_in_place(|| {
                channel::find_port(hutch_proto::AGENT_PORT_NAME, Duration::from_secs(10))
            }) else {
                eprintln!("hutch-agent: no virtio port named {} appeared", hutch_proto::AGENT_PORT_NAME);
                return 1;
            };
            eprintln!("hutch-agent: ready on {}", port.display());
            channel::serve(port, app).await;
            0
        }
    }
}

async fn serve_tcp(addr: &str, app: axum::Router) -> i32 {
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("hutch-agent: cannot listen on {addr}: {e}");
            return 1;
        }
    };
    if let Ok(local) = listener.local_addr() {
        println!("listening on {local}");
    }
    match axum::serve(listener, app).await {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("hutch-agent: {e}");
            1
        }
    }
}

