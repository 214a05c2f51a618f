"""The official `e2b` SDK from PyPI, unchanged, against `hutch serve`: only the
E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY environment points it at hutch."""

import pytest
from e2b import Sandbox
from e2b.exceptions import NotFoundException
from e2b.sandbox.commands.command_handle import CommandExitException
from conftest import wait_until


@pytest.fixture
def sbx(server):
    s = Sandbox.create("base", metadata={"suite": "official"}, envs={"FOO": "bar"})
    yield s
    s.kill()


def test_happy_path(server):
    sbx = Sandbox.create("base", metadata={"k": "v"})
    try:
        assert sbx.is_running()
        chunks = []
        result = sbx.commands.run("echo hello from hutch; uname -r", on_stdout=chunks.append)
        assert result.exit_code == 0
        assert result.stdout.startswith("hello from hutch\n")
        assert result.stdout.strip().endswith("-cloud-amd64")
        assert "".join(chunks) == result.stdout
        info = sbx.files.write("/home/user/hello.txt", "hello world")
        assert info.path == "/home/user/hello.txt"
        assert sbx.files.read("/home/user/hello.txt") == "hello world"
        names = [e.name for e in sbx.files.list("/home/user")]
        assert "hello.txt" in names
        assert sbx.files.exists("/home/user/hello.txt")
        assert not sbx.files.exists("/home/user/missing.txt")
    finally:
        assert sbx.kill() is True
    assert not sbx.is_running()
    assert Sandbox.kill(sbx.sandbox_id) is False


def test_commands(sbx):
    r = sbx.commands.run("echo $FOO; echo oops >&2")
    assert (r.stdout, r.stderr) == ("bar\n", "oops\n")
    assert sbx.commands.run("echo $X", envs={"X": "scoped"}).stdout == "scoped\n"
    assert sbx.commands.run("pwd; whoami", cwd="/tmp").stdout == "/tmp\nuser\n"
    assert sbx.commands.run("whoami", user="root").stdout == "root\n"
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("exit 3")
    assert e.value.exit_code == 3
    handle = sbx.commands.run("read line; echo got:$line", background=True, stdin=True)
    sbx.commands.send_stdin(handle.pid, "ping\n")
    assert handle.wait().stdout == "got:ping\n"
    sleeper = sbx.commands.run("sleep 600", background=True)  # the guest's sleep: a long-running process to list and kill
    assert sleeper.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(sleeper.pid)
    assert not sbx.commands.kill(999999)
    broken = sbx.commands.run(r"printf 'a\377b'").stdout
    assert broken == "a\ufffdb"


def test_files(sbx):
    sbx.files.write("data/blob.bin", b"\x00\x01\xfe\xff")
    assert sbx.files.read("data/blob.bin", format="bytes") == b"\x00\x01\xfe\xff"
    assert sbx.files.make_dir("/home/user/newdir") is True
    assert sbx.files.make_dir("/home/user/newdir") is False
    moved = sbx.files.rename("/home/user/data/blob.bin", "/home/user/newdir/blob.bin")
    assert moved.path == "/home/user/newdir/blob.bin"
    deep = [e.path for e in sbx.files.list("/home/user", depth=2)]
    assert "/home/user/newdir/blob.bin" in deep
    sbx.files.remove("/home/user/newdir")
    assert not sbx.files.exists("/home/user/newdir")
    with pytest.raises(NotFoundException):
        sbx.files.read("/home/user/nope.txt")
    written = sbx.files.write_files([
        {"path": "/home/user/m1.txt", "data": "one"},
        {"path": "/home/user/m2.txt", "data": "two"},
    ])
    assert sorted(w.path for w in written) == ["/home/user/m1.txt", "/home/user/m2.txt"]
    assert sbx.files.read("/home/user/m2.txt") == "two"


def test_list_info_timeout_connect(sbx):
    ids = [s.sandbox_id for s in Sandbox.list().next_items()]
    assert sbx.sandbox_id in ids
    from e2b import SandboxQuery
    found = Sandbox.list(query=SandboxQuery(metadata={"suite": "official"})).next_items()
    assert [s.sandbox_id for s in found] == [sbx.sandbox_id]
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": "other"})).next_items() == []
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id and info.metadata == {"suite": "official"}
    sbx.set_timeout(600)
    later = sbx.get_info().end_at
    assert (later - info.started_at).total_seconds() > 590
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.commands.run("echo same").stdout == "same\n"
    metrics = sbx.get_metrics()
    assert metrics and metrics[-1].mem_total > 0


def test_ports_are_reachable_through_the_proxy(server, sbx):
    import httpx

    sbx.commands.run("mkdir -p /home/user/www && head -c 5000000 /dev/urandom > /home/user/www/blob && echo hi > /home/user/www/hi.txt")
    server_proc = sbx.commands.run("cd /home/user/www && python3 -m http.server 8001", background=True)
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8001"}
    tries = []

    def answers():
        tries.append(httpx.get(server.url + "/hi.txt", headers=headers, timeout=30))
        return tries[-1].status_code == 200

    wait_until(answers, "the guest's http.server on port 8001 to answer GET /hi.txt through the proxy", timeout=60,
               interval=0.3, detail=lambda: f"last answer {tries[-1].status_code}: {tries[-1].text}")
    r = tries[-1]
    assert r.status_code == 200 and r.text == "hi\n", r.text
    # Routing by Host, as get_host() addresses it, and a large streamed body.
    host = f"8001-{sbx.sandbox_id}.sandbox.test"
    big = httpx.get(server.url + "/blob", headers={"Host": host}, timeout=120)
    assert big.status_code == 200 and len(big.content) == 5_000_000
    digest = sbx.commands.run("sha256sum /home/user/www/blob | cut -d' ' -f1").stdout.strip()
    import hashlib

    assert hashlib.sha256(big.content).hexdigest() == digest
    closed = httpx.get(server.url + "/", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8999"})
    assert closed.status_code == 502 and "port is not open" in closed.json()["message"]
    server_proc.kill()


ECHO_SERVER = r'''
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 9000)); s.listen(1)
c, _ = s.accept()
req = b""
while b"\r\n\r\n" not in req:
    req += c.recv(1024)
c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n")
while True:
    d = c.recv(1024)
    if not d:
        break
    c.sendall(d.upper())
'''


def listening(sbx, port: int) -> bool:
    """Whether a TCP socket in the guest listens on `port` (IPv4), read from
    /proc/net/tcp without connecting: a probe connection would use up a server that
    accepts once."""
    for line in sbx.commands.run("cat /proc/net/tcp").stdout.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # 0A: LISTEN
            return True
    return False


def test_upgraded_connections_are_spliced_through(server, sbx):
    """A WebSocket-style upgrade through the proxy: after 101 the bytes flow both ways."""
    import socket
    from urllib.parse import urlparse

    sbx.files.write("/home/user/echo.py", ECHO_SERVER)
    sbx.commands.run("python3 /home/user/echo.py", background=True)
    u = urlparse(server.url)
    request = (
        f"GET /chat HTTP/1.1\r\nHost: {u.netloc}\r\nUpgrade: echo\r\nConnection: Upgrade\r\n"
        f"E2b-Sandbox-Id: {sbx.sandbox_id}\r\nE2b-Sandbox-Port: 9000\r\n\r\n"
    ).encode()
    wait_until(lambda: listening(sbx, 9000), "the guest's echo server to listen on 127.0.0.1:9000", timeout=60)
    conn = socket.create_connection((u.hostname, u.port), timeout=30)
    conn.sendall(request)
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = conn.recv(1024)
        if not chunk:
            break
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head
    conn.sendall(b"hello through the tunnel")
    got = b""
    while len(got) < len(b"hello through the tunnel"):
        got += conn.recv(1024)
    assert got == b"HELLO THROUGH THE TUNNEL"
    conn.close()
