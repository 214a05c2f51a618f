"""Inspected against relayed HTTPS from one sandbox (issue 32), in the same run.

One `hutch serve` (its stacks dial through the test map: every byte goes to loopback)
and one `base` sandbox made through the official E2B SDK, allowed inspect.test and
plain.test. Both hosts are listeners of one Python HTTPS server (tests/networld.py), so
the only difference is hutch: inspect.test has a header rule (hutch ends the guest's
TLS, verifies the server, re-sends each request with the rule's header), plain.test has
none (its bytes are relayed untouched). Rounds alternate relayed and inspected:
- small requests: curl in the guest sends BENCH_REQUESTS GETs on one kept-alive
  connection; requests/s over the guest's own clock, p50 of curl's per-request time
  (the first, which pays the handshakes, left out);
- a download of BENCH_DOWNLOAD_MB MB: curl's own MB/s;
- hutch's CPU (user + system of the `hutch serve` process, whose stacks relay and
  inspect) per request and per 100 MB.
Medians over BENCH_ROUNDS rounds, and inspected / relayed.

    scripts/bench-inspection.sh    # or: python bench/inspection.py
"""

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import API_KEY, free_port, launch, new_home, stop  # noqa: E402
from networld import NetWorld  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
REQUESTS = int(os.environ.get("BENCH_REQUESTS", "200"))
DOWNLOAD_MB = int(os.environ.get("BENCH_DOWNLOAD_MB", "100"))
HOSTS = {"relayed": "plain.test", "inspected": "inspect.test"}


def cpu_seconds(pid: int) -> float:
    """CPU time of process `pid`, all its threads, in seconds: the scheduler's own count
    (nanoseconds, `/proc/PID/task/*/schedstat`), not clock ticks, which are 10 ms."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError):
            continue  # a thread that ended since the listing
    return total / 1e9


def small_requests(sbx, host: str, pid: int) -> dict:
    urls = " ".join([f"https://{host}/small"] * REQUESTS)
    # `-k`: the guest does not trust the test CA that signed plain.test; inspect.test gets
    # the same flag so both sides do the same work. Times go to stderr, bodies nowhere.
    cmd = (f"s=$(date +%s%N); curl -sk -w '%{{stderr}}%{{time_total}}\\n' {urls} >/dev/null; "
           f"e=$(date +%s%N); echo $(( (e - s) / 1000 ))")
    cpu = cpu_seconds(pid)
    r = sbx.commands.run(cmd, timeout=900)
    cpu = cpu_seconds(pid) - cpu
    times = [float(t) for t in r.stderr.split()]
    assert len(times) == REQUESTS, r.stderr[-500:]
    wall_s = int(r.stdout.strip()) / 1e6
    return {"rps": REQUESTS / wall_s, "p50_ms": statistics.median(times[1:]) * 1000, "cpu_ms_per_req": cpu * 1000 / REQUESTS}


def download(sbx, host: str, pid: int) -> dict:
    n = DOWNLOAD_MB * 1_000_000
    cpu = cpu_seconds(pid)
    r = sbx.commands.run(f"curl -sk -o /dev/null -w '%{{size_download}} %{{speed_download}}' https://{host}/bytes/{n}", timeout=900)
    cpu = cpu_seconds(pid) - cpu
    size, speed = r.stdout.split()
    assert int(size) == n, r.stdout
    return {"mb_s": float(speed) / 1e6, "cpu_s_per_100mb": cpu * 100 / DOWNLOAD_MB}


def main():
    world = NetWorld(Path(tempfile.mkdtemp(prefix="hutch-bench-inspection-world-")))
    home = new_home("hutch-bench-inspection-")
    port = free_port()
    proc = launch(home, port, "--upstream-ca", str(world.tls_ca), env_extra={"HUTCH_NET_TEST_MAP": str(world.map)})
    url = f"http://127.0.0.1:{port}"
    os.environ.update(E2B_API_KEY=API_KEY, E2B_API_URL=url, E2B_SANDBOX_URL=url)
    from e2b import Sandbox
    network = {"allow_out": list(HOSTS.values()), "deny_out": ["0.0.0.0/0"],
               "rules": {"inspect.test": [{"transform": {"headers": {"X-Hutch-Test": "bench"}}}]}}
    sbx = Sandbox.create("base", network=network, timeout=3600)
    try:
        # Off the clock: both paths once, so TCG has translated curl's and TLS's code.
        for host in HOSTS.values():
            sbx.commands.run(f"curl -sk -o /dev/null https://{host}/warm https://{host}/warm", timeout=300)
        got = {kind: [] for kind in HOSTS}
        for n in range(ROUNDS):
            for kind, host in HOSTS.items():
                row = small_requests(sbx, host, proc.pid) | download(sbx, host, proc.pid)
                got[kind].append(row)
                print(f"round {n + 1} {kind:9}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
        # inspect.test's requests had the rule's header (hutch inspected them), plain.test's none.
        assert {r["x_hutch_test"] for r in world.tls_requests("inspect")} == {"bench"}
        assert {r["x_hutch_test"] for r in world.tls_requests("plain")} == {None}
        print(f"\n{ROUNDS} rounds, {REQUESTS} small requests and {DOWNLOAD_MB} MB each; medians\n")
        print("| | relayed | inspected | inspected / relayed |")
        print("|---|---|---|---|")
        names = {"rps": "small requests/s", "p50_ms": "p50 per request (ms)", "cpu_ms_per_req": "hutch CPU per request (ms)",
                 "mb_s": "download (MB/s)", "cpu_s_per_100mb": "hutch CPU per 100 MB (s)"}
        for key, name in names.items():
            relayed = statistics.median(r[key] for r in got["relayed"])
            inspected = statistics.median(r[key] for r in got["inspected"])
            ratio = inspected / relayed if relayed else float("nan")
            print(f"| {name} | {relayed:.2f} | {inspected:.2f} | {ratio:.2f} |")
    finally:
        sbx.kill()
        stop(proc)
        world.close()


if __name__ == "__main__":
    start = time.monotonic()
    main()
    print(f"\n(took {time.monotonic() - start:.0f} s)")
