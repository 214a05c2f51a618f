"""hutch for a user who is not root. `hutch run`: the user's base template (root's, made
by `hutch setup` before the tests, linked in) boots, and the guest gets root-owned system
files, setuid bits and its own user. `hutch template
build`: a Dockerfile FROM an image on a loopback registry, its layers unpacked in such a
namespace, keeps the image's owners and modes, and its RUN and COPY steps run. `hutch serve`:
each QEMU is still jailed, in a user namespace as an id of the user's /etc/subuid
range (docs/SECURITY.md), and in a cgroup under one delegated to the user."""

import json
import os
import pwd
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from conftest import API_KEY, HUTCH, ROOT, free_port, qemus_under, shared_home, wait_until
from oci_registry import CONFIG, add_dir, add_file, busybox_image, docker_registry, layer, push

USER = "hutch-unpriv"
# The user's base template built by the user, not linked from root's (slow: see below).
UNPRIV_MMDEBSTRAP = os.environ.get("HUTCH_TEST_UNPRIV_MMDEBSTRAP") == "1"


def ensure_user() -> Path:
    try:
        home = Path(pwd.getpwnam(USER).pw_dir)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", USER], check=True)
        home = Path(pwd.getpwnam(USER).pw_dir)
    for table, flag in (("/etc/subuid", "--add-subuids"), ("/etc/subgid", "--add-subgids")):
        lines = open(table).read().splitlines() if os.path.exists(table) else []
        if not any(line.startswith(f"{USER}:") for line in lines):
            subprocess.run(["usermod", flag, "300000-365535", USER], check=True)
    if subprocess.run(["getent", "group", "kvm"], capture_output=True).returncode == 0:
        subprocess.run(["usermod", "--append", "--groups", "kvm", USER], check=True)
    return home


def install_binaries(home: Path) -> Path:
    """The user's own copy: the checkout may sit where only root can read."""
    bin_dir = home / "bin"
    bin_dir.mkdir(exist_ok=True)
    agent = ROOT / "target" / "x86_64-unknown-linux-musl" / "agent" / "hutch-agent"
    for src, name in ((HUTCH, "hutch"), (agent, "hutch-agent")):
        shutil.copy2(src, bin_dir / name)
    user = pwd.getpwnam(USER)
    for p in (bin_dir, bin_dir / "hutch", bin_dir / "hutch-agent"):
        os.chown(p, user.pw_uid, user.pw_gid)
    return bin_dir


def reuse_base_template(hutch_home: Path) -> None:
    """Root's base template, linked into the user's home so the user's hutch finds it
    built. Building it as the user (mmdebstrap in a user namespace, then the image written
    in one) cost 1.5-2 minutes of every run; the image writing in a namespace is still
    proven by the registry-image build below, and `HUTCH_TEST_UNPRIV_MMDEBSTRAP=1` makes
    the first test run the whole unprivileged mmdebstrap instead (`UNPRIV_MMDEBSTRAP`).
    The image stays root's and read-only to the user: hutch only reads a template's
    image (each sandbox's disk is an overlay on it)."""
    if UNPRIV_MMDEBSTRAP:
        return
    dst = hutch_home / "templates" / "base"
    # Root works in a directory the user owns: refuse a link the user could have planted.
    assert not any(p.is_symlink() for p in (hutch_home, hutch_home / "templates", dst)), "a symlink in the user's hutch home"
    src = shared_home() / "templates" / "base"
    image = json.loads((src / "template.json").read_text())["body"]["image"]
    linked = (dst / image).exists() and os.path.samefile(src / image, dst / image)
    if linked and (dst / "template.json").read_bytes() == (src / "template.json").read_bytes():
        return
    shutil.rmtree(dst, ignore_errors=True)
    (dst / image).parent.mkdir(parents=True)
    for manifest in ("template.json", str(Path(image).parent / "template.json")):
        shutil.copyfile(src / manifest, dst / manifest)
    try:
        os.link(src / image, dst / image)
    except OSError:  # another filesystem: a copy, sparse as the original
        subprocess.run(["cp", "--sparse=always", src / image, dst / image], check=True)
    user = pwd.getpwnam(USER)
    for p in [hutch_home, hutch_home / "templates", *(q for q in dst.rglob("*") if q.name != "rootfs.ext4"), dst]:
        os.chown(p, user.pw_uid, user.pw_gid)


def test_hutch_run_boots_the_base_template_without_root():
    home = ensure_user()
    bin_dir = install_binaries(home)
    if UNPRIV_MMDEBSTRAP:
        shutil.rmtree(home / "hutch-home" / "templates" / "base", ignore_errors=True)
    reuse_base_template(home / "hutch-home")
    script = "id -un; stat -c '%u %a' /usr/bin/sudo /etc/shadow; sudo id -u"
    cmd = f"HUTCH_HOME={home}/hutch-home {bin_dir}/hutch run -- sh -c \"{script}\""
    r = subprocess.run(["su", USER, "-c", cmd], capture_output=True, text=True, timeout=1500, cwd=home)
    assert r.returncode == 0, r.stderr[-3000:]
    # The guest's own user, root-owned setuid sudo (mode 4755) and shadow (640), and sudo works.
    assert r.stdout == "user\n0 4755\n0 640\n0\n", (r.stdout, r.stderr[-2000:])
    assert ("building template 'base'" in r.stderr) == UNPRIV_MMDEBSTRAP, r.stderr[-2000:]
    leftovers = list((home / "hutch-home" / "tmp").iterdir()) + list((home / "hutch-home" / "sandboxes").iterdir())
    assert leftovers == [], leftovers


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    with docker_registry(tmp_path_factory.mktemp("registry")) as addr:
        yield addr


def owned_image() -> list[bytes]:
    """busybox, then a layer of files with other owners and modes than its writer's."""
    def owners(tar):
        add_file(tar, "srv/users", b"user's\n", 0o640, owner=1000)
        add_file(tar, "srv/suid", b"#!/bin/sh\n", 0o4755)
        add_dir(tar, "srv/private", 0o750, owner=100)
        add_file(tar, "srv/private/f", b"private\n", 0o600, owner=100)

    return busybox_image(["sh", "cat", "id", "stat", "chown", "echo"]) + [layer(owners)]


def test_hutch_template_build_from_a_registry_image_without_root(registry):
    home = ensure_user()
    bin_dir = install_binaries(home)
    push(registry, "owned", "1", owned_image(), CONFIG)
    ctx = home / "ctx"
    ctx.mkdir(exist_ok=True)
    (ctx / "copied.txt").write_text("copied\n")
    (ctx / "Dockerfile").write_text(
        f"FROM {registry}/owned:1\nCOPY copied.txt /srv/\nUSER root\nRUN echo built > /srv/built && chown 1000:1000 /srv/built\n")
    user = pwd.getpwnam(USER)
    for p in (ctx, *ctx.iterdir()):
        os.chown(p, user.pw_uid, user.pw_gid)
    env = f"HUTCH_HOME={home}/hutch-home"
    build = f"{env} {bin_dir}/hutch template build -t unpriv --insecure-registry {registry} {ctx}"
    r = subprocess.run(["su", USER, "-c", build], capture_output=True, text=True, timeout=1500, cwd=home)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "unpacking 3 layer(s)" in r.stderr, r.stderr[-3000:]
    probe = "stat -c '%n %u:%g %a' /srv/users /srv/suid /srv/private /srv/private/f /srv/built /srv/copied.txt; cat /srv/private/f"
    run = f"{env} {bin_dir}/hutch run --template unpriv -u root -- sh -c \"{probe}\""
    r = subprocess.run(["su", USER, "-c", run], capture_output=True, text=True, timeout=600, cwd=home)
    assert r.returncode == 0, r.stderr[-3000:]
    # The image's owners and modes (setuid kept), the RUN step's chown, COPY's root-owned file.
    assert r.stdout.splitlines() == [
        "/srv/users 1000:1000 640", "/srv/suid 0:0 4755", "/srv/private 100:100 750", "/srv/private/f 100:100 600",
        "/srv/built 1000:1000 644", "/srv/copied.txt 0:0 644", "private"], r.stdout
    removed = subprocess.run(["su", USER, "-c", f"{env} {bin_dir}/hutch template rm unpriv"], capture_output=True, text=True, timeout=120)
    assert removed.returncode == 0, removed.stderr
    hutch_home = home / "hutch-home"
    scratch = hutch_home / "cache" / "build" / "tmp"
    assert not scratch.exists() or list(scratch.iterdir()) == [], list(scratch.iterdir())
    assert list((hutch_home / "tmp").iterdir()) == [] and list((hutch_home / "sandboxes").iterdir()) == []
    assert qemus_under(hutch_home) == []


def subordinate_range(table: str) -> range:
    for line in open(table).read().splitlines():
        name, start, count = line.split(":")
        if name == USER:
            return range(int(start), int(start) + int(count))
    raise AssertionError(f"{USER} has no range in {table}")


def delegate_cgroups(name: str) -> list[Path]:
    """A cgroup per v1 controller handed to the user, as systemd's Delegate=yes or an
    operator would (v2 hosts: one group). hutch makes its VMs' groups inside."""
    user = pwd.getpwnam(USER)
    own = {}
    for line in open("/proc/self/cgroup").read().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(","):
            own[c] = path
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        dirs = [Path("/sys/fs/cgroup") / own[""].lstrip("/") / name]
    else:
        dirs = [Path(f"/sys/fs/cgroup/{c}") / own[c].lstrip("/") / name for c in ("memory", "pids", "cpu")]
    for d in dirs:
        d.mkdir(exist_ok=True)
        for p in [d, *d.iterdir()]:
            os.chown(p, user.pw_uid, user.pw_gid)
    return dirs


def remove_cgroups(dirs: list[Path]) -> None:
    # What the server started beside itself (its reaper) leaves once the server has.
    busy = lambda: [p for d in dirs for p in d.rglob("cgroup.procs") if p.read_text().strip()]
    wait_until(lambda: not busy(), "the server's processes to leave its cgroups", timeout=30, detail=lambda: str(busy()))
    for d in dirs:
        for sub in sorted(d.rglob("*"), key=lambda p: -len(p.parts)):
            if sub.is_dir():
                sub.rmdir()
        d.rmdir()


def status_fields(pid: int) -> dict[str, list[str]]:
    fields = {}
    for line in open(f"/proc/{pid}/status").read().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.split()
    return fields


def test_hutch_serve_without_root_jails_each_vm_as_an_id_of_the_users_range():
    home = ensure_user()
    bin_dir = install_binaries(home)
    user = pwd.getpwnam(USER)
    uids, gids = subordinate_range("/etc/subuid"), subordinate_range("/etc/subgid")
    hutch_home = home / "hutch-home"
    reuse_base_template(hutch_home)
    delegated = delegate_cgroups("hutch-unpriv-serve")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    moves = "; ".join(f"echo $$ > {d}/cgroup.procs" for d in delegated)
    # No pools: the test follows its one sandbox's VM and cgroups.
    serve = f"{bin_dir}/hutch serve --listen 127.0.0.1:{port} --accel tcg --max-sandboxes 2 --no-pool"
    log = open(home / "serve.log", "w")
    # setpriv execs: the server is this process, as the user, with its own groups only.
    proc = subprocess.Popen(
        ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--init-groups", "--reset-env", "sh", "-c",
         f"{moves}; exec env HUTCH_HOME={hutch_home} HUTCH_API_KEY={API_KEY} {serve}"],
        stdout=log, stderr=subprocess.STDOUT, cwd=home,
    )
    conn = dict(api_key=API_KEY, api_url=url, sandbox_url=url)
    try:
        def answers():
            assert proc.poll() is None, (home / "serve.log").read_text()
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(answers, "the unprivileged hutch serve to answer", timeout=120)
        assert status_fields(proc.pid)["Uid"] == [str(user.pw_uid)] * 4
        sbx = Sandbox.create("base", **conn)
        pid = int((hutch_home / "sandboxes" / sbx.sandbox_id / "qemu.pid").read_text())
        f = status_fields(pid)
        # An id of the user's range, not the user's: it cannot signal or read the server.
        assert len(set(f["Uid"])) == 1 and int(f["Uid"][0]) in uids and int(f["Uid"][0]) != user.pw_uid, f["Uid"]
        assert len(set(f["Gid"])) == 1 and int(f["Gid"][0]) in gids, f["Gid"]
        assert f["Groups"] == [] and f["CapEff"] == ["0000000000000000"], (f["Groups"], f["CapEff"])
        assert f["NoNewPrivs"] == ["1"] and f["Seccomp"] == ["2"]
        assert os.readlink(f"/proc/{pid}/ns/user") != os.readlink("/proc/self/ns/user")
        assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
        assert f["NSpid"] == [str(pid), "1"], f["NSpid"]
        assert sorted(n for n in os.listdir(f"/proc/{pid}/root/proc") if n.isdigit()) == ["1"]
        # Its view of the user's hutch home: its own disk, not the database or records.
        root = f"/proc/{pid}/root{hutch_home}"
        seen = {os.path.relpath(os.path.join(d, n), root) for d, ds, fs in os.walk(root) for n in ds + fs}
        assert f"sandboxes/{sbx.sandbox_id}/disk.qcow2" in seen, sorted(seen)
        assert not any(p.endswith((".db", "vm.json", "console.log")) for p in seen), sorted(seen)
        # Its cgroups are under the delegated ones, with the VM's limits.
        groups = [Path(f"/sys/fs/cgroup/{c}{path}") if c else Path(f"/sys/fs/cgroup{path}")
                  for _, c, path in (line.split(":", 2) for line in open(f"/proc/{pid}/cgroup").read().splitlines())
                  if c in ("memory", "pids", "") and "hutch-unpriv-serve" in path]
        assert groups and all(any(g.is_relative_to(d) for d in delegated) for g in groups), groups
        limits = {n: (g / n).read_text().strip() for g in groups for n in ("pids.max", "memory.limit_in_bytes", "memory.max") if (g / n).exists()}
        assert limits["pids.max"] == "256", limits
        assert 512 << 20 < int(limits.get("memory.limit_in_bytes") or limits["memory.max"]) <= 2 << 30, limits
        # The guest works, and what its VM wrote survives a pause: the server (the user)
        # saves it, and the next QEMU, as another id of the range, gets the disk back.
        assert sbx.commands.run("echo jailed > /home/user/f && cat /home/user/f").stdout == "jailed\n"
        assert sbx.pause() is True
        wait_until(lambda: not any(g.exists() for g in groups), "the paused VM's cgroups to go", timeout=30)
        back = Sandbox.connect(sbx.sandbox_id, timeout=120, **conn)
        assert back.commands.run("cat /home/user/f").stdout == "jailed\n"
        pid = int((hutch_home / "sandboxes" / sbx.sandbox_id / "qemu.pid").read_text())
        assert int(status_fields(pid)["Uid"][0]) in uids
        groups = [g for d in delegated for g in (d / "hutch").iterdir() if g.is_dir()]
        assert groups, "the resumed VM has cgroups of its own too"
        back.kill()
        wait_until(lambda: not any(g.exists() for g in groups), "the killed VM's cgroups to go", timeout=30)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        remove_cgroups(delegated)
    assert qemus_under(hutch_home) == []
    assert list((hutch_home / "sandboxes").iterdir()) == []
