//! `hutch bench --suite net`: iperf3 both ways and TCP connections per second from one
//! guest to servers on the host's loopback, through hutch's stack, through passt (which
//! speaks the same stream protocol) and through QEMU's user-mode network (libslirp), in
//! the same run, rounds interleaved (method in docs/BENCHMARKS.md).
//!
//! Every byte goes to loopback: hutch's stack reaches the servers through its test seam
//! (the guest dials a documentation address the seam maps to 127.0.0.1), passt and slirp
//! map the gateway address to the host's loopback as they do by default.

use crate::local::Local;
use anyhow::Context;
use hutch_net::seam::{TestMap, TestMapFile};
use hutch_proto::net::{GATEWAY_IP, GUEST_IP, GUEST_MAC, MTU, PREFIX_LEN};
use hutch_proto::process::{DataEvent, ProcessConfig, ProcessEvent, StartRequest};
use hutch_sdk::envd::AgentClient;
use hutch_vmm::qemu::QemuBackend;
use hutch_vmm::{Nic, NicHostEnd, VmSpec};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

/// Seconds of each iperf3 run and of the connection loop.
const IPERF_SECS: u32 = 8;
const CONNECT_SECS: u32 = 5;
/// What the guest dials to reach the host's loopback through hutch's stack (TEST-NET-1,
/// mapped by the seam; nothing else is mapped, so nothing else is dialed).
const MAPPED: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
/// The host files the guest needs for iperf3 (the guest's Debian has libc and libcrypto).
const IPERF_FILES: [&str; 3] = ["/usr/bin/iperf3", "/usr/lib/x86_64-linux-gnu/libiperf.so.0", "/usr/lib/x86_64-linux-gnu/libsctp.so.1"];

#[derive(Debug, Clone, Copy, PartialEq)]
enum Stack {
    Hutch,
    Passt,
    Slirp,
}

impl Stack {
    fn name(self) -> &'static str {
        match self {
            Stack::Hutch => "hutch (hutch-net, in hutch's process)",
            Stack::Passt => "passt (Debian's, --fd on the same stream netdev)",
            Stack::Slirp => "QEMU user-mode (-netdev user, libslirp)",
        }
    }
}

/// One stack's figures from one round.
#[derive(Default, Clone)]
struct Round {
    up_mbps: f64,
    down_mbps: f64,
    connects_per_sec: f64,
    /// CPU seconds of the stack's process per GiB moved (None: it runs inside QEMU).
    up_cpu_per_gib: Option<f64>,
    down_cpu_per_gib: Option<f64>,
}

/// The host's servers: iperf3 and a listener that accepts and closes.
struct Servers {
    iperf: Child,
    iperf_port: u16,
    accept_port: u16,
}

impl Drop for Servers {
    fn drop(&mut self) {
        let _ = self.iperf.kill();
        let _ = self.iperf.wait();
    }
}

pub async fn run(local: &Local, rounds: usize) -> anyhow::Result<()> {
    anyhow::ensure!(
        std::env::var("HUTCH_JAIL").is_ok_and(|v| v == "off" || v == "0"),
        "the network benchmark needs HUTCH_JAIL=off: QEMU's user-mode network reaches the host's loopback only from the host's network namespace, and all three stacks run unconfined so they compare alike (scripts/bench-net.sh sets it)"
    );
    for tool in ["iperf3", "passt"] {
        anyhow::ensure!(hutch_vmm::process::find_program(tool).is_some_and(|p| p.is_file()), "{tool} is not installed; run scripts/bench-net.sh, which installs iperf3 and passt from Debian");
    }
    let servers = start_servers()?;
    let backend = local.backend();
    let stacks = [Stack::Hutch, Stack::Passt, Stack::Slirp];
    let mut results: Vec<Vec<Round>> = vec![Vec::new(); stacks.len()];
    for round in 0..rounds {
        for (i, &stack) in stacks.iter().enumerate() {
            eprintln!("round {}/{rounds}: {}", round + 1, stack.name());
            let r = measure(local, &backend, stack, &servers).await.with_context(|| format!("measuring {}", stack.name()))?;
            eprintln!(
                "  guest->host {:.0} Mbit/s, host->guest {:.0} Mbit/s, {:.0} connects/s",
                r.up_mbps, r.down_mbps, r.connects_per_sec
            );
            results[i].push(r);
        }
    }
    print_table(&stacks, &results, rounds);
    Ok(())
}

fn print_table(stacks: &[Stack], results: &[Vec<Round>], rounds: usize) {
    let med = |v: Vec<f64>| median(v);
    let passt = stacks.iter().position(|s| *s == Stack::Passt).map(|i| &results[i]);
    let ref_of = |f: fn(&Round) -> f64| passt.map(|r| med(r.iter().map(f).collect())).unwrap_or(f64::NAN);
    let (ref_up, ref_down, ref_conn) = (ref_of(|r| r.up_mbps), ref_of(|r| r.down_mbps), ref_of(|r| r.connects_per_sec));
    println!("### Network stacks ({rounds} rounds, medians; iperf3 {IPERF_SECS} s each way, connects for {CONNECT_SECS} s)\n");
    println!("| stack | guest -> host Mbit/s | host -> guest Mbit/s | TCP connects/s | / passt (up, down, connects) | stack CPU s per GiB (up / down) |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (stack, rs) in stacks.iter().zip(results) {
        let up = med(rs.iter().map(|r| r.up_mbps).collect());
        let down = med(rs.iter().map(|r| r.down_mbps).collect());
        let conn = med(rs.iter().map(|r| r.connects_per_sec).collect());
        let cpu = match (rs.iter().map(|r| r.up_cpu_per_gib).collect::<Option<Vec<_>>>(), rs.iter().map(|r| r.down_cpu_per_gib).collect::<Option<Vec<_>>>()) {
            (Some(u), Some(d)) => format!("{:.2} / {:.2}", med(u), med(d)),
            _ => "inside QEMU's main loop".into(),
        };
        println!(
            "| {} | {up:.0} | {down:.0} | {conn:.0} | {:.2}, {:.2}, {:.2} | {cpu} |",
            stack.name(),
            up / ref_up,
            down / ref_down,
            conn / ref_conn
        );
    }
    println!("\nEach round, per stack:\n");
    for (stack, rs) in stacks.iter().zip(results) {
        let list = |f: fn(&Round) -> f64| rs.iter().map(|r| format!("{:.0}", f(r))).collect::<Vec<_>>().join(", ");
        println!("- {}: up {}; down {}; connects/s {}", stack.name(), list(|r| r.up_mbps), list(|r| r.down_mbps), list(|r| r.connects_per_sec));
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port())
}

fn start_servers() -> anyhow::Result<Servers> {
    let iperf_port = free_port()?;
    let iperf = Command::new("iperf3")
        .args(["-s", "-B", "127.0.0.1", "-p", &iperf_port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting iperf3 -s")?;
    // Accepts and closes at once: the guest's loop measures connection setup alone.
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let accept_port = listener.local_addr()?.port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            drop(conn);
        }
    });
    let servers = Servers { iperf, iperf_port, accept_port };
    wait_listening(servers.iperf_port)?;
    Ok(servers)
}

/// Waits for iperf3's listener, with a deadline.
fn wait_listening(port: u16) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if std::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return Ok(());
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "iperf3 -s did not listen on 127.0.0.1:{port} within 10 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What hutch's stack, passt or slirp hold for one VM, ended on drop.
enum HostEnd {
    Hutch(hutch_net::NetHandle),
    Passt(Child),
    Slirp,
}

impl Drop for HostEnd {
    fn drop(&mut self) {
        if let HostEnd::Passt(child) = self {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl HostEnd {
    /// The pid whose CPU time is the stack's (None: slirp, inside QEMU).
    fn stack_pid(&self) -> Option<u32> {
        match self {
            HostEnd::Hutch(_) => Some(std::process::id()),
            HostEnd::Passt(child) => Some(child.id()),
            HostEnd::Slirp => None,
        }
    }
}

async fn measure(local: &Local, backend: &QemuBackend, stack: Stack, servers: &Servers) -> anyhow::Result<Round> {
    let dir = local.home.tmp().join(format!("bench-net-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let result = measure_in(local, backend, stack, servers, &dir).await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn measure_in(local: &Local, backend: &QemuBackend, stack: Stack, servers: &Servers, dir: &Path) -> anyhow::Result<Round> {
    let disk = dir.join("disk.qcow2");
    hutch_vmm::disk::create_overlay(&local.artifacts.template.image(), &disk).await?;
    let host_end = match stack {
        Stack::Slirp => NicHostEnd::QemuUser {
            // The guest keeps its fixed address and gateway; slirp serves the host's
            // loopback at `host`.
            options: format!("net={}/24,host={GATEWAY_IP},dns=198.18.0.3,dhcpstart=198.18.0.16,ipv6=off", Ipv4Addr::from(u32::from(GUEST_IP) & !0xff)),
        },
        _ => NicHostEnd::Stream,
    };
    let spec = VmSpec {
        id: "bench-net".into(),
        dir: dir.to_path_buf(),
        kernel: local.artifacts.kernel.vmlinuz(),
        initrd: local.artifacts.initramfs.clone(),
        disk,
        base: Some(local.artifacts.template.image()),
        cpus: 1,
        memory_mib: hutch_core::SandboxOptions::default().memory.get(),
        accel: local.accel.accel,
        memory: hutch_vmm::Memory::Anonymous,
        incoming: None,
        die_with_parent: true,
        agent_channel: hutch_proto::AGENT_PORT_NAME.into(),
        nic: Some(Nic { mac: GUEST_MAC, mtu: MTU as u32, host_end }),
    };
    let mut vm = hutch_vmm::VmBackend::start(backend, &spec).await?;
    let outcome = async {
        let (end, target) = attach(stack, &spec, servers).await?;
        tokio::time::timeout(Duration::from_secs(60), hutch_sdk::envd::wait_idle(&spec.agent_socket()))
            .await
            .context("the guest's agent did not answer within 60 s")??;
        let agent = hutch_sdk::envd::connect(&spec.agent_socket()).await?;
        let r = measure_guest(&agent, &end, target, servers).await;
        agent.close();
        if let (HostEnd::Hutch(handle), Ok(_)) = (&end, &r) {
            // A figure from a stack whose link broke would be no figure at all.
            if let hutch_net::LinkState::Lost(why) = handle.link() {
                anyhow::bail!("hutch's stack lost its link during the run: {why}");
            }
        }
        drop(end);
        r
    }
    .await;
    vm.kill().await?;
    outcome
}

/// Connects the stack to the VM's NIC; returns it and the address the guest dials for
/// the host's loopback through it.
async fn attach(stack: Stack, spec: &VmSpec, servers: &Servers) -> anyhow::Result<(HostEnd, Ipv4Addr)> {
    match stack {
        Stack::Hutch => {
            let mut map = TestMapFile::default();
            for port in [servers.iperf_port, servers.accept_port] {
                map.tcp.insert(SocketAddr::from((MAPPED, port)), SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
            }
            let policy = hutch_net::Policy::parse(&format!("allow@{MAPPED}:tcp"))?;
            let env = hutch_net::Environment::default();
            let link = tokio::net::UnixStream::connect(spec.net_socket()).await?;
            let handle = hutch_net::NetHandle::start(link, policy, env.reach, Arc::new(TestMap::new(map)), env.limits);
            Ok((HostEnd::Hutch(handle), MAPPED))
        }
        Stack::Passt => {
            use std::os::fd::AsRawFd;
            let link = std::os::unix::net::UnixStream::connect(spec.net_socket())?;
            // passt takes the connected socket by number: let it survive exec.
            nix::fcntl::fcntl(link.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()))?;
            let fd = link.as_raw_fd().to_string();
            let child = Command::new("passt")
                .args(["--foreground", "--one-off", "--fd", &fd, "--address", &GUEST_IP.to_string()])
                .args(["--netmask", &PREFIX_LEN.to_string(), "--gateway", &GATEWAY_IP.to_string(), "--mtu", &MTU.to_string()])
                .args(["--no-dhcpv6", "--no-ndp", "--no-ra", "--ipv4-only", "--quiet"])
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .context("starting passt")?;
            // passt holds its own copy now.
            drop(link);
            Ok((HostEnd::Passt(child), GATEWAY_IP))
        }
        Stack::Slirp => Ok((HostEnd::Slirp, GATEWAY_IP)),
    }
}

async fn measure_guest(agent: &AgentClient, end: &HostEnd, target: Ipv4Addr, servers: &Servers) -> anyhow::Result<Round> {
    for file in IPERF_FILES {
        let data = std::fs::read(file).with_context(|| format!("reading {file}"))?;
        let name = Path::new(file).file_name().and_then(|n| n.to_str()).unwrap_or("x");
        agent.upload(&format!("/opt/bench/{name}"), hutch_sdk::envd::full(data)).await?;
    }
    run_in_guest(agent, "chmod +x /opt/bench/iperf3").await?;
    let iperf = |reverse: &str| {
        format!("LD_LIBRARY_PATH=/opt/bench /opt/bench/iperf3 -c {target} -p {} -t {IPERF_SECS} -J {reverse}", servers.iperf_port)
    };
    let mut round = Round::default();
    for reverse in [false, true] {
        let cpu_before = end.stack_pid().map(cpu_seconds).transpose()?;
        let out = run_in_guest(agent, &iperf(if reverse { "-R" } else { "" })).await?;
        let cpu_after = end.stack_pid().map(cpu_seconds).transpose()?;
        let report: serde_json::Value = serde_json::from_str(&out).context("iperf3's JSON report")?;
        let received = &report["end"]["sum_received"];
        let bps = received["bits_per_second"].as_f64().context("iperf3 reported no throughput")?;
        let bytes = received["bytes"].as_f64().unwrap_or(0.0);
        let per_gib = cpu_before.zip(cpu_after).map(|(b, a)| (a - b) / (bytes / (1u64 << 30) as f64).max(1e-9));
        if reverse {
            (round.down_mbps, round.down_cpu_per_gib) = (bps / 1e6, per_gib);
        } else {
            (round.up_mbps, round.up_cpu_per_gib) = (bps / 1e6, per_gib);
        }
    }
    agent.upload("/opt/bench/connects", hutch_sdk::envd::full(connect_loop()?)).await?;
    let out = run_in_guest(agent, &format!("chmod +x /opt/bench/connects && /opt/bench/connects {target} {} {CONNECT_SECS}", servers.accept_port)).await?;
    round.connects_per_sec = out.trim().parse().with_context(|| format!("the connect loop printed {out:?}"))?;
    Ok(round)
}

/// The guest's connect loop: connect, close, again, for a few seconds; prints the rate.
/// C, built here with the host's compiler (static, so the guest needs nothing): a loop in
/// an interpreter would measure the interpreter under TCG, not the stacks.
const CONNECT_LOOP_C: &str = r#"
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
int main(int argc, char **argv) {
    if (argc != 4) return 2;
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(atoi(argv[2])) };
    if (inet_pton(AF_INET, argv[1], &a.sin_addr) != 1) return 2;
    double start = now(), end = start + atof(argv[3]);
    long n = 0;
    while (now() < end) {
        int s = socket(AF_INET, SOCK_STREAM, 0);
        if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a) != 0) { perror("connect"); return 1; }
        close(s);
        n++;
    }
    printf("%f\n", n / (now() - start));
    return 0;
}
"#;

fn connect_loop() -> anyhow::Result<Vec<u8>> {
    let dir = tempfile_dir()?;
    let (src, bin) = (dir.join("connects.c"), dir.join("connects"));
    std::fs::write(&src, CONNECT_LOOP_C)?;
    let status = Command::new("cc").args(["-O2", "-static", "-o"]).arg(&bin).arg(&src).status().context("running cc (the host's C compiler)")?;
    anyhow::ensure!(status.success(), "cc could not build the connect loop ({status}); install gcc and libc6-dev");
    let data = std::fs::read(&bin)?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(data)
}

fn tempfile_dir() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("hutch-bench-net-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Runs `script` with sh in the guest; its stdout, or an error with its stderr.
async fn run_in_guest(agent: &AgentClient, script: &str) -> anyhow::Result<String> {
    let req = StartRequest {
        process: ProcessConfig { cmd: "/bin/sh".into(), args: vec!["-c".into(), script.into()], ..Default::default() },
        stdin: Some(false),
        ..Default::default()
    };
    let mut stream = agent.start(&req).await?;
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let deadline = Duration::from_secs(u64::from(IPERF_SECS) * 4 + 60);
    tokio::time::timeout(deadline, async {
        while let Some(ev) = stream.next().await {
            match ev? {
                ProcessEvent::Data(DataEvent::Stdout(b)) => out.extend_from_slice(&b),
                ProcessEvent::Data(DataEvent::Stderr(b)) => err.extend_from_slice(&b),
                ProcessEvent::End(end) => {
                    anyhow::ensure!(end.exit_code == 0, "`{script}` exited with {}: {}{}", end.exit_code, String::from_utf8_lossy(&err), String::from_utf8_lossy(&out));
                    return Ok(());
                }
                _ => {}
            }
        }
        anyhow::bail!("`{script}` ended without an exit status")
    })
    .await
    .with_context(|| format!("`{script}` did not finish within {} s", deadline.as_secs()))??;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// User plus system CPU seconds of `pid` so far (/proc's clock ticks are 1/100 s on
/// Linux whatever the kernel's HZ).
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name may hold spaces; the fields after it are fixed.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).context("unexpected /proc stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11).and_then(|u| u.parse().ok()).unwrap_or(0) + fields.get(12).and_then(|s| s.parse().ok()).unwrap_or(0);
    Ok(ticks as f64 / 100.0)
}
