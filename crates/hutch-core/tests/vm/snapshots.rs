//! Memory snapshots with real VMs: template restores, pause/resume, sandbox snapshots
//! (fork), and no leaks over many restore cycles.

use crate::check;
use crate::support::{qemu_processes_of, qemus_since, run, Env};
use hutch_core::sandbox::StartKind;
use hutch_core::Sandbox;
use libtest_mimic::Trial;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub fn trials(env: &Arc<Env>) -> Vec<Trial> {
    vec![
        env.trial("snapshots::restored_sandboxes_get_their_own_identity_clock_and_entropy", fresh_identity),
        env.trial("snapshots::cold_boots_when_asked", cold_when_asked),
        env.trial("snapshots::pause_and_resume_keep_processes_files_and_memory", pause_resume),
        env.trial("snapshots::a_sandbox_snapshot_restores_into_independent_copies_sharing_its_memory", fork_independent),
        env.trial("snapshots::fifty_restore_cycles_leave_nothing_behind", fifty_cycles),
        env.trial("snapshots::a_host_that_leaves_and_comes_back_gets_a_fresh_session", quick_reconnect),
    ]
}

async fn fresh_identity(env: Arc<Env>) -> anyhow::Result<()> {
    let a = Sandbox::create(&env.home, &env.artifacts, &env.backend, &Env::options()).await?;
    let b = Sandbox::create(&env.home, &env.artifacts, &env.backend, &Env::options()).await?;
    for sb in [&a, &b] {
        check!(sb.started_from() == StartKind::Snapshot, "{} was not restored from the template snapshot", sb.id());
        let file = run(sb.agent(), "cat /run/hutch/sandbox.json").await?.stdout_str();
        let identity: serde_json::Value = serde_json::from_str(&file)?;
        let id = sb.id().as_str();
        check!(identity["sandboxId"] == id && identity["envVars"]["E2B_SANDBOX_ID"] == id, "{id} sees itself as {file:?}");
        let env = run(sb.agent(), "echo $E2B_SANDBOX_ID").await?.stdout_str();
        check!(env.trim() == id, "{id}'s processes see E2B_SANDBOX_ID={env:?}");
        crate::clock::check_skew(sb.agent(), "after the restore").await?;
    }
    let random = |sb: &Sandbox| {
        let agent = sb.agent().clone();
        async move { run(&agent, "head -c 16 /dev/urandom | od -An -tx1").await.map(|o| o.stdout_str()) }
    };
    let (ra, rb) = (random(&a).await?, random(&b).await?);
    check!(ra != rb, "two clones of one snapshot read the same random bytes: {ra}");
    a.destroy().await?;
    b.destroy().await?;
    Ok(())
}

async fn cold_when_asked(env: Arc<Env>) -> anyhow::Result<()> {
    let sb = Sandbox::create(&env.home, &env.artifacts, &env.backend, &Env::cold()).await?;
    check!(sb.started_from() == StartKind::Cold, "asked for a cold boot, got {:?}", sb.started_from());
    crate::clock::check_clocksource(sb.agent()).await?;
    let out = run(sb.agent(), "echo cold").await?;
    check!(out.stdout_str() == "cold\n", "got {:?}", out.stdout_str());
    sb.destroy().await?;
    Ok(())
}

/// What the pause test's guest holds: the python's random line and the sleeper count
/// (`-x`: the whole command line, so the shell running pgrep does not count itself).
const HELD_STATE: &str = "cat /tmp/x 2>/dev/null; echo; pgrep -c -x -f 'sleep 100000'";

async fn pause_resume(env: Arc<Env>) -> anyhow::Result<()> {
    let mut sb = Sandbox::create(&env.home, &env.artifacts, &env.backend, &Env::options()).await?;
    let dir = sb.dir().to_path_buf();
    // A process holding state in memory only, a file, and a background sleeper.
    run(sb.agent(), "echo kept > /home/user/file; (sleep 100000 &) ; python3 -c 'import os,time; x=os.urandom(8).hex(); open(\"/tmp/x.new\",\"w\").write(x); os.rename(\"/tmp/x.new\", \"/tmp/x\"); time.sleep(100000)' > /dev/null 2>&1 &").await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let before = loop {
        let state = run(sb.agent(), HELD_STATE).await?.stdout_str();
        if state.lines().next().is_some_and(|x| x.len() == 16) && state.ends_with("\n1\n") {
            break state;
        }
        check!(Instant::now() < deadline, "the background python did not write /tmp/x (and the sleeper start) within 30 s: {state:?}");
    };
    let qemu = sb.pid().unwrap_or(0);
    sb.pause(hutch_core::sandbox::layout::PauseMode::Full).await?;
    check!(sb.pid().is_none(), "the VM still runs after pause");
    let id = sb.id().to_string();
    drop(sb);
    check!(dir.join(hutch_core::sandbox::layout::PAUSED_STATE).is_file(), "no saved state in {dir:?}");
    check!(!std::path::Path::new(&format!("/proc/{qemu}")).exists(), "QEMU {qemu} outlived the pause");
    // Time passing while paused is the behaviour under test (the clock must catch up).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let sb = Sandbox::resume(&dir, &env.backend, &Env::options()).await?;
    check!(sb.id().as_str() == id && sb.started_from() == StartKind::Resumed, "resumed as {} ({:?})", sb.id(), sb.started_from());
    let after = run(sb.agent(), HELD_STATE).await?.stdout_str();
    check!(after == before, "state before pause {before:?}, after resume {after:?}");
    let file = run(sb.agent(), "cat /home/user/file").await?.stdout_str();
    check!(file == "kept\n", "file after resume: {file:?}");
    crate::clock::check_skew(sb.agent(), "after a resume (it slept 1.5 s paused)").await?;
    check!(!dir.join(hutch_core::sandbox::layout::PAUSED_STATE).exists(), "the saved state outlived the resume");
    sb.destroy().await?;
    check!(!dir.exists(), "{dir:?} left behind");
    Ok(())
}

async fn fork_independent(env: Arc<Env>) -> anyhow::Result<()> {
    let mut source = Sandbox::create(&env.home, &env.artifacts, &env.backend, &Env::options()).await?;
    run(source.agent(), "echo source > /home/user/who").await?;
    // Where the server keeps sandbox snapshots: a jail binds backing images only from
    // hutch's templates and snapshots.
    let snap_dir = env.home.root().join("snapshots").join("sandboxes").join(format!("fork-test-{}", std::process::id()));
    std::fs::create_dir_all(&snap_dir)?;
    let full = source.snapshot(&snap_dir, "base").await?;
    // As the manager does for forks: RAM moves into a shared file the copies map.
    let snap = hutch_core::snapshot::share_memory(&full, &env.backend, env.artifacts.kernel.vmlinuz(), env.artifacts.initramfs.clone()).await?;
    let state = std::fs::metadata(snap_dir.join("state"))?.len();
    check!(snap.manifest.shared_memory && state < (1 << 20), "state is {state} bytes after share_memory");
    // The source runs on after the snapshot, with a working agent.
    run(source.agent(), "echo changed > /home/user/who").await?;
    let a = Sandbox::from_snapshot(&env.home, &env.artifacts, &env.backend, &snap, &Env::options()).await?;
    let b = Sandbox::from_snapshot(&env.home, &env.artifacts, &env.backend, &snap, &Env::options()).await?;
    run(a.agent(), "echo a >> /home/user/who").await?;
    run(b.agent(), "echo b >> /home/user/who").await?;
    let read = |sb: &Sandbox| {
        let agent = sb.agent().clone();
        async move { run(&agent, "cat /home/user/who").await.map(|o| o.stdout_str()) }
    };
    let (s, ra, rb) = (read(&source).await?, read(&a).await?, read(&b).await?);
    check!(s == "changed\n" && ra == "source\na\n" && rb == "source\nb\n", "source {s:?}, forks {ra:?} and {rb:?}");
    check!(a.id() != b.id() && a.id() != source.id(), "forks share an id");
    for sb in [source, a, b] {
        sb.destroy().await?;
    }
    std::fs::remove_dir_all(&snap_dir)?;
    Ok(())
}

async fn fifty_cycles(env: Arc<Env>) -> anyhow::Result<()> {
    let qemus_before = qemu_processes_of(&env.home);
    let before: Vec<_> = std::fs::read_dir(env.home.sandboxes())?.flatten().map(|e| e.path()).collect();
    for i in 0..50 {
        let sb = Sandbox::create(&env.home, &env.artifacts, &env.backend, &Env::options()).await?;
        if i % 10 == 0 {
            let out = run(sb.agent(), "echo $E2B_SANDBOX_ID").await?;
            check!(out.stdout_str().trim() == sb.id().as_str(), "cycle {i}: {:?}", out.stdout_str());
        }
        sb.destroy().await?;
    }
    let after: Vec<_> = std::fs::read_dir(env.home.sandboxes())?.flatten().map(|e| e.path()).filter(|p| !before.contains(p)).collect();
    check!(after.is_empty(), "left behind: {after:?}");
    check!(qemus_since(&env.home, &qemus_before).is_empty(), "QEMU left running");
    Ok(())
}

/// A host that leaves and comes back (as hutch does around every save) gets a fresh,
/// working session each time, on a restored guest.
async fn quick_reconnect(env: Arc<Env>) -> anyhow::Result<()> {
    let sb = Sandbox::create(&env.home, &env.artifacts, &env.backend, &Env::options()).await?;
    let socket = sb.dir().join("agent.sock");
    let mut agent = sb.agent().clone();
    check!(sb.agent_socket().as_deref() == Some(socket.as_path()), "the agent socket is not in the sandbox's directory");
    for i in 0..10 {
        hutch_core::snapshot::release_agent(&agent, &socket, Duration::from_secs(10)).await?;
        agent = tokio::time::timeout(Duration::from_secs(10), hutch_envd::connect(&socket)).await??;
        let out = tokio::time::timeout(Duration::from_secs(10), run(&agent, &format!("echo {i}"))).await;
        check!(matches!(&out, Ok(Ok(o)) if o.stdout_str() == format!("{i}\n")), "reconnect {i}: {out:?}");
    }
    agent.close();
    sb.destroy().await?;
    Ok(())
}
