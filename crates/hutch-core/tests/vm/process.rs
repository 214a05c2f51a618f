//! Processes in the shared sandbox: output, exit statuses, stdin, env, users, PTY.

use crate::check;
use crate::support::{collect, run, sh, Env, Shared};
use bytes::Bytes;
use hutch_envd::AgentError;
use hutch_proto::connect::Code;
use hutch_proto::process::{DataEvent, ProcessConfig, ProcessEvent, ProcessSelector, Pty, PtySize, Signal, StartRequest};
use libtest_mimic::Trial;
use std::sync::Arc;
use std::time::Duration;

pub fn trials(env: &Arc<Env>, sb: &Shared) -> Vec<Trial> {
    crate::shared_trials!(
        env,
        sb,
        "process::echo" => echo,
        "process::stdout_and_stderr_are_separate" => separate_streams,
        "process::exit_codes" => exit_codes,
        "process::death_by_signal" => death_by_signal,
        "process::stdin_round_trip" => stdin_round_trip,
        "process::envs_cwd_and_user" => envs_cwd_user,
        "process::non_utf8_output_survives" => non_utf8,
        "process::hundred_mb_output_with_bounded_agent_memory" => big_output,
        "process::pty_terminal" => pty,
        "process::list_connect_and_kill" => list_connect_kill,
        "process::errors_are_typed" => process_errors,
        "process::guest_has_its_own_kernel_and_clock" => own_kernel,
    )
}

async fn echo(sb: Shared) -> anyhow::Result<()> {
    let out = run(&sb.agent, "echo hello from the guest").await?;
    check!(out.stdout_str() == "hello from the guest\n", "stdout was {:?}", out.stdout_str());
    check!(out.end.exited && out.end.exit_code == 0, "end was {:?}", out.end);
    check!(out.end.status == "exit status 0", "status was {:?}", out.end.status);
    Ok(())
}

async fn separate_streams(sb: Shared) -> anyhow::Result<()> {
    let out = run(&sb.agent, "echo out; echo err >&2; echo out2").await?;
    check!(out.stdout == b"out\nout2\n", "stdout {:?}", out.stdout_str());
    check!(out.stderr == b"err\n", "stderr {:?}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

async fn exit_codes(sb: Shared) -> anyhow::Result<()> {
    for code in [0, 1, 7] {
        let out = run(&sb.agent, &format!("exit {code}")).await?;
        check!(out.end.exited && out.end.exit_code == code, "exit {code} gave {:?}", out.end);
        check!(out.end.shell_code() == code, "shell code {}", out.end.shell_code());
    }
    Ok(())
}

async fn death_by_signal(sb: Shared) -> anyhow::Result<()> {
    let out = run(&sb.agent, "kill -TERM $$; sleep 5").await?;
    check!(!out.end.exited, "a killed process reported exited: {:?}", out.end);
    check!(out.end.status == "signal: terminated", "status {:?}", out.end.status);
    check!(out.end.shell_code() == 143, "shell code {}", out.end.shell_code());
    Ok(())
}

async fn stdin_round_trip(sb: Shared) -> anyhow::Result<()> {
    let mut req = sh("cat; echo '<eof>'");
    req.stdin = Some(true);
    let stream = sb.agent.start(&req).await?;
    let pid = stream.pid;
    let payload = Bytes::from_static(b"line one\nline two\x00\xff binary\n");
    sb.agent.send_stdin(pid, payload.slice(..10)).await?;
    sb.agent.send_stdin(pid, payload.slice(10..)).await?;
    sb.agent.close_stdin(pid).await?;
    let out = tokio::time::timeout(Duration::from_secs(30), collect(stream)).await??;
    let mut expected = payload.to_vec();
    expected.extend_from_slice(b"<eof>\n");
    check!(out.stdout == expected, "stdout {:?}", out.stdout_str());
    Ok(())
}

async fn envs_cwd_user(sb: Shared) -> anyhow::Result<()> {
    let req = StartRequest {
        process: ProcessConfig {
            cmd: "/bin/bash".into(),
            args: vec!["-c".into(), "echo \"$GREETING|$(pwd)|$(id -un)|$HOME\"".into()],
            envs: [("GREETING".to_string(), "hi there".to_string())].into(),
            cwd: Some("/tmp".into()),
        },
        stdin: Some(false),
        ..Default::default()
    };
    let out = collect(sb.agent.start(&req).await?).await?;
    check!(out.stdout_str() == "hi there|/tmp|user|/home/user\n", "default user: {:?}", out.stdout_str());
    let out = collect(sb.agent.as_user(Some("root")).start(&req).await?).await?;
    check!(out.stdout_str() == "hi there|/tmp|root|/root\n", "root: {:?}", out.stdout_str());
    let out = run(&sb.agent, "pwd; id -u; id -G").await?;
    check!(out.stdout_str() == "/home/user\n1000\n1000 27\n", "defaults: {:?}", out.stdout_str());
    let err = sb.agent.as_user(Some("nobody-here")).start(&req).await.err();
    check!(matches!(&err, Some(AgentError::Rpc(e)) if e.code == Code::Unauthenticated), "unknown user gave {err:?}");
    let mut bad_cwd = req.clone();
    bad_cwd.process.cwd = Some("/no/such/dir".into());
    let err = sb.agent.start(&bad_cwd).await.err();
    check!(matches!(&err, Some(AgentError::Rpc(e)) if e.code == Code::InvalidArgument && e.message.contains("/no/such/dir")), "bad cwd gave {err:?}");
    Ok(())
}

async fn non_utf8(sb: Shared) -> anyhow::Result<()> {
    let out = run(&sb.agent, r"printf 'a\377\376b\300'; printf '\200' >&2").await?;
    check!(out.stdout == b"a\xff\xfeb\xc0", "stdout bytes {:?}", out.stdout);
    check!(out.stderr == b"\x80", "stderr bytes {:?}", out.stderr);
    Ok(())
}

async fn big_output(sb: Shared) -> anyhow::Result<()> {
    const SIZE: usize = 100_000_000;
    let mut stream = sb.agent.start(&sh(&format!("head -c {SIZE} /dev/zero | tr '\\0' 'x'"))).await?;
    let mut total = 0usize;
    let mut all_x = true;
    while let Some(ev) = stream.next().await {
        match ev? {
            ProcessEvent::Data(DataEvent::Stdout(b)) => {
                total += b.len();
                all_x &= b.iter().all(|c| *c == b'x');
            }
            ProcessEvent::End(end) => {
                check!(end.exit_code == 0, "end {end:?}");
                break;
            }
            _ => {}
        }
    }
    check!(total == SIZE && all_x, "received {total} bytes (all 'x': {all_x})");
    // The agent (PID 1) streamed it all: its peak memory must stay far below 100 MB.
    let out = run(&sb.agent, "grep VmHWM /proc/1/status").await?;
    let kib: u64 = out.stdout_str().split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(u64::MAX);
    check!(kib < 64 * 1024, "agent peak RSS {kib} KiB");
    Ok(())
}

async fn pty(sb: Shared) -> anyhow::Result<()> {
    let req = StartRequest {
        process: ProcessConfig { cmd: "/bin/bash".into(), args: vec!["-i".into()], ..Default::default() },
        pty: Some(Pty { size: PtySize { cols: 100, rows: 30 } }),
        stdin: Some(true),
        ..Default::default()
    };
    let mut stream = sb.agent.start(&req).await?;
    let pid = stream.pid;
    sb.agent.send_pty(pid, Bytes::from_static(b"tty; stty size; echo mark-$((6*7))\n")).await?;
    let mut seen = Vec::new();
    let found = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(ev) = stream.next().await {
            if let ProcessEvent::Data(DataEvent::Pty(b)) = ev? {
                seen.extend_from_slice(&b);
                if String::from_utf8_lossy(&seen).contains("mark-42") {
                    return Ok::<_, anyhow::Error>(());
                }
            }
        }
        anyhow::bail!("stream ended")
    })
    .await;
    let text = String::from_utf8_lossy(&seen).to_string();
    check!(matches!(found, Ok(Ok(()))), "no mark in PTY output: {text:?}");
    check!(text.contains("/dev/pts/"), "not a terminal: {text:?}");
    check!(text.contains("30 100"), "wrong size: {text:?}");
    sb.agent.resize(pid, 120, 40).await?;
    // Ctrl-C reaches the foreground job through the terminal, then exit ends bash.
    sb.agent.send_pty(pid, Bytes::from_static(b"sleep 4242\n")).await?;
    wait_for_sleeper(&sb, true).await?;
    sb.agent.send_pty(pid, Bytes::from_static(b"\x03")).await?;
    // ^C flushes the terminal's input queue, so type the next line after it landed.
    wait_for_sleeper(&sb, false).await?;
    sb.agent.send_pty(pid, Bytes::from_static(b"stty size; exit 3\n")).await?;
    let out = tokio::time::timeout(Duration::from_secs(30), collect(stream)).await??;
    let text = String::from_utf8_lossy(&out.pty);
    check!(text.contains("40 120"), "resize not seen: {text:?}");
    check!(out.end.exit_code == 3, "bash ended with {:?}", out.end);
    Ok(())
}

async fn list_connect_kill(sb: Shared) -> anyhow::Result<()> {
    let req = StartRequest { tag: Some("sleeper".into()), ..sh("echo started; sleep 600") };
    let mut first = sb.agent.start(&req).await?;
    let pid = first.pid;
    match first.next().await {
        Some(Ok(ProcessEvent::Data(DataEvent::Stdout(b)))) if b == "started\n" => {}
        other => anyhow::bail!("expected the first output, got {other:?}"),
    }
    let listed = sb.agent.list_processes().await?;
    check!(listed.iter().any(|p| p.pid == pid && p.tag.as_deref() == Some("sleeper")), "not listed: {listed:?}");
    let second = sb.agent.connect_process(ProcessSelector::Tag("sleeper".into())).await?;
    check!(second.pid == pid, "connect found pid {}", second.pid);
    sb.agent.signal(pid, Signal::Kill).await?;
    let (a, b) = tokio::join!(collect(first), collect(second));
    let (a, b) = (a?, b?);
    for end in [&a.end, &b.end] {
        check!(end.status == "signal: killed" && end.shell_code() == 137, "end {end:?}");
    }
    let listed = sb.agent.list_processes().await?;
    check!(!listed.iter().any(|p| p.pid == pid), "still listed after kill");
    Ok(())
}

async fn process_errors(sb: Shared) -> anyhow::Result<()> {
    let missing = StartRequest {
        process: ProcessConfig { cmd: "no-such-command".into(), ..Default::default() },
        ..Default::default()
    };
    let err = sb.agent.start(&missing).await.err();
    check!(matches!(&err, Some(AgentError::Rpc(e)) if e.code == Code::NotFound && e.message.contains("no-such-command")), "got {err:?}");
    let err = sb.agent.signal(999_999, Signal::Kill).await.err();
    check!(matches!(&err, Some(AgentError::Rpc(e)) if e.code == Code::NotFound), "signal to missing pid gave {err:?}");
    let err = sb.agent.connect_process(ProcessSelector::Pid(999_999)).await.err();
    check!(matches!(&err, Some(AgentError::Rpc(e)) if e.code == Code::NotFound), "connect to missing pid gave {err:?}");
    let err = sb.agent.send_stdin(999_999, Bytes::from_static(b"x")).await.err();
    check!(matches!(&err, Some(AgentError::Rpc(e)) if e.code == Code::NotFound), "stdin to missing pid gave {err:?}");
    // The agent keeps serving after bad requests.
    let out = run(&sb.agent, "echo still here").await?;
    check!(out.stdout_str() == "still here\n", "after errors: {:?}", out.stdout_str());
    Ok(())
}

/// Waits until the PTY test's `sleep 4242` runs (or has ended), as the guest sees it.
async fn wait_for_sleeper(sb: &Shared, running: bool) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let found = run(&sb.agent, "pgrep -x -f 'sleep 4242' >/dev/null && echo yes || echo no").await?.stdout_str() == "yes\n";
        if found == running {
            return Ok(());
        }
        check!(std::time::Instant::now() < deadline, "the PTY's `sleep 4242` {} within 30 s", if running { "did not start" } else { "did not end on ^C" });
    }
}

async fn own_kernel(sb: Shared) -> anyhow::Result<()> {
    crate::clock::check_skew(&sb.agent, "in the shared sandbox").await?;
    crate::clock::check_clocksource(&sb.agent).await?;
    let out = run(&sb.agent, "uname -r; hostname").await?;
    let text = out.stdout_str();
    let mut lines = text.lines();
    let release = lines.next().unwrap_or_default();
    let host_release = nix::sys::utsname::uname().map(|u| u.release().to_string_lossy().into_owned()).unwrap_or_default();
    check!(release.ends_with("-cloud-amd64") && release != host_release, "guest kernel {release:?}, host {host_release:?}");
    check!(lines.next() == Some("hutch"), "hostname {text:?}");
    Ok(())
}
