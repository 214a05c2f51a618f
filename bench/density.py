"""Density and bursts through the official E2B SDK against `hutch serve` (issue 31).

Density: one `hutch serve --no-pool` with room for 200 sandboxes. Idle `base` sandboxes
are created one after another, each running `true` once (so its QEMU has translated
what a first command runs), until 200 run or the host's MemAvailable falls below the
pools' reserve (an eighth of memory, at least 1 GiB) plus one guest: memory says stop.
Then every sandbox runs `echo <its number>` and must answer it. Reported: how many ran
and answered, the host memory they took (MemAvailable before minus after, and the sum
of their QEMUs' PSS), create and command latencies at the start and at the end, and
the load while they idle.

Bursts: 20 official-SDK `Sandbox.create()` + `commands.run("true")` at once, on
- a server whose pool holds 20 waiting sandboxes (`--pool base=20`, filled off the
  clock): the pool warm;
- the default server, after one burst already taught it the demand (its pool is as
  large as that burst, up to `--pool-max`, 4): what a user's second burst meets;
- `--no-pool`: every create restores its own sandbox, the pool cold.
Each reports p50 / p95 of create and of create + first command, and failures.

    scripts/bench-density.sh    # or: python bench/density.py [density|bursts]
"""

import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import API_KEY, HUTCH, free_port, new_home, qemus_under  # noqa: E402
from common import pct, pool_ready  # noqa: E402

TARGET = int(os.environ.get("BENCH_SANDBOXES", "200"))
BURST = int(os.environ.get("BENCH_BURST", "20"))
GUEST_MIB = 512


def ms(v):
    return f"{v * 1000:.0f}"


def meminfo(field):
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) // 1024
    raise KeyError(field)


def reserve_mib():
    """The pools' reserve (`manager/pool_sizing.rs`): an eighth of memory, at least 1 GiB."""
    return max(1024, meminfo("MemTotal") // 8)


def pss_mib(pids):
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def serve(flags):
    home, port = new_home("hutch-density-"), free_port()
    env = dict(os.environ, HUTCH_HOME=str(home), HUTCH_API_KEY=API_KEY, HUTCH_LOG="warn")
    proc = subprocess.Popen([str(HUTCH), "serve", "--listen", f"127.0.0.1:{port}", "--accel", "tcg", *flags],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(home / "serve.log", "w"))
    url = f"http://127.0.0.1:{port}"
    os.environ.update(E2B_API_KEY=API_KEY, E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_DOMAIN="localhost")
    deadline = time.time() + 120
    while True:
        try:
            httpx.get(url + "/health", timeout=2)
            return proc, url, home
        except httpx.HTTPError:
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError(f"hutch serve did not answer: {(home / 'serve.log').read_text()[-2000:]}")
            time.sleep(0.2)  # the server is still starting: polled until the deadline


def stop(proc, sandboxes):
    """Kills every sandbox (a server that stops leaves them running for the next one)."""
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda s: s.kill(), sandboxes))
    proc.terminate()
    proc.wait(timeout=60)


def density():
    from e2b import Sandbox

    free_before = meminfo("MemAvailable")
    limit = TARGET + 8
    proc, url, home = serve(["--no-pool", "--max-sandboxes", str(limit), "--key-max-running", str(limit)])
    sandboxes, creates, firsts, why = [], [], [], f"{TARGET} reached"
    try:
        Sandbox.create().kill()  # the template's snapshot is built off the clock
        free_before = meminfo("MemAvailable")
        while len(sandboxes) < TARGET:
            if meminfo("MemAvailable") < reserve_mib() + GUEST_MIB:
                why = f"memory: MemAvailable {meminfo('MemAvailable')} MiB < reserve {reserve_mib()} + one guest {GUEST_MIB}"
                break
            t0 = time.perf_counter()
            try:
                sbx = Sandbox.create(timeout=3600)
            except Exception as e:  # noqa: BLE001 - reported, and the count stops here
                why = f"create {len(sandboxes) + 1} failed: {e}"
                break
            t1 = time.perf_counter()
            sandboxes.append(sbx)
            sbx.commands.run("true")
            creates.append(t1 - t0)
            firsts.append(time.perf_counter() - t1)
            if len(sandboxes) % 20 == 0:
                print(f"  {len(sandboxes)} sandboxes, MemAvailable {meminfo('MemAvailable')} MiB, load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
        # idle a little, as idle sandboxes do, before they are asked again
        settle_until = time.time() + 30
        while time.time() < settle_until:
            time.sleep(1)  # the idle period being measured, not a synchronisation
        free_after = meminfo("MemAvailable")
        pss = pss_mib(qemus_under(home))
        load = os.getloadavg()
        answered, answers = 0, []
        for i, sbx in enumerate(sandboxes):
            t0 = time.perf_counter()
            try:
                out = sbx.commands.run(f"echo {i}", timeout=60)
                answered += out.stdout.strip() == str(i)
                answers.append(time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - counted as not answering
                print(f"  sandbox {i} did not answer: {e}", file=sys.stderr)
        n = len(sandboxes)
        head, tail = creates[:20], creates[-20:]
        print("| sandboxes running | answered `echo` | stopped because | host memory per sandbox (MemAvailable drop) MiB | QEMU PSS per sandbox MiB | load (1 / 5 min) while idle |")
        print("|---:|---:|---|---:|---:|---|")
        print(f"| {n} | {answered} | {why} | {(free_before - free_after) / max(n, 1):.1f} | {pss / max(n, 1):.1f} | {load[0]:.1f} / {load[1]:.1f} |")
        print()
        print("| latency (ms) | p50 | p95 |")
        print("|---|---:|---:|")
        print(f"| create, first 20 sandboxes | {ms(statistics.median(head))} | {ms(pct(head, 0.95))} |")
        print(f"| create, last 20 sandboxes | {ms(statistics.median(tail))} | {ms(pct(tail, 0.95))} |")
        print(f"| first `true`, last 20 sandboxes | {ms(statistics.median(firsts[-20:]))} | {ms(pct(firsts[-20:], 0.95))} |")
        if answers:
            print(f"| `echo` in each of the {n}, after 30 s idle | {ms(statistics.median(answers))} | {ms(pct(answers, 0.95))} |")
    finally:
        stop(proc, sandboxes)


def burst():
    """BURST creates + first commands at once: (creates, ttis, failures, sandboxes)."""
    from e2b import Sandbox

    def one(_):
        t0 = time.perf_counter()
        sbx = Sandbox.create()
        t1 = time.perf_counter()
        sbx.commands.run("true")
        return sbx, t1 - t0, time.perf_counter() - t0

    sandboxes, creates, ttis, failures = [], [], [], []
    with ThreadPoolExecutor(BURST) as pool:
        for f in [pool.submit(one, i) for i in range(BURST)]:
            try:
                sbx, c, t = f.result()
                sandboxes.append(sbx)
                creates.append(c)
                ttis.append(t)
            except Exception as e:  # noqa: BLE001 - counted as a failure
                failures.append(str(e)[:200])
    return creates, ttis, failures, sandboxes


def bursts():
    from e2b import Sandbox

    limit = str(BURST * 2 + 2)
    configs = [
        (f"`--pool base={BURST}`, filled", ["--pool", f"base={BURST}"], BURST, False),
        ("default, second burst (pool sized by the first)", [], 0, True),
        ("`--no-pool`", ["--no-pool"], 0, False),
    ]
    print(f"| server | creates at once | create p50 | create p95 | TTI p50 | TTI p95 | failures |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, flags, fill, teach in configs:
        proc, url, _home = serve([*flags, "--max-sandboxes", limit, "--key-max-running", limit])
        sandboxes = []
        try:
            Sandbox.create().kill()  # the template's snapshot is built off the clock
            if teach:
                *_, first = burst()
                sandboxes += first
                with ThreadPoolExecutor(4) as pool:
                    list(pool.map(lambda s: s.kill(), first))
                sandboxes.clear()
                pool_ready(url, API_KEY, "base", 4, within=600)
            if fill:
                pool_ready(url, API_KEY, "base", fill, within=600)
            creates, ttis, failures, sandboxes = burst()
            row = f"| {name} | {BURST} | {ms(statistics.median(creates))} | {ms(pct(creates, 0.95))} | {ms(statistics.median(ttis))} | {ms(pct(ttis, 0.95))} | {len(failures)} |" if creates else f"| {name} | {BURST} | – | – | – | – | {len(failures)} |"
            print(row, flush=True)
            for f in failures:
                print(f"  failure: {f}", file=sys.stderr)
        finally:
            stop(proc, sandboxes)


def main():
    which = sys.argv[1:] or ["bursts", "density"]
    if "bursts" in which:
        bursts()
        print()
    if "density" in which:
        density()
    print(f"\nhost: {os.cpu_count()} cores, {meminfo('MemTotal')} MiB")


if __name__ == "__main__":
    main()
