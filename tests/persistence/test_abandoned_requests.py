"""Lifecycle operations whose client hangs up: each runs to its end in the sandbox's
owner task (issue 11). Before, the server dropped the handler with the connection, and
a pause could stop between QMP `stop` and `cont`, leaving a guest stopped that the
data plane called paused and the API called running."""

import socket
import urllib.parse

from e2b import PtySize, Sandbox

from conftest import wait_until


def hang_up_once_begun(server, path: str, begun: str, body: bytes = b"") -> None:
    """POSTs `path` (with a JSON `body`, if any) and closes the connection once the
    server's log says the operation began (a line holding `begun`). A fixed 50 ms
    hang-up could land before a loaded server had read the request at all, and then no
    operation began (seen in CI for a pause, then for a snapshot)."""
    url = urllib.parse.urlsplit(server.url)
    request = (f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nX-API-Key: {server.key}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    log = server.home / "serve.log"
    with socket.create_connection((url.hostname, url.port), timeout=10) as conn:
        conn.sendall(request)
        wait_until(lambda: any(begun in line for line in log.read_text(errors="replace").splitlines()), "the server to begin the operation", timeout=60)


def state_of(server, sid: str) -> str:
    return server.api().get(f"/sandboxes/{sid}").json().get("state", "")


def test_an_abandoned_pause_still_pauses_and_the_sandbox_resumes(server):
    sbx = Sandbox.create("base")
    try:
        sbx.files.write("/home/user/kept", "before the pause")
        hang_up_once_begun(server, f"/sandboxes/{sbx.sandbox_id}/pause", f"pausing (Client, Full) sandbox={sbx.sandbox_id}")
        wait_until(lambda: state_of(server, sbx.sandbox_id) == "paused", "the abandoned pause to finish", timeout=120,
                   detail=lambda: state_of(server, sbx.sandbox_id))
        back = Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert back.files.read("/home/user/kept") == "before the pause"
        assert back.commands.run("echo runs").stdout == "runs\n"
    finally:
        Sandbox.kill(sbx.sandbox_id)


def test_an_abandoned_snapshot_is_stored_and_the_sandbox_runs_on(server):
    sbx = Sandbox.create("base")
    try:
        sbx.files.write("/home/user/kept", "in the snapshot")
        hang_up_once_begun(server, f"/sandboxes/{sbx.sandbox_id}/snapshots", f"snapshotting sandbox={sbx.sandbox_id}", b'{"name": "abandoned"}')
        listed = lambda: [s for s in server.api().get("/snapshots").json() if "abandoned" in s["names"]]
        snaps = wait_until(listed, "the abandoned snapshot to be stored", timeout=120, detail=lambda: server.api().get("/snapshots").text)
        assert sbx.commands.run("echo runs-on").stdout == "runs-on\n"
        child = Sandbox.create("abandoned", timeout=120)
        try:
            assert child.files.read("/home/user/kept") == "in the snapshot"
        finally:
            child.kill()
        assert Sandbox.delete_snapshot(snaps[0]["snapshotID"]) is True
    finally:
        sbx.kill()


def test_a_sandbox_pauses_while_a_command_streams_its_output(server):
    """Pausing a busy sandbox is the normal case: the open stream ends, the pause
    succeeds, and the command's process is still there after the resume."""
    sbx = Sandbox.create("base")
    try:
        streaming = sbx.commands.run("for i in $(seq 600); do echo tick $i; sleep 0.5; done", background=True)
        alive = lambda: sbx.commands.run("pgrep -f 'seq 600' >/dev/null && echo alive || true").stdout == "alive\n"
        wait_until(alive, "the streaming command to run", timeout=30)
        # Its output stream is open through the server while the pause saves the VM.
        assert sbx.pause() is True
        streaming.disconnect()
        back = Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert back.commands.run("pgrep -f 'seq 600' >/dev/null && echo alive").stdout == "alive\n"
    finally:
        Sandbox.kill(sbx.sandbox_id)


def test_a_sandbox_pauses_with_a_terminal_open(server):
    """A PTY's output stream is as open as a command's: the pause still succeeds, and the
    terminal's shell, with what it started, is there after the resume."""
    sbx = Sandbox.create("base")
    try:
        terminal = sbx.pty.create(PtySize(rows=24, cols=80), timeout=0)
        sbx.pty.send_stdin(terminal.pid, b"exec -a hutch-pty-marker sleep 100000\n")
        started = lambda: sbx.commands.run("pgrep -f '^hutch-pty-marker' || true").stdout.strip()
        marker = wait_until(started, "the terminal's command to run", timeout=30)
        assert sbx.pause() is True
        terminal.disconnect()
        back = Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert back.commands.run("pgrep -f '^hutch-pty-marker'").stdout.strip() == marker
        back.pty.send_stdin(terminal.pid, b"\x03")  # the terminal still takes input: Ctrl-C ends it
        gone = lambda: back.commands.run("pgrep -f '^hutch-pty-marker' || echo gone").stdout.strip() == "gone"
        wait_until(gone, "Ctrl-C through the resumed terminal to end its command", timeout=30)
    finally:
        Sandbox.kill(sbx.sandbox_id)
