//! Running one command in a sandbox, as `hutch run` and `hutch exec` both do.

use crate::terminal;
use anyhow::Context;
use bytes::Bytes;
use clap::Args;
use hutch_envd::{AgentClient, AgentError, ProcessStream};
use hutch_proto::connect::Code;
use hutch_proto::process::{DataEvent, ProcessConfig, ProcessEvent, Pty, PtySize, Signal, StartRequest};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What to run and how (shared by `run` and `exec`).
#[derive(Args, Debug)]
pub struct ExecFlags {
    /// Environment variable for the command (repeatable).
    #[arg(short, long = "env", value_name = "K=V", value_parser = parse_env)]
    pub envs: Vec<(String, String)>,
    /// Working directory in the guest (default: the user's home).
    #[arg(short = 'w', long)]
    pub workdir: Option<String>,
    /// User to run as in the guest.
    #[arg(short, long, default_value = "user")]
    pub user: String,
    /// Kill the command after this many seconds (exit code 124).
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,
    /// Keep stdin open and forward it to the command.
    #[arg(short, long)]
    pub interactive: bool,
    /// Give the command a terminal (PTY).
    #[arg(short, long)]
    pub tty: bool,
    /// The command and its arguments.
    #[arg(required = true, value_name = "CMD", trailing_var_arg = true)]
    pub command: Vec<String>,
}

pub fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() && !k.contains('\0') => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("'{s}' is not K=V")),
    }
}

/// Runs a command in a sandbox through its agent, streaming output, forwarding stdin or
/// a terminal; returns the shell exit code (128+N for signal N, 124 after a timeout,
/// 127 when the command does not exist).
pub async fn exec(agent: &AgentClient, args: &ExecFlags) -> anyhow::Result<i32> {
    let agent = agent.as_user(Some(&args.user));
    let tty = args.tty && terminal::stdin_is_tty();
    let (cmd, rest) = args.command.split_first().context("no command given")?;
    let req = StartRequest {
        process: ProcessConfig {
            cmd: cmd.clone(),
            args: rest.to_vec(),
            envs: args.envs.iter().cloned().collect::<BTreeMap<_, _>>(),
            cwd: args.workdir.clone(),
        },
        pty: tty.then(|| {
            let (cols, rows) = terminal::size();
            Pty { size: PtySize { cols, rows } }
        }),
        tag: None,
        stdin: Some(args.interactive || tty),
    };
    let stream = match agent.start(&req).await {
        Ok(s) => s,
        Err(AgentError::Rpc(e)) if e.code == Code::NotFound => {
            eprintln!("hutch: {}", e.message);
            return Ok(127);
        }
        Err(AgentError::Rpc(e)) if e.code == Code::PermissionDenied => {
            eprintln!("hutch: {}", e.message);
            return Ok(126);
        }
        Err(AgentError::Rpc(e)) if e.code == Code::InvalidArgument || e.code == Code::Unauthenticated => {
            anyhow::bail!("{}", e.message)
        }
        Err(e) => return Err(e).context("starting the command"),
    };
    let pid = stream.pid;
    let _raw = if tty { terminal::RawMode::enable() } else { None };
    let input = if tty {
        Some(tokio::spawn(forward_terminal(agent.clone(), pid)))
    } else if args.interactive {
        Some(tokio::spawn(forward_stdin(agent.clone(), pid)))
    } else {
        None
    };
    let result = match args.timeout {
        Some(secs) => {
            match tokio::time::timeout(Duration::from_secs(secs), pump_output(stream)).await {
                Ok(r) => r,
                Err(_) => {
                    let _ = agent.signal(pid, Signal::Kill).await;
                    drop(_raw);
                    eprintln!("hutch: the command timed out after {secs} s and was killed");
                    Ok(124)
                }
            }
        }
        None => pump_output(stream).await,
    };
    if let Some(task) = input {
        task.abort();
    }
    result
}

/// Copies output to our stdout/stderr until the process ends; returns its shell code.
async fn pump_output(mut stream: ProcessStream) -> anyhow::Result<i32> {
    let mut stdout = tokio::io::stdout();
    let mut stderr = tokio::io::stderr();
    while let Some(event) = stream.next().await {
        match event.context("reading the command's output")? {
            ProcessEvent::Data(DataEvent::Stdout(b)) | ProcessEvent::Data(DataEvent::Pty(b)) => {
                stdout.write_all(&b).await?;
                stdout.flush().await?;
            }
            ProcessEvent::Data(DataEvent::Stderr(b)) => {
                stderr.write_all(&b).await?;
                stderr.flush().await?;
            }
            ProcessEvent::End(end) => {
                if let Some(err) = end.error.as_deref().filter(|e| !e.is_empty()) {
                    eprintln!("hutch: {err}");
                }
                return Ok(end.shell_code());
            }
            ProcessEvent::Start { .. } | ProcessEvent::Keepalive {} => {}
        }
    }
    anyhow::bail!("the sandbox ended the command's stream without an exit status")
}

async fn forward_stdin(agent: AgentClient, pid: u32) {
    let mut stdin = tokio::io::stdin();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match stdin.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if agent.send_stdin(pid, Bytes::copy_from_slice(&buf[..n])).await.is_err() {
                    return;
                }
            }
        }
    }
    let _ = agent.close_stdin(pid).await;
}

/// Raw keystrokes to the guest PTY (Ctrl-C included: the guest's terminal turns it into
/// SIGINT for the foreground process), and window size changes.
async fn forward_terminal(agent: AgentClient, pid: u32) {
    let resize = {
        let agent = agent.clone();
        tokio::spawn(async move {
            let Ok(mut winch) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change()) else { return };
            while winch.recv().await.is_some() {
                let (cols, rows) = terminal::size();
                let _ = agent.resize(pid, cols, rows).await;
            }
        })
    };
    let mut stdin = tokio::io::stdin();
    let mut buf = vec![0u8; 4096];
    loop {
        match stdin.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if agent.send_pty(pid, Bytes::copy_from_slice(&buf[..n])).await.is_err() {
                    break;
                }
            }
        }
    }
    resize.abort();
}
