"""hutch's Python SDK and CLI: paused sandboxes outlive a server restart; snapshot
archives round-trip between servers, and a tampered archive is refused."""

import shutil
import subprocess
import tarfile

import pytest

import hutch
from hutch import Sandbox
from conftest import API_KEY, HUTCH, free_port, held_secret, launch, new_home, qemus_under, stop

# In the guest: writes a secret, then stays alive (its sleep keeps the process whose survival is checked).
HOLD = "python3 -c 'import os,time; open(\"/tmp/secret\",\"w\").write(os.urandom(8).hex()); time.sleep(10**6)' >/dev/null 2>&1 &"


def test_a_paused_sandbox_resumes_after_the_server_restarts(tmp_path):
    home, port = new_home("hutch-restart-"), free_port()
    url = f"http://127.0.0.1:{port}"
    proc = launch(home, port)
    try:
        sbx = Sandbox.create(api_url=url, api_key=API_KEY, timeout=600)
        sbx.commands.run(HOLD)
        secret = held_secret(sbx)
        assert sbx.files.read("/tmp/secret") == secret
        sbx.commands.run("echo on-disk > /home/user/f")
        assert sbx.pause() is True
        running = Sandbox.create(api_url=url, api_key=API_KEY)
        stop(proc)
        # The running one's VM runs on for the next server (test_adoption.py); the paused one has none.
        assert len(qemus_under(home)) == 1, qemus_under(home)
        proc = launch(home, port)
        states = {s.sandbox_id: s.state for s in Sandbox.list(api_url=url, api_key=API_KEY)}
        assert states == {sbx.sandbox_id: "paused", running.sandbox_id: "running"}, f"after restart: {states}"
        back = Sandbox.connect(sbx.sandbox_id, api_url=url, api_key=API_KEY)
        assert back.files.read("/tmp/secret") == secret
        assert back.files.read("/home/user/f") == "on-disk\n"
        assert "time.sleep" in back.commands.run("pgrep -af python3").stdout
        assert back.kill() is True
        assert Sandbox.kill(running.sandbox_id, api_url=url, api_key=API_KEY) is True
    finally:
        stop(proc)
    assert not list((home / "sandboxes").glob("*")), "sandbox files left"
    shutil.rmtree(home)


def test_archive_round_trip_and_tampering(server, tmp_path):
    src = Sandbox.create()
    try:
        src.files.write("/home/user/payload", "exported")
        snap = src.create_snapshot("archived")
    finally:
        src.kill()
    archive = tmp_path / "archived.tar"
    size = Sandbox.export_snapshot("archived", str(archive))
    assert size == archive.stat().st_size > 0
    with tarfile.open(archive) as t:
        assert t.getnames() == ["manifest.json", "disk.qcow2"]

    # Import into a second server, as another host would.
    home, port = new_home("hutch-import-"), free_port()
    url = f"http://127.0.0.1:{port}"
    proc = launch(home, port)
    try:
        imported = Sandbox.import_snapshot(str(archive), api_url=url, api_key=API_KEY)
        assert imported.names == ["archived"] and not imported.memory
        child = Sandbox.create("archived", api_url=url, api_key=API_KEY)
        assert child.files.read("/home/user/payload") == "exported"
        child.kill()

        tampered = tmp_path / "tampered.tar"
        data = bytearray(archive.read_bytes())
        data[len(data) // 2] ^= 0xFF
        tampered.write_bytes(bytes(data))
        with pytest.raises(hutch.InvalidArgumentError, match="modified or is corrupt"):
            Sandbox.import_snapshot(str(tampered), name="tampered", api_url=url, api_key=API_KEY)
        with pytest.raises(hutch.ConflictError, match="exists"):
            Sandbox.import_snapshot(str(archive), api_url=url, api_key=API_KEY)
        # The CLI, the same way: import under another name, export again.
        env = {"HUTCH_API_URL": url, "HUTCH_API_KEY": API_KEY, "PATH": "/usr/bin:/bin"}
        out = subprocess.run([str(HUTCH), "snapshot", "import", str(archive), "--name", "via-cli"], env=env, capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.strip() == "via-cli", out.stderr
        out = subprocess.run([str(HUTCH), "snapshot", "import", str(tampered)], env=env, capture_output=True, text=True)
        assert out.returncode == 1 and "modified or is corrupt" in out.stderr, out.stderr
        ls = subprocess.run([str(HUTCH), "snapshot", "ls"], env=env, capture_output=True, text=True).stdout
        assert "archived" in ls and "via-cli" in ls and "tampered" not in ls
        assert Sandbox.delete_snapshot("via-cli", api_url=url, api_key=API_KEY)
        assert Sandbox.delete_snapshot("archived", api_url=url, api_key=API_KEY)
    finally:
        stop(proc)
    assert not list((home / "snapshots" / "sandboxes").glob("*")), "snapshot files left after delete"
    shutil.rmtree(home)
    assert Sandbox.delete_snapshot(snap.snapshot_id)
