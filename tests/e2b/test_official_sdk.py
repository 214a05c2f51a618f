"""The official `e2b` SDK from PyPI, unchanged, against `hutch serve`: only the
E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY environment points it at hutch. Run with the
newest and the oldest supported SDK sets (scripts/python-tests.sh)."""

from importlib.metadata import version

import pytest
from e2b import Sandbox
from e2b.exceptions import NotFoundException, TimeoutException
from e2b.sandbox.commands.command_handle import CommandExitException
from conftest import wait_until


@pytest.fixture
def sbx(server):
    s = Sandbox.create("base", metadata={"suite": "official"}, envs={"FOO": "bar"})
    yield s
    s.kill()


@pytest.mark.sdk_versions  # the create route (v1 POST /sandboxes with timeout, secure and allowInternetAccess, against v2), end to end
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


@pytest.mark.sdk_versions  # the process service's messages: stdin, signals, list, non-UTF-8 output
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


@pytest.mark.sdk_versions  # the filesystem service and the multipart upload of write_files
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


@pytest.mark.sdk_versions  # connect (v1 with timeout 300 against v2 without) after set_timeout(600) must only extend it
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
    # A range holds only its points (issue 37, item 6): one that ended an hour ago none.
    import datetime
    now = datetime.datetime.now(datetime.timezone.utc)
    hour = datetime.timedelta(hours=1)
    assert sbx.get_metrics(start=now - 2 * hour, end=now - hour) == []
    assert sbx.get_metrics(start=now - hour, end=now + hour)


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


@pytest.mark.sdk_versions  # the /health probe after a broken stream, and how a 502 is read
def test_a_command_whose_sandbox_is_killed_ends_as_e2b_says(server):
    """The SDK asks envd's /health after a stream breaks, and names a sandbox that is
    gone "killed or reached its end of life" (issue 12, item 11)."""
    sbx = Sandbox.create("base")
    handle = sbx.commands.run("sleep 600", background=True)  # the guest's sleep: a command that outlives its sandbox
    assert Sandbox.kill(sbx.sandbox_id) is True
    with pytest.raises(Exception) as ended:
        handle.wait()
    if version("e2b").startswith("2.45."):
        # Its Connect client does not take a dropped HTTP/1.1 stream for a transport
        # failure, so it never asks /health and calls it a timeout.
        assert isinstance(ended.value, TimeoutException) and "sandbox timeout" in str(ended.value), repr(ended.value)
    else:
        assert "sandbox was killed or reached its end of life" in str(ended.value), repr(ended.value)


@pytest.mark.sdk_versions  # signed URLs and the upload/download headers
def test_signed_file_urls_work_through_one_sandbox_url(server):
    """With E2B_SANDBOX_URL set (as here) the SDK's signed URLs name no sandbox: hutch
    finds it by the signature, and a bad one is a 401 (issue 12, item 14)."""
    import httpx
    sbx = Sandbox.create("base")
    other = Sandbox.create("base")
    try:
        sbx.files.write("/home/user/signed.txt", "signed content")
        url = sbx.download_url("/home/user/signed.txt", use_signature_expiration=120)
        assert sbx.sandbox_id not in url and url.startswith(server.url + "/files?")
        got = httpx.get(url)
        assert (got.status_code, got.text) == (200, "signed content")
        up = httpx.post(other.upload_url("/home/user/up.txt"), files={"file": ("up.txt", b"uploaded")})
        assert up.status_code == 200, up.text
        assert other.files.read("/home/user/up.txt") == "uploaded"
        assert not sbx.files.exists("/home/user/up.txt"), "the upload went to the sandbox whose token signed it"
        for bad in (url.replace("signature=v1_", "signature=v1_x"), url.split("&signature")[0], url.replace("signed.txt", "other.txt")):
            refused = httpx.get(bad)
            assert refused.status_code == 401, (bad, refused.status_code, refused.text)
            assert refused.json()["code"] == 401
        expired = httpx.get(sbx.download_url("/home/user/signed.txt", use_signature_expiration=-10))
        assert expired.status_code == 401 and "expired" in expired.text, expired.text
    finally:
        sbx.kill()
        other.kill()


@pytest.mark.sdk_versions  # Content-Encoding and Accept-Encoding on /files
def test_gzip_uploads_and_downloads(server, sbx):
    """files.write(gzip=True) sends Content-Encoding: gzip, files.read(gzip=True)
    asks for it; raw requests see envd's headers (issue 12, item 6)."""
    import gzip
    import httpx
    text = "compress me " * 5000
    sbx.files.write("/home/user/packed.txt", text, gzip=True)
    assert sbx.files.read("/home/user/packed.txt") == text
    assert sbx.files.read("/home/user/packed.txt", gzip=True) == text
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token}
    raw = httpx.get(server.url + "/files", params={"path": "/home/user/packed.txt"},
                    headers={**headers, "Accept-Encoding": "gzip"})
    assert raw.headers["content-encoding"] == "gzip" and raw.headers["vary"] == "Accept-Encoding"
    assert raw.text == text, "httpx inflates it"
    plain = httpx.get(server.url + "/files", params={"path": "/home/user/packed.txt"},
                      headers={**headers, "Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers and plain.headers["content-length"] == str(len(text))
    # A gzipped multipart body, and refusals in envd's words.
    body = gzip.compress(b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"m.txt\"\r\n\r\nmultipart\r\n--b--\r\n")
    up = httpx.post(server.url + "/files", params={"path": "/home/user/m.txt"}, content=body,
                    headers={**headers, "Content-Type": "multipart/form-data; boundary=b", "Content-Encoding": "gzip"})
    assert up.status_code == 200, up.text
    assert sbx.files.read("/home/user/m.txt") == "multipart"
    for encoding, data in (("br", b"x"), ("gzip", b"not gzip")):
        bad = httpx.post(server.url + "/files", params={"path": "/home/user/bad.txt"}, content=data,
                         headers={**headers, "Content-Type": "application/octet-stream", "Content-Encoding": encoding})
        assert bad.status_code == 400, (encoding, bad.status_code, bad.text)


def test_the_base_template_has_what_e2bs_has(sbx):
    """`python`, node/npm, jq and a C toolchain, as in E2B's base image (issue 12,
    item 15): a user's `python app.py` must not fail with 127."""
    sbx.files.write("/home/user/app.py", "print('from app.py')")
    assert sbx.commands.run("python app.py", cwd="/home/user").stdout == "from app.py\n"
    assert sbx.commands.run("node -e 'console.log(6 * 7)'").stdout == "42\n"
    assert sbx.commands.run("npm --version").exit_code == 0
    assert sbx.commands.run("echo '{\"a\": [1, 2]}' | jq -c .a").stdout == "[1,2]\n"
    sbx.files.write("/home/user/hello.c", '#include <stdio.h>\nint main(void) { puts("compiled"); return 0; }\n')
    assert sbx.commands.run("gcc -o hello hello.c && ./hello && make --version >/dev/null", cwd="/home/user").stdout == "compiled\n"


def test_symlink_info_and_writes_into_new_directories(sbx):
    """get_info on a symlink reports what it resolves to and its absolute target, and
    write_files into a directory that does not exist yet creates it (issue 12, item 8)."""
    from e2b.sandbox.filesystem.filesystem import WriteEntry
    from e2b import FileType
    sbx.files.write("/home/user/test_file.txt", "target")
    sbx.commands.run("ln -sf test_file.txt /home/user/link.txt", cwd="/home/user")
    info = sbx.files.get_info("/home/user/link.txt")
    assert info.type == FileType.FILE
    assert info.symlink_target == "/home/user/test_file.txt"
    written = sbx.files.write_files([WriteEntry(path="/0/a.txt", data="in a new directory"), WriteEntry(path="/0/b/c.txt", data="deeper")])
    assert [w.path for w in written] == ["/0/a.txt", "/0/b/c.txt"]
    assert sbx.files.read("/0/b/c.txt") == "deeper"
    owner = sbx.commands.run("stat -c %U /0 /0/b /0/a.txt").stdout.split()
    assert owner == ["user", "user", "user"], owner


def test_file_metadata_lives_in_the_files_xattrs(sbx):
    """files.write(metadata=...) and write_files keep it as envd does (user.e2b.*
    xattrs): get_info, list and a rename show it, setting it inside the sandbox shows
    up, and an overwrite without it clears it (issue 12, item 7)."""
    import inspect
    if "metadata" not in inspect.signature(sbx.files.write).parameters:
        pytest.skip(f"e2b {version('e2b')} has no file metadata (it came with envd 0.6.2 support)")
    from e2b.sandbox.filesystem.filesystem import WriteEntry
    tags = {"author": "mish", "stage": "draft"}
    written = sbx.files.write("/home/user/meta.txt", "x", metadata={"Author": "mish", "stage": "draft"})
    # The write's answer carries what the file keeps, as envd's does (issue 37, item 1).
    assert written.metadata == tags, written
    assert sbx.files.get_info("/home/user/meta.txt").metadata == tags
    assert {e.name: e.metadata for e in sbx.files.list("/home/user")}["meta.txt"] == tags
    sbx.files.rename("/home/user/meta.txt", "/home/user/moved.txt")
    assert sbx.files.get_info("/home/user/moved.txt").metadata == tags
    sbx.commands.run("python3 -c \"import os; os.setxattr('/home/user/moved.txt', 'user.e2b.origin', b'shell')\"")
    assert sbx.files.get_info("/home/user/moved.txt").metadata == {**tags, "origin": "shell"}
    assert sbx.files.write("/home/user/moved.txt", "y").metadata is None
    assert not sbx.files.get_info("/home/user/moved.txt").metadata
    batch = sbx.files.write_files([WriteEntry(path="/home/user/m1.txt", data="1"), WriteEntry(path="/home/user/m2.txt", data="2")], metadata={"batch": "7"})
    assert [w.metadata for w in batch] == [{"batch": "7"}, {"batch": "7"}], batch
    assert [sbx.files.get_info(f"/home/user/m{i}.txt").metadata for i in (1, 2)] == [{"batch": "7"}, {"batch": "7"}]
    with pytest.raises(Exception):
        sbx.files.write("/home/user/bad.txt", "z", metadata={"k": "\u00e9"})


def events_until(handle, count: int) -> list:
    """The watcher's events, polled until `count` have come (inotify reports them to the
    agent's watch task asynchronously)."""
    seen: list = []
    wait_until(lambda: seen.extend(handle.get_new_events()) or len(seen) >= count, f"{count} watch events", timeout=30,
               detail=lambda: f"events so far: {seen}")
    return seen


@pytest.mark.sdk_versions  # the watch stream
def test_watch_events_come_as_envd_reports_them(sbx):
    """A new file in a watched directory is CREATE, CHMOD (envd's chown), then WRITE, and
    a recursive watch names a file in a subdirectory `sub/file` (issue 12, item 9; E2B's
    test_watch_iterated and test_watch_recursive_directory_changes)."""
    from e2b import FilesystemEventType as T
    sbx.files.make_dir("watched")
    handle = sbx.files.watch_dir("watched")
    sbx.files.write("watched/new.txt", "first")
    events = events_until(handle, 3)
    assert [(e.type, e.name) for e in events] == [(T.CREATE, "new.txt"), (T.CHMOD, "new.txt"), (T.WRITE, "new.txt")]
    sbx.files.write("watched/new.txt", "again")
    assert any(e.type == T.WRITE and e.name == "new.txt" for e in events_until(handle, 1))
    handle.stop()

    sbx.files.make_dir("tree/sub")
    handle = sbx.files.watch_dir("tree", recursive=True)
    sbx.files.write("tree/sub/file.txt", "nested")
    events = events_until(handle, 3)
    assert [(e.type, e.name) for e in events] == [(T.CREATE, "sub/file.txt"), (T.CHMOD, "sub/file.txt"), (T.WRITE, "sub/file.txt")]
    handle.stop()
