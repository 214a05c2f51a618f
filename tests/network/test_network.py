"""Sandbox networking through the official e2b SDK and hutch's REST API: DNS, TCP (with
half-close), UDP, denials, live policy updates, pause/resume and fork. Every destination
is a loopback listener behind the server's test map (tests/networld.py); the map's
violations file shows every dial or lookup the stack tried outside it."""

import ipaddress
import json
import os
import socket
import subprocess
import shutil

import httpx
from pathlib import Path

import pytest
from e2b import Sandbox
from conftest import API_KEY, free_port, launch, new_home, stop
from networld import API, HTTP_BODY, WEB

# Runs inside the guest: each check prints one JSON result; errors are the errno name
# (ECONNREFUSED is the stack's RST: a dropped SYN would time out instead) and how long
# the guest waited for it.
PROBE = r'''
import errno, json, socket, sys, time, urllib.request

def timed(f):
    t = time.monotonic()
    try:
        return {"ok": f(), "ms": round((time.monotonic() - t) * 1000)}
    except OSError as e:
        name = errno.errorcode.get(e.errno) if e.errno else None
        return {"err": name or type(e).__name__ + ": " + str(e), "ms": round((time.monotonic() - t) * 1000)}

def resolve(name):
    return sorted({a[4][0] for a in socket.getaddrinfo(name, 80, socket.AF_INET, socket.SOCK_STREAM)})

def http(url):
    return urllib.request.urlopen(url, timeout=10).read().decode()

def echo(host, port, data):
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(data.encode())
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out.decode()

def udp(host, port, data):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5)
        s.connect((host, port))
        s.send(data.encode())
        return s.recv(65536).decode()

def connect(host, port):
    with socket.create_connection((host, port), timeout=5):
        return "connected"

def ping(host, data):
    # A raw socket (root): the echo request as ping sends it; the answer is the reply's
    # data, or the type/code of an ICMP error ("3/13": administratively prohibited).
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as s:
        s.settimeout(5)
        body = data.encode()
        header = bytes([8, 0, 0, 0, 0x12, 0x34, 0, 1])
        total = sum(int.from_bytes((header + body + b"\0")[i:i + 2], "big") for i in range(0, len(header + body), 2))
        while total >> 16:
            total = (total & 0xFFFF) + (total >> 16)
        packet = header[:2] + (~total & 0xFFFF).to_bytes(2, "big") + header[4:] + body
        s.sendto(packet, (host, 0))
        while True:
            reply, (src, _) = s.recvfrom(65536)
            icmp = reply[(reply[0] & 0x0F) * 4:]
            if src != host:
                continue
            if icmp[0] == 0 and icmp[4:6] == b"\x12\x34":
                return icmp[8:].decode()
            if icmp[0] == 3:
                return f"3/{icmp[1]}"

checks = json.loads(sys.argv[1])
print(json.dumps([timed(lambda c=c: globals()[c[0]](*c[1:])) for c in checks]))
'''


def probe(sbx, *checks):
    sbx.files.write("/tmp/probe.py", PROBE)
    arg = json.dumps([list(c) for c in checks]).replace("'", "'\\''")
    out = sbx.commands.run(f"python3 /tmp/probe.py '{arg}'", timeout=120).stdout
    return json.loads(out)


def refused(result):
    # A refusal the guest hears at once (the RST or ICMP of the stack), not a timeout.
    return result.get("err") == "ECONNREFUSED" and result["ms"] < 1000


def test_default_sdk_sandbox_reaches_the_internet_and_nothing_private(server, net_world):
    before = net_world.violation_lines()
    sbx = Sandbox.create("base")
    try:
        r = probe(
            sbx,
            ("resolve", "example.test"),
            ("http", "http://example.test/"),
            ("echo", "example.test", 7, "half-closed"),
            ("udp", WEB, 7, "ping"),
            ("resolve", "rebind.example.test"),
            ("resolve", "metadata.example.test"),
            ("connect", "10.0.0.1", 80),
            ("connect", "169.254.169.254", 80),
            ("connect", "198.18.0.1", 22),
            ("udp", "192.168.1.1", 9, "x"),
        )
        assert all("ok" in x for x in r[:4]), r[3]
        assert r[0]["ok"] == [WEB]
        assert r[1]["ok"] == HTTP_BODY.decode()
        assert r[2]["ok"] == "echo:half-closed", "the upstream must see the guest's FIN and still answer"
        assert r[3]["ok"] == "udp:ping"
        # The guest's own tools: curl over HTTP, and getent through the libc resolver.
        tools = sbx.commands.run("curl -sS --max-time 10 http://example.test/ && getent hosts example.test", timeout=60)
        assert [l.split() for l in tools.stdout.splitlines()] == [HTTP_BODY.decode().split(), [WEB, "example.test"]], tools.stdout
        # Public names pointing at loopback or the metadata service do not resolve.
        assert r[4].get("err") and r[5].get("err"), r[4:6]
        for denial in r[6:10]:
            assert refused(denial), denial
        # Denials are decided before any dial: the seam saw none of them.
        assert net_world.violation_lines() == before
        info = server.api().get(f"/sandboxes/{sbx.sandbox_id}").json()
        assert info["allowInternetAccess"] is True and info["egress"] == ["allow@public"]
        log = server.api().get(f"/sandboxes/{sbx.sandbox_id}/network").json()["log"]
        assert log["counters"]["flows_denied"] >= 3 and log["counters"]["names_denied"] >= 2
        messages = {d["message"] for d in log["denials"]}
        assert "private addresses are never reachable from sandboxes" in messages
        assert any("resolves to a loopback address" in m for m in messages)
    finally:
        sbx.kill()


def test_ping_is_answered_where_rules_allow_icmp_and_refused_elsewhere(server, net_world):
    before = net_world.violation_lines()
    sbx = Sandbox.create("base")
    try:
        sbx.update_network({"allow_out": [WEB], "deny_out": ["0.0.0.0/0"]})
        sbx.files.write("/tmp/probe.py", PROBE)
        arg = json.dumps([["ping", WEB, "hutch ping"], ["ping", API, "x"]])
        r = json.loads(sbx.commands.run(f"python3 /tmp/probe.py '{arg}'", user="root", timeout=120).stdout)
        # The echo went out from the host (to the test map's loopback) and came back.
        assert r[0].get("ok") == "hutch ping", r[0]
        # Not allowed: "administratively prohibited" at once, not a timeout.
        assert r[1].get("ok") == "3/13" and r[1]["ms"] < 1000, r[1]
        assert net_world.violation_lines() == before
    finally:
        sbx.kill()


def test_allow_internet_access_false_resolves_and_reaches_nothing(server, net_world):
    before = net_world.violation_lines()
    sbx = Sandbox.create("base", allow_internet_access=False)
    try:
        r = probe(sbx, ("resolve", "example.test"), ("connect", WEB, 80), ("udp", WEB, 7, "x"))
        assert r[0].get("err"), r[0]
        assert refused(r[1]) and refused(r[2]), r
        assert net_world.violation_lines() == before
        assert server.api().get(f"/sandboxes/{sbx.sandbox_id}").json()["allowInternetAccess"] is False
    finally:
        sbx.kill()


def test_allow_out_names_beat_deny_out_all_traffic(server, net_world):
    sbx = Sandbox.create("base", network={"allow_out": ["api.example.test"], "deny_out": ["0.0.0.0/0"]})
    try:
        r = probe(sbx, ("http", "http://api.example.test/"), ("resolve", "example.test"), ("connect", WEB, 80))
        assert r[0]["ok"] == HTTP_BODY.decode()
        # Other names still resolve (E2B's domains are checked on the connection), but
        # 0.0.0.0/0 in denyOut refuses their connections.
        assert r[1]["ok"] == [WEB]
        assert refused(r[2]), r[2]
        info = server.api().get(f"/sandboxes/{sbx.sandbox_id}").json()
        assert info["network"] == {"allowOut": ["api.example.test"], "denyOut": ["0.0.0.0/0"]}
    finally:
        sbx.kill()


def test_update_network_takes_effect_live_and_keeps_open_connections(server, net_world):
    sbx = Sandbox.create("base")
    try:
        # A connection opened before the update, used after it.
        sbx.files.write("/tmp/held.py", "import socket,sys,time\n"
                        "s=socket.create_connection(('%s',7)); s.sendall(b'before')\n"
                        "open('/tmp/held.ready','w').close()\n"
                        "while not __import__('os').path.exists('/tmp/held.go'): time.sleep(0.05)\n"
                        "s.sendall(b'+after'); s.shutdown(socket.SHUT_WR); print(s.recv(100).decode())\n" % WEB)
        held = sbx.commands.run("python3 /tmp/held.py", background=True)
        sbx.commands.run("while [ ! -e /tmp/held.ready ]; do sleep 0.05; done", timeout=60)
        sbx.update_network({"deny_out": ["0.0.0.0/0"]})
        r = probe(sbx, ("connect", WEB, 80))
        assert refused(r[0]), r[0]
        sbx.commands.run("touch /tmp/held.go")
        assert held.wait().stdout.strip() == "echo:before+after"
        sbx.update_network({})
        assert probe(sbx, ("http", "http://example.test/"))[0]["ok"] == HTTP_BODY.decode()
    finally:
        sbx.kill()


def test_networking_survives_pause_resume_and_fork(server, net_world):
    sbx = Sandbox.create("base", network={"allow_out": ["example.test"], "deny_out": ["0.0.0.0/0"]})
    child = None
    try:
        assert sbx.pause() is True
        back = Sandbox.connect(sbx.sandbox_id, timeout=120)
        r = probe(back, ("http", "http://example.test/"), ("http", "http://api.example.test/"))
        assert r[0]["ok"] == HTTP_BODY.decode()
        assert r[1].get("err") or "refused" in str(r[1]), r[1]
        forked = server.api().post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 1}).json()
        child = Sandbox.connect(forked[0]["sandbox"]["sandboxID"])
        r = probe(child, ("http", "http://example.test/"), ("connect", API, 80))
        assert r[0]["ok"] == HTTP_BODY.decode()
        assert refused(r[1]), r[1]
    finally:
        if child:
            child.kill()
        sbx.kill()


@pytest.mark.parametrize("body, field, words", [
    ({"network": {"allowOut": ["example.com"]}}, "network.allowOut", "you must include 'ALL_TRAFFIC' in deny out"),
    ({"network": {"denyOut": ["example.com"]}}, "network.denyOut", "denyOut takes only those"),
    ({"network": {"allowOut": ["10.0.0.1/8"], "denyOut": ["0.0.0.0/0"]}}, "network.allowOut", "host bits set; did you mean 10.0.0.0/8?"),
    ({"network": {"allowOut": ["a.*.example.com"], "denyOut": ["0.0.0.0/0"]}}, "network.allowOut", "wildcard"),
    ({"network": {"allowOut": ["bücher.de"], "denyOut": ["0.0.0.0/0"]}}, "network.allowOut", "punycode"),
    ({"network": {"egressProxy": {"address": "socks5://127.0.0.1:1080"}}}, "network.egressProxy", "egress proxy"),
    ({"network": {"egressProxy": {"address": "127.0.0.1:1080"}}}, "network.egressProxy.address", "an address sandboxes may not reach"),
    ({"network": {"egressProxy": {"address": "socks.test:1080", "password": "p"}}}, "network.egressProxy.password", "without a username"),
    ({"network": {"egressProxy": {"address": "socks.test:1080", "tls": True}}}, "network.egressProxy.tls", "without TLS"),
    ({"network": {"httpsPorts": [443, 0]}}, "network.httpsPorts", "`0` is not a port"),
    ({"network": {"httpsPorts": [70000]}}, "network.httpsPorts", "from 1 to 65535"),
    ({"egress": ["allow@public"], "network": {"httpsPorts": [0]}}, "network.httpsPorts", "not a port"),
    ({"network": {"httpsPorts": [443] * 257}}, "network.httpsPorts", "at most 256"),
    ({"network": {"rules": {"*": [{}]}}}, "network.rules.*", "is not a host"),
    ({"network": {"rules": {"a.test": [{}, {}]}}}, "network.rules.a.test", "a host takes one rule"),
    ({"network": {"rules": {"a.test": [{"transform": {"headers": {"X": "v\r\nEvil: 1"}}}]}}}, "network.rules.a.test.transform.headers.X", "CR, LF"),
    ({"network": {"rules": {"a.test": [{"transform": {"headers": {"X": "${e2b.identity.tokens.aws}"}}}]}}}, "network.rules.a.test.transform.headers.X", "workload identity"),
    ({"network": {"rules": {"a.test": [{"transform": {"headers": {"X": "${e2b.secrets.no-such-secret}"}}}]}}}, "network.rules", "no secret named `no-such-secret`"),
    ({"envVars": {"K": "${e2b.secrets.nobody}"}}, "envVars.K", "bound to no host"),
    ({"envVars": {"K": "${e2b.secrets.x"}}, "envVars.K", "malformed"),
    ({"secrets": {"K": {"hosts": []}}}, "secrets.K.hosts", "name at least one"),
    ({"secrets": {"1K": {"hosts": ["a.test"]}}}, "secrets.1K", "environment variable"),
    ({"secrets": {"K": {"hosts": ["10.0.0.0/8"]}}}, "secrets.K.hosts", "is an address"),
    ({"secrets": {"K": {"hosts": ["*.a.test"]}}}, "secrets.K.hosts", "is a wildcard"),
    ({"secrets": {"K": {"hosts": ["a.test"], "headers": ["Connection"]}}}, "secrets.K.headers", "connection header"),
    ({"secrets": {"K": {"hosts": ["a.test"], "query": ["a&b"]}}}, "secrets.K.query", "not a parameter's name"),
    ({"secrets": {"K": {"hosts": ["a.test"]}}, "envVars": {"K": "v"}}, "secrets.K", "set it in one place"),
    ({"secrets": {"K": {"name": "no-such-secret", "hosts": ["a.test"]}}}, "secrets", "no secret named `no-such-secret`"),
    ({"egress": ["allow@public:tcp:0"]}, "egress", "port 0"),
    ({"egress": ["allow@public:tcp:90-80"]}, "egress", "runs backwards"),
    ({"egress": ["allow@privte"]}, "egress", "did you mean `private`?"),
    ({"egress": ["allow@example.com:443"]}, "egress", "is a port, not a protocol"),
    ({"egress": ["allow@public"] * 1025}, "egress", "at most 1024 rules"),
])
def test_bad_network_settings_are_400_naming_the_field(server, body, field, words):
    r = server.api().post("/v2/sandboxes", json={"templateID": "base", **body})
    assert r.status_code == 400, r.text
    message = r.json()["message"]
    assert message.startswith(field) and words in message, message


def test_pip_download_from_the_package_index_with_sdk_defaults(tmp_path):
    """The one test whose sandbox reaches the real internet: the package index this
    machine may use, through a server with no test map and the host's resolver."""
    home = new_home("hutch-net-pip-")
    port = free_port()
    # Where this machine's resolver puts the index: on the build machines a mirror at
    # an address IANA reserves, which `public` leaves out, so the operator adds it.
    extra = []
    for name in ("pypi.org", "files.pythonhosted.org"):
        for addr in {a[4][0] for a in socket.getaddrinfo(name, 443, socket.AF_INET)}:
            if not ipaddress.ip_address(addr).is_global:
                extra += ["--net-public", f"{addr}/32"]
    proc = launch(home, port, *extra)
    url = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL")}
    os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url)
    try:
        sbx = Sandbox.create("base")
        try:
            # The host's pip settings and the CA bundle they name (the mirror's
            # certificate is signed by this machine's own CA).
            pip_conf = Path("/etc/pip.conf")
            if pip_conf.exists():
                sbx.files.write("/etc/pip.conf", pip_conf.read_text(), user="root")
                for line in pip_conf.read_text().splitlines():
                    key, _, value = line.partition("=")
                    if key.strip() == "cert":
                        sbx.files.write(value.strip(), Path(value.strip()).read_bytes(), user="root")
            r = sbx.commands.run("python3 -m pip download --no-deps --disable-pip-version-check -d /tmp/dl six==1.16.0 && ls /tmp/dl", timeout=300)
            assert "six-1.16.0-py2.py3-none-any.whl" in r.stdout
        finally:
            sbx.kill()
    finally:
        for k, v in saved.items():
            os.environ[k] = v
        stop(proc)
        subprocess.run(["rm", "-rf", str(home)])


def test_hutch_sdk_egress_rules_and_live_update(server, net_world):
    """hutch's own SDK: no egress unless asked, hutch's rule strings, update_network and
    the denial log."""
    from hutch import Sandbox as HutchSandbox
    with HutchSandbox.create() as closed:
        assert refused(probe(closed, ("connect", WEB, 80))[0])
        assert closed.network()["egress"] == []
    with HutchSandbox.create(egress=["allow@example.test:tcp:80"]) as s:
        r = probe(s, ("http", "http://example.test/"), ("echo", "example.test", 7, "x"), ("connect", API, 80))
        assert r[0]["ok"] == HTTP_BODY.decode()
        assert refused(r[1]) and refused(r[2]), r
        s.update_network(["allow@public:tcp:7"])
        r = probe(s, ("echo", "example.test", 7, "y"), ("http", "http://example.test/"))
        assert r[0]["ok"] == "echo:y"
        assert "err" in r[1] or "Connection refused" in str(r[1]), r[1]
        view = s.network()
        assert view["egress"] == ["allow@public:tcp:7"]
        assert any(d["proto"] == "tcp" and d["port"] == 80 and "no rule allows it" == d["message"] for d in view["log"]["denials"])


def test_an_adopted_sandbox_gets_a_fresh_stack_with_its_own_rules(net_world, monkeypatch):
    """After `hutch serve` dies (SIGKILL), the next server adopts the running VM and
    connects a new stack to its NIC: the same rules, working connections, a new log."""
    import signal
    home, port = new_home("hutch-net-adopt-"), free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"HUTCH_NET_TEST_MAP": str(net_world.map)}
    # The SDK's data plane goes by these too: this server's, never E2B's.
    for name, value in (("E2B_API_URL", url), ("E2B_SANDBOX_URL", url), ("E2B_API_KEY", API_KEY)):
        monkeypatch.setenv(name, value)
    proc = launch(home, port, env_extra=env)
    sid = None
    try:
        sbx = Sandbox.create("base", network={"allow_out": [WEB], "deny_out": ["0.0.0.0/0"]}, timeout=600)
        sid = sbx.sandbox_id
        assert probe(sbx, ("http", f"http://{WEB}/"))[0]["ok"] == HTTP_BODY.decode()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        proc = launch(home, port, env_extra=env)
        back = Sandbox.connect(sid)
        r = probe(back, ("http", f"http://{WEB}/"), ("connect", API, 80))
        assert r[0].get("ok") == HTTP_BODY.decode(), r[0]
        assert refused(r[1]), r[1]
        view = httpx.get(f"{url}/sandboxes/{sid}/network", headers={"X-API-Key": API_KEY}).json()
        assert view["network"] == {"allowOut": [WEB], "denyOut": ["0.0.0.0/0"]}
        assert view["log"]["counters"]["flows_denied"] == 1 and "link_lost" not in view["log"], view["log"]
    finally:
        if sid:
            Sandbox.kill(sid)
        stop(proc)
    shutil.rmtree(home, ignore_errors=True)
