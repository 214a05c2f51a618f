"""The trust boundary as a client sees it: a secure sandbox (the official SDKs'
default) lets nobody into its envd API without its access token, except through URLs
signed with it; the host's own calls carry the token; hutch's credentials never reach
the guest; names from clients never become paths."""

import httpx
import pytest
from e2b import Sandbox
from e2b.sandbox.signature import get_signature

from conftest import wait_until


@pytest.fixture
def secure(server):
    s = Sandbox.create("base")
    assert s._envd_access_token, "the official SDK's sandboxes are secure by default"
    yield s
    s.kill()


def routed(sbx, port: int = 49983) -> dict:
    """Data-plane routing alone, with no credential of any kind."""
    return {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(port)}


def port_answer(server, headers: dict, path: str, what: str) -> httpx.Response:
    """The first 200 from a server the guest is starting on a port, through the proxy."""
    seen = []

    def answers():
        seen.append(httpx.get(server.url + path, headers=headers, timeout=30))
        return seen[-1].status_code == 200

    wait_until(answers, what, timeout=60, interval=0.3, detail=lambda: f"last answer {seen[-1].status_code}: {seen[-1].text}")
    return seen[-1]


def test_files_need_the_token_or_a_signature(server, secure):
    secure.files.write("/home/user/secret.txt", "mine")
    files = server.url + "/files"
    # The hole this closes: knowing the id was enough to read or plant files as root.
    for params in ({"path": "/home/user/secret.txt"}, {"path": "/etc/shadow", "username": "root"}):
        r = httpx.get(files, params=params, headers=routed(secure))
        assert r.status_code == 401, r.text
        assert "access token" in r.json()["message"]
    planted = httpx.post(files, params={"path": "/etc/profile.d/x.sh", "username": "root"}, headers=routed(secure),
                         files={"file": ("x.sh", b"echo owned\n")})
    assert planted.status_code == 401, planted.text
    assert not secure.files.exists("/etc/profile.d/x.sh")
    wrong = httpx.get(files, params={"path": "/home/user/secret.txt"}, headers={**routed(secure), "X-Access-Token": "0" * 32})
    # envd's words first (what SDK users match on), then what to do.
    assert wrong.status_code == 401 and wrong.json()["message"].startswith("access token present in header but does not match"), wrong.text
    # Every other envd route wants the token too; only GET /health is open.
    assert httpx.get(server.url + "/health", headers=routed(secure)).status_code in (200, 204)
    stat = httpx.post(server.url + "/filesystem.Filesystem/Stat", json={"path": "/"}, headers=routed(secure))
    assert stat.status_code == 401


def test_signed_urls_open_one_file_for_one_operation(server, secure):
    secure.files.write("/home/user/report.txt", "quarterly")
    headers = routed(secure)  # routing only: the signature is the credential
    down = httpx.get(secure.download_url("/home/user/report.txt"), headers=headers)
    assert down.status_code == 200 and down.text == "quarterly", down.text
    timed = httpx.get(secure.download_url("/home/user/report.txt", use_signature_expiration=120), headers=headers)
    assert timed.status_code == 200 and timed.text == "quarterly", timed.text
    up = httpx.post(secure.upload_url("/home/user/upload.txt", use_signature_expiration=120), headers=headers,
                    files={"file": ("upload.txt", b"sent with a signed URL")})
    assert up.status_code == 200, up.text
    assert secure.files.read("/home/user/upload.txt") == "sent with a signed URL"
    # A read signature does not write, nor open another path.
    read_url = secure.download_url("/home/user/report.txt")
    assert httpx.post(read_url, headers=headers, files={"file": ("r", b"x")}).status_code == 401
    other = read_url.replace("report.txt", "upload.txt")
    r = httpx.get(other, headers=headers)
    assert r.status_code == 401 and r.json()["message"].startswith("invalid signature"), r.text
    # An expired signature (the SDK's own signer, dated in the past) is refused.
    sig = get_signature("/home/user/report.txt", "read", None, secure._envd_access_token, -10)
    expired = httpx.get(server.url + "/files", headers=headers, params={
        "path": "/home/user/report.txt", "signature": sig["signature"], "signature_expiration": sig["expiration"]})
    assert expired.status_code == 401 and expired.json()["message"].startswith("signature is already expired"), expired.text
    assert secure.files.read("/home/user/report.txt") == "quarterly"


def test_the_hosts_own_calls_carry_the_token(server, secure):
    """Metrics, port tunnels and the flush before a pause all go from hutch to a secure
    sandbox's agent, which refused them when they went without its token."""
    assert secure.get_metrics(), "metrics of a secure sandbox"
    secure.commands.run("mkdir -p /tmp/www && echo tunnelled > /tmp/www/t.txt")
    web = secure.commands.run("cd /tmp/www && python3 -m http.server 8002", background=True)
    got = port_answer(server, routed(secure, 8002), "/t.txt", "the secure sandbox's port 8002 to answer through the proxy")
    assert got.text == "tunnelled\n"
    web.kill()
    log = server.home / "serve.log"
    before = log.read_text()
    secure.files.write("/home/user/unflushed.txt", "written just before the pause")
    assert secure.pause() is True
    after = log.read_text()[len(before):]
    assert "did not flush" not in after and "401" not in after, after
    again = Sandbox.connect(secure.sandbox_id)
    assert again.files.read("/home/user/unflushed.txt") == "written just before the pause"


HEADER_ECHO = r'''
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = "\n".join(f"{k.lower()}: {v}" for k, v in self.headers.items()).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
HTTPServer(("0.0.0.0", 8003), H).serve_forever()
'''


def test_hutchs_credentials_never_reach_the_guest(server, secure):
    secure.files.write("/tmp/echo.py", HEADER_ECHO)
    echo = secure.commands.run("python3 /tmp/echo.py", background=True)
    sent = {**routed(secure, 8003), "X-API-Key": server.key, "E2b-Traffic-Access-Token": "tok", "Cookie": "app=1",
            "Authorization": "Bearer app-token"}
    seen = port_answer(server, sent, "/", "the guest's header echo on port 8003").text
    assert server.key not in seen and "x-api-key" not in seen and "e2b-traffic-access-token" not in seen, seen
    # The guest's own web app keeps its cookies and its own authorization.
    assert "cookie: app=1" in seen and "authorization: Bearer app-token" in seen, seen
    echo.kill()


def test_template_ids_never_become_paths(server):
    api = server.api()
    for bad in ("../../etc", "a/b", ".hidden", "x" * 65, "base\u0000"):
        r = api.post("/v2/sandboxes", json={"templateID": bad})
        assert r.status_code == 400, r.text
        assert "not allowed" in r.json()["message"], r.text
    unknown = api.post("/v2/sandboxes", json={"templateID": "nope"})
    assert unknown.status_code == 400
    message = unknown.json()["message"]
    assert "unknown template 'nope'" in message and "built-in" in message, message
    assert str(server.home) not in message


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_console_flood_is_bounded_on_disk_and_in_memory(server, secure):
    bystander = Sandbox.create("base")
    try:
        # 6 MiB of lines from guest root straight onto the serial console: six times what
        # the console may keep on disk (an emulated UART under TCG takes ~200 KB/s).
        flood = secure.commands.run("yes " + "A" * 63 + " | head -c 6291456 | sudo tee /dev/ttyS0 > /dev/null; echo done",
                                    timeout=600, request_timeout=600)
        assert flood.stdout == "done\n"
        console = server.home / "sandboxes" / secure.sandbox_id / "console.log"
        older = console.with_name("console.log.1")
        on_disk = console.stat().st_size + (older.stat().st_size if older.exists() else 0)
        assert on_disk <= 1 << 20, on_disk
        before = rss_kib(server.proc.pid)
        api = server.api()
        page = api.get(f"/sandboxes/{secure.sandbox_id}/logs", params={"limit": 5})
        assert page.status_code == 200, page.text
        body = page.json()
        assert len(body["logs"]) == 5 and body["droppedBytes"] >= 5 << 20 and body["nextOffset"] == 5, {k: body[k] for k in ("droppedBytes",)}
        whole = api.get(f"/sandboxes/{secure.sandbox_id}/logs", params={"limit": 10000})
        assert whole.status_code == 200 and "AAAA" in whole.json()["logs"][-1]["line"]
        grown = rss_kib(server.proc.pid) - before
        assert grown < 64 << 10, f"the server grew by {grown} KiB serving the logs"
        assert api.get(f"/sandboxes/{secure.sandbox_id}/logs", params={"limit": 0}).status_code == 400
        # The flooding sandbox and a bystander both still work.
        assert secure.commands.run("echo alive").stdout == "alive\n"
        assert bystander.commands.run("echo bystander").stdout == "bystander\n"
    finally:
        bystander.kill()


def used_bytes(home) -> int:
    """Blocks actually allocated under `home` (holes do not count)."""
    import os
    total = 0
    for root, _, files in os.walk(home):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def sparse_archive(tmp_path, logical: int, declared: int):
    """A few-KB GNU sparse tar whose disk.qcow2 expands to `logical` zero bytes."""
    import hashlib
    import json
    import subprocess
    work = tmp_path / "sparse"
    work.mkdir()
    manifest = {"format": "hutch-snapshot-archive/1", "name": None, "template": "base", "created_at": "2026-01-01T00:00:00Z",
                "disk_sha256": hashlib.sha256(b"").hexdigest(), "disk_bytes": declared}
    (work / "manifest.json").write_text(json.dumps(manifest))
    with open(work / "disk.qcow2", "wb") as f:
        f.truncate(logical)
    out = tmp_path / "sparse.tar"
    subprocess.run(["tar", "--sparse", "-cf", str(out), "-C", str(work), "manifest.json", "disk.qcow2"], check=True)
    assert out.stat().st_size < 1 << 20
    return out


def test_archives_cannot_fill_the_disk(server, tmp_path):
    api = server.api()
    imports = lambda body, **kw: api.post("/snapshots/archive", content=body, **kw)
    # Declares a 64 GiB disk: refused before anything is written.
    huge = sparse_archive(tmp_path, 64 << 30, 64 << 30)
    before = used_bytes(server.home)
    r = imports(huge.read_bytes())
    assert r.status_code == 400 and "more than" in r.json()["message"], r.text
    # Declares 1 MiB but expands to 8 GiB of zeros: stopped past the declared size.
    (tmp_path / "sparse").rename(tmp_path / "sparse-1")
    lying = sparse_archive(tmp_path, 8 << 30, 1 << 20)
    r = imports(lying.read_bytes())
    assert r.status_code == 400 and "more than" in r.json()["message"], r.text
    assert used_bytes(server.home) - before < 64 << 20, "a refused archive left data behind"
    # An upload announcing more than the limit is refused before its body is sent.
    import socket
    from urllib.parse import urlparse
    u = urlparse(server.url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(f"POST /snapshots/archive HTTP/1.1\r\nHost: x\r\nX-API-Key: {server.key}\r\n"
                  f"Content-Length: {64 << 30}\r\n\r\n".encode())
        reply = s.recv(4096).decode(errors="replace")
    assert reply.startswith("HTTP/1.1 413"), reply
    assert api.get("/snapshots").json() == []


def import_archive(server, tmp_path, name: str, disk: bytes) -> httpx.Response:
    """Imports a well-formed archive (manifest, checksum right) around `disk`."""
    import hashlib
    import json
    import tarfile
    (tmp_path / "disk.qcow2").write_bytes(disk)
    manifest = {"format": "hutch-snapshot-archive/1", "name": name, "template": "base", "created_at": "2026-01-01T00:00:00Z",
                "disk_sha256": hashlib.sha256(disk).hexdigest(), "disk_bytes": len(disk)}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    archive = tmp_path / f"{name}.tar"
    with tarfile.open(archive, "w", format=tarfile.GNU_FORMAT) as t:
        t.add(tmp_path / "manifest.json", "manifest.json")
        t.add(tmp_path / "disk.qcow2", "disk.qcow2")
    return server.api().post("/snapshots/archive", content=archive.read_bytes())


def test_an_imported_disk_cannot_be_bigger_than_its_template(server, tmp_path):
    import subprocess
    disk = tmp_path / "huge.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(disk), "1T"], check=True)
    r = import_archive(server, tmp_path, "huge", disk.read_bytes())
    assert r.status_code == 400 and "more than the" in r.json()["message"], r.text
    assert server.api().get("/snapshots").json() == []


def test_an_imported_disk_that_is_not_qcow2_is_the_clients_mistake(server, tmp_path):
    """A raw image (or any other bytes) where the archive promises a qcow2 disk: a 400
    saying so, not a 500, and nothing stored."""
    r = import_archive(server, tmp_path, "raw", b"\0" * (1 << 20))
    assert r.status_code == 400 and "qcow2" in r.json()["message"], r.text
    assert server.api().get("/snapshots").json() == []


def test_one_key_cannot_take_the_whole_server(tmp_path):
    """Per-key quotas: a key at its limit gets 429 naming the quota, another key is
    not affected, and what the key frees it can use again."""
    import shutil
    import signal
    import subprocess
    import os
    from conftest import API_KEY, HUTCH, free_port, launch, new_home
    home, port = new_home("hutch-quota-"), free_port()
    proc = launch(home, port, "--key-max-running", "1", "--key-max-paused", "1", "--key-max-snapshots", "1")
    url = f"http://127.0.0.1:{port}"
    other = subprocess.run([str(HUTCH), "keys", "create", "--name", "other"], env=dict(os.environ, HUTCH_HOME=str(home)),
                           capture_output=True, text=True, check=True).stdout.strip()
    mine, theirs = (httpx.Client(base_url=url, headers={"X-API-Key": k}, timeout=120) for k in (API_KEY, other))
    made = []
    try:
        first = mine.post("/v2/sandboxes", json={"templateID": "base"})
        assert first.status_code == 201, first.text
        made.append((mine, first.json()["sandboxID"]))
        second = mine.post("/v2/sandboxes", json={"templateID": "base"})
        assert second.status_code == 429 and "quota" in second.json()["message"], second.text
        snap = mine.post(f"/sandboxes/{made[0][1]}/snapshots", json={})
        assert snap.status_code == 201, snap.text
        again = mine.post(f"/sandboxes/{made[0][1]}/snapshots", json={})
        assert again.status_code == 429 and "snapshots" in again.json()["message"], again.text
        assert mine.post(f"/sandboxes/{made[0][1]}/pause").status_code == 204
        # Paused, it no longer counts as running: the key may start another, but not pause it too.
        third = mine.post("/v2/sandboxes", json={"templateID": "base"})
        assert third.status_code == 201, third.text
        made.append((mine, third.json()["sandboxID"]))
        paused_too = mine.post(f"/sandboxes/{made[1][1]}/pause")
        assert paused_too.status_code == 429 and "paused" in paused_too.json()["message"], paused_too.text
        # Nor resume the first while the second runs.
        resumed = mine.post(f"/sandboxes/{made[0][1]}/connect", json={})
        assert resumed.status_code == 429, resumed.text
        # Another key is untouched by all of this.
        theirs_made = theirs.post("/v2/sandboxes", json={"templateID": "base"})
        assert theirs_made.status_code == 201, theirs_made.text
        made.append((theirs, theirs_made.json()["sandboxID"]))
        assert mine.delete(f"/templates/{snap.json()['snapshotID']}").status_code == 204
    finally:
        for client, sid in made:
            client.delete(f"/sandboxes/{sid}")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    shutil.rmtree(home, ignore_errors=True)


# Answers with how it was reached (the TLS version, or `plain`) and the Host it got;
# argv: the port, then a certificate and key to serve HTTPS.
HOST_ECHO = """
import http.server, ssl, sys
class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        how = self.connection.version() if hasattr(self.connection, "version") else "plain"
        body = f"{how} {self.headers.get('Host', '')}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
server = http.server.HTTPServer(("0.0.0.0", int(sys.argv[1])), Echo)
if len(sys.argv) > 2:
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(sys.argv[2], sys.argv[3])
    server.socket = tls.wrap_socket(server.socket, server_side=True)
server.serve_forever()
"""
SELF_SIGNED = "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout /tmp/k.pem -out /tmp/c.pem -subj /CN=guest -days 1"


def test_mask_request_host_is_the_host_header_a_port_sees(server):
    """E2B's ingress settings: maskRequestHost is the Host a port's server gets, and
    httpsPorts makes the proxy's hop to a port TLS (a self-signed certificate works)."""
    sbx = Sandbox.create("base", network={"mask_request_host": "app.internal:${PORT}", "https_ports": [8443, 8007]})
    plain = Sandbox.create("base")
    try:
        for s in (sbx, plain):
            s.files.write("/tmp/host_echo.py", HOST_ECHO)
            s.commands.run("python3 /tmp/host_echo.py 8006", background=True)
        sbx.commands.run(f"{SELF_SIGNED} 2>/dev/null && exec python3 /tmp/host_echo.py 8443 /tmp/c.pem /tmp/k.pem", background=True)
        sbx.commands.run("python3 /tmp/host_echo.py 8007", background=True)
        got = port_answer(server, {"Host": f"8006-{sbx.sandbox_id}.sandbox.test"}, "/", "the Host echo on port 8006")
        assert got.text == "plain app.internal:8006"
        got = port_answer(server, {"Host": f"8443-{sbx.sandbox_id}.sandbox.test"}, "/", "the HTTPS Host echo on port 8443")
        assert got.text == "TLSv1.3 app.internal:8443"
        # A port in httpsPorts whose server speaks plain HTTP: a 502 that says so.
        wait_until(lambda: ":8007 " in sbx.commands.run("ss -ltn").stdout, "the plain server on 8007 to listen", timeout=60, interval=0.3)
        r = httpx.get(server.url + "/", headers={"Host": f"8007-{sbx.sandbox_id}.sandbox.test"}, timeout=30)
        assert r.status_code == 502 and "httpsPorts" in r.json()["message"] and r.json()["port"] == 8007, r.text
        # A network update replaces the egress rules and keeps the ingress settings.
        sbx.update_network({"allow_out": ["192.0.2.1"], "deny_out": ["0.0.0.0/0"]})
        again = httpx.get(server.url + "/", headers={"Host": f"8443-{sbx.sandbox_id}.sandbox.test"}, timeout=30)
        assert again.text == "TLSv1.3 app.internal:8443", again.text
        # Without the settings the guest sees the client's own Host, over plain HTTP.
        client_host = f"8006-{plain.sandbox_id}.sandbox.test"
        assert port_answer(server, {"Host": client_host}, "/", "the unmasked Host echo").text == f"plain {client_host}"
    finally:
        sbx.kill()
        plain.kill()
    bad = server.api().post("/v2/sandboxes", json={"templateID": "base", "network": {"maskRequestHost": "a b"}})
    assert bad.status_code == 400 and bad.json()["message"].startswith("network.maskRequestHost"), bad.text


def test_private_ports_need_the_traffic_token(server):
    sbx = Sandbox.create("base", network={"allow_public_traffic": False})
    try:
        token = sbx.traffic_access_token
        assert token, "allowPublicTraffic: false returns a trafficAccessToken"
        sbx.commands.run("mkdir -p /tmp/p && echo private > /tmp/p/x.txt")
        web = sbx.commands.run("cd /tmp/p && python3 -m http.server 8004", background=True)
        with_token = {**routed(sbx, 8004), "E2b-Traffic-Access-Token": token}
        got = port_answer(server, with_token, "/x.txt", "the private port 8004 to answer with the traffic token")
        assert got.text == "private\n"
        for headers in (routed(sbx, 8004), {**routed(sbx, 8004), "E2b-Traffic-Access-Token": "0" * len(token)}):
            r = httpx.get(server.url + "/x.txt", headers=headers, timeout=30)
            assert r.status_code == 403 and "trafficAccessToken" in r.json()["message"], r.text
        # The envd API still goes by the envd token, and the detail repeats the traffic token.
        assert sbx.commands.run("echo envd").stdout == "envd\n"
        assert server.api().get(f"/sandboxes/{sbx.sandbox_id}").json()["trafficAccessToken"] == token
        web.kill()
    finally:
        sbx.kill()
    public = Sandbox.create("base")
    try:
        assert public.traffic_access_token is None
    finally:
        public.kill()
