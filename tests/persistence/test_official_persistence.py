"""Pause/resume, fork and snapshots through the official SDKs (e2b and
e2b-code-interpreter, scripts/lib.sh), unchanged, against `hutch serve`."""

import pytest
import time

from e2b import Sandbox
from e2b_code_interpreter import Sandbox as CodeSandbox
from conftest import API_KEY, held_secret, wait_until

# In the guest: writes a secret, then stays alive (its sleep keeps the process whose survival is checked).
HOLD = "python3 -c 'import os,time; open(\"/tmp/secret\",\"w\").write(os.urandom(8).hex()); time.sleep(10**6)'"


def guest_skew(sbx) -> float:
    """The guest clock's certain error in seconds: how far its reading lies outside the
    host's before/after window (a slow round trip widens the window, never the error)."""
    before = time.time()
    guest = float(sbx.commands.run("date +%s.%N").stdout)
    after = time.time()
    return guest - before if guest < before else guest - after if guest > after else 0.0


def state_of(sandbox_id: str) -> str:
    return next(s.state.value for s in Sandbox.list().next_items() if s.sandbox_id == sandbox_id)


@pytest.mark.sdk_versions  # pause's body ({"memory": true} against {}) and the v1 connect that resumes; a code-interpreter create on v1
def test_interpreter_variable_file_and_process_survive_pause_and_connect(server):
    sbx = CodeSandbox.create(timeout=600)
    try:
        assert sbx.run_code("kept = 6 * 7").error is None
        sbx.files.write("/home/user/notes.txt", "written before the pause")
        sbx.commands.run(HOLD, background=True)
        secret = held_secret(sbx)
        assert sbx.files.read("/tmp/secret") == secret
        # The SMBIOS tables live in QEMU's firmware RAM block, not in guest RAM: a pause
        # must keep that block too.
        dmi = sbx.commands.run("sha256sum /sys/firmware/dmi/tables/DMI", user="root").stdout
        # A background command across the pause (issue 37, item 7): the time the guest
        # spends paused (seconds, below) does not count against its sleep, which goes on
        # from where it was once the guest runs again.
        sbx.commands.run("sleep 5 && echo done > /home/user/after-pause", background=True)
        assert sbx.pause() is True
        assert state_of(sbx.sandbox_id) == "paused"
        # Restored from the template's snapshot, it kept only the pages it changed
        # since (guest_ram.rs), not the ~300 MiB the interpreter's guest holds.
        kept = server.home / "sandboxes" / sbx.sandbox_id / "memory.state"
        with open(kept, "rb") as f:
            assert f.read(8) == b"HUTCHMEM", "the pause saved all of memory, not the changed pages"
        assert kept.stat().st_size < 96 << 20, f"{kept.stat().st_size >> 20} MiB kept by a pause of a nearly idle interpreter"
        assert sbx.pause() is False, "pausing a paused sandbox must answer 409 (False)"
        # A snapshot of the paused sandbox makes those changed pages a whole memory.
        snap = sbx.create_snapshot()
        child = CodeSandbox.create(template=snap.snapshot_id, timeout=120)
        try:
            assert child.run_code("kept").text == "42"
            assert child.files.read("/tmp/secret") == secret
            assert child.commands.run("sha256sum /sys/firmware/dmi/tables/DMI", user="root").stdout == dmi
        finally:
            child.kill()
            Sandbox.delete_snapshot(snap.snapshot_id)
        # Not a synchronisation: the sandbox stays paused for a while on purpose, far
        # longer than the 0.1 s skew bound below, so a guest clock that did not follow
        # the host across the pause cannot pass unnoticed.
        time.sleep(2)
        back = CodeSandbox.connect(sbx.sandbox_id)
        assert back.is_running()
        assert not back.files.exists("/home/user/after-pause"), "the time paused counted against a running sleep"
        assert state_of(sbx.sandbox_id) == "running"
        assert back.run_code("kept").text == "42"
        assert back.files.read("/home/user/notes.txt") == "written before the pause"
        assert back.files.read("/tmp/secret") == secret
        assert "time.sleep" in back.commands.run("pgrep -af python3").stdout
        assert back.commands.run("sha256sum /sys/firmware/dmi/tables/DMI", user="root").stdout == dmi
        skew = guest_skew(back)
        assert abs(skew) <= 0.1, f"the guest clock is {skew:.3f} s off the host's after the pause"
        wait_until(lambda: back.files.exists("/home/user/after-pause"), "the command started before the pause to finish", timeout=30)
    finally:
        Sandbox.kill(sbx.sandbox_id)


@pytest.mark.sdk_versions  # fork's body (timeout 300 sent against left out)
def test_fork_gives_independent_copies(server):
    src = Sandbox.create(timeout=300)
    try:
        src.files.write("/home/user/who", "source\n")
        forks = src.fork(count=2)
        assert all(isinstance(f, Sandbox) for f in forks), forks
        a, b = forks
        assert len({src.sandbox_id, a.sandbox_id, b.sandbox_id}) == 3
        a.commands.run("echo a >> /home/user/who")
        b.commands.run("echo b >> /home/user/who")
        src.commands.run("echo src >> /home/user/who")
        assert a.files.read("/home/user/who") == "source\na\n"
        assert b.files.read("/home/user/who") == "source\nb\n"
        assert src.files.read("/home/user/who") == "source\nsrc\n"
        skew = guest_skew(a)
        assert abs(skew) <= 0.1, f"a fork's clock is {skew:.3f} s off the host's"
        for f in forks:
            f.kill()
    finally:
        src.kill()


def test_snapshot_is_a_template_and_can_be_deleted(server):
    src = Sandbox.create(timeout=300)
    try:
        src.files.write("/home/user/from-snapshot", "yes")
        snap = src.create_snapshot(name="persist-test")
        assert snap.snapshot_id and snap.names == ["persist-test"]
        listed = [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
        assert snap.snapshot_id in listed
        for template in (snap.snapshot_id, "persist-test"):
            child = Sandbox.create(template, timeout=120)
            assert child.files.read("/home/user/from-snapshot") == "yes"
            child.kill()
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
    finally:
        src.kill()


def test_timeout_pauses_when_asked(server):
    sbx = Sandbox.create(timeout=3, lifecycle={"on_timeout": "pause"})
    try:
        sbx.files.write("/home/user/kept", "after auto-pause")
        wait_until(lambda: state_of(sbx.sandbox_id) == "paused", "the sandbox to be paused at its 3 s timeout (on_timeout: pause)",
                   timeout=60, interval=0.5, detail=lambda: f"state {state_of(sbx.sandbox_id)!r}")
        back = Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert back.files.read("/home/user/kept") == "after auto-pause"
    finally:
        Sandbox.kill(sbx.sandbox_id)


@pytest.mark.sdk_versions  # autoResume in the v1 create body, and pause's body
def test_traffic_resumes_a_sandbox_that_asked_for_it(server):
    """E2B's auto_resume: a command, a file call or a port request to the paused
    sandbox resumes it, when it carries the sandbox's token (issue 12, item 13)."""
    import httpx
    sbx = Sandbox.create(timeout=600, lifecycle={"on_timeout": "pause", "auto_resume": True})
    plain = Sandbox.create(timeout=600, lifecycle={"on_timeout": "pause"})
    try:
        sbx.commands.run(HOLD, background=True)
        secret = held_secret(sbx)
        sbx.pause()
        assert state_of(sbx.sandbox_id) == "paused"
        # Without its access token the traffic resumes nothing.
        refused = httpx.get(server.url + "/health", headers={"E2b-Sandbox-Id": sbx.sandbox_id})
        assert refused.status_code == 403, refused.text
        assert state_of(sbx.sandbox_id) == "paused"
        # The SDK's own call, with the token, resumes it: memory and processes as they were.
        assert sbx.commands.run("cat /tmp/secret").stdout == secret
        assert state_of(sbx.sandbox_id) == "running"
        sbx.pause()
        assert sbx.files.read("/tmp/secret") == secret
        assert state_of(sbx.sandbox_id) == "running"

        # A sandbox that did not ask stays paused and says so.
        plain.pause()
        answer = httpx.get(server.url + "/health", headers={"E2b-Sandbox-Id": plain.sandbox_id})
        assert answer.status_code == 502 and "paused" in answer.json()["message"], answer.text
        assert state_of(plain.sandbox_id) == "paused"
    finally:
        Sandbox.kill(sbx.sandbox_id)
        Sandbox.kill(plain.sandbox_id)


def test_fifty_snapshot_create_kill_cycles_leave_nothing(server):
    import sqlite3

    for i in range(50):
        sbx = Sandbox.create(timeout=60)
        if i % 10 == 0:
            assert sbx.commands.run("echo $E2B_SANDBOX_ID").stdout.strip() == sbx.sandbox_id
        assert sbx.kill() is True
    assert [s for s in Sandbox.list().next_items()] == []
    # The server keeps warm pools (its default): their sandboxes are all that may run.
    from conftest import only_pools_left
    only_pools_left(server)
    with sqlite3.connect(server.home / "hutch.db") as db:
        assert db.execute("SELECT COUNT(*) FROM sandboxes").fetchone()[0] == 0, "sandbox rows left"


def test_a_sandbox_started_from_a_snapshot_can_be_snapshotted_and_forked(server):
    """Its template id is the snapshot's (as E2B shows it); its own snapshots and forks
    still boot with the template underneath (issue 11: they named the snapshot id,
    which no one could prepare, and nobody could start them)."""
    src = Sandbox.create(timeout=300)
    first = second = None
    try:
        src.files.write("/home/user/layer", "one")
        first = src.create_snapshot()
        child = Sandbox.create(first.snapshot_id, timeout=300)
        try:
            child.files.write("/home/user/layer2", "two")
            second = child.create_snapshot()
            grandchild = Sandbox.create(second.snapshot_id, timeout=120)
            try:
                assert grandchild.files.read("/home/user/layer") == "one"
                assert grandchild.files.read("/home/user/layer2") == "two"
            finally:
                grandchild.kill()
            forks = child.fork(count=1)
            try:
                assert forks[0].files.read("/home/user/layer2") == "two"
            finally:
                for f in forks:
                    f.kill()
        finally:
            child.kill()
    finally:
        src.kill()
        for snap in (first, second):
            if snap is not None:
                Sandbox.delete_snapshot(snap.snapshot_id)


def pause_without_memory(sbx) -> None:
    """The SDK's filesystem-only pause: `mode` from e2b 2.5x on, `keep_memory` before."""
    import inspect
    if "mode" in inspect.signature(sbx.pause).parameters:
        sbx.pause(mode="filesystem")
    else:
        sbx.pause(keep_memory=False)


def running_holder(sbx) -> str:
    """HOLD's process, if it runs (the bracket keeps the pattern from matching the shell
    that runs pgrep)."""
    return sbx.commands.run("pgrep -f 'time[.]sleep' || true").stdout.strip()


def boot_id(sbx) -> str:
    return sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout.strip()


@pytest.mark.sdk_versions  # pause with {"memory": false} and {"memory": true}; v1 connect resuming each
def test_a_pause_without_memory_keeps_files_and_boots_on_resume(server):
    """E2B's filesystem-only pause (issue 12, item 12): the files stay, the processes go,
    the guest boots on resume; the timeout's auto-pause can be asked to do the same, and
    a full pause can be resumed by a reboot."""
    import httpx
    sbx = Sandbox.create("base", timeout=600, envs={"KEPT_ENV": "yes"})
    try:
        sbx.files.write("/home/user/kept.txt", "written before the pause")
        sbx.commands.run(HOLD, background=True)
        held_secret(sbx)
        booted = boot_id(sbx)
        pause_without_memory(sbx)
        assert state_of(sbx.sandbox_id) == "paused"
        detail = httpx.get(f"{server.url}/sandboxes/{sbx.sandbox_id}", headers={"X-API-Key": API_KEY}).json()
        assert detail.get("pauseMode") == "filesystem", detail
        back = Sandbox.connect(sbx.sandbox_id, timeout=600)
        assert back.files.read("/home/user/kept.txt") == "written before the pause"
        assert boot_id(back) != booted, "the guest did not boot"
        assert not running_holder(back), "a process outlived the pause"
        # Secure as before, with the sandbox's own environment.
        assert back.commands.run("echo $KEPT_ENV").stdout.strip() == "yes"

        # A full pause, resumed by booting (e2b 2.5x's on_resume="reboot"; memory: false on the wire).
        back.commands.run(HOLD, background=True)
        held_secret(back)
        booted = boot_id(back)
        back.pause()
        assert httpx.get(f"{server.url}/sandboxes/{sbx.sandbox_id}", headers={"X-API-Key": API_KEY}).json().get("pauseMode") == "full"
        reply = httpx.post(f"{server.url}/v2/sandboxes/{sbx.sandbox_id}/connect", headers={"X-API-Key": API_KEY},
                           json={"timeout": 600, "memory": False}, timeout=300)
        assert reply.status_code == 201, reply.text
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.files.read("/home/user/kept.txt") == "written before the pause"
        assert boot_id(again) != booted
        assert not running_holder(again), "a process outlived the reboot"
    finally:
        Sandbox.kill(sbx.sandbox_id)


@pytest.mark.sdk_versions  # autoPauseMemory from the old on_timeout keep_memory spelling, on the v1 create
def test_the_timeout_can_pause_without_memory(server):
    import inspect
    import httpx
    mode = "mode" if "mode" in inspect.signature(Sandbox.pause).parameters else None
    on_timeout = {"action": "pause", "mode": "filesystem"} if mode else {"action": "pause", "keep_memory": False}
    sbx = Sandbox.create("base", timeout=4, lifecycle={"on_timeout": on_timeout})
    try:
        sbx.files.write("/home/user/kept", "after a disk-only auto-pause")
        # pauseMode shows once the pause has finished (E2B's word); "paused" shows from its start.
        detail = lambda: httpx.get(f"{server.url}/sandboxes/{sbx.sandbox_id}", headers={"X-API-Key": API_KEY}).json()
        wait_until(lambda: detail().get("pauseMode"), "the sandbox to be paused at its 4 s timeout", timeout=60, interval=0.5, detail=detail)
        assert detail()["pauseMode"] == "filesystem"
        back = Sandbox.connect(sbx.sandbox_id, timeout=600)
        assert back.files.read("/home/user/kept") == "after a disk-only auto-pause"
    finally:
        Sandbox.kill(sbx.sandbox_id)
    # E2B's two refusals, word for word.
    for body, words in [({"autoPause": False, "autoPauseMemory": False}, "only applies when autoPause is true"),
                        ({"autoPause": True, "autoPauseMemory": False, "autoResume": {"enabled": True}}, "cannot be combined with autoResume")]:
        r = httpx.post(f"{server.url}/v2/sandboxes", headers={"X-API-Key": API_KEY}, json={"templateID": "base", **body})
        assert r.status_code == 400 and words in r.json()["message"], r.text
