"""Time to interactive through the official E2B SDKs against `hutch serve` (issue 31).

Base template, official `e2b` SDK: `Sandbox.create()` then the first
`commands.run("true")`, split into its two calls, and a second `commands.run("true")`
in the same sandbox (the same run's floor: a command round trip once nothing is cold).
Base template, a terminal: `Sandbox.create()` then `pty.create` and `echo $ABC` typed,
until the echo's output, twice (issue 37, item 8). Code interpreter, official
`e2b_code_interpreter` SDK: `Sandbox.create()` then the first `run_code("1")`, and a
second `run_code("1")` as its floor.

The server logs each create's phases (`HUTCH_LOG=hutch_core=debug`: admission, the
VM, the record), and a second table splits the creates of each row by them: what
separates a create's time from its VM's.

Each server configuration runs in its own home, one after another in the same run:
- the default `hutch serve` (warm pools sized by demand), each run starting once the
  pool has its sandbox again (polled on /status, off the clock): one user's creates;
- the default, back to back: the next create right after the last kill, whatever the
  pool holds (a loop of creates, what sizing by demand is for);
- `--no-pool`: every create restores its own sandbox.

    scripts/bench-tti.sh        # or: BENCH_RUNS=20 python bench/tti.py
"""

import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import API_KEY, HUTCH, free_port, new_home  # noqa: E402
from common import pct, pool_ready  # noqa: E402

RUNS = int(os.environ.get("BENCH_RUNS", "20"))
# (name, serve flags, wait for the pool to refill before each run)
CONFIGS = [
    ("default (pools by demand), pool refilled", [], True),
    ("default, back to back", [], False),
    ("--no-pool", ["--no-pool"], False),
]


CREATED = re.compile(r"created sandbox (\S+) from (.+) in ([\d.]+) ms: admission ([\d.]+), VM ([\d.]+), record ([\d.]+)")


def serve(extra):
    home, port = new_home("hutch-tti-"), free_port()
    env = dict(os.environ, HUTCH_HOME=str(home), HUTCH_API_KEY=API_KEY, HUTCH_LOG="warn,hutch_core=debug")
    log = home / "serve.log"
    proc = subprocess.Popen([str(HUTCH), "serve", "--listen", f"127.0.0.1:{port}", "--accel", "tcg", "--max-sandboxes", "6", *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    url = f"http://127.0.0.1:{port}"
    os.environ.update(E2B_API_KEY=API_KEY, E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_DOMAIN="localhost")
    return proc, url, log


def created(log, ids):
    """The phases the server logged for the sandboxes `ids`: {id: (from, total, admission, vm, record)}."""
    found = {}
    for line in log.read_text(errors="replace").splitlines():
        m = CREATED.search(line)
        if m and m.group(1) in ids:
            found[m.group(1)] = (m.group(2), *map(float, m.groups()[2:]))
    return found


def warm_server(Sandbox, first):
    """Waits until the server answers and one sandbox has run (off the clock)."""
    deadline = time.time() + 300
    while True:
        try:
            sbx = Sandbox.create()
            first(sbx)
            sbx.kill()
            return
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(0.5)  # the server is still starting: retried until the deadline


def measure(Sandbox, first, url, template, refilled):
    create, first_call, second, ids = [], [], [], []
    for _ in range(RUNS):
        if refilled:
            pool_ready(url, API_KEY, template, 1, within=120)
        t0 = time.perf_counter()
        sbx = Sandbox.create()
        t1 = time.perf_counter()
        first(sbx)
        t2 = time.perf_counter()
        first(sbx)
        t3 = time.perf_counter()
        sbx.kill()
        ids.append(sbx.sandbox_id)
        create.append(t1 - t0)
        first_call.append(t2 - t1)
        second.append(t3 - t2)
    return (create, first_call, second), ids


def drain(terminal, on_pty):
    """Reads a terminal until it ends; the kill that ends it is the caller's."""
    from e2b.sandbox.commands.command_handle import CommandExitException
    try:
        terminal.wait(on_pty=on_pty)
    except CommandExitException:
        pass


def row(name, create, first, second):
    tti = [a + b for a, b in zip(create, first)]
    ms = lambda v: f"{v * 1000:.1f}"  # noqa: E731
    floor = statistics.median(second)
    return f"| {name} | {ms(statistics.median(create))} | {ms(statistics.median(first))} | {ms(statistics.median(tti))} | {ms(pct(tti, 0.95))} | {ms(floor)} | {statistics.median(tti) / floor:.1f}x |"


def main():
    import e2b
    import e2b_code_interpreter

    def run_true(sbx):
        sbx.commands.run("true")

    def run_code(sbx):
        execution = sbx.run_code("1")
        assert execution.text == "1", execution

    def terminal_echo(sbx):
        """A terminal's first answer: `pty.create`, `echo $ABC` typed, until its output
        (what E2B's own PTY test gives 300 ms)."""
        from e2b.sandbox.commands.command_handle import PtySize
        seen, out = threading.Event(), bytearray()

        def on_pty(data):
            out.extend(data)
            if b"123\r\n" in out.split(b"echo $ABC", 1)[-1]:
                seen.set()

        terminal = sbx.pty.create(PtySize(24, 80), envs={"ABC": "123"}, timeout=0)
        reader = threading.Thread(target=lambda: drain(terminal, on_pty), daemon=True)
        reader.start()
        sbx.pty.send_stdin(terminal.pid, b"echo $ABC\n")
        assert seen.wait(30), bytes(out)
        sbx.pty.kill(terminal.pid)
        reader.join(30)

    kinds = [
        ("base, `commands.run`", e2b.Sandbox, run_true, "base"),
        ("base, `pty.create` and an `echo`", e2b.Sandbox, terminal_echo, "base"),
        ("code interpreter, `run_code`", e2b_code_interpreter.Sandbox, run_code, "code-interpreter"),
    ]
    print("| template, first call | server | create p50 | first call p50 | TTI p50 | TTI p95 | second call p50 (floor) | TTI / floor |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    phases = []
    for name, extra, refilled in CONFIGS:
        proc, url, log = serve(extra)
        try:
            for kind, Sandbox, first, template in kinds:
                warm_server(Sandbox, first)
                samples, ids = measure(Sandbox, first, url, template, refilled and "--no-pool" not in extra)
                print(row(f"{kind} | {name}", *samples), flush=True)
                traced = created(log, set(ids))
                for source in sorted({t[0] for t in traced.values()}):
                    rows = [t for t in traced.values() if t[0] == source]
                    med = lambda i: statistics.median(r[i] for r in rows)  # noqa: E731
                    phases.append(f"| {kind} | {name} | {source} | {len(rows)} | {med(1):.1f} | {med(2):.1f} | {med(3):.1f} | {med(4):.1f} |")
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print("\nInside the server, by where the VM came from (p50 ms; the SDK's create above adds HTTP and its client):\n")
    print("| template | server | VM from | creates | in the server | admission | VM | record |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    print("\n".join(phases))
    print(f"\nruns: {RUNS} per row; host: {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
