"""Two QEMU releases side by side on hutch's guest: cold boot and snapshot restore,
interleaved in one run so both see the same machine (load, page cache, thermals).

    scripts/bench-qemu-versions.sh                       # QEMU 7.2 vs 10.0, 10 rounds
    python3 bench/qemu_versions.py --rounds 1 --cpus max # a quick check

Every VM is hutch's QEMU command line (crates/hutch-vmm/src/qemu/args.rs) started
directly, on hutch's own kernel, initramfs and `base` template, with only `-cpu` varied:

- cold boot: spawn -> `hutch-agent: ready` on the serial console;
- restore: spawn -> the agent echoed a hello on its channel, i.e. the restored guest ran
  code. The state comes from one snapshot per (QEMU, cpu), taken first, with RAM in a
  shared file saved with `x-ignore-shared`, the way hutch's template snapshots are.

Each round runs the cold boot and the restore of every (QEMU, cpu) as separate tasks in
one shuffled order, one VM at a time. The first `--qemu` is the baseline of the ratios.
Nothing under $HUTCH_HOME is written: every VM gets its own qcow2 overlay in a scratch
directory that is removed on every exit, with any QEMU still running.
"""

import argparse
import contextlib
import ctypes
import datetime
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_QEMUS = ["/opt/qemu72/qemu-7.2", "/usr/bin/qemu-system-x86_64"]
# `max` is what hutch runs under TCG; Haswell-noTSX is a fixed model both releases
# know, so the guest sees the same CPUID on both (`max` grows with each release).
DEFAULT_CPUS = "max,Haswell-noTSX"
MEMORY = "512M"
READY_LINE = b"hutch-agent: ready"  # crates/hutch-core/src/sandbox.rs, READY_LINE
TSC_FALLBACK_KHZ = 3_000_000  # crates/hutch-vmm/src/clock.rs, FALLBACK_TSC_KHZ
# A hutch-agent reply to a hello that did not come within this is retried on a new
# connection, as hutch does (crates/hutch-core/src/sandbox.rs, connect_restored).
HELLO_ATTEMPT_S = 5.0

COLD, RESTORE, LOADED = "cold boot", "restore", "restore: state loaded"
TITLES = {
    COLD: 'cold boot: spawn -> "hutch-agent: ready" on the console',
    RESTORE: "restore: spawn -> agent hello echoed on the agent socket",
    LOADED: "restore, first part: spawn -> migration state loaded (QMP), before `cont`",
}


class VmError(Exception):
    """A VM that failed or missed its deadline: reported, and the benchmark goes on."""


# --- the host and the guest artifacts ------------------------------------------------


@dataclass
class Artifacts:
    kernel: Path
    initrd: Path
    rootfs: Path
    tsc_khz: int
    tsc_source: str


def find_artifacts(home: Path) -> Artifacts:
    kernel = find_kernel(home)
    initrds = sorted(home.glob("initramfs/initramfs-*.cpio.gz"), key=lambda p: p.stat().st_mtime)
    if not initrds:
        sys.exit(f"no initramfs under {home}/initramfs (build hutch's artifacts first)")
    rootfs = home / "templates/base/rootfs.ext4"
    if not rootfs.is_file():
        sys.exit(f"no template image at {rootfs}")
    khz, source = read_tsc_khz(home)
    return Artifacts(kernel, initrds[-1], rootfs, khz, source)


def find_kernel(home: Path) -> Path:
    """The kernel named by the current.json manifest in $HUTCH_HOME/kernel*."""
    for manifest in sorted(home.glob("kernel*/current.json")):
        version = json.loads(manifest.read_text())["version"]
        vmlinuz = manifest.parent / version / "boot" / f"vmlinuz-{version}"
        if vmlinuz.is_file():
            return vmlinuz
    sys.exit(f"no kernel under {home}/kernel* (no current.json naming an existing vmlinuz)")


def read_tsc_khz(home: Path) -> tuple[int, str]:
    """The host TSC rate hutch measured (line 2 of host-tsc): the guest clock runs at the
    host's TSC under TCG, and boots without `tsc_early_khz` hang half the time."""
    try:
        line = (home / "host-tsc").read_text().splitlines()[1]
        return int(re.search(r"\d+", line).group()), f"{home}/host-tsc"
    except (OSError, IndexError, AttributeError, ValueError):
        return TSC_FALLBACK_KHZ, "fallback (no usable host-tsc)"


def load_line() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def other_qemus() -> int:
    """QEMU processes running on the machine now (another user's VMs skew the numbers)."""
    count = 0
    for comm in Path("/proc").glob("[0-9]*/comm"):
        with contextlib.suppress(OSError):
            count += comm.read_text().startswith("qemu-system")
    return count


# --- the QEMU binaries ---------------------------------------------------------------


@dataclass
class Qemu:
    path: str
    label: str  # "7.2.22"
    version_line: str
    cpus: set = field(default_factory=set)


def probe_qemu(path: str) -> Qemu:
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
    line = out.splitlines()[0].strip()
    label = re.search(r"version (\d[\d.]*)", line).group(1)
    # Two binaries of one release (a wrapper adding flags, say) keep apart by their name.
    if Path(path).name not in ("qemu-system-x86_64", "qemu-7.2"):
        label += f" ({Path(path).name})"
    return Qemu(path, label, line, cpu_models(path))


def cpu_models(path: str) -> set:
    """The model names of `-cpu help`: 7.2 prefixes each line with "x86 ", 10.0 indents."""
    out = subprocess.run([path, "-cpu", "help"], capture_output=True, text=True, check=True).stdout
    models = set()
    for line in out.splitlines()[1:]:
        if not line.strip():
            break  # the CPUID flag list follows a blank line
        words = line.split()
        models.add(words[1] if words[0] == "x86" and len(words) > 1 else words[0])
    return models


# --- one VM --------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


def _die_with_parent():
    # Runs in the child before exec: if this script is SIGKILLed, the kernel kills QEMU.
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Deadline:
    def __init__(self, seconds: float, what: str):
        self.end = time.monotonic() + seconds
        self.seconds = seconds
        self.what = what

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise VmError(f"{self.what}: not done within {self.seconds:g} s")
        return left


LIVE: set = set()  # every VM not yet killed, for the cleanup on exit


class Vm:
    """One QEMU process in its own directory and its own process group."""

    def __init__(self, qemu: Qemu, vmdir: Path, args: list):
        self.dir = vmdir
        self.console = vmdir / "console.log"
        self.agent_sock = vmdir / "agent.sock"
        self.qmp_sock = vmdir / "qmp.sock"
        self.log = vmdir / "qemu.log"
        with open(self.log, "wb") as log:
            self.started = time.monotonic()
            # A new session: Ctrl-C at the terminal is ours to handle, and killing the
            # group also takes the `cat` of an exec: migration.
            self.proc = subprocess.Popen([qemu.path, *args], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        LIVE.add(self)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def check_alive(self):
        if self.proc.poll() is not None:
            raise VmError(f"QEMU exited with status {self.proc.returncode}")

    def wait_for_console(self, text: bytes, deadline: Deadline):
        seen = b""
        with contextlib.ExitStack() as stack:
            f = None
            while True:
                if f is None and self.console.exists():
                    f = stack.enter_context(open(self.console, "rb"))
                if f is not None:
                    seen += f.read()
                    if text in seen:
                        return
                self.check_alive()
                deadline.left()
                time.sleep(0.005)

    def qmp(self, deadline: Deadline) -> "Qmp":
        while True:
            self.check_alive()
            try:
                return Qmp(self.qmp_sock, deadline)
            except (FileNotFoundError, ConnectionRefusedError):
                deadline.left()
                time.sleep(0.005)

    def quit(self, qmp: "Qmp", deadline: Deadline):
        """Ends QEMU the orderly way, so everything it wrote (disk, RAM file) is complete."""
        with contextlib.suppress(VmError, OSError):
            qmp.execute("quit")
        qmp.close()
        try:
            self.proc.wait(timeout=min(10.0, deadline.left()))
        except subprocess.TimeoutExpired:
            raise VmError("QEMU did not exit after quit") from None

    def kill(self):
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        LIVE.discard(self)

    def tails(self, lines: int = 8) -> str:
        out = ""
        for name, path in (("console", self.console), ("qemu stderr", self.log)):
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").strip().splitlines()[-lines:]
                if tail:
                    out += f"\n    last {name} lines:\n" + "\n".join(f"      {t}" for t in tail)
        return out

    def stderr_lines(self) -> list:
        with contextlib.suppress(OSError):
            return [l.strip() for l in self.log.read_text(errors="replace").splitlines() if l.strip()]
        return []


@contextlib.contextmanager
def running(vm: Vm, warnings: set, key: tuple):
    """Kills the VM however the block ends; a failure carries the VM's last output."""
    try:
        yield vm
    except (VmError, OSError) as e:
        raise VmError(f"{e}{vm.tails()}") from e
    finally:
        vm.kill()
        warnings.update((key, line) for line in vm.stderr_lines())


class Qmp:
    """A minimal QMP client: one command at a time, events skipped."""

    def __init__(self, path: Path, deadline: Deadline):
        self.deadline = deadline
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(deadline.left())
            self.sock.connect(str(path))
            self.reader = self.sock.makefile("rb")
            self._receive()  # the greeting
            self.execute("qmp_capabilities")
        except BaseException:
            self.sock.close()
            raise

    def _receive(self) -> dict:
        self.sock.settimeout(self.deadline.left())
        line = self.reader.readline()
        if not line:
            raise VmError("QEMU closed its QMP socket")
        return json.loads(line)

    def execute(self, command: str, arguments: dict | None = None):
        message = {"execute": command, **({"arguments": arguments} if arguments else {})}
        self.sock.sendall(json.dumps(message).encode() + b"\n")
        while True:
            reply = self._receive()
            if "return" in reply:
                return reply["return"]
            if "error" in reply:
                raise VmError(f"QMP {command}: {reply['error'].get('desc', reply['error'])}")
            # Anything else is an asynchronous event (STOP, RESUME, ...): not needed here.

    def ignore_shared(self):
        # RAM lives in the memory file, so the migration stream carries only devices.
        self.execute("migrate-set-capabilities", {"capabilities": [{"capability": "x-ignore-shared", "state": True}]})

    def close(self):
        with contextlib.suppress(OSError):
            self.reader.close()
            self.sock.close()


def qemu_args(art: Artifacts, cpu: str, vmdir: Path, disk: Path, memory_backend: str, incoming: bool) -> list:
    """hutch's TCG command line (crates/hutch-vmm/src/qemu/args.rs), with `-cpu` varied.
    RAM is always a backend named mem0: the migration stream names its RAM blocks."""
    args = ["-M", "microvm,accel=tcg,memory-backend=mem0", "-cpu", cpu, "-smp", "1", "-m", MEMORY,
            "-object", memory_backend]
    if incoming:
        # -S: the loaded guest waits for `cont`, so the host decides when it runs.
        args += ["-incoming", "defer", "-S"]
    args += [
        "-no-user-config", "-nodefaults", "-display", "none", "-no-reboot",
        "-chardev", f"file,id=console,path={vmdir / 'console.log'}", "-serial", "chardev:console",
        "-kernel", str(art.kernel), "-initrd", str(art.initrd),
        # hutch passes the fallback rate on restores (the command line of a restored guest
        # no longer matters); passing the same one everywhere changes nothing measured.
        "-append", f"console=ttyS0 quiet panic=-1 reboot=t tsc_early_khz={art.tsc_khz} lpj=6000000",
        "-drive", f"id=root,file={disk},format=qcow2,if=none,discard=unmap",
        "-device", "virtio-blk-device,drive=root",
        "-device", "virtio-serial-device",
        "-chardev", f"socket,id=agent,path={vmdir / 'agent.sock'},server=on,wait=off",
        "-device", "virtserialport,chardev=agent,name=hutch.agent",
        "-qmp", f"unix:{vmdir / 'qmp.sock'},server=on,wait=off",
    ]
    return args


def ram_backend(mem_path: Path | None = None, share: bool = False) -> str:
    if mem_path is None:
        return f"memory-backend-ram,id=mem0,size={MEMORY}"
    return f"memory-backend-file,id=mem0,size={MEMORY},mem-path={mem_path},share={'on' if share else 'off'}"


def make_overlay(backing: Path, backing_format: str, overlay: Path):
    # The same qemu-img for every VM, so both releases get byte-identical disk layouts.
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", backing_format, "-b", str(backing), str(overlay)],
                   check=True, capture_output=True)


def shell_quoted(path: Path) -> str:
    # exec: migrations run through /bin/sh.
    if "'" in str(path):
        raise VmError(f"path {path} cannot be quoted for an exec: migration")
    return f"'{path}'"


def agent_hello(vm: Vm, deadline: Deadline) -> int:
    """Opens a session on the agent channel the way hutch's host does
    (crates/hutch-sdk/src/envd/transport.rs): write `HUTCH-HELLO <nonce>\\n` and read
    until the agent echoes that very line; what comes before is leftover of older
    sessions. The nonce must be 16 hex digits: the agent parses it as a u64 and ignores a
    hello it cannot parse. Returns the number of connections it took."""
    attempts = 0
    while True:
        attempts += 1
        hello = b"HUTCH-HELLO %016x\n" % secrets.randbits(64)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(min(HELLO_ATTEMPT_S, deadline.left()))
                s.connect(str(vm.agent_sock))
                s.sendall(hello)
                seen = b""
                while hello not in seen:
                    chunk = s.recv(65536)
                    if not chunk:
                        raise ConnectionError("the agent socket closed")
                    seen = seen[-(1 << 20):] + chunk
                # The VM is killed next, so the session is not closed cleanly; a guest
                # that lives on would need it (see crates/hutch-core/src/snapshot.rs).
                return attempts
        except OSError:
            # A freshly resumed guest can miss a first hello. The pause lets the agent see
            # this host leave before the next hello, or the hello would land in the old
            # session (crates/hutch-core/src/sandbox.rs).
            vm.check_alive()
            deadline.left()
            time.sleep(0.2)


# --- the measurements ----------------------------------------------------------------


@dataclass
class Snapshot:
    dir: Path
    seconds: float  # boot and save
    state_bytes: int

    @property
    def disk(self) -> Path:
        return self.dir / "disk.qcow2"  # the source VM's overlay, frozen by the save

    @property
    def memory(self) -> Path:
        return self.dir / "memory"

    @property
    def state(self) -> Path:
        return self.dir / "state"


def take_snapshot(qemu: Qemu, cpu: str, art: Artifacts, snapdir: Path, timeout: float, warnings: set) -> Snapshot:
    """Boots a VM on a shared RAM file and saves it the way hutch saves a template."""
    snapdir.mkdir()
    snap = Snapshot(snapdir, 0.0, 0)
    make_overlay(art.rootfs, "raw", snap.disk)
    args = qemu_args(art, cpu, snapdir, snap.disk, ram_backend(snap.memory, share=True), incoming=False)
    deadline = Deadline(timeout, "boot of the snapshot's VM")
    with running(Vm(qemu, snapdir, args), warnings, (qemu.label, cpu)) as vm:
        vm.wait_for_console(READY_LINE, deadline)
        # No host ever connects to this guest, so its agent waits for a first hello and
        # a restored guest opens a fresh session. (hutch connects, then closes and waits
        # for "hutch-agent: idle"; the agent prints that only when a session ends, so
        # without one there is nothing more to wait for.)
        deadline = Deadline(timeout, "saving the snapshot")
        qmp = vm.qmp(deadline)
        qmp.ignore_shared()
        qmp.execute("stop")
        qmp.execute("migrate", {"uri": f"exec:cat > {shell_quoted(snap.state)}"})
        while (status := qmp.execute("query-migrate").get("status")) != "completed":
            if status in ("failed", "cancelled"):
                raise VmError(f"saving the snapshot: migration {status}")
            deadline.left()
            time.sleep(0.005)
        vm.quit(qmp, deadline)
        snap.seconds = vm.elapsed()
    snap.state_bytes = snap.state.stat().st_size
    return snap


def cold_boot(qemu: Qemu, cpu: str, art: Artifacts, vmdir: Path, timeout: float, warnings: set) -> dict:
    disk = vmdir / "disk.qcow2"
    make_overlay(art.rootfs, "raw", disk)
    args = qemu_args(art, cpu, vmdir, disk, ram_backend(), incoming=False)
    deadline = Deadline(timeout, "cold boot to agent ready")
    with running(Vm(qemu, vmdir, args), warnings, (qemu.label, cpu)) as vm:
        vm.wait_for_console(READY_LINE, deadline)
        return {COLD: vm.elapsed()}


def restore(qemu: Qemu, cpu: str, art: Artifacts, snap: Snapshot, vmdir: Path, timeout: float, warnings: set) -> dict:
    # A new overlay on the frozen disk: the guest's disk matches the RAM it resumes with.
    disk = vmdir / "disk.qcow2"
    make_overlay(snap.disk, "qcow2", disk)
    # share=off: the guest's writes are private copies, the memory file stays intact.
    args = qemu_args(art, cpu, vmdir, disk, ram_backend(snap.memory, share=False), incoming=True)
    deadline = Deadline(timeout, "restore to agent hello")
    with running(Vm(qemu, vmdir, args), warnings, (qemu.label, cpu)) as vm:
        qmp = vm.qmp(deadline)
        qmp.ignore_shared()
        qmp.execute("migrate-incoming", {"uri": f"exec:cat {shell_quoted(snap.state)}"})
        # Started with -S, the loaded guest waits in "paused"; QEMU exits on a bad stream.
        while qmp.execute("query-status").get("status") == "inmigrate":
            vm.check_alive()
            deadline.left()
            time.sleep(0.002)
        loaded = vm.elapsed()
        qmp.execute("cont")
        attempts = agent_hello(vm, deadline)
        return {RESTORE: vm.elapsed(), LOADED: loaded, "hello attempts": attempts}


# --- statistics and the report -------------------------------------------------------


def percentile(samples: list, p: float) -> float:
    """Linear interpolation between the closest ranks."""
    s = sorted(samples)
    k = (len(s) - 1) * p
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def table(kind: str, qemus: list, cpus: list, samples: dict, failures: dict) -> str:
    base = qemus[0].label
    rows = [f"### {TITLES[kind]}", "",
            f"| QEMU | cpu | n | failed | p50 ms | p95 ms | min ms | max ms | p50 / {base} p50 |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for cpu in cpus:
        base_samples = samples.get((kind, base, cpu))
        for q in qemus:
            xs = samples.get((kind, q.label, cpu), [])
            failed = failures.get((kind, q.label, cpu), 0)
            if not xs:
                rows.append(f"| {q.label} | {cpu} | 0 | {failed} | - | - | - | - | - |")
                continue
            ms = [x * 1000 for x in xs]
            ratio = f"{percentile(xs, 0.5) / percentile(base_samples, 0.5):.2f}" if base_samples else "-"
            rows.append(f"| {q.label} | {cpu} | {len(xs)} | {failed} | {percentile(ms, 0.5):.0f} | {percentile(ms, 0.95):.0f} "
                        f"| {min(ms):.0f} | {max(ms):.0f} | {ratio} |")
    return "\n".join(rows)


def log(message: str):
    print(message, file=sys.stderr, flush=True)


# --- the run -------------------------------------------------------------------------


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--qemu", action="append", metavar="BINARY",
                   help=f"a QEMU to compare (repeat; the first is the baseline; default: {' and '.join(DEFAULT_QEMUS)})")
    p.add_argument("--cpus", default=DEFAULT_CPUS, help=f"comma-separated -cpu models (default {DEFAULT_CPUS})")
    p.add_argument("--rounds", type=int, default=10, help="rounds of every measurement (default 10)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a VM gets to reach its goal (default 60)")
    p.add_argument("--seed", type=int, help="seed of the shuffled order (default: random, printed)")
    p.add_argument("--home", type=Path, default=Path(os.environ.get("HUTCH_HOME", Path.home() / ".local/share/hutch")),
                   help="hutch's home with the guest artifacts (default $HUTCH_HOME or ~/.local/share/hutch)")
    args = p.parse_args()
    args.qemu = args.qemu or DEFAULT_QEMUS
    args.cpus = [c.strip() for c in args.cpus.split(",") if c.strip()]
    if args.rounds < 1 or not args.cpus:
        p.error("need at least one round and one cpu model")
    return args


def check_cpus(qemus: list, cpus: list):
    for q in qemus:
        missing = [c for c in cpus if c not in q.cpus]
        if missing:
            sys.exit(f"QEMU {q.label} ({q.path}) does not know the cpu model(s) {', '.join(missing)} (see -cpu help)")


def run(args, scratch: Path) -> str:
    started_at = datetime.datetime.now(datetime.timezone.utc)
    load_start, others_start = load_line(), other_qemus()
    art = find_artifacts(args.home)
    qemus = [probe_qemu(path) for path in args.qemu]
    check_cpus(qemus, args.cpus)
    seed = args.seed if args.seed is not None else secrets.randbits(32)
    rng = random.Random(seed)
    warnings: set = set()
    samples: dict = {}
    failures: dict = {}
    errors: list = []
    retried_hellos = 0

    # One snapshot per (QEMU, cpu), before any measurement: a restore loads the state its
    # own release saved, with the same cpu model.
    snapshots = {}
    for q in qemus:
        for cpu in args.cpus:
            log(f"snapshot: QEMU {q.label}, cpu {cpu} ...")
            try:
                snapshots[(q.label, cpu)] = take_snapshot(q, cpu, art, scratch / f"snap-{q.label}-{cpu}", args.timeout, warnings)
            except (VmError, OSError, subprocess.CalledProcessError) as e:
                errors.append(f"snapshot, QEMU {q.label}, cpu {cpu}: {e}")
                log(f"  FAILED: {e}")

    tasks = [(kind, q, cpu) for q in qemus for cpu in args.cpus for kind in (COLD, RESTORE)]
    n = 0
    for rnd in range(1, args.rounds + 1):
        rng.shuffle(tasks)
        for kind, q, cpu in tasks:
            key = (q.label, cpu)
            n += 1
            vmdir = scratch / f"vm-{n}"
            vmdir.mkdir()
            try:
                if kind == COLD:
                    result = cold_boot(q, cpu, art, vmdir, args.timeout, warnings)
                elif key in snapshots:
                    result = restore(q, cpu, art, snapshots[key], vmdir, args.timeout, warnings)
                else:
                    failures[(kind, *key)] = failures.get((kind, *key), 0) + 1
                    continue  # its snapshot failed (reported above)
                for k in (COLD, RESTORE, LOADED):
                    if k in result:
                        samples.setdefault((k, *key), []).append(result[k])
                retried_hellos += result.get("hello attempts", 1) > 1
                log(f"round {rnd}/{args.rounds}: QEMU {q.label:<7} cpu {cpu:<14} {kind:<9} {result[kind] * 1000:8.0f} ms")
            except (VmError, OSError, subprocess.CalledProcessError) as e:
                failures[(kind, *key)] = failures.get((kind, *key), 0) + 1
                errors.append(f"round {rnd}, {kind}, QEMU {q.label}, cpu {cpu}: {e}")
                log(f"round {rnd}/{args.rounds}: QEMU {q.label} cpu {cpu} {kind} FAILED: {e}")
            finally:
                shutil.rmtree(vmdir, ignore_errors=True)

    out = [f"## QEMU {' vs '.join(q.label for q in qemus)} on hutch's guest (TCG)", "",
           f"- date: {started_at:%Y-%m-%d %H:%M} UTC; {args.rounds} round(s), each running the cold boot and the "
           f"restore of every (QEMU, cpu) once, in a shuffled order (seed {seed}), one VM at a time",
           f"- host: nproc {len(os.sched_getaffinity(0))}; load average at start {load_start}, at end {load_line()}; "
           f"other QEMU processes at start {others_start}, at end {other_qemus()}"]
    out += [f"- QEMU {q.label}: `{q.path}`: {q.version_line}" for q in qemus]
    out += [f"- guest: `{art.kernel.name}`, `{art.initrd.name}`, template `{art.rootfs}`; 1 vCPU, {MEMORY} RAM; "
            f"tsc_early_khz={art.tsc_khz} ({art.tsc_source})"]
    out += [f"- snapshot QEMU {label}, cpu {cpu}: boot and save {s.seconds:.1f} s, device state {s.state_bytes / 1024:.0f} KiB"
            for (label, cpu), s in snapshots.items()]
    for kind in (COLD, RESTORE, LOADED):
        out += ["", table(kind, qemus, args.cpus, samples, failures)]
    if retried_hellos:
        out += ["", f"{retried_hellos} restore(s) needed more than one hello connection (each retry costs >= 0.2 s)."]
    if warnings:
        out += ["", "QEMU's stderr (deduplicated):"]
        out += [f"- QEMU {label}, cpu {cpu}: `{line}`" for (label, cpu), line in sorted(warnings)]
    if errors:
        out += ["", "Failures:"] + [f"- {e}" for e in errors]
    return "\n".join(out)


def cleanup(scratch: Path):
    for vm in list(LIVE):
        vm.kill()
    shutil.rmtree(scratch, ignore_errors=True)


def main():
    args = parse_args()

    # SIGTERM and SIGHUP end the run like Ctrl-C does: through the finally below.
    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    # Short: QEMU's unix socket paths must stay under 108 bytes.
    scratch = Path(tempfile.mkdtemp(prefix="hutch-qemu-bench-"))
    try:
        report = run(args, scratch)
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        sys.exit(130)
    finally:
        # A second Ctrl-C must not cut the cleanup short.
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        cleanup(scratch)
    print(report)


if __name__ == "__main__":
    main()
