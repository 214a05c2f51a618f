"""Hostile guests: whatever the code in one sandbox does as root, the host, the server
and a bystander sandbox keep working, and the victim's state is reported truthfully."""

import httpx
import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxException

from conftest import wait_until


@pytest.fixture
def bystander(server):
    s = Sandbox.create("base")
    yield s
    s.kill()


def still_fine(server, bystander):
    assert server.api().get("/health").status_code == 200
    assert bystander.commands.run("echo fine").stdout == "fine\n"


def test_a_memory_hog_is_killed_inside_its_own_vm(server, bystander):
    hog = Sandbox.create("base")
    try:
        r = hog.commands.run("python3 -c 'a = [bytearray(1 << 20) for _ in range(4096)]' ; echo exit=$?", timeout=300)
        assert "exit=137" in r.stdout, r.stdout  # the guest kernel's OOM killer, not the host's
        assert hog.commands.run("echo survived").stdout == "survived\n"
        still_fine(server, bystander)
    finally:
        hog.kill()


def test_a_fork_bomb_stays_in_its_vm(server, bystander):
    bomb = Sandbox.create("base")
    try:
        bomb.commands.run("(ulimit -u unlimited; sudo sh -c 'f(){ f|f& }; f' ) >/dev/null 2>&1 &", timeout=30)
        still_fine(server, bystander)
        # The bombed sandbox can always be killed, and is then gone for real.
        assert bomb.kill() is True
        assert server.api().get(f"/sandboxes/{bomb.sandbox_id}").status_code == 404
    finally:
        bomb.kill()


def test_an_output_flood_does_not_grow_the_server(server, bystander):
    from test_trust_boundary import rss_kib
    flood = Sandbox.create("base")
    try:
        before = rss_kib(server.proc.pid)
        seen = []
        # 32 MiB of stdout, streamed to this client as it comes.
        flood.commands.run("yes flood-flood-flood-flood | head -c 33554432", on_stdout=lambda s: seen.append(len(s)),
                           timeout=600, request_timeout=600)
        assert sum(seen) == 32 << 20, sum(seen)
        grown = rss_kib(server.proc.pid) - before
        assert grown < 128 << 10, f"the server grew by {grown} KiB relaying a stdout flood"
        still_fine(server, bystander)
    finally:
        flood.kill()


def test_a_kernel_panic_is_reported_as_the_end_of_the_sandbox(server, bystander):
    victim = Sandbox.create("base")
    sid = victim.sandbox_id
    try:
        try:
            victim.commands.run("sudo sh -c 'echo c > /proc/sysrq-trigger'", timeout=30)
        except Exception:
            pass  # the stream ends with the VM
        wait_until(lambda: server.api().get(f"/sandboxes/{sid}").status_code == 404,
                   "the panicked sandbox to be reported gone (404)", timeout=60,
                   detail=lambda: server.api().get(f"/sandboxes/{sid}").text)
        r = httpx.get(server.url + "/health", headers={"E2b-Sandbox-Id": sid})
        assert r.status_code == 502
        assert not (server.home / "sandboxes" / sid).exists(), "the panicked sandbox's files were left"
        still_fine(server, bystander)
    finally:
        Sandbox.kill(sid)


def test_garbage_on_the_agent_port_breaks_only_that_sandbox(server, bystander):
    victim = Sandbox.create("base")
    try:
        port = victim.commands.run("grep -l hutch.agent /sys/class/virtio-ports/*/name | head -1 | cut -d/ -f5").stdout.strip()
        assert port.startswith("vport"), port
        try:
            victim.commands.run(f"sudo sh -c 'head -c 1000000 /dev/urandom > /dev/{port}'", timeout=60)
        except Exception:
            pass  # the session may die under it
        still_fine(server, bystander)
        # The server still answers for the victim, whatever state it is in.
        r = server.api().get(f"/sandboxes/{victim.sandbox_id}")
        assert r.status_code in (200, 404), r.text
    finally:
        victim.kill()


def test_another_keys_sandbox_is_404_on_every_route(server, bystander):
    from test_rest_errors import subprocess_key
    other = server.api(key=subprocess_key(server))
    sid = bystander.sandbox_id
    routes = [("GET", f"/sandboxes/{sid}"), ("DELETE", f"/sandboxes/{sid}"), ("POST", f"/sandboxes/{sid}/timeout"),
              ("POST", f"/sandboxes/{sid}/connect"), ("POST", f"/v2/sandboxes/{sid}/connect"), ("GET", f"/sandboxes/{sid}/metrics"),
              ("GET", f"/sandboxes/{sid}/logs"), ("POST", f"/sandboxes/{sid}/pause"), ("POST", f"/sandboxes/{sid}/resume"),
              ("POST", f"/sandboxes/{sid}/fork"), ("POST", f"/sandboxes/{sid}/snapshots")]
    for method, path in routes:
        body = {"timeout": 30} if path.endswith("/timeout") else {}
        r = other.request(method, path, json=body)
        assert r.status_code == 404, f"{method} {path}: {r.status_code} {r.text}"
    assert sid not in other.get("/v2/sandboxes").text
    still_fine(server, bystander)


def test_file_paths_stay_inside_the_guest(server, bystander):
    files = bystander.files
    assert files.read("../../../../../etc/hostname").strip() == "hutch"
    files.write("/home/user/escape", "x")
    bystander.commands.run("ln -sf /etc/shadow /home/user/shadow-link")
    with pytest.raises(SandboxException):
        files.read("/home/user/shadow-link")  # as the default user: permission denied
    assert "root:" in files.read("/home/user/shadow-link", user="root")  # root in its own VM may


def test_vms_paused_by_a_full_host_disk_resume_when_space_returns(tmp_path, monkeypatch):
    """QEMU pauses a VM whose disk write finds the host's disk full (werror=enospc). The
    server resumes it once there is room again, and the guest's write completes."""
    import os
    import shutil
    import signal
    import subprocess
    import tempfile
    from pathlib import Path
    from conftest import API_KEY, free_port, launch, link_shared_artifacts
    home = Path(tempfile.mkdtemp(prefix="hutch-enospc-", dir="/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(home)], check=True)
    proc = None
    try:
        link_shared_artifacts(home)
        port = free_port()
        proc = launch(home, port)
        url = f"http://127.0.0.1:{port}"
        # Both planes on this server (never the SDK's default cloud).
        monkeypatch.setenv("E2B_API_URL", url)
        monkeypatch.setenv("E2B_SANDBOX_URL", url)
        sbx = Sandbox.create("base", api_key=API_KEY)
        # Leave the guest less room on the host than it is about to write.
        free = shutil.disk_usage(home).free
        filler = home / "filler"
        with open(filler, "wb") as f:
            f.truncate(0)
            f.write(b"\1" * (free - (24 << 20)))
        writer = sbx.commands.run("dd if=/dev/urandom of=/home/user/big bs=1M count=64 conv=fsync 2>/dev/null; echo wrote $?",
                                  background=True, timeout=240)  # bounds the wait below
        wait_until(lambda: shutil.disk_usage(home).free < (2 << 20), "the guest's writes to fill the host's tmpfs", timeout=300,
                   detail=lambda: f"{shutil.disk_usage(home).free} bytes free")

        def guest_stopped() -> bool:
            try:
                httpx.get(url + "/health", headers={"E2b-Sandbox-Id": sbx.sandbox_id}, timeout=3)
                return False
            except httpx.TimeoutException:
                return True  # QEMU paused the guest: nothing in it answers

        wait_until(guest_stopped, "QEMU to pause the guest on the full disk (its agent stops answering)", timeout=120, interval=1)
        assert "resumed the VM" not in (home / "serve.log").read_text()
        filler.unlink()
        result = writer.wait()
        assert result.stdout.strip() == "wrote 0", result.stdout
        assert sbx.commands.run("stat -c %s /home/user/big").stdout.strip() == str(64 << 20)
        assert "resumed the VM" in (home / "serve.log").read_text()
        sbx.kill()
    finally:
        if proc:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        subprocess.run(["umount", "-l", str(home)], check=False)
        shutil.rmtree(home, ignore_errors=True)


def status_fields(pid: int) -> dict:
    return {k: v.split() for k, _, v in (line.partition(":") for line in open(f"/proc/{pid}/status"))}


def hutch_cgroups(pid: int) -> list:
    """The cgroup directories hutch put a QEMU in (one per v1 controller, or a v2 group)."""
    dirs = []
    for line in open(f"/proc/{pid}/cgroup"):
        _, controllers, path = line.strip().split(":", 2)
        if "/hutch/" in path:
            first = controllers.split(",")[0]
            dirs.append(f"/sys/fs/cgroup/{first}{path}" if first else f"/sys/fs/cgroup{path}")
    return dirs


def test_qemu_runs_jailed_as_its_own_user_in_its_own_cgroup(server, bystander):
    """What an escaped QEMU would have: no root, no capabilities, a seccomp filter, a
    memory/pids/cpu cgroup, and a filesystem holding only its own VM's files."""
    import os
    victim = Sandbox.create("base")
    sid = victim.sandbox_id
    try:
        pid = int((server.home / "sandboxes" / sid / "qemu.pid").read_text())
        f = status_fields(pid)
        uid = str(1_500_000_000 + pid)
        assert f["Uid"] == [uid] * 4 and f["Gid"] == [uid] * 4, f["Uid"]
        assert f["Groups"] == [] and f["CapEff"] == ["0000000000000000"] and f["CapPrm"] == ["0000000000000000"]
        assert f["NoNewPrivs"] == ["1"] and f["Seccomp"] == ["2"]
        # Pid 1 of its own PID namespace, whose /proc (what it would read) lists only itself.
        assert f["NSpid"] == [str(pid), "1"], f["NSpid"]
        assert sorted(n for n in os.listdir(f"/proc/{pid}/root/proc") if n.isdigit()) == ["1"]
        groups = hutch_cgroups(pid)
        limits = {}
        for d in groups:
            for name in ("memory.limit_in_bytes", "memory.max", "pids.max", "cpu.cfs_quota_us", "cpu.max"):
                if os.path.exists(f"{d}/{name}"):
                    limits[name] = open(f"{d}/{name}").read().strip()
        memory = int(limits.get("memory.limit_in_bytes") or limits["memory.max"])
        assert 512 << 20 < memory <= 2 << 30, limits  # the guest's RAM plus QEMU's own
        assert limits["pids.max"] == "256", limits
        assert ("cpu.cfs_quota_us" in limits and int(limits["cpu.cfs_quota_us"]) > 0) or "cpu.max" in limits, limits
        # Its view of HUTCH_HOME: its own disk, but not the bystander's, nor the database.
        root = f"/proc/{pid}/root{server.home}"
        seen = {os.path.relpath(os.path.join(d, n), root) for d, ds, fs in os.walk(root) for n in ds + fs}
        assert f"sandboxes/{sid}/disk.qcow2" in seen, sorted(seen)
        assert not any(bystander.sandbox_id in p for p in seen), sorted(seen)
        assert not any(p.endswith((".db", "vm.json", "console.log")) for p in seen), sorted(seen)
        # The guest works as before, and the cgroups go with the VM.
        assert victim.commands.run("echo jailed").stdout == "jailed\n"
        still_fine(server, bystander)
        victim.kill()
        wait_until(lambda: not any(os.path.exists(d) for d in groups), "the killed VM's cgroups to be removed", timeout=30,
                   detail=lambda: str([d for d in groups if os.path.exists(d)]))
    finally:
        Sandbox.kill(sid)


def backing_name(disk) -> str:
    header = open(disk, "rb").read(20)
    offset, length = int.from_bytes(header[8:16], "big"), int.from_bytes(header[16:20], "big")
    with open(disk, "rb") as f:
        f.seek(offset)
        return f.read(length).decode()


def rename_backing(disk, name: str) -> None:
    """What a QEMU the guest took over can do to its own overlay: name another file."""
    with open(disk, "r+b") as f:
        offset = int.from_bytes(f.read(16)[8:16], "big")
        f.seek(16)
        f.write(len(name).to_bytes(4, "big"))
        f.seek(offset)
        f.write(name.encode())


def test_a_rewritten_disk_header_cannot_reach_another_keys_snapshot(server):
    """An escaped QEMU can rewrite its overlay's qcow2 header to stack it on another
    tenant's stored snapshot. hutch gives every stored copy the base it made the
    overlay on, and refuses to start a VM whose header names any other."""
    import os
    import subprocess
    from conftest import HUTCH
    other = subprocess.run([str(HUTCH), "keys", "create", "--name", "other-tenant"], env=dict(os.environ, HUTCH_HOME=str(server.home)),
                           capture_output=True, text=True, check=True).stdout.strip()
    theirs = Sandbox.create("base", api_key=other)
    theirs.files.write("/home/user/secret", "theirs")
    their_snapshot = theirs.create_snapshot()
    theirs.kill()
    their_disk = server.home / "snapshots" / "sandboxes" / their_snapshot.snapshot_id / "disk.qcow2"
    assert their_disk.exists()
    mine = Sandbox.create("base")
    snap = None
    try:
        disk = server.home / "sandboxes" / mine.sandbox_id / "disk.qcow2"
        made_on = backing_name(disk)
        # A running VM's header travels into its snapshots: the stored copy gets hutch's.
        rename_backing(disk, str(their_disk))
        snap = mine.create_snapshot()
        stored = server.home / "snapshots" / "sandboxes" / snap.snapshot_id / "disk.qcow2"
        assert backing_name(stored) == made_on
        assert mine.commands.run("echo still-mine").stdout == "still-mine\n"
        # A paused VM's: the resume is refused rather than binding their disk into it.
        assert mine.pause() is True
        rename_backing(disk, str(their_disk))
        with pytest.raises(SandboxException) as refused:
            Sandbox.connect(mine.sandbox_id, timeout=60)
        assert "409" in str(refused.value) and "changed from inside its VM" in str(refused.value), str(refused.value)
        # Their snapshot is untouched and still theirs to start.
        child = Sandbox.create(their_snapshot.snapshot_id, api_key=other)
        try:
            assert child.files.read("/home/user/secret") == "theirs"
        finally:
            child.kill()
    finally:
        Sandbox.kill(mine.sandbox_id)
        if snap is not None:
            Sandbox.delete_snapshot(snap.snapshot_id)
        Sandbox.delete_snapshot(their_snapshot.snapshot_id, api_key=other)


# Runs as root inside an attacking guest; each attack prints one JSON line.
ATTACKS = r'''
import json, random, resource, select, socket, struct, sys, time

def gateway():
    for line in open("/proc/net/route").read().splitlines()[1:]:
        f = line.split()
        if f[1] == "00000000":
            return f[0], socket.inet_ntoa(struct.pack("<I", int(f[2], 16)))

def dns_query(name):
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return struct.pack(">HHHHHH", random.getrandbits(16), 0x0100, 1, 0, 0, 0) + labels + struct.pack(">HH", 1, 1)

def checksum(data):
    total = sum(int.from_bytes((data + b"\0")[i:i + 2], "big") for i in range(0, len(data), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF

def raw_udp(dst, port, payload):
    """A datagram for `dst` in an Ethernet frame of its own, straight to the gateway
    (the guest's kernel would keep one for 0.0.0.0 to itself)."""
    iface, gw = gateway()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # the gateway's MAC in the ARP table
        s.settimeout(10)
        s.sendto(dns_query("example.test"), (gw, 53))
        s.recv(512)
        src = s.getsockname()[0]
    gw_mac = next(l.split()[3] for l in open("/proc/net/arp").read().splitlines()[1:] if l.split()[0] == gw)
    my_mac = open(f"/sys/class/net/{iface}/address").read().strip()
    payload = payload.encode()
    udp = struct.pack(">HHHH", 40000, port, 8 + len(payload), 0) + payload
    ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0, socket.inet_aton(src), socket.inet_aton(dst))
    ip = ip[:10] + struct.pack(">H", checksum(ip)) + ip[12:]
    eth = bytes.fromhex(gw_mac.replace(":", "")) + bytes.fromhex(my_mac.replace(":", "")) + b"\x08\x00"
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
        s.bind((iface, 0))
        s.send(eth + ip + udp)
    return "sent"

def udp_echo(host, port, data):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(10)
        s.sendto(data.encode(), (host, port))
        return s.recv(512).decode()

def dns_tcp_flood(count):
    """`count` connections to port 53 at once, held open until all are answered."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (count + 64, count + 64))
    _, gw = gateway()
    socks, settled = [], set()
    poller = select.poll()
    for _ in range(count):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((gw, 53))
        socks.append(s)
        poller.register(s, select.POLLOUT)
    deadline = time.monotonic() + 300
    while len(settled) < count and time.monotonic() < deadline:
        for fd, _ in poller.poll(1000):
            settled.add(fd)
            poller.unregister(fd)
    out = {"connected": 0, "refused": 0, "other": 0}
    for s in socks:
        err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if s.fileno() not in settled:
            out["other"] += 1
        elif err == 0:
            out["connected"] += 1
        elif err == 111:
            out["refused"] += 1
        else:
            out["other"] += 1
    return out

def silent_names(count):
    """`count` questions for random names under a domain whose server never answers."""
    _, gw = gateway()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for i in range(count):
            s.sendto(dns_query(f"n{random.getrandbits(48)}.silent.test"), (gw, 53))
            if i % 50 == 49:
                time.sleep(0.2)  # pacing the attack over a few seconds, not synchronisation
    return count

print(json.dumps(globals()[sys.argv[1]](*json.loads(sys.argv[2]))))
'''


@pytest.fixture(scope="module")
def attacker(server):
    """A guest with E2B's widest egress (`allowOut: ["0.0.0.0/0"]`) and root."""
    s = Sandbox.create("base", network={"allow_out": ["0.0.0.0/0"]})
    s.files.write("/tmp/attacks.py", ATTACKS)
    yield s
    s.kill()


def attack(sbx, name, *args, background=False):
    import json
    cmd = f"python3 /tmp/attacks.py {name} '{json.dumps(list(args))}'"
    if background:
        return sbx.commands.run(cmd, user="root", background=True, timeout=600)
    return json.loads(sbx.commands.run(cmd, user="root", timeout=600).stdout)


def test_a_datagram_to_this_network_never_reaches_the_hosts_loopback(server, net_world, attacker):
    """0.0.0.0:P on the host is its own 127.0.0.1:P; `allowOut: 0.0.0.0/0` must not reach it."""
    from networld import WEB
    net_world.drained(net_world.loopback_probe)
    before = net_world.violation_lines()
    assert attack(attacker, "raw_udp", "0.0.0.0", net_world.probe_port, "leak") == "sent"
    # Frames are decided in order: once a later datagram is answered, the first one was too.
    assert attack(attacker, "udp_echo", WEB, 7, "after") == "udp:after"
    assert net_world.drained(net_world.loopback_probe) == 0, "a guest's datagram reached a loopback listener on the host"
    assert net_world.violation_lines() == before
    log = server.api().get(f"/sandboxes/{attacker.sandbox_id}/network").json()["log"]
    assert any(d["message"] == "loopback addresses are never reachable from sandboxes" and d["ip"] == "0.0.0.0" for d in log["denials"]), log["denials"]


def test_a_dns_over_tcp_flood_is_capped_and_does_not_grow_the_server(server, attacker, bystander):
    from test_trust_boundary import rss_kib
    pid = server.proc.pid
    before = rss_kib(pid)
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM) to now
    r = attack(attacker, "dns_tcp_flood", 10_000)
    peak = int(next(l.split()[1] for l in open(f"/proc/{pid}/status") if l.startswith("VmHWM:")))
    assert r["connected"] <= 8 and r["refused"] + r["connected"] == 10_000, r
    assert peak - before < 64 << 10, f"the server grew by {peak - before} KiB under 10,000 connections to port 53"
    still_fine(server, bystander)
    # The attacker's own DNS still works once its connections are gone.
    assert attacker.commands.run("getent hosts example.test").stdout.split() == ["93.184.216.34", "example.test"]


def test_names_whose_server_never_answers_hold_up_no_one_else(server, net_world, attacker):
    net_world.drained(net_world.silent_dns)
    threads = lambda: int(status_fields(server.proc.pid)["Threads"][0])
    before = threads()
    flood = attack(attacker, "silent_names", 1000, background=True)
    try:
        wait_until(lambda: net_world.drained(net_world.silent_dns) > 0, "the attacker's questions to reach the silent server", timeout=60)
        other = Sandbox.create("base")
        try:
            assert other.commands.run("echo created-during-the-flood").stdout == "created-during-the-flood\n"
        finally:
            other.kill()
        assert threads() - before < 16, f"the server went from {before} to {threads()} threads"
    finally:
        assert flood.wait().exit_code == 0


def octal(n: int, width: int) -> bytes:
    return ("%o" % n).zfill(width - 1).encode() + b"\0"


def tar_header(name: str, size_field: bytes, kind: bytes, gnu_extra=None) -> bytes:
    """One 512-byte GNU tar header, checksum filled in."""
    h = bytearray(512)
    h[0:len(name)] = name.encode()
    h[100:108], h[108:116], h[116:124] = octal(0o644, 8), octal(0, 8), octal(0, 8)
    h[124:136], h[136:148] = size_field, octal(0, 12)
    h[156:157] = kind
    h[257:265] = b"ustar  \0"
    for offset, value in (gnu_extra or {}).items():
        h[offset:offset + len(value)] = value
    h[148:156] = b" " * 8
    h[148:156] = ("%06o\0 " % sum(h)).encode()
    return bytes(h)


def sparse_tar() -> bytes:
    """A GNU sparse entry ('S'): 512 stored bytes standing for a 4 GiB file, which tar-rs
    would write by seeking over the hole (and the COPY would then copy whole)."""
    real = 4 << 30
    extra = {386: octal(real - 512, 12), 398: octal(512, 12), 483: octal(real, 12)}
    return tar_header("big.bin", octal(512, 12), b"S", extra) + b"x" * 512 + bytes(1024)


def inflating_tar() -> bytes:
    """An entry claiming 9 GiB (GNU base-256 size) with a MiB of zeros behind it: what
    a gzip bomb looks like to the server once inflated, more than one COPY may hold."""
    size = b"\x80" + (9 << 30).to_bytes(11, "big")
    return tar_header("big.bin", size, b"0") + bytes(1 << 20)


def refused_copy(server, tar: bytes) -> str:
    """Builds a template whose one COPY is `tar` (gzipped), through E2B's file-hash
    upload; the build's error message."""
    import gzip
    import os
    api = server.api()
    made = api.post("/v3/templates", json={"name": f"hostile-copy-{os.urandom(4).hex()}", "cpuCount": 1, "memoryMB": 512})
    assert made.status_code in (200, 202), made.text
    tid, bid = made.json()["templateID"], made.json()["buildID"]
    digest = os.urandom(32).hex()
    link = api.get(f"/templates/{tid}/files/{digest}").json()
    assert link["present"] is False, link
    put = httpx.put(link["url"], content=gzip.compress(tar, compresslevel=1))
    assert put.status_code < 300, put.text
    start = api.post(f"/v2/templates/{tid}/builds/{bid}",
                     json={"fromTemplate": "base", "steps": [{"type": "COPY", "args": ["big.bin", "/srv/"], "filesHash": digest}]})
    assert start.status_code == 202, start.text
    status = lambda: api.get(f"/templates/{tid}/builds/{bid}/status").json()
    done = wait_until(lambda: status() if status()["status"] in ("error", "ready") else None, "the build to end", timeout=120)
    # A template whose one build failed is deleted whole, as on E2B (its claim was once
    # left behind in the shared home, one per run).
    deleted = api.delete(f"/templates/{tid}")
    assert deleted.status_code == 204, deleted.text
    assert not (server.home / "templates" / tid).exists()
    assert done["status"] == "error", done
    return done["reason"]["message"]


def test_copy_uploads_that_would_fill_the_hosts_disk_are_refused(server):
    """A sparse entry and an upload inflating past the COPY cap fail the build with one
    sentence each, before they are written; nothing is left in the build's scratch."""
    scratch = server.home / "cache" / "build" / "tmp"
    sparse = refused_copy(server, sparse_tar())
    assert "step 1 `COPY big.bin /srv/`" in sparse and "'big.bin' in the uploaded files is a sparse file" in sparse, sparse
    inflating = refused_copy(server, inflating_tar())
    assert "more than 8192 MiB, the most one COPY may hold" in inflating, inflating
    assert not list(scratch.glob("*/context-*")) and not list(scratch.glob("*/copy-*")), list(scratch.rglob("*"))
    assert str(server.home) not in sparse + inflating, "a build message names a host path"
