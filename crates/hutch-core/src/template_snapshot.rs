//! Template snapshots: the first time a template is used, hutch boots it once, lets
//! its services come up (and warms them: a Jupyter kernel for the code interpreter),
//! and saves the VM with its RAM in a shared file. Every later sandbox of the template
//! restores that instead of booting.
//!
//! A snapshot belongs to one exact combination of template build, kernel, initramfs
//! (which holds the agent), VM shape and QEMU version: its directory name carries a
//! hash of all of them, so when any changes, a new snapshot is made and the old one is
//! left for `hutch snapshot prune`-style cleanup (`remove_stale`).

use hutch_envd::AgentClient;
use crate::artifacts::Artifacts;
use crate::sandbox::boot::{wait_for_agent, wait_for_port, SandboxOptions};
use crate::sandbox::errors::{CreateError, TemplateSnapshotError};
use crate::sandbox::layout::console_tail;
use crate::snapshot::{Manifest, MemorySnapshot};
use hutch_image::HutchHome;
use hutch_vmm::{Memory, VmBackend, VmSpec};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long one warm-up request may take.
const WARM_UP_TIMEOUT: Duration = Duration::from_secs(300);

/// Bumped when the snapshot layout or the agent's restore contract changes.
const FORMAT: &str = "hutch-snapshot-3";

/// What the snapshot's guest ran before it was saved: a change means a new snapshot.
fn warm_up_id(artifacts: &Artifacts, memory_mib: u32) -> String {
    let service = artifacts.template.warm_up(memory_mib).map(|w| format!("{} {}", w.path, w.body));
    std::iter::once(crate::shell_warm_up::WHAT.to_string()).chain(service).collect::<Vec<_>>().join("\n")
}

/// How long a hutch waits for another one making the same template snapshot (a boot
/// and warm-up: a few minutes under TCG) before saying so.
const LOCK_WAIT: Duration = Duration::from_secs(15 * 60);

/// Takes the lock file at `path`, waiting for its holder up to `LOCK_WAIT`.
async fn lock_within(path: &Path, limit: Duration) -> Result<nix::fcntl::Flock<std::fs::File>, TemplateSnapshotError> {
    let started = Instant::now();
    loop {
        let file = std::fs::File::create(path).map_err(|e| TemplateSnapshotError::Dir(path.to_path_buf(), e))?;
        match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(lock) => {
                // Its holder removes the file before letting go: a lock on a file that
                // is no longer at `path` guards nothing, so take the one there now.
                use std::os::unix::fs::MetadataExt;
                let (held, there) = (lock.metadata().map(|m| m.ino()).ok(), std::fs::metadata(path).map(|m| m.ino()).ok());
                if held.is_some() && held == there {
                    return Ok(lock);
                }
                continue;
            }
            Err((_, nix::errno::Errno::EWOULDBLOCK)) if started.elapsed() < limit => {}
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => return Err(TemplateSnapshotError::LockTimeout { lock: path.to_path_buf(), mins: limit.as_secs() / 60 }),
            Err((_, e)) => return Err(TemplateSnapshotError::Dir(path.to_path_buf(), e.into())),
        }
        // The poll interval of a wait bounded by LOCK_WAIT.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The host's TSC rate in MHz: the snapshot's kernel was told the rate in kHz when it
/// booted, and keeps its clock by it. MHz, so that a re-measurement after a reboot
/// (a few ppm off) keeps the snapshot while a different host makes a new one.
fn tsc_mhz(home: &HutchHome) -> String {
    let cache = home.root().join("host-tsc");
    ((hutch_vmm::clock::host_tsc_khz(Some(&cache)) + 500) / 1000).to_string()
}

/// The directory of the snapshot for this template, kernel, initramfs and VM shape.
pub fn dir_for(home: &HutchHome, artifacts: &Artifacts, opts: &SandboxOptions, backend: &dyn VmBackend) -> PathBuf {
    let mut h = Sha256::new();
    let t = &artifacts.template;
    let initramfs = artifacts.initramfs.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    for part in [
        FORMAT,
        &t.build_id,
        &t.recipe,
        &artifacts.kernel.version,
        &artifacts.kernel.package_version,
        &initramfs,
        &opts.cpus.to_string(),
        &opts.memory.get().to_string(),
        opts.accel.as_str(),
        // The VMM that saves and restores it, the flags the snapshot's kernel booted
        // with and the devices the saved VM has (a state loads only into the same set).
        &backend.snapshot_key(),
        &tsc_mhz(home),
        &warm_up_id(artifacts, opts.memory.get()),
    ] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    home.template_snapshots().join(format!("{}-{}", shape_prefix(t, opts), hex::encode(&h.finalize()[..8])))
}

/// The part of a snapshot's directory name that says which template (and tag: a
/// tagged build's snapshot does not replace the current build's) and VM shape it is
/// for: snapshots with the same prefix replace each other. Names have no '@'.
fn shape_prefix(template: &hutch_image::template::Template, opts: &SandboxOptions) -> String {
    let tagged = template.tag.as_ref().map(|t| format!("{}@{t}", template.name));
    format!("{}-{}cpu-{}mib-{}", tagged.as_deref().unwrap_or(&template.name), opts.cpus, opts.memory.get(), opts.accel.as_str())
}

/// Where a template VM runs while its snapshot is made: `.t{pid}-{n}` under the
/// template snapshots' root. Short, because the VM's sockets live in it and socket
/// paths are limited; one per snapshot, because two templates' first snapshots may be
/// made at once in one process. Removed when dropped, so a caller that gives up (Ctrl-C
/// in `hutch run`, a cancelled request) leaves no RAM-sized memory file behind.
struct Scratch(PathBuf);

impl Scratch {
    fn new(home: &HutchHome) -> Result<Scratch, TemplateSnapshotError> {
        static MADE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = home.template_snapshots().join(format!(".t{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| TemplateSnapshotError::Dir(dir.clone(), e))?;
        Ok(Scratch(dir))
    }

    /// The pid of the process that made the scratch directory called `name`.
    fn maker(name: &str) -> Option<i32> {
        name.strip_prefix(".t")?.split_once('-')?.0.parse().ok()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Removes the scratch directories of hutch processes that died making a snapshot
/// (`kill -9`, power loss): nothing else would, and each holds a guest's RAM.
fn sweep_scratch(home: &HutchHome) {
    for entry in std::fs::read_dir(home.template_snapshots()).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if Scratch::maker(&name).is_some_and(|pid| !crate::sweep::alive(pid)) {
            tracing::info!(dir = %entry.path().display(), "removing a template snapshot a dead hutch left half-made");
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// The template's snapshot, made now if it does not exist yet. Concurrent callers
/// (several `hutch run`s, a server) wait on a lock file and make it once.
pub async fn ensure(home: &HutchHome, artifacts: &Artifacts, backend: &dyn VmBackend, opts: &SandboxOptions) -> Result<MemorySnapshot, TemplateSnapshotError> {
    let dir = dir_for(home, artifacts, opts, backend);
    if let Some(s) = MemorySnapshot::open(&dir) {
        return Ok(s);
    }
    std::fs::create_dir_all(home.template_snapshots()).map_err(|e| TemplateSnapshotError::Dir(home.template_snapshots(), e))?;
    let lock_path = dir.with_extension("lock");
    let lock = lock_within(&lock_path, LOCK_WAIT).await?;
    if let Some(s) = MemorySnapshot::open(&dir) {
        return Ok(s);
    }
    sweep_scratch(home);
    let tmp = Scratch::new(home)?;
    let made = make(artifacts, backend, opts, &tmp.0).await;
    // A directory here without a manifest is no snapshot (one a pruner removed while a
    // restore kept its empty overlay in it): it would stop the rename for good.
    if dir.is_dir() && !dir.join(crate::snapshot::MANIFEST).is_file() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let result = match made {
        Ok(manifest) => std::fs::rename(&tmp.0, &dir)
            .map_err(|e| TemplateSnapshotError::Dir(dir.clone(), e))
            .map(|()| MemorySnapshot { dir: dir.clone(), manifest }),
        Err(e) => Err(e),
    };
    drop(tmp);
    // Removed while held; a waiter that then gets the old file's lock sees it is gone.
    let _ = std::fs::remove_file(&lock_path);
    drop(lock);
    if result.is_ok() {
        tracing::info!(template = %artifacts.template.name, "saved the template's memory snapshot in {}", dir.display());
        crate::pruning::prune_replaced(home, &dir, &shape_prefix(&artifacts.template, opts));
        crate::pruning::prune_template_builds(home);
    }
    result
}

async fn make(artifacts: &Artifacts, backend: &dyn VmBackend, opts: &SandboxOptions, dir: &Path) -> Result<Manifest, TemplateSnapshotError> {
    let started = Instant::now();
    let disk = dir.join("disk.qcow2");
    // The image's real path: a home whose `templates` is a link to a shared one (the
    // tests' homes) would otherwise write its own, short-lived path into a snapshot
    // every home shares, and every later sandbox of it would lose its backing file.
    let image = std::fs::canonicalize(artifacts.template.image()).unwrap_or_else(|_| artifacts.template.image());
    hutch_vmm::disk::create_overlay(&image, &disk)
        .await
        .map_err(|e| TemplateSnapshotError::Boot(CreateError::Disk(e)))?;
    let spec = VmSpec {
        id: "template-snapshot".into(),
        dir: dir.to_path_buf(),
        kernel: artifacts.kernel.vmlinuz(),
        initrd: artifacts.initramfs.clone(),
        disk: disk.clone(),
        base: Some(image.clone()),
        cpus: opts.cpus,
        memory_mib: opts.memory.get(),
        accel: opts.accel,
        memory: Memory::SharedFile(dir.join("memory")),
        incoming: None,
        die_with_parent: true,
        agent_channel: hutch_proto::AGENT_PORT_NAME.into(),
        nic: Some(crate::sandbox::layout::guest_nic()),
    };
    let mut vm = backend.start(&spec).await.map_err(|e| TemplateSnapshotError::Boot(CreateError::Start(e)))?;
    let agent = wait_for_agent(vm.as_mut(), opts.boot_timeout, started).await.map_err(TemplateSnapshotError::Boot)?;
    // Best effort, as in the pool: an image without bash makes a snapshot all the same.
    // Before the service's warm-up, which ends as close to the save as it can: the
    // other order cost a restored code interpreter 120 ms more to restore and 600 ms
    // more for its first cell, repeatably (docs/BENCHMARKS.md).
    let user = artifacts.template.source.as_ref().and_then(|s| s.defaults.user.as_deref());
    use crate::shell_warm_up::{warm_shells, WarmShellsError};
    match warm_shells(&agent, user).await {
        Ok(()) => {}
        Err(e @ WarmShellsError::Agent(_)) => tracing::debug!(template = %artifacts.template.name, "warming the template's shells up: {e}"),
        Err(e @ WarmShellsError::Timeout) => tracing::warn!(template = %artifacts.template.name, "{e}; saving its snapshot without waiting for them"),
    }
    if let Some(port) = artifacts.template.ready_port() {
        wait_for_port(&agent, port, opts.boot_timeout, started, dir).await.map_err(TemplateSnapshotError::Boot)?;
        for w in artifacts.template.warm_up(opts.memory.get()) {
            warm_up(&agent, port, w.path, w.body)
                .await
                .map_err(|detail| TemplateSnapshotError::WarmUp { port, detail: format!("{detail}; console:\n{}", console_tail(&spec.console_log(), 20)) })?;
        }
    }
    if let Some(defaults) = artifacts.template.source.as_ref().map(|s| &s.defaults) {
        start_command(&agent, defaults)
            .await
            .map_err(|detail| TemplateSnapshotError::StartCmd(format!("{detail}; console:\n{}", console_tail(&spec.console_log(), 20))))?;
    }
    crate::snapshot::release_agent(&agent, &vm.agent_socket(), Duration::from_secs(10)).await?;
    drop(agent);
    crate::snapshot::save_vm(vm.as_mut(), &disk, None, dir, true).await?;
    vm.stop(Duration::from_secs(5)).await.map_err(TemplateSnapshotError::Stop)?;
    // QEMU's files are not part of the snapshot; the boot's console is (restored
    // sandboxes start their console with it).
    for f in ["qemu.log", "qemu.pid", "agent.sock", "qmp.sock", "net.sock"] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    let manifest = Manifest {
        template: artifacts.template.name.clone(),
        cpus: opts.cpus,
        memory_mib: opts.memory.get(),
        accel: opts.accel,
        shared_memory: true,
        created_at: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        source_sandbox: None,
        base: None,
        nic: true,
        // The template's guest never had an `/init`.
        guest_token: None,
    };
    MemorySnapshot::write_manifest(dir, &manifest)?;
    Ok(manifest)
}

/// How long a template's ready command may take to first succeed.
const READY_WAIT: Duration = Duration::from_secs(300);

/// Starts the template's start command (left running: the snapshot keeps it) and
/// waits until its ready command exits 0, both as the template's user, in its workdir,
/// with its env.
pub(crate) async fn start_command(agent: &AgentClient, defaults: &hutch_proto::agent::ImageDefaults) -> Result<(), String> {
    let Some(start) = defaults.start_cmd.as_deref() else { return Ok(()) };
    let user = defaults.user.clone().unwrap_or_else(|| "user".into());
    let agent = agent.as_user(Some(&user));
    let request = |cmd: &str, tag: Option<&str>| hutch_proto::process::StartRequest {
        process: hutch_proto::process::ProcessConfig { cmd: "/bin/sh".into(), args: vec!["-c".into(), cmd.into()], envs: defaults.env.clone(), cwd: defaults.workdir.clone() },
        pty: None,
        tag: tag.map(str::to_string),
        stdin: Some(false),
    };
    // Its events are not awaited: it runs on in the guest once the stream is dropped.
    agent.start(&request(start, Some("start_cmd"))).await.map_err(|e| format!("`{start}` could not start: {e}"))?;
    let Some(ready) = defaults.ready_cmd.as_deref() else { return Ok(()) };
    let started = Instant::now();
    loop {
        // Each attempt within what is left of READY_WAIT: a ready command that hangs
        // must not hold the sandbox's start forever.
        let attempt = async {
            let mut stream = agent.start(&request(ready, None)).await.map_err(|e| format!("the ready command `{ready}` could not start: {e}"))?;
            let mut code = None;
            while let Some(event) = stream.next().await {
                if let Ok(hutch_proto::process::ProcessEvent::End(end)) = event {
                    code = Some(if end.exited { end.exit_code } else { -1 });
                }
            }
            Ok::<_, String>(code)
        };
        let left = READY_WAIT.saturating_sub(started.elapsed()).max(Duration::from_secs(1));
        let code = match tokio::time::timeout(left, attempt).await {
            Ok(code) => code?,
            Err(_) => return Err(format!("the ready command `{ready}` did not finish within {} s", READY_WAIT.as_secs())),
        };
        if code == Some(0) {
            return Ok(());
        }
        if started.elapsed() > READY_WAIT {
            return Err(format!("the ready command `{ready}` did not succeed within {} s (last exit {code:?})", READY_WAIT.as_secs()));
        }
        // The poll interval of a wait bounded by READY_WAIT.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// One HTTP/1.1 request to the template's service through the agent, read to the end.
pub(crate) async fn warm_up(agent: &AgentClient, port: u16, path: &str, body: &str) -> Result<(), String> {
    let mut tunnel = agent.tunnel(port).await.map_err(|e| e.to_string())?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    tunnel.write_all(request.as_bytes()).await.map_err(|e| e.to_string())?;
    let mut reply = Vec::new();
    // As long as a boot may take: Java's kernel alone starts in 24 s on an idle host
    // under TCG, and `hutch setup` may share the host with a build.
    // At most 64 KiB of the reply is read: it is checked for a status and an error.
    tokio::time::timeout(WARM_UP_TIMEOUT, (&mut tunnel).take(64 << 10).read_to_end(&mut reply))
        .await
        .map_err(|_| format!("no reply within {} s", WARM_UP_TIMEOUT.as_secs()))?
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&reply);
    if !text.starts_with("HTTP/1.1 200") && !text.starts_with("HTTP/1.0 200") {
        return Err(format!("unexpected reply: {}", text.lines().next().unwrap_or("(empty)")));
    }
    if text.contains("\"error\"") {
        return Err(format!("the warm-up code failed: {}", text.chars().take(500).collect::<String>()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pruning::{prune_replaced, remove_tag_snapshots};

    #[test]
    fn removing_a_tags_snapshots_leaves_a_longer_tags_alone() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let home = HutchHome::at(tmp.path());
        let make = |name: &str| {
            let dir = home.template_snapshots().join(name);
            std::fs::create_dir_all(&dir).expect("dir");
            std::fs::write(dir.join(crate::snapshot::MANIFEST), b"{}").expect("manifest");
            dir
        };
        let v1 = make("app@v1-1cpu-512mib-kvm-0123456789abcdef");
        let v1_rc = make("app@v1-rc-1cpu-512mib-kvm-0123456789abcdef");
        let current = make("app-1cpu-512mib-kvm-0123456789abcdef");
        remove_tag_snapshots(&home, "app", "v1");
        assert!(!v1.exists() && v1_rc.exists() && current.exists());
    }

    #[tokio::test]
    async fn a_held_snapshot_lock_is_waited_for_within_a_deadline_and_its_removal_frees_the_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.lock");
        let held = lock_within(&path, Duration::from_secs(1)).await.expect("first lock");
        let waited = lock_within(&path, Duration::from_millis(200)).await;
        assert!(matches!(waited, Err(TemplateSnapshotError::LockTimeout { .. })), "{waited:?}");
        // A waiter already holding the old file when its holder removes it and lets go.
        let stale = std::fs::File::open(&path).expect("open");
        std::fs::remove_file(&path).expect("remove");
        drop(held);
        let stale = nix::fcntl::Flock::lock(stale, nix::fcntl::FlockArg::LockExclusiveNonblock).expect("the removed file locks");
        let fresh = lock_within(&path, Duration::from_secs(1)).await.expect("a new file at the path");
        assert!(path.is_file());
        drop((stale, fresh));
    }

    /// The scratch directories under the template snapshots' root.
    fn scratch_dirs(home: &HutchHome) -> Vec<String> {
        let names = std::fs::read_dir(home.template_snapshots()).into_iter().flatten().flatten();
        names.map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| Scratch::maker(n).is_some()).collect()
    }

    fn fake() -> (tempfile::TempDir, HutchHome, Artifacts, hutch_vmm::fake::FakeBackend) {
        let tmp = tempfile::tempdir().expect("tempdir");
        let home = HutchHome::at(tmp.path().join("home"));
        let artifacts = crate::fake_guest::artifacts(tmp.path());
        let guest = std::sync::Arc::new(crate::fake_guest::FakeAgent::default());
        (tmp, home, artifacts, hutch_vmm::fake::FakeBackend::with_guest(guest))
    }

    /// Ctrl-C in `hutch run`'s first use of a template drops `ensure` wherever it
    /// waits: the template VM and its RAM-sized scratch directory go with it.
    #[tokio::test]
    async fn a_snapshot_given_up_midway_leaves_no_scratch_dir_and_no_vm() {
        let (_tmp, home, artifacts, backend) = fake();
        let opts = SandboxOptions::default();
        for step in [hutch_vmm::fake::Step::Start, hutch_vmm::fake::Step::Save, hutch_vmm::fake::Step::Stop] {
            let hold = backend.hold(step);
            {
                let making = ensure(&home, &artifacts, &backend, &opts);
                tokio::pin!(making);
                tokio::select! {
                    () = hold.reached() => {}
                    done = &mut making => panic!("the snapshot was made ({:?}) without waiting at {step:?}", done.map(|s| s.dir)),
                }
                assert_eq!(scratch_dirs(&home).len(), 1, "at {step:?}");
            } // the caller gives up here
            hold.release();
            assert_eq!(scratch_dirs(&home), Vec::<String>::new(), "a scratch directory outlived its snapshot's caller at {step:?}");
            assert_eq!(backend.live(), 0, "the template VM outlived its snapshot's caller at {step:?}");
        }
        let made = ensure(&home, &artifacts, &backend, &opts).await.expect("the snapshot is made on the next try");
        assert!(made.dir.join(crate::snapshot::MANIFEST).is_file());
    }

    /// `hutch serve --pool base=1 --pool code-interpreter=1` on a fresh home makes two
    /// templates' first snapshots at once in one process: each keeps its own VM's
    /// scratch directory (one per process once let the second wipe the first's).
    #[tokio::test]
    async fn two_templates_first_snapshots_made_at_once_each_keep_their_scratch_dir() {
        let (_tmp, home, base, backend) = fake();
        let mut other = base.clone();
        other.template.name = "other".into();
        let opts = SandboxOptions::default();
        let hold = backend.hold(hutch_vmm::fake::Step::Save);
        let first = ensure(&home, &base, &backend, &opts);
        tokio::pin!(first);
        tokio::select! {
            () = hold.reached() => {}
            done = &mut first => panic!("the first snapshot was made ({:?}) without waiting at its save", done.map(|s| s.dir)),
        }
        let second = ensure(&home, &other, &backend, &opts).await.expect("the second template's snapshot, made while the first saves");
        hold.release();
        let first = first.await.expect("the first template's snapshot");
        assert_ne!(first.dir, second.dir);
        for made in [&first, &second] {
            assert!(MemorySnapshot::open(&made.dir).is_some(), "{} is not a whole snapshot", made.dir.display());
        }
        assert_eq!(scratch_dirs(&home), Vec::<String>::new());
        assert_eq!(backend.live(), 0);
    }

    /// A hutch killed while making a snapshot leaves its scratch directory: the next
    /// snapshot made removes it, and leaves a live process's alone.
    #[tokio::test]
    async fn a_dead_processes_scratch_dir_is_removed_and_a_live_ones_kept() {
        let (_tmp, home, artifacts, backend) = fake();
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        child.wait().expect("wait");
        let dead = home.template_snapshots().join(format!(".t{}-7", child.id()));
        let live = home.template_snapshots().join(format!(".t{}-99", std::process::id()));
        for dir in [&dead, &live] {
            std::fs::create_dir_all(dir).expect("dir");
            std::fs::write(dir.join("memory"), b"ram").expect("memory");
        }
        ensure(&home, &artifacts, &backend, &SandboxOptions::default()).await.expect("snapshot");
        assert!(!dead.exists(), "a dead hutch's scratch directory was kept");
        assert!(live.exists(), "a live hutch's scratch directory was removed");
    }

    fn qcow2(path: &Path, backing: Option<&Path>) {
        let mut cmd = std::process::Command::new("qemu-img");
        cmd.args(["create", "-q", "-f", "qcow2"]);
        if let Some(b) = backing {
            cmd.args(["-F", "qcow2", "-b"]).arg(b);
        }
        cmd.arg(path).arg("1M");
        assert!(cmd.status().expect("qemu-img").success());
    }

    fn template_snapshot(home: &HutchHome, name: &str) -> PathBuf {
        let dir = home.template_snapshots().join(name);
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(dir.join(crate::snapshot::MANIFEST), "{}").expect("manifest");
        qcow2(&dir.join("disk.qcow2"), None);
        dir
    }

    #[test]
    fn a_replaced_template_snapshot_stays_while_a_stored_snapshot_stacks_on_it() {
        let tmp = tempfile::tempdir().expect("tmp");
        let home = HutchHome::at(tmp.path());
        let old = template_snapshot(&home, "base-1cpu-512mib-tcg-0ld");
        let new = template_snapshot(&home, "base-1cpu-512mib-tcg-new");
        // A stored snapshot of a sandbox that started from the old one, two layers up
        // (a fork of a fork): nothing names the template snapshot but the disk chain.
        let stored = tmp.path().join("snapshots/sandboxes");
        std::fs::create_dir_all(stored.join("fork")).expect("dir");
        std::fs::create_dir_all(stored.join("snap")).expect("dir");
        qcow2(&stored.join("fork/disk.qcow2"), Some(&old.join("disk.qcow2")));
        qcow2(&stored.join("snap/disk.qcow2"), Some(&stored.join("fork/disk.qcow2")));
        // With `fork` gone, `snap`'s chain cannot be read: everything is kept.
        std::fs::remove_dir_all(stored.join("fork")).expect("rm");
        prune_replaced(&home, &new, "base-1cpu-512mib-tcg");
        assert!(old.exists(), "an unreadable chain must keep every template snapshot");
        std::fs::create_dir_all(stored.join("fork")).expect("dir");
        qcow2(&stored.join("fork/disk.qcow2"), Some(&old.join("disk.qcow2")));
        prune_replaced(&home, &new, "base-1cpu-512mib-tcg");
        assert!(old.exists(), "pruning deleted the base of a stored snapshot");
        std::fs::remove_dir_all(&stored).expect("rm");
        prune_replaced(&home, &new, "base-1cpu-512mib-tcg");
        assert!(!old.exists(), "an unused replaced snapshot was kept");
        assert!(new.exists());
    }
}
