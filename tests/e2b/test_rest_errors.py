"""Bad input to the REST API gets the right 4xx JSON, and the server keeps serving."""

import httpx

from conftest import API_KEY, wait_until


def error(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["code"] == status and body["message"]
    return body["message"]


def test_authentication(server):
    assert "X-API-Key" in error(server.api(key=None).get("/v2/sandboxes"), 401)
    assert "invalid" in error(server.api(key="e2b_" + "1" * 40).get("/v2/sandboxes"), 401)


def test_bad_bodies(server):
    api = server.api()
    error(api.post("/v2/sandboxes", content=b"{not json", headers={"content-type": "application/json"}), 400)
    error(api.post("/v2/sandboxes", json={"templateID": 42}), 400)
    error(api.post("/v2/sandboxes", json={"timeout": 5}), 400)
    error(api.post("/v2/sandboxes", json={"templateID": "base", "timeout": -1}), 400)
    assert "unknown template" in error(api.post("/v2/sandboxes", json={"templateID": "nope"}), 400)
    too_large = api.post("/v2/sandboxes", content=b"x" * (2 << 20), headers={"content-type": "application/json"})
    error(too_large, 413)
    # The rest of its body is left unread: the server says the connection ends, so the
    # client's next request goes on a new one (on this one it could find it closed).
    assert too_large.headers.get("connection") == "close", too_large.headers
    error(api.get("/v2/sandboxes?limit=0"), 400)
    error(api.get("/v2/sandboxes?state=sleeping"), 400)


def test_a_late_body_the_server_does_not_need_leaves_the_connection_usable(server):
    """A 404 comes before the body is read; the body's packet comes after the head's (as
    on a loaded host). The server must then either keep the connection usable or say
    `Connection: close`, never close one it promised to keep (the client's next request
    on it would find it gone)."""
    import socket
    port = int(server.url.rsplit(":", 1)[1])
    for method in ("GET", "POST", "DELETE"):
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall((f"{method} /sandboxes/inothere/pause HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\n"
                       "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n").encode())
            # An answer may come before the body: the old server gave one at once.
            s.settimeout(0.5)
            try:
                early = s.recv(65536)
            except socket.timeout:
                early = b""
            s.settimeout(60)
            s.sendall(b"{}")
            first = early or s.recv(65536)
            assert first.startswith(b"HTTP/1.1 4"), first
            if b"connection: close" in first.lower():
                continue
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            second = s.recv(65536)
            assert second.startswith(b"HTTP/1.1 200"), (method, first, second)


def test_unknown_sandbox(server):
    api = server.api()
    error(api.get("/sandboxes/inothere"), 404)
    error(api.delete("/sandboxes/inothere"), 404)
    error(api.post("/sandboxes/inothere/timeout", json={"timeout": 10}), 404)
    resp = httpx.get(server.url + "/health", headers={"E2b-Sandbox-Id": "inothere", "E2b-Sandbox-Port": "49983"})
    assert resp.status_code == 502 and "was not found" in resp.json()["message"]


def test_expiry_limits_and_key_isolation(server):
    api = server.api()
    created = [api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120}) for _ in range(3)]
    for r in created:
        assert r.status_code == 201, r.text
    ids = [r.json()["sandboxID"] for r in created]
    assert "at most" in error(api.post("/v2/sandboxes", json={"templateID": "base"}), 429)
    # Another key sees none of them.
    other = subprocess_key(server)
    assert server.api(key=other).get("/v2/sandboxes").json() == []
    error(server.api(key=other).get(f"/sandboxes/{ids[0]}"), 404)
    # Paging over the three.
    page = api.get("/v2/sandboxes?limit=2")
    assert len(page.json()) == 2 and page.headers["x-next-token"]
    rest = api.get(f"/v2/sandboxes?limit=2&nextToken={page.headers['x-next-token']}")
    assert len(rest.json()) == 1 and "x-next-token" not in rest.headers
    # Shortened timeouts end them: gone from the API, 502 on the data plane. (The last of
    # them was created moments ago with 120 s: were the shortening ignored, it would
    # outlive the wait's 30 s deadline, so the wait still tells the two apart.)
    for sid in ids:
        assert api.post(f"/sandboxes/{sid}/timeout", json={"timeout": 1}).status_code == 204
    wait_until(lambda: all(api.get(f"/sandboxes/{sid}").status_code == 404 for sid in ids),
               "the three sandboxes to end at their shortened 1 s timeout (GET /sandboxes/{id} answering 404)", timeout=30,
               detail=lambda: {sid: api.get(f"/sandboxes/{sid}").status_code for sid in ids})
    for sid in ids:
        error(api.get(f"/sandboxes/{sid}"), 404)
        resp = httpx.get(server.url + "/health", headers={"E2b-Sandbox-Id": sid})
        assert resp.status_code == 502
    assert api.get("/v2/sandboxes").json() == []
    assert api.get("/health").status_code == 200


def subprocess_key(server) -> str:
    import os
    import subprocess
    from conftest import HUTCH

    out = subprocess.run([str(HUTCH), "keys", "create", "--name", "other"], env=dict(os.environ, HUTCH_HOME=str(server.home)),
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_internal_agent_endpoints_are_not_proxied(server):
    api = server.api()
    made = api.post("/v2/sandboxes", json={"templateID": "base", "secure": True})
    assert made.status_code == 201, made.text
    sid, token = made.json()["sandboxID"], made.json()["envdAccessToken"]
    try:
        headers = {"E2b-Sandbox-Id": sid, "X-Access-Token": token}
        for path in ("/init", "/shutdown", "/init/"):
            r = httpx.post(server.url + path, headers=headers, json={"accessToken": "stolen"})
            assert r.status_code == 403 and "internal" in r.json()["message"], r.text
        # The secure sandbox still wants its token, and the token still works.
        stat = {"path": "/home/user"}
        assert httpx.post(server.url + "/filesystem.Filesystem/Stat", json=stat, headers={"E2b-Sandbox-Id": sid}).status_code == 401
        assert httpx.post(server.url + "/filesystem.Filesystem/Stat", json=stat, headers=headers).status_code == 200
    finally:
        assert api.delete(f"/sandboxes/{sid}").status_code == 204
