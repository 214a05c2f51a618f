"""Running sandboxes outlive `hutch serve` (issue 11): their QEMU runs on when the server
stops, gracefully or by SIGKILL, and the next server on the same home adopts them, with
their processes, memory and files, reconnecting to QMP and the agent."""

import os
import shutil
import signal
import subprocess

from hutch import Sandbox
from conftest import API_KEY, HUTCH, free_port, launch, new_home, qemus_under, stop, wait_until

# In the guest: a background process holding a secret in memory and on /tmp.
HOLD = ("python3 -c 'import os,time; s=os.urandom(8).hex(); open(\"/tmp/secret\",\"w\").write(s); "
        "time.sleep(10**6)' >/dev/null 2>&1 &")


def holder(sbx) -> tuple[str, str]:
    """The background process's pid and the secret it wrote."""
    def both():
        out = sbx.commands.run("pgrep -f 'time[.]sleep' || true; cat /tmp/secret 2>/dev/null || true").stdout.split()
        return (out[0], out[1]) if len(out) == 2 and len(out[1]) == 16 else None
    return wait_until(both, "the guest's background python to run and write its secret", timeout=60)


def test_three_running_sandboxes_keep_their_processes_across_a_graceful_and_a_kill_9_restart():
    home, port = new_home("hutch-adopt-"), free_port()
    url = f"http://127.0.0.1:{port}"
    proc = launch(home, port)
    ids: list[str] = []
    try:
        boxes = [Sandbox.create(api_url=url, api_key=API_KEY, timeout=900) for _ in range(3)]
        ids = [b.sandbox_id for b in boxes]
        for b in boxes:
            b.commands.run(HOLD)
            b.files.write("/home/user/note", f"written by {b.sandbox_id}")
        held = {b.sandbox_id: holder(b) for b in boxes}
        qemus = sorted(qemus_under(home))
        assert len(qemus) == 3, qemus
        for how in (signal.SIGTERM, signal.SIGKILL):
            proc.send_signal(how)
            proc.wait(timeout=60)
            # The VMs did not go with the server: the same three QEMU processes run.
            assert sorted(qemus_under(home)) == qemus, f"after {how.name}: QEMUs {qemus_under(home)}, before {qemus}"
            proc = launch(home, port)
            states = {s.sandbox_id: s.state for s in Sandbox.list(api_url=url, api_key=API_KEY)}
            assert states == {i: "running" for i in ids}, f"after {how.name}: {states}"
            for sid in ids:
                back = Sandbox.connect(sid, api_url=url, api_key=API_KEY)
                assert holder(back) == held[sid], f"{sid} after {how.name}: its background process or memory changed"
                assert back.files.read("/home/user/note") == f"written by {sid}"
                assert back.commands.run("echo still-serving").stdout == "still-serving\n"
            assert sorted(qemus_under(home)) == qemus, "an adopted VM was restarted, not adopted"
        # An adopted sandbox pauses, resumes and is killed like any other.
        paused = Sandbox.connect(ids[0], api_url=url, api_key=API_KEY)
        assert paused.pause() is True
        again = Sandbox.connect(ids[0], api_url=url, api_key=API_KEY)
        assert holder(again) == held[ids[0]]
        for sid in ids:
            assert Sandbox.kill(sid, api_url=url, api_key=API_KEY) is True
        ids = []
        assert not qemus_under(home), "killing the adopted sandboxes left QEMU running"
    finally:
        for sid in ids:
            Sandbox.kill(sid, api_url=url, api_key=API_KEY)
        stop(proc)
    assert not list((home / "sandboxes").glob("*")), "sandbox files left"
    shutil.rmtree(home)


def test_kill_on_exit_ends_running_sandboxes_and_a_local_sweep_spares_a_servers_vms(tmp_path):
    """Also: while no server runs, the reaper the server started ends a VM at its end
    time (and only then), and `hutch doctor` lists the VMs no server owns."""
    home, port = new_home("hutch-adopt-"), free_port()
    url = f"http://127.0.0.1:{port}"
    proc = launch(home, port)
    try:
        sbx = Sandbox.create(api_url=url, api_key=API_KEY, timeout=600)
        short = Sandbox.create(api_url=url, api_key=API_KEY, timeout=20)
        short_qemu = next(p for p in qemus_under(home) if short.sandbox_id in open(f"/proc/{p}/cmdline").read())
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        doctor = subprocess.run([str(HUTCH), "doctor"], env=dict(os.environ, HUTCH_HOME=str(home)), capture_output=True, text=True, timeout=120).stdout
        assert "2 VM(s) no server owns" in doctor and f"{short.sandbox_id} (QEMU pid {short_qemu}, ends in" in doctor, doctor
        reaper_log = home / "reaper.log"
        wait_until(lambda: short_qemu not in qemus_under(home), "the reaper to end the orphaned VM at its end time", timeout=90,
                   detail=lambda: reaper_log.read_text() if reaper_log.exists() else "no reaper.log")
        assert f"sandbox={short.sandbox_id}" in reaper_log.read_text() and "ended an orphaned VM at its end time" in reaper_log.read_text()
        # A local command's orphan sweep runs while no server does: the server's VM
        # is left for the next server.
        env = {"HUTCH_HOME": str(home), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
        ran = subprocess.run([str(HUTCH), "run", "--accel", "tcg", "--", "true"], env=env, capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0, ran.stderr
        assert len(qemus_under(home)) == 1, "a local sweep killed the server's VM"
        proc = launch(home, port, "--kill-on-exit")
        assert [s.sandbox_id for s in Sandbox.list(api_url=url, api_key=API_KEY)] == [sbx.sandbox_id]
        assert Sandbox.connect(sbx.sandbox_id, api_url=url, api_key=API_KEY).commands.run("echo adopted").stdout == "adopted\n"
        stop(proc)
        assert not qemus_under(home), "--kill-on-exit left QEMU running"
        proc = launch(home, port)
        assert Sandbox.list(api_url=url, api_key=API_KEY) == []
    finally:
        stop(proc)
    assert not qemus_under(home)
    # With no server and no VM left, the reaper ends too.
    # With no server and no VM left, the reapers end too (one per server start).
    started = (home / "serve.log").read_text().count("hutch serve: listening")
    wait_until(lambda: (home / "reaper.log").read_text().count("the reaper ends") == started, "every reaper to end with nothing left to watch",
               timeout=30, detail=lambda: (home / "reaper.log").read_text())
    assert not list((home / "sandboxes").glob("*")), "sandbox files left"
    shutil.rmtree(home)
