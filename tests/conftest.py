"""A real `hutch serve` for the Python tests: its own HUTCH_HOME (artifact folders
linked to the shared cache, so the database and sandboxes are this run's alone), a
free port, and an API key in the E2B format. Teardown checks nothing was left behind."""

import asyncio
import inspect
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
HUTCH = Path(os.environ.get("HUTCH_BIN", ROOT / "target" / "release" / "hutch"))
API_KEY = "e2b_" + "0" * 40

# Until a test's server sets them, the official SDKs' endpoints point at a closed port on
# loopback: an SDK call that names no server must fail here, never default to E2B's
# cloud (api.e2b.app, sandbox.e2b.app), which these machines must not contact.
for _name in ("E2B_API_URL", "E2B_SANDBOX_URL"):
    os.environ.setdefault(_name, "http://127.0.0.1:9")


def pytest_configure(config):
    # scripts/python-tests.sh runs every test with the newest official SDKs, then only
    # these again with the oldest supported ones.
    config.addinivalue_line(
        "markers",
        "sdk_versions: exercises what differs between official SDK versions on the wire "
        "(the v1 and v2 create, connect, pause and fork bodies, list paging, the /health probe "
        "after a broken stream, the envd services, signed URLs and content encodings, the code "
        "interpreter's /execute stream)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used the session's server gets the end of that server's log in
    its report: the server's home (and its log) goes when the session ends."""
    outcome = yield
    report = outcome.get_result()
    server = item.funcargs.get("server") if hasattr(item, "funcargs") else None
    if report.when == "call" and report.failed and isinstance(server, Server):
        try:
            lines = (server.home / "serve.log").read_text(errors="replace").splitlines()
        except OSError as e:
            lines = [f"(the server's log could not be read: {e})"]
        report.sections.append(("hutch serve log, last 80 lines", "\n".join(lines[-80:])))


def _timed_out(what: str, timeout: float, detail: Callable[[], Any] | None) -> AssertionError:
    message = f"timed out after {timeout}s waiting for {what}"
    if detail is not None:
        message += f"; {detail()}"
    return AssertionError(message)


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = 30.0, interval: float = 0.1,
               detail: Callable[[], Any] | None = None) -> Any:
    """Polls `predicate()` until it returns something truthy and returns that, or fails
    with an AssertionError naming `what` was awaited (plus `detail()`, if given, for the
    state seen at the deadline). The only pause the suite takes to synchronise with
    anything: a poll interval inside a wait for the condition itself, bounded by a
    deadline. Deadlines are meant for a slow, loaded machine emulating the guest (TCG)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, detail)
        time.sleep(interval)  # the poll interval of this deadline-bounded wait


async def wait_until_async(predicate: Callable[[], Any], what: str, timeout: float = 30.0, interval: float = 0.1,
                           detail: Callable[[], Any] | None = None) -> Any:
    """`wait_until` for async tests: the event loop keeps running between polls (so
    callbacks it delivers can arrive); `predicate` may return an awaitable."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, detail)
        await asyncio.sleep(interval)  # the poll interval of this deadline-bounded wait


def held_secret(sbx) -> str:
    """The 16 hex digits the persistence tests' guest process writes to /tmp/secret,
    once they are all there (the file exists, empty, before the write lands). Works
    with the official SDK's and hutch's `Sandbox` alike."""
    def written():
        secret = sbx.commands.run("cat /tmp/secret 2>/dev/null || true").stdout
        return secret if len(secret) == 16 else None
    return wait_until(written, "the guest's python to write its 16 hex digits to /tmp/secret", timeout=60)


def shared_home() -> Path:
    return Path(os.environ.get("HUTCH_HOME") or Path.home() / ".local/share/hutch")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def qemus_under(home: Path) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if cmd.startswith("qemu-system") and str(home) in cmd:
                pids.append(int(entry.name))
    return pids


def pooled_ready(url: str) -> int:
    """Sandboxes waiting in the server's warm pools (GET /status)."""
    pools = httpx.get(url + "/status", headers={"X-API-Key": API_KEY}, timeout=30).json()["pools"]
    return sum(p["ready"] for p in pools.values())


def only_pools_left(server: "Server") -> None:
    """Waits until what runs under the server's home is its warm pools' sandboxes and
    nothing else: one directory and one QEMU per waiting sandbox (a refill may still be
    starting one when a test ends)."""
    def dirs() -> int:
        return len(list((server.home / "sandboxes").glob("*"))) if (server.home / "sandboxes").exists() else 0

    wait_until(lambda: dirs() == len(qemus_under(server.home)) == pooled_ready(server.url),
               "only the warm pools' sandboxes to be left", timeout=60,
               detail=lambda: f"{dirs()} directories, QEMUs {qemus_under(server.home)}, {pooled_ready(server.url)} pooled")


def link_shared_artifacts(home: Path) -> None:
    """Kernel, initramfs, templates and template snapshots come from the shared cache
    (built once by `hutch setup`); everything else under `home` is the test's own. So do
    the host facts a template snapshot's name is made of (the TSC rate, QEMU's version):
    a server that measured them itself could name the shared snapshot differently, make
    its own and prune the other while another worker's sandboxes stack on it."""
    (home / "snapshots").mkdir(parents=True, exist_ok=True)
    for sub in ("kernel", "initramfs", "templates", "snapshots/templates"):
        (shared_home() / sub).mkdir(parents=True, exist_ok=True)
        (home / sub).symlink_to(shared_home() / sub)
    for fact in ("host-tsc", "qemu-version"):
        (home / fact).symlink_to(shared_home() / fact)


class Server:
    def __init__(self, url: str, home: Path, proc: subprocess.Popen):
        self.url, self.home, self.proc, self.key = url, home, proc, API_KEY

    def api(self, key: str | None = API_KEY) -> httpx.Client:
        headers = {"X-API-Key": key} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)


def launch(home: Path, port: int, *extra: str, env_extra: dict | None = None, pools: bool = False) -> subprocess.Popen:
    """Starts `hutch serve` on `home` and waits until it answers. Without `pools` it runs
    with `--no-pool` (pools pinned in `extra` only): tests that count QEMUs count the
    sandboxes they made."""
    env = dict(os.environ, HUTCH_HOME=str(home), HUTCH_API_KEY=API_KEY, **(env_extra or {}))
    log = open(home / "serve.log", "a")
    no_pool = [] if pools else ["--no-pool"]
    proc = subprocess.Popen(
        [str(HUTCH), "serve", "--listen", f"127.0.0.1:{port}", "--max-sandboxes", os.environ.get("HUTCH_TEST_MAX", "3"), "--accel", "tcg", *no_pool, *extra],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    serve_log = home / "serve.log"

    def answers() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"hutch serve exited ({proc.returncode}) before it answered:\n" + serve_log.read_text())
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(answers, f"hutch serve to answer GET {url}/health", timeout=120, detail=lambda: "\n" + serve_log.read_text())
    return proc


def stop(proc: subprocess.Popen) -> None:
    """Stops a `hutch serve` started by `launch` the way an operator would (SIGTERM)."""
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def new_home(prefix: str) -> Path:
    home = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    link_shared_artifacts(home)
    return home


@pytest.fixture(scope="session")
def net_world(tmp_path_factory):
    """Loopback stand-ins for the internet, and the map the server's stacks dial by
    (tests/networld.py): no sandbox traffic leaves this machine."""
    from networld import NetWorld
    world = NetWorld(tmp_path_factory.mktemp("networld"))
    yield world
    world.close()


@pytest.fixture(scope="session")
def server(net_world):
    home = new_home("hutch-serve-")
    port = free_port()
    # As a user runs it: warm pools sized by demand, so the suite's creates go through them.
    # The manager's lifecycle at info too (pauses, adoptions): what a failed test's
    # report shows of this server (pytest_runtest_makereport).
    log = "warn,hutch_core::manager=info,hutch_core::orphans=info"
    # The test CA signs the HTTPS hosts whose TLS hutch inspects (tests/network/test_inspection.py).
    proc = launch(home, port, "--upstream-ca", str(net_world.tls_ca),
                  env_extra={"HUTCH_NET_TEST_MAP": str(net_world.map), "HUTCH_LOG": log}, pools=True)
    url = f"http://127.0.0.1:{port}"
    os.environ.update(E2B_API_KEY=API_KEY, E2B_API_URL=url, E2B_SANDBOX_URL=url, HUTCH_API_URL=url, HUTCH_API_KEY=API_KEY)
    yield Server(url, home, proc)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    left = list((home / "sandboxes").glob("*")) if (home / "sandboxes").exists() else []
    snaps = list((home / "snapshots" / "sandboxes").glob("*")) if (home / "snapshots" / "sandboxes").exists() else []
    qemus = qemus_under(home)
    shutil.rmtree(home, ignore_errors=True)
    assert not left, f"sandbox directories left: {left}"
    assert not snaps, f"snapshot files left (forks must go with their sandboxes, tests delete theirs): {snaps}"
    assert not qemus, f"QEMU processes left: {qemus}"
