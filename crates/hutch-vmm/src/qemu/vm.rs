//! One QEMU process: spawn (or adopt from an earlier hutch), wait for QMP, stop, kill.
//! Dropping a `QemuVm` kills the process unless it was released, and with
//! `die_with_parent` the kernel kills it if hutch itself dies (PR_SET_PDEATHSIG), so
//! neither a panic nor a SIGKILL of `hutch run` leaks QEMU. `hutch serve` starts VMs
//! without it: they outlive the server, and the next one adopts them.

use crate::backend::{AdoptError, CpuShare, CpuShareError, Memory, PauseSave, SnapshotError, StartError, StopError, VmHandle, VmSpec};
use crate::guest_ram::GuestRam;
use crate::saved_state::{Form, StateFile};
use crate::pidfd::PidFd;
use crate::qmp::Qmp;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// QEMU greets on QMP within a second when the host is well; a host tearing down big
/// address spaces (seen: 10 s stalls as five ASan fuzzers exited) needs longer.
const QMP_WAIT: Duration = Duration::from_secs(30);
/// A whole-RAM migration of a 1 GiB guest into a file takes a few seconds; this only
/// guards against a wedged QEMU.
const MIGRATION_WAIT: Duration = Duration::from_secs(300);
const MAX_SOCKET_PATH: usize = 107;

/// A listening socket at `path` for QEMU to serve on (it is handed the fd).
fn listen_at(path: &Path) -> std::io::Result<std::os::fd::OwnedFd> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let listener = std::os::unix::net::UnixListener::bind(path)?;
    super::jail::lift(listener.into())
}

/// QEMU's names for the migration fds hutch hands it.
const MIGRATION_OUT: &str = "migout";
const MIGRATION_IN: &str = "migin";
/// A save's bandwidth cap (bytes/s) and allowed downtime (ms): as high as QEMU takes.
/// Its defaults (128 MiB/s, 300 ms) are for a live migration over a network, sharing
/// the link with a running guest; every save here stops the guest first and writes to
/// a local file, where a cap only makes the pause longer (a 177 MiB state took 1.4 s).
/// They stay set in that QEMU: a live migration, if hutch ever makes one, sets its own.
const SAVE_BANDWIDTH: u64 = 1 << 40;
/// How long copying a guest's pages out or back may take (GB/s: a 64 GiB guest's
/// every page in about a minute); a QEMU that stalls its own memory is killed then.
const PAGE_COPY_WAIT: Duration = Duration::from_secs(120);
/// The most device state a pause takes from QEMU (it writes ~100 KB).
const MAX_DEVICE_STATE: u64 = 16 << 20;
const SAVE_DOWNTIME_MS: u64 = 2_000_000;

/// Connects to a socket QEMU listens on, retrying until `limit`: an adopted QEMU
/// takes a new client once it has seen the last one (the dead hutch's) go.
async fn connect_within(path: &Path, limit: Duration) -> Option<tokio::net::UnixStream> {
    let started = Instant::now();
    while started.elapsed() < limit {
        if let Ok(stream) = tokio::net::UnixStream::connect(path).await {
            return Some(stream);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

const ADOPT_WAIT: Duration = Duration::from_secs(10);

/// How long a QEMU whose QMP socket closed may take to be seen exiting.
const EXIT_WAIT: Duration = Duration::from_secs(2);

/// How long the console copy may take to write out what an exited QEMU left in its socket.
const CONSOLE_DRAIN: Duration = Duration::from_secs(1);

pub struct QemuVm {
    spec: VmSpec,
    /// hutch's own child (it reaps it) or, adopted from an earlier hutch, init's.
    process: PidFd,
    /// Released for a later hutch: dropping it leaves QEMU running.
    released: bool,
    qmp: Option<Qmp>,
    exit: Option<String>,
    /// The VM's cgroup when it is confined; removed once QEMU has exited.
    group: Option<super::cgroup::Group>,
    /// The id QEMU runs as, when hutch is not root: held until QEMU has exited.
    lease: Option<super::userns::Lease>,
    /// Copies the console to `console.log`; stops when this handle drops.
    console: crate::console::Reader,
}

fn stderr_of(spec: &VmSpec) -> String {
    std::fs::read_to_string(spec.dir.join("qemu.log")).unwrap_or_default().trim().to_string()
}

impl QemuVm {
    pub async fn start(binary: &str, spec: &VmSpec, jail: Option<&super::jail::JailConfig>) -> Result<QemuVm, StartError> {
        use super::args::{AGENT_FD, CONSOLE_FD, NET_FD, QMP_FD};
        use std::os::fd::AsFd;
        let spec = &super::boot_stand_ins::for_loading(spec).map_err(|source| StartError::StandIns { kernel: spec.kernel.display().to_string(), source })?;
        for sock in [spec.agent_socket(), spec.qmp_socket(), spec.console_socket(), spec.net_socket()] {
            if sock.as_os_str().len() > MAX_SOCKET_PATH {
                return Err(StartError::PathTooLong(sock.display().to_string()));
            }
        }
        let log = std::fs::File::create(spec.dir.join("qemu.log")).map_err(StartError::Spawn)?;
        // std makes every end close-on-exec: only the dups onto 3-5 reach QEMU, so no
        // other child of hutch inherits another VM's sockets. The console listens too
        // (rather than being one end of a pair): a hutch adopting the VM reconnects.
        let console_qemu = listen_at(&spec.console_socket()).map_err(StartError::Spawn)?;
        let qmp_listener = listen_at(&spec.qmp_socket()).map_err(StartError::Spawn)?;
        let agent_listener = listen_at(&spec.agent_socket()).map_err(StartError::Spawn)?;
        let net_listener = match &spec.nic {
            Some(nic) if nic.listens() => Some(listen_at(&spec.net_socket()).map_err(StartError::Spawn)?),
            _ => None,
        };
        let mut handed = vec![(console_qemu.as_fd(), CONSOLE_FD), (qmp_listener.as_fd(), QMP_FD), (agent_listener.as_fd(), AGENT_FD)];
        if let Some(net) = &net_listener {
            handed.push((net.as_fd(), NET_FD));
        }
        let mut prepared = match jail {
            Some(config) => Some(super::jail::Prepared::new(spec, config, binary).map_err(super::jail::JailError::into_start_error)?),
            None => None,
        };
        let missing = || StartError::Unavailable(super::version::QemuVersionError::Missing { binary: binary.into() }.into());
        let program = crate::process::find_program(binary).ok_or_else(missing)?;
        let loading = match &spec.incoming {
            Some(incoming) => {
                let state = read_state(&incoming.state, spec.ram_bytes()).map_err(|source| StartError::State { path: incoming.state.display().to_string(), source })?;
                super::args::Loading { no_configuration: !state.configuration }
            }
            None => super::args::Loading::default(),
        };
        let mut launch = super::spawn::Launch::new(&program, super::args::command_line(spec, loading)).arg0(binary).stdout(log.as_fd()).stderr(log.as_fd()).die_with_parent(spec.die_with_parent);
        for (fd, to) in handed {
            launch = launch.hand(fd, to);
        }
        let child = launch.spawn(prepared.as_mut()).map_err(|e| match e {
            super::spawn::SpawnError::NotFound { .. } => missing(),
            super::spawn::SpawnError::Child(e) if e.kind() == std::io::ErrorKind::NotFound && !program.is_file() => missing(),
            super::spawn::SpawnError::Map(e) => StartError::Jail(super::jail::JailError::from(e).into()),
            super::spawn::SpawnError::Child(e) if jail.is_some() => StartError::Confine(e),
            super::spawn::SpawnError::Child(e) | super::spawn::SpawnError::Prepare(e) | super::spawn::SpawnError::Clone(e) => StartError::Spawn(e),
            super::spawn::SpawnError::Invalid(why) => StartError::Spawn(std::io::Error::other(why)),
        })?;
        let process = match child.fd.try_clone().and_then(|fd| PidFd::of(child.pid, fd)) {
            Ok(process) => process,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait_within(Duration::from_secs(10));
                return Err(StartError::Spawn(e));
            }
        };
        drop(child);
        // QEMU holds its own copies; once it exits, nobody listens on its sockets.
        drop((console_qemu, qmp_listener, agent_listener, net_listener));
        let (group, lease) = prepared.map(|p| (p.group, p.lease)).unwrap_or_default();
        let mut vm = QemuVm { spec: spec.clone(), process, released: false, qmp: None, exit: None, group, lease, console: Default::default() };
        // Queued in the listener's backlog at once, so QEMU takes it as it starts,
        // before the guest writes anything.
        let console = tokio::net::UnixStream::connect(spec.console_socket()).await.map_err(StartError::Spawn)?;
        vm.console = crate::console::spawn_reader(console, spec.console_log());
        std::fs::write(spec.dir.join("qemu.pid"), vm.process.pid().to_string())
            .map_err(StartError::Spawn)?;
        vm.qmp = Some(vm.connect_qmp(QMP_WAIT).await?);
        if spec.nic.as_ref().is_some_and(crate::backend::Nic::listens) {
            if let Err(e) = vm.wait_net_listening().await {
                return Err(vm.exited_or(e).await);
            }
            if spec.incoming.is_none() {
                if let Err(e) = vm.run("cont", None).await {
                    return Err(vm.exited_or(StartError::Cont(e)).await);
                }
            }
        }
        Ok(vm)
    }

    /// `error`, unless QEMU has exited (or does within a moment): then that, with its stderr.
    async fn exited_or(&mut self, error: StartError) -> StartError {
        match self.exited_within(EXIT_WAIT).await {
            Some((status, stderr)) => StartError::Exited { status, stderr },
            None => error,
        }
    }

    /// QEMU's exit status and stderr, once it has exited, if it does within `limit`.
    async fn exited_within(&mut self, limit: Duration) -> Option<(String, String)> {
        if !self.wait_exit(limit).await {
            return None;
        }
        Some((self.exit_status().unwrap_or_default(), stderr_of(&self.spec)))
    }

    /// Waits until the stream netdev listens. QEMU starts listening on a worker
    /// thread and only then marks the netdev's link down until a client connects;
    /// a guest that runs before that sends its frames to a netdev with no
    /// connection, and QEMU 10.0 dereferences the missing channel and dies with
    /// SIGSEGV (seen on `cont` after a restore, where queued frames are flushed, in
    /// about 1 in 30 restores on a loaded 2-core host). So guests start paused (-S)
    /// and run once `info network` no longer says "initializing". QEMU before 9.0 shows
    /// no state there (an empty one), so on 8.x this passes at once, as before.
    async fn wait_net_listening(&mut self) -> Result<(), StartError> {
        let started = Instant::now();
        loop {
            let info = self.run("human-monitor-command", Some(json!({ "command-line": "info network" }))).await.map_err(StartError::NetQuery)?;
            let text = info.as_str().unwrap_or("");
            match netdev_state(text) {
                NetdevState::Initializing if started.elapsed() < QMP_WAIT => tokio::time::sleep(Duration::from_millis(2)).await,
                NetdevState::Initializing => {
                    return Err(StartError::NetBackend(format!("still initializing after {} s; `info network` says: {}", QMP_WAIT.as_secs(), text.trim())))
                }
                NetdevState::Failed(why) => return Err(StartError::NetBackend(why)),
                NetdevState::Listening => return Ok(()),
            }
        }
    }

    /// Takes over the QEMU of `spec` an earlier hutch left running as `pid`: checks
    /// the process is that VM's, holds its cgroup and id again, and reconnects to its
    /// QMP and console sockets. The guest runs on throughout.
    pub async fn adopt(spec: &VmSpec, pid: u32, jail: Option<&super::jail::JailConfig>) -> Result<QemuVm, AdoptError> {
        let pidfd = PidFd::open(pid).map_err(|_| AdoptError::Gone { pid })?;
        let ours = crate::process::names_dir(pid, &spec.dir);
        // Read before asking whether it still runs: then the command line was its own.
        if pidfd.has_exited() {
            return Err(AdoptError::Gone { pid });
        }
        if !ours {
            return Err(AdoptError::NotOurs { pid });
        }
        let lease = match jail.map(|j| &j.identity) {
            Some(super::jail::Identity::Subordinate(ids)) => {
                let uid = proc_uid(pid).ok_or(AdoptError::Gone { pid })?;
                Some(ids.lease_uid(uid).map_err(AdoptError::Lease)?)
            }
            _ => None,
        };
        let group = super::cgroup::Group::of_process(pid);
        let mut vm = QemuVm { spec: spec.clone(), process: pidfd, released: false, qmp: None, exit: None, group, lease, console: Default::default() };
        if let Some(console) = connect_within(&spec.console_socket(), ADOPT_WAIT).await {
            vm.console = crate::console::spawn_reader(console, spec.console_log());
        }
        let qmp = vm.connect_qmp(ADOPT_WAIT).await.map_err(|e| match e {
            StartError::Exited { .. } => AdoptError::Gone { pid },
            _ => AdoptError::QmpTimeout { secs: ADOPT_WAIT.as_secs() },
        })?;
        vm.qmp = Some(qmp);
        vm.cancel_migration().await.map_err(|e| AdoptError::Migration(e.to_string()))?;
        Ok(vm)
    }

    /// Connects to QMP within `limit`, giving up early if QEMU exits.
    async fn connect_qmp(&mut self, limit: Duration) -> Result<Qmp, StartError> {
        let started = Instant::now();
        loop {
            if let Some(status) = self.exit_status() {
                return Err(StartError::Exited { status, stderr: stderr_of(&self.spec) });
            }
            // The socket listens from the start; QEMU greets once it runs, and a QEMU
            // that exits first closes it, ending the wait.
            let left = limit.saturating_sub(started.elapsed());
            match tokio::time::timeout(left, Qmp::connect(&self.spec.qmp_socket())).await {
                Ok(Ok(q)) => return Ok(q),
                Ok(Err(e)) if started.elapsed() > limit => return Err(StartError::Qmp(e)),
                Ok(Err(_)) | Err(_) => {}
            }
            if started.elapsed() > limit {
                return Err(StartError::QmpTimeout { secs: limit.as_secs() });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Cancels a save a dead hutch started (its file is discarded): QEMU would stop the
    /// guest again when it completed, after the adopter had let it run.
    async fn cancel_migration(&mut self) -> Result<(), SnapshotError> {
        let started = Instant::now();
        let mut cancelled = false;
        loop {
            let info = self.run("query-migrate", None).await?;
            match info.get("status").and_then(Value::as_str).unwrap_or("none") {
                "none" | "completed" | "failed" | "cancelled" => return Ok(()),
                _ if !cancelled => {
                    self.run("migrate_cancel", None).await?;
                    cancelled = true;
                }
                _ => {}
            }
            if started.elapsed() > ADOPT_WAIT {
                return Err(SnapshotError::Timeout { what: "cancelling a save", secs: ADOPT_WAIT.as_secs() });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Passes an open migration file to QEMU under `name`.
    async fn hand_over(&mut self, name: &str, file: &std::fs::File) -> Result<(), SnapshotError> {
        use std::os::fd::AsFd;
        self.qmp()?.send_fd(name, file.as_fd()).await.map_err(SnapshotError::Qmp)
    }

    /// QEMU has exited: its cgroup is empty and can go.
    fn ended(&mut self, status: String) {
        self.exit = Some(status);
        self.group = None;
        self.lease = None;
    }

    fn qmp(&mut self) -> Result<&mut Qmp, SnapshotError> {
        self.qmp.as_mut().ok_or(SnapshotError::NoQmp)
    }

    /// Loads the incoming state QEMU was started for (see `VmHandle::load`).
    async fn load_state(&mut self) -> Result<(), SnapshotError> {
        let Some(incoming) = self.spec.incoming.clone() else {
            return Err(SnapshotError::Migration { what: "load", detail: "the VM was not started to load a state".into() });
        };
        let mut file = std::fs::File::open(&incoming.state).map_err(|e| SnapshotError::Migration { what: "load", detail: format!("opening the state file: {e}") })?;
        let state = crate::saved_state::read(&mut file, crate::saved_state::page_size(), self.spec.ram_bytes()).map_err(|source| SnapshotError::StateFile { path: incoming.state.display().to_string(), source })?;
        if let Form::Changes(changes) = &state.form {
            file = self.put_back_pages(file, changes.clone()).await?;
        }
        use std::io::Seek;
        file.seek(std::io::SeekFrom::Start(state.stream_at())).map_err(|e| SnapshotError::Migration { what: "load", detail: format!("seeking the state file: {e}") })?;
        self.ignore_shared(incoming.ignore_shared).await?;
        self.hand_over(MIGRATION_IN, &file).await?;
        drop(file);
        self.run("migrate-incoming", Some(json!({ "uri": format!("fd:{MIGRATION_IN}") }))).await?;
        // Started with -S: once the state is in, the guest waits in "paused".
        let started = Instant::now();
        loop {
            if let Some(status) = self.exit_status() {
                // QEMU exits when an incoming stream does not fit the machine.
                return Err(SnapshotError::Migration { what: "load", detail: format!("QEMU exited ({status}): {}", stderr_of(&self.spec)) });
            }
            let status = self.run("query-status", None).await?;
            if status.get("status").and_then(Value::as_str) != Some("inmigrate") {
                return Ok(());
            }
            if started.elapsed() > MIGRATION_WAIT {
                return Err(SnapshotError::Timeout { what: "load", secs: MIGRATION_WAIT.as_secs() });
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// The guest RAM of this QEMU, which maps `memory` as its spec says.
    fn guest_ram(&self, memory: &Path, write: bool) -> Result<GuestRam, SnapshotError> {
        let bytes = self.spec.ram_bytes();
        let shared = matches!(self.spec.memory, Memory::SharedFile(_));
        GuestRam::open(self.process.pid(), memory, shared, bytes, write, || !self.process.has_exited()).map_err(SnapshotError::GuestRam)
    }

    /// QEMU's RAM blocks besides guest RAM, where it has them now.
    async fn other_ram_blocks(&mut self) -> Result<Vec<super::ram_blocks::RamBlock>, SnapshotError> {
        let listed = self.run("x-query-ramblock", None).await?;
        let text = listed.get("human-readable-text").and_then(Value::as_str).unwrap_or_default();
        super::ram_blocks::others(text).map_err(|detail| SnapshotError::Migration { what: "listing QEMU's RAM blocks", detail })
    }

    /// Writes the saved pages of `changes` (read from `file`) into the RAM of this
    /// QEMU, which maps again the memory file they were saved against, and its other
    /// RAM blocks where it has them; before QEMU loads its devices, some of which read
    /// guest RAM as they load.
    async fn put_back_pages(&mut self, mut file: std::fs::File, changes: crate::saved_state::ChangedPages) -> Result<std::fs::File, SnapshotError> {
        let (Memory::PrivateFile(memory) | Memory::SharedFile(memory)) = &self.spec.memory else {
            return Err(SnapshotError::Migration { what: "load", detail: "the state holds only the pages that differ from a snapshot's memory file, and this VM maps none".into() });
        };
        // `saved_state::read` took the state only for this VM's RAM size.
        let ram = self.guest_ram(memory, true)?;
        let here = self.other_ram_blocks().await?;
        let mut targets = Vec::new();
        for saved in &changes.blocks {
            match here.iter().find(|b| b.name == saved.name && b.used == saved.len) {
                Some(block) => targets.push((saved.clone(), block.host_addr)),
                None => return Err(SnapshotError::Migration { what: "load", detail: format!("this QEMU has no RAM block {:?} of {} bytes, which the state holds", saved.name, saved.len) }),
            }
        }
        let copied = within_copy_deadline("load", "writing the saved pages", move || {
            use std::io::{Read, Seek};
            let copy = crate::guest_ram::GuestRamError::Copy;
            file.seek(std::io::SeekFrom::Start(changes.pages_at)).map_err(copy)?;
            ram.copy_in(&changes.runs, &mut std::io::BufReader::with_capacity(1 << 20, &mut file))?;
            for (block, addr) in targets {
                let mut data = vec![0u8; block.len as usize];
                file.seek(std::io::SeekFrom::Start(block.at)).map_err(copy)?;
                file.read_exact(&mut data).map_err(copy)?;
                ram.write_raw(addr, &data)?;
            }
            Ok(file)
        });
        copied.await
    }

    /// Writes the pages of the stopped guest that differ from `memory`, and QEMU's other
    /// RAM blocks, into a new `state`, and returns it (positioned after them) with the
    /// count of pages.
    async fn write_changed_pages(&mut self, state: &Path, memory: &Path) -> Result<(std::fs::File, u64), SnapshotError> {
        let ram = self.guest_ram(memory, false)?;
        let others = self.other_ram_blocks().await?;
        let (state, page_size) = (state.to_path_buf(), crate::saved_state::page_size());
        let written = within_copy_deadline("save", "copying the changed pages", move || {
            let copy = crate::guest_ram::GuestRamError::Copy;
            let runs = ram.changed()?;
            let blocks = others.into_iter().map(|b| Ok((b.name, ram.read_raw(b.host_addr, b.used)?))).collect::<Result<Vec<_>, crate::guest_ram::GuestRamError>>()?;
            let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).open(&state).map_err(copy)?;
            crate::saved_state::write_header(&mut file, page_size, ram.bytes(), &runs, &blocks).map_err(copy)?;
            ram.copy_out(&runs, &mut file)?;
            crate::saved_state::write_blocks(&mut file, &blocks).map_err(copy)?;
            Ok((file, runs.iter().map(|r| r.pages).sum()))
        });
        written.await
    }

    /// Has QEMU save its device state (no RAM) and appends it to `file` (QMP
    /// `xen-save-devices-state`: despite its name QEMU's generic device-only save, run
    /// on the main loop; the guest is stopped, so it stays stopped). QEMU truncates
    /// whatever file it is given, so it writes into a memfd, copied after the pages.
    async fn append_devices(&mut self, file: &mut std::fs::File) -> Result<(), SnapshotError> {
        use std::io::Seek;
        use std::os::fd::{AsFd, AsRawFd};
        let failed = |what: &str, e: std::io::Error| SnapshotError::Migration { what: "save", detail: format!("{what}: {e}") };
        let memfd = nix::sys::memfd::memfd_create(c"hutch-devices", nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC).map_err(|e| failed("making a memfd for the device state", e.into()))?;
        // Write-only: the access mode QEMU's open of the fd set asks for.
        let write_only = std::fs::OpenOptions::new().write(true).open(format!("/proc/self/fd/{}", memfd.as_raw_fd())).map_err(|e| failed("reopening the memfd", e))?;
        let fdset = match self.qmp()?.add_fd(write_only.as_fd()).await {
            Ok(id) => id,
            Err(e) => {
                if matches!(e, crate::qmp::QmpError::Timeout { .. }) {
                    self.qmp = None;
                }
                return Err(SnapshotError::Qmp(e));
            }
        };
        let saved = self.run("xen-save-devices-state", Some(json!({ "filename": format!("/dev/fdset/{fdset}"), "live": false }))).await;
        if self.qmp.is_some() {
            let _ = self.run("remove-fd", Some(json!({ "fdset-id": fdset }))).await;
        }
        saved?;
        // QEMU could have grown the memfd without bound (it is QEMU's to write): read
        // at most the cap, and only a stream.
        let mut devices = std::fs::File::from(memfd);
        devices.seek(std::io::SeekFrom::Start(0)).map_err(|e| failed("reading the device state", e))?;
        let mut stream = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(&mut devices, MAX_DEVICE_STATE + 1), &mut stream).map_err(|e| failed("reading the device state", e))?;
        if stream.len() as u64 > MAX_DEVICE_STATE || !stream.starts_with(crate::saved_state::QEMU_MAGIC) {
            return Err(SnapshotError::Migration { what: "save", detail: format!("QEMU's device state is not a migration stream of at most {} MiB", MAX_DEVICE_STATE >> 20) });
        }
        std::io::Write::write_all(file, &stream).map_err(|e| failed("writing the device state", e))
    }

    async fn run(&mut self, command: &str, args: Option<Value>) -> Result<Value, SnapshotError> {
        let result = self.qmp()?.execute(command, args).await;
        if let Err(crate::qmp::QmpError::Timeout { .. }) = &result {
            // Its late reply would be taken for the next command's: drop the connection
            // (stop then kills QEMU instead of asking it).
            self.qmp = None;
        }
        result.map_err(SnapshotError::Qmp)
    }

    async fn ignore_shared(&mut self, on: bool) -> Result<(), SnapshotError> {
        let caps = json!({ "capabilities": [{ "capability": "x-ignore-shared", "state": on }] });
        self.run("migrate-set-capabilities", Some(caps)).await.map(drop)
    }

    /// Polls `query-migrate` until the outgoing migration ends.
    async fn wait_migration(&mut self) -> Result<(), SnapshotError> {
        let started = Instant::now();
        loop {
            let info = self.run("query-migrate", None).await?;
            match info.get("status").and_then(Value::as_str).unwrap_or("") {
                "completed" => return Ok(()),
                "failed" | "cancelled" => {
                    let detail = info.get("error-desc").and_then(Value::as_str).unwrap_or("no detail").to_string();
                    return Err(SnapshotError::Migration { what: "save", detail });
                }
                _ => {}
            }
            if started.elapsed() > MIGRATION_WAIT {
                return Err(SnapshotError::Timeout { what: "save", secs: MIGRATION_WAIT.as_secs() });
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Whether QEMU exits within `limit`; once it has, the console copy has written
    /// out what it left in its socket (the guest's last lines).
    async fn wait_exit(&mut self, limit: Duration) -> bool {
        match self.process.wait(limit).await.then(|| self.process.exit_status().unwrap_or_else(|| "exited".into())) {
            Some(status) => {
                self.ended(status);
                self.console.finish(CONSOLE_DRAIN).await;
                true
            }
            None => false,
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum NetdevState {
    Initializing,
    Listening,
    Failed(String),
}

/// The state of netdev `net0` in QEMU's `info network` output, whose line reads
/// ` \ net0: index=0,type=stream,<state>` (`initializing`, `listening`, the peer's
/// address once connected, or `error: ...`).
fn netdev_state(info: &str) -> NetdevState {
    let state = info.lines().find_map(|l| l.trim_start_matches([' ', '\\']).strip_prefix("net0: ")?.split_once("type=stream,").map(|(_, s)| s.trim()));
    match state {
        None | Some("initializing") => NetdevState::Initializing,
        Some(s) => match s.strip_prefix("error: ") {
            Some(why) => NetdevState::Failed(why.to_string()),
            None => NetdevState::Listening,
        },
    }
}

/// Runs a copy between guest RAM and a state file on a blocking thread, within
/// `PAGE_COPY_WAIT` (`what` names the migration step, `doing` the copy).
async fn within_copy_deadline<T: Send + 'static>(
    what: &'static str,
    doing: &'static str,
    copy: impl FnOnce() -> Result<T, crate::guest_ram::GuestRamError> + Send + 'static,
) -> Result<T, SnapshotError> {
    match tokio::time::timeout(PAGE_COPY_WAIT, tokio::task::spawn_blocking(copy)).await {
        Ok(Ok(done)) => done.map_err(SnapshotError::GuestRam),
        Ok(Err(e)) => Err(SnapshotError::Migration { what, detail: format!("the page copy stopped: {e}") }),
        Err(_) => Err(SnapshotError::Timeout { what: doing, secs: PAGE_COPY_WAIT.as_secs() }),
    }
}

/// An error and its causes, on one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// What the state file at `path` holds.
fn read_state(path: &Path, ram_bytes: u64) -> Result<StateFile, crate::saved_state::StateFileError> {
    crate::saved_state::read(&mut std::fs::File::open(path)?, crate::saved_state::page_size(), ram_bytes)
}

/// The host uid process `pid` runs as.
fn proc_uid(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("Uid:"))?.split_whitespace().next()?.parse().ok()
}

impl Drop for QemuVm {
    /// Sends SIGKILL without waiting; a short-lived thread waits for the process to go
    /// (however long a loaded host takes to tear it down), reaps it when it is hutch's
    /// child, and only then removes its cgroup and frees its id, which a live process
    /// still holds.
    fn drop(&mut self) {
        if self.released {
            if let Some(group) = self.group.take() {
                group.leave();
            }
            return;
        }
        if self.exit_status().is_some() {
            return;
        }
        let _ = self.process.kill();
        let (group, lease) = (self.group.take(), self.lease.take());
        let Ok(fd) = self.process.try_clone_fd() else { return };
        std::thread::spawn(move || {
            use std::os::fd::AsFd;
            crate::pidfd::wait_within(fd.as_fd(), Duration::MAX);
            let deadline = Instant::now() + Duration::from_secs(10);
            while group.as_ref().is_some_and(|g| !g.try_remove()) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            drop(lease);
        });
    }
}

#[async_trait::async_trait]
impl VmHandle for QemuVm {
    fn pid(&self) -> Option<u32> {
        Some(self.process.pid())
    }

    fn set_cpu_share(&self, share: CpuShare) -> Result<(), CpuShareError> {
        match &self.group {
            Some(group) => group.set_cpu_share(share).map_err(|e| CpuShareError(Box::new(e))),
            None => Ok(()),
        }
    }

    fn agent_socket(&self) -> PathBuf {
        self.spec.agent_socket()
    }

    fn console_log(&self) -> PathBuf {
        self.spec.console_log()
    }


    fn exit_status(&mut self) -> Option<String> {
        if self.exit.is_none() {
            if let Some(status) = self.process.exit_status() {
                self.ended(status);
            }
        }
        self.exit.clone()
    }

    async fn stop(&mut self, grace: Duration) -> Result<(), StopError> {
        if self.exit_status().is_some() {
            return Ok(());
        }
        if let Some(qmp) = self.qmp.as_mut() {
            let _ = tokio::time::timeout(grace, qmp.execute("quit", None)).await;
        }
        if self.wait_exit(grace).await {
            return Ok(());
        }
        self.kill().await
    }

    async fn kill(&mut self) -> Result<(), StopError> {
        if self.exit_status().is_some() {
            return Ok(());
        }
        let pid = self.process.pid();
        if let Err(source) = self.process.kill() {
            if self.exit_status().is_some() {
                return Ok(());
            }
            return Err(StopError::Kill { pid, source });
        }
        if !self.wait_exit(Duration::from_secs(10)).await {
            return Err(StopError::Kill { pid, source: std::io::Error::other("it did not exit within 10 s of SIGKILL") });
        }
        self.exit = Some("killed".into());
        Ok(())
    }

    async fn save(&mut self, state: &Path, ignore_shared: bool) -> Result<(), SnapshotError> {
        let file = std::fs::File::create(state).map_err(|e| SnapshotError::Migration { what: "save", detail: format!("creating the state file: {e}") })?;
        self.ignore_shared(ignore_shared).await?;
        let uncapped = json!({ "max-bandwidth": SAVE_BANDWIDTH, "downtime-limit": SAVE_DOWNTIME_MS });
        self.run("migrate-set-parameters", Some(uncapped)).await?;
        self.hand_over(MIGRATION_OUT, &file).await?;
        self.run("stop", None).await?;
        self.run("migrate", Some(json!({ "uri": format!("fd:{MIGRATION_OUT}") }))).await?;
        // QEMU writes through its own copy of the fd; ours closes when `file` drops.
        self.wait_migration().await?;
        // Loading tells a state's form by its first bytes (`saved_state.rs`), and
        // QEMU wrote these: only its own stream counts.
        let mut magic = [0u8; 4];
        let ours = std::fs::File::open(state).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic)).is_ok() && magic == *crate::saved_state::QEMU_MAGIC;
        if !ours {
            return Err(SnapshotError::Migration { what: "save", detail: "QEMU wrote something other than a migration stream".into() });
        }
        Ok(())
    }

    async fn save_for_pause(&mut self, state: &Path) -> Result<PauseSave, SnapshotError> {
        let Memory::PrivateFile(memory) = self.spec.memory.clone() else {
            self.save(state, false).await?;
            return Ok(PauseSave::Whole { why: "its RAM maps no snapshot's memory file".into() });
        };
        self.run("stop", None).await?;
        let (mut file, pages) = match self.write_changed_pages(state, &memory).await {
            Ok(written) => written,
            // A QEMU that stalls its own memory (userfaultfd) is not asked again.
            Err(e @ SnapshotError::Timeout { .. }) => {
                let _ = self.kill().await;
                return Err(e);
            }
            // hutch may not read this QEMU's memory (an adopted QEMU under Yama's
            // ptrace rules, say): the whole save needs no such access. A RAM mapping
            // not where and as QEMU makes it is a QEMU someone changed: said louder.
            Err(e) => {
                let why = chain(&e);
                match &e {
                    SnapshotError::GuestRam(crate::guest_ram::GuestRamError::Mapping { .. }) => tracing::warn!(vm = %self.spec.id, "saving all memory: {why}"),
                    _ => tracing::debug!(vm = %self.spec.id, "saving all memory: {why}"),
                }
                self.save(state, false).await?;
                return Ok(PauseSave::Whole { why });
            }
        };
        self.append_devices(&mut file).await?;
        Ok(PauseSave::Changes { pages, page_size: crate::saved_state::page_size() })
    }

    async fn load(&mut self) -> Result<(), SnapshotError> {
        match self.load_state().await {
            // A QEMU that dies while loading closes QMP before it can be reaped: say
            // why it died rather than that its socket closed.
            Err(e @ SnapshotError::Qmp(crate::qmp::QmpError::Closed | crate::qmp::QmpError::Io(_))) => match self.exited_within(EXIT_WAIT).await {
                Some((status, stderr)) => Err(SnapshotError::Migration { what: "load", detail: format!("QEMU exited ({status}): {stderr}") }),
                None => Err(e),
            },
            other => other,
        }
    }

    async fn resume(&mut self) -> Result<(), SnapshotError> {
        self.run("cont", None).await.map(drop)
    }

    async fn run_state(&mut self) -> Result<String, SnapshotError> {
        let status = self.run("query-status", None).await?;
        Ok(status.get("status").and_then(Value::as_str).unwrap_or("unknown").to_string())
    }

    fn release(mut self: Box<Self>) {
        self.released = true;
    }
}


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_stream_netdevs_state_from_info_network() {
        let nic = |state: &str| format!("virtio-net-device.0: index=0,type=nic,model=virtio-net-device,macaddr=52:54:00:68:75:02\r\n \\ net0: index=0,type=stream,{state}\r\n");
        assert_eq!(netdev_state(&nic("initializing")), NetdevState::Initializing);
        assert_eq!(netdev_state(&nic("listening")), NetdevState::Listening);
        assert_eq!(netdev_state(&nic("unix:/h/sandboxes/x/net.sock")), NetdevState::Listening);
        assert_eq!(netdev_state(&nic("error: Bad file descriptor")), NetdevState::Failed("Bad file descriptor".into()));
        assert_eq!(netdev_state(""), NetdevState::Initializing);
        // QEMU 8.x shows no state at all: nothing to wait for there.
        assert_eq!(netdev_state(&nic("")), NetdevState::Listening);
    }
}
