"""hutch's own Python SDK (sdk/python) against a real `hutch serve`."""

import asyncio
import os
import subprocess
import sys
import time

import pytest

import hutch
from hutch import AsyncSandbox, Sandbox
from conftest import ROOT, wait_until, wait_until_async


@pytest.fixture
def sbx(server):
    with Sandbox.create(metadata={"suite": "sdk"}, envs={"GREETING": "hi"}) as s:
        yield s


def test_commands(sbx):
    chunks = []
    r = sbx.commands.run("echo $GREETING; echo warn >&2", on_stdout=chunks.append, on_stderr=chunks.append)
    assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "warn\n", 0)
    assert sorted(chunks) == ["hi\n", "warn\n"]
    assert sbx.commands.run("echo $A-$(pwd)-$(whoami)", envs={"A": "x"}, cwd="/tmp", user="root").stdout == "x-/tmp-root\n"
    with pytest.raises(hutch.CommandExitError) as e:
        sbx.commands.run("echo bad >&2; exit 4")
    assert e.value.exit_code == 4 and e.value.stderr == "bad\n"
    h = sbx.commands.run("read x; echo got $x", background=True, stdin=True)
    h.send_stdin("it\n")
    assert h.wait().stdout == "got it\n"
    bg = sbx.commands.run("sleep 600", background=True)  # the guest's sleep: a long-running process to list and kill
    assert bg.pid in [p["pid"] for p in sbx.commands.list()]
    assert bg.kill() is True
    assert sbx.commands.kill(999999) is False
    started = time.time()
    with pytest.raises(hutch.TimeoutError):  # the guest's sleep is what the 2 s timeout cuts short
        sbx.commands.run("sleep 30", timeout=2)
    assert time.time() - started < 20


def test_files(sbx):
    info = sbx.files.write("notes/a.txt", "alpha")
    assert info.path == "/home/user/notes/a.txt"
    assert sbx.files.read("notes/a.txt") == "alpha"
    sbx.files.write("/home/user/b.bin", b"\x00\xff")
    assert sbx.files.read("/home/user/b.bin", format="bytes") == b"\x00\xff"
    assert b"".join(sbx.files.read("/home/user/b.bin", format="stream")) == b"\x00\xff"
    assert sbx.files.exists("notes/a.txt") and not sbx.files.exists("notes/zzz")
    assert sbx.files.make_dir("d1/d2") is True and sbx.files.make_dir("d1/d2") is False
    assert sbx.files.rename("notes/a.txt", "d1/a.txt").path == "/home/user/d1/a.txt"
    listed = {e.path: e.type for e in sbx.files.list("d1", depth=2)}
    assert listed == {"/home/user/d1/a.txt": "file", "/home/user/d1/d2": "dir"}
    sbx.files.remove("d1")
    assert not sbx.files.exists("d1")
    with pytest.raises(hutch.NotFoundError):
        sbx.files.read("/nope")
    events = []
    handle = sbx.files.watch_dir("/home/user", events.append)
    try:
        sbx.files.write("/home/user/watched.txt", "w")
        wait_until(lambda: any(e.name == "watched.txt" for e in events), "watch_dir to report /home/user/watched.txt",
                   detail=lambda: f"events {events}")
    finally:
        handle.stop()
    assert any(e.name == "watched.txt" and e.type in ("create", "write") for e in events), events


def test_lifecycle_and_errors(server, sbx):
    assert sbx.is_running()
    assert sbx.sandbox_id in [s.sandbox_id for s in Sandbox.list(metadata={"suite": "sdk"})]
    sbx.set_timeout(900)
    assert (sbx.get_info().end_at - sbx.get_info().started_at).total_seconds() > 890
    assert Sandbox.connect(sbx.sandbox_id).commands.run("echo again").stdout == "again\n"
    assert Sandbox.kill("inothere") is False
    with pytest.raises(hutch.NotFoundError):
        Sandbox.connect("inothere")
    with pytest.raises(hutch.AuthenticationError):
        Sandbox.create(api_key="e2b_" + "f" * 40)
    with pytest.raises(hutch.InvalidArgumentError):
        Sandbox.create(template="no-such-template")
    assert sbx.get_host(8080) == f"8080-{sbx.sandbox_id}.127.0.0.1"


def test_pause_modes_reboot_and_disk_only_snapshots(server, sbx):
    """hutch's SDK speaks E2B's pause modes: a pause without memory and a reboot keep the
    files and boot the guest; a disk-only snapshot starts sandboxes by booting."""
    boot = lambda s: s.commands.run("cat /proc/sys/kernel/random/boot_id").stdout
    sbx.files.write("/home/user/kept.txt", "kept")
    first = boot(sbx)
    assert sbx.pause(mode="filesystem") is True
    assert sbx.get_info().pause_mode == "filesystem"
    back = Sandbox.connect(sbx.sandbox_id)
    assert back.files.read("/home/user/kept.txt") == "kept" and boot(back) != first
    second = boot(back)
    assert back.pause() is True
    assert sbx.get_info().pause_mode == "full"
    rebooted = Sandbox.connect(sbx.sandbox_id, on_resume="reboot")
    assert boot(rebooted) != second and rebooted.files.read("/home/user/kept.txt") == "kept"
    snap = rebooted.create_snapshot(mode="filesystem")
    assert snap.memory is False
    with Sandbox.create(template=snap.snapshot_id) as started:
        assert started.files.read("/home/user/kept.txt") == "kept"
    assert Sandbox.delete_snapshot(snap.snapshot_id)
    with pytest.raises(ValueError):
        rebooted.pause(mode="sideways")


def test_async_sandbox(server):
    async def main():
        async with await AsyncSandbox.create(metadata={"suite": "async"}) as s:
            out = []
            r = await s.commands.run("for i in 1 2; do echo $i; done", on_stdout=out.append)
            assert r.stdout == "1\n2\n" and "".join(out) == "1\n2\n"
            await s.files.write("x.txt", "async")
            assert await s.files.read("x.txt") == "async"
            assert [e.name for e in await s.files.list("/home/user") if e.name == "x.txt"] == ["x.txt"]
            events = []
            watch = await s.files.watch_dir("/home/user", events.append)
            try:
                await s.commands.run("touch /home/user/seen")
                await wait_until_async(lambda: any(e.name == "seen" for e in events), "the async watch_dir to report /home/user/seen",
                                       detail=lambda: f"events {events}")
            finally:
                await watch.stop()
            assert any(e.name == "seen" for e in events), events
            with pytest.raises(hutch.CommandExitError):
                await s.commands.run("false")
            sid = s.sandbox_id
        assert sid not in [x.sandbox_id for x in await AsyncSandbox.list()]

    asyncio.run(main())


def test_quickstart_example_runs(server):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "sdk" / "python"))
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "tick 3" in out.stdout and "hello from 6.1" in out.stdout and "exit code 3: no such thing" in out.stdout
    assert "script.py" in out.stdout and out.stdout.strip().endswith("sandbox killed")
