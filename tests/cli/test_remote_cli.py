"""`hutch create/ls/exec/cp/kill/logs/timeout` against a real `hutch serve`."""

import json
import os
import subprocess

from conftest import HUTCH


def hutch(server, *args, stdin=None):
    env = dict(os.environ, HUTCH_API_URL=server.url, HUTCH_API_KEY=server.key)
    return subprocess.run([str(HUTCH), *args], env=env, input=stdin, capture_output=True, timeout=120)


def test_docker_like_workflow(server, tmp_path):
    made = hutch(server, "create", "--metadata", "owner=cli", "--timeout", "120")
    assert made.returncode == 0, made.stderr
    sid = made.stdout.decode().strip()
    try:
        listed = hutch(server, "ls")
        assert sid in listed.stdout.decode() and "owner=cli" in listed.stdout.decode()
        as_json = json.loads(hutch(server, "ls", "--json", "--metadata", "owner=cli").stdout)
        assert [s["sandboxID"] for s in as_json] == [sid]

        r = hutch(server, "exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 6")
        assert (r.stdout, r.stderr, r.returncode) == (b"out\n", b"err\n", 6)
        r = hutch(server, "exec", "-i", sid, "--", "tr", "a-z", "A-Z", stdin=b"shout\n")
        assert r.stdout == b"SHOUT\n"
        r = hutch(server, "exec", "-u", "root", "-w", "/tmp", "-e", "X=1", sid, "--", "sh", "-c", "echo $X $(pwd) $(whoami)")
        assert r.stdout == b"1 /tmp root\n"

        payload = bytes(range(256)) * 4096
        local = tmp_path / "in.bin"
        local.write_bytes(payload)
        assert hutch(server, "cp", str(local), f"{sid}:/home/user/in.bin").returncode == 0
        back = tmp_path / "out.bin"
        assert hutch(server, "cp", f"{sid}:/home/user/in.bin", str(back)).returncode == 0
        assert back.read_bytes() == payload
        assert hutch(server, "cp", f"{sid}:/home/user/in.bin", "-").stdout == payload
        owner = hutch(server, "exec", sid, "--", "stat", "-c", "%U", "/home/user/in.bin")
        assert owner.stdout == b"user\n"

        assert "hutch-agent: ready" in hutch(server, "logs", sid).stdout.decode()
        assert hutch(server, "timeout", sid, "600").returncode == 0
        # Output cut short by the reader is not an error.
        piped = subprocess.run(f"{HUTCH} ls | head -c 1", shell=True, capture_output=True,
                               env=dict(os.environ, HUTCH_API_URL=server.url, HUTCH_API_KEY=server.key))
        assert b"panicked" not in piped.stderr
    finally:
        killed = hutch(server, "kill", sid)
    assert killed.returncode == 0 and killed.stdout.decode().strip() == sid
    assert sid not in hutch(server, "ls").stdout.decode()


def test_errors_are_one_clear_line(server):
    r = hutch(server, "exec", "inothere", "--", "true")
    assert r.returncode == 1 and b"not found" in r.stderr and b"panicked" not in r.stderr
    r = hutch(server, "kill", "inothere")
    assert r.returncode == 1 and b"no sandbox 'inothere'" in r.stderr
    r = hutch(server, "cp", "a", "b")
    assert r.returncode == 1 and b"one side of cp must be a sandbox path" in r.stderr
    env = dict(os.environ, HUTCH_API_URL=server.url)
    env.pop("HUTCH_API_KEY", None)
    r = subprocess.run([str(HUTCH), "ls"], env=env, capture_output=True)
    assert r.returncode == 1 and b"HUTCH_API_KEY" in r.stderr
    r = hutch(server, "ls", "--api-url", "http://127.0.0.1:1")
    assert r.returncode == 1 and b"cannot reach hutch serve" in r.stderr


def test_run_code(server, tmp_path):
    sid = hutch(server, "create", "--template", "code-interpreter").stdout.decode().strip()
    try:
        assert hutch(server, "run-code", sid, "x = 40").returncode == 0
        r = hutch(server, "run-code", sid, "print('side'); x + 2")
        assert (r.stdout, r.returncode) == (b"side\n42\n", 0)
        r = hutch(server, "run-code", sid, "-", stdin=b"import matplotlib.pyplot as plt\nplt.plot([1,2])\nplt.show()\n")
        assert r.returncode == 0, r.stderr
        r = hutch(server, "run-code", "--save-images", str(tmp_path), sid, "import matplotlib.pyplot as plt\nplt.plot([2,1])\nplt.show()")
        assert (tmp_path / "result-0.png").read_bytes().startswith(b"\x89PNG")
        r = hutch(server, "run-code", sid, "undefined")
        assert r.returncode == 1 and b"NameError" in r.stderr
    finally:
        hutch(server, "kill", sid)


def test_pause_resume_fork_from_the_cli(server):
    sid = hutch(server, "create", "--timeout", "300").stdout.decode().strip()
    try:
        assert hutch(server, "exec", sid, "--", "sh", "-c", "echo 1 > /home/user/n").returncode == 0
        r = hutch(server, "pause", sid)
        assert (r.returncode, r.stdout.decode().strip()) == (0, sid), r.stderr
        assert f"{sid}  base       paused" in hutch(server, "ls").stdout.decode()
        r = hutch(server, "pause", sid)
        assert r.returncode == 0 and b"already paused" in r.stderr
        r = hutch(server, "exec", sid, "--", "cat", "/home/user/n")
        assert r.stdout == b"1\n", "exec resumes a paused sandbox, as E2B's connect does"
        forks = hutch(server, "fork", sid, "--count", "2")
        assert forks.returncode == 0, forks.stderr
        ids = forks.stdout.decode().split()
        assert len(ids) == 2 and sid not in ids
        for i, f in enumerate(ids):
            assert hutch(server, "exec", f, "--", "sh", "-c", f"echo {i} >> /home/user/n").returncode == 0
        assert [hutch(server, "exec", f, "--", "cat", "/home/user/n").stdout for f in ids] == [b"1\n0\n", b"1\n1\n"]
        assert hutch(server, "kill", *ids).returncode == 0
        r = hutch(server, "fork", sid, "--count", "21")
        assert r.returncode == 2 and b"21" in r.stderr
    finally:
        hutch(server, "kill", sid)
