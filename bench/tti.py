"""Time to interactive through the official E2B Python SDK against `hutch serve`
(issue 31): `Sandbox.create()` then the first `commands.run("true")`, split into its
two calls, and a second `commands.run("true")` in the same sandbox (what the first
costs beyond it is the guest's first `bash -l`). Each server configuration in its own
home, one after another in the same run, next to the same run's floor: the second
command's round trip.

    scripts/bench-tti.sh        # or: python bench/tti.py [--pool base=1] ...
"""

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import API_KEY, HUTCH, free_port, new_home  # noqa: E402

RUNS = int(os.environ.get("BENCH_RUNS", "20"))
CONFIGS = [("default (no pool)", []), ("--pool base=1", ["--pool", "base=1"])]


def pct(samples, p):
    s = sorted(samples)
    return s[min(len(s) - 1, round((len(s) - 1) * p))]


def serve(extra):
    home, port = new_home("hutch-tti-"), free_port()
    env = dict(os.environ, HUTCH_HOME=str(home), HUTCH_API_KEY=API_KEY)
    proc = subprocess.Popen([str(HUTCH), "serve", "--listen", f"127.0.0.1:{port}", "--accel", "tcg", "--max-sandboxes", "6", *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    os.environ.update(E2B_API_KEY=API_KEY, E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_DOMAIN="localhost")
    return proc, home


def pool_filled(url):
    """Waits (off the clock) until the pool has its sandbox again: a refill follows each take."""
    import httpx

    deadline = time.time() + 120
    while httpx.get(url + "/status", headers={"X-API-Key": API_KEY}).json()["pools"].get("base", {}).get("ready", 0) < 1:
        if time.time() > deadline:
            raise TimeoutError("the pool did not refill within 120 s")
        time.sleep(0.1)


def wait_ready(Sandbox, pooled):
    deadline = time.time() + 300
    while True:
        try:
            sbx = Sandbox.create()
            sbx.kill()
            break
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(0.5)
    if pooled:
        pool_filled(os.environ["E2B_API_URL"])


def measure(Sandbox, pooled):
    create, first, second = [], [], []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        sbx = Sandbox.create()
        t1 = time.perf_counter()
        sbx.commands.run("true")
        t2 = time.perf_counter()
        sbx.commands.run("true")
        t3 = time.perf_counter()
        sbx.kill()
        create.append(t1 - t0)
        first.append(t2 - t1)
        second.append(t3 - t2)
        if pooled:
            pool_filled(os.environ["E2B_API_URL"])
    return create, first, second


def main():
    from e2b import Sandbox

    print("| server | create p50 | first command p50 | TTI p50 | TTI p95 | second command p50 (floor) | TTI / floor |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, extra in CONFIGS:
        proc, _home = serve(extra)
        try:
            pooled = bool(extra)
            wait_ready(Sandbox, pooled)
            create, first, second = measure(Sandbox, pooled)
            tti = [a + b for a, b in zip(create, first)]
            ms = lambda v: f"{v * 1000:.1f}"  # noqa: E731
            floor = statistics.median(second)
            print(f"| {name} | {ms(statistics.median(create))} | {ms(statistics.median(first))} | {ms(statistics.median(tti))} | {ms(pct(tti, 0.95))} | {ms(floor)} | {statistics.median(tti) / floor:.1f}x |")
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(f"\nruns: {RUNS} per server; host: {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
