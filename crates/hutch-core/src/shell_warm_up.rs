//! The shells SDKs start first, run once before anyone asks: every `commands.run` is
//! `/bin/bash -l -c CMD` as the template's user, and every `pty.create` an interactive
//! `/bin/bash -i -l` on a terminal (its readline, prompt and `.bashrc` are code and
//! files the first kind never touches).
//!
//! Run in a template's VM before its snapshot is saved, the files they read are in
//! every restored guest's page cache. Run again in each pooled sandbox, their code is
//! also translated: under TCG a fresh QEMU translates what the guest runs on first use
//! and keeps it. Measured through the official SDK (docs/BENCHMARKS.md): a pooled
//! sandbox's first terminal echoed in 233 ms and its second in 124 before the
//! terminal was warmed; 109 after.

use hutch_envd::{AgentClient, AgentError};
use hutch_proto::process::{ProcessConfig, Pty, PtySize, Signal, StartRequest};
use std::time::Duration;

/// What `warm_shells` runs, in a template snapshot's key: a change makes new snapshots.
pub(crate) const WHAT: &str = "shells first: bash -l -c true; bash -i -l on a terminal";

/// How long each shell may take to end before its process group is killed: a profile
/// that waits for something holds neither a template's snapshot nor a pool.
const SHELL_WAIT: Duration = Duration::from_secs(10);

/// How long `warm_shells` takes in all at most (two shells and their kills, each call to
/// the agent bounded on its own): past it, an agent that does not answer is not waited
/// for.
const WARM_SHELLS_WAIT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub(crate) enum WarmShellsError {
    /// The guest said no (no bash, no such user): a sandbox as good as one with them.
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// The agent did not answer in time: whatever it is doing, a user would wait behind it.
    #[error("the shells' warm-up did not end within {} s", WARM_SHELLS_WAIT.as_secs())]
    Timeout,
}

fn bash(args: &[&str], envs: &[(&str, &str)]) -> ProcessConfig {
    ProcessConfig {
        cmd: "/bin/bash".into(),
        args: args.iter().map(|a| a.to_string()).collect(),
        envs: envs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        cwd: None,
    }
}

/// Runs both shells to their end as `user` (the template's, or "user"), within
/// `WARM_SHELLS_WAIT`; the caller decides what an error means.
pub(crate) async fn warm_shells(agent: &AgentClient, user: Option<&str>) -> Result<(), WarmShellsError> {
    tokio::time::timeout(WARM_SHELLS_WAIT, run_shells(agent, user)).await.map_err(|_| WarmShellsError::Timeout)?.map_err(WarmShellsError::from)
}

async fn run_shells(agent: &AgentClient, user: Option<&str>) -> Result<(), AgentError> {
    let agent = agent.as_user(Some(user.unwrap_or("user")));
    let command = StartRequest { process: bash(&["-l", "-c", "true"], &[]), pty: None, tag: None, stdin: Some(false) };
    run_bounded(&agent, &command, None).await?;
    // What the official SDKs' `pty.create` sends (their terminal and locale), and an
    // empty HISTFILE: the user's history file must not start with the warm-up's lines.
    let terminal = StartRequest {
        process: bash(&["-i", "-l"], &[("TERM", "xterm-256color"), ("LANG", "C.UTF-8"), ("LC_ALL", "C.UTF-8"), ("HISTFILE", "")]),
        pty: Some(Pty { size: PtySize { cols: 80, rows: 24 } }),
        tag: None,
        stdin: Some(true),
    };
    // Typed before the shell reads: the terminal holds it, as for a user. HISTFILE is
    // unset again in case a profile set it.
    run_bounded(&agent, &terminal, Some(b"unset HISTFILE; echo $TERM\nexit\n")).await
}

/// Starts `request`, types `typed` on its terminal, and reads its output until it ends,
/// at most `SHELL_WAIT`; then its process group is killed.
async fn run_bounded(agent: &AgentClient, request: &StartRequest, typed: Option<&'static [u8]>) -> Result<(), AgentError> {
    let mut stream = agent.start(request).await?;
    let pid = stream.pid;
    let ran = async {
        if let Some(typed) = typed {
            agent.send_pty(pid, bytes::Bytes::from_static(typed)).await?;
        }
        while stream.next().await.is_some() {}
        Ok::<_, AgentError>(())
    };
    match tokio::time::timeout(SHELL_WAIT, ran).await {
        Ok(Ok(())) => Ok(()),
        // Whatever went wrong once it started, it does not stay behind (in a snapshot
        // every sandbox of the template restores, or in a pooled sandbox).
        failed => {
            agent.signal(pid, Signal::Kill).await?;
            failed.unwrap_or(Ok(()))
        }
    }
}
