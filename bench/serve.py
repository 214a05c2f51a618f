"""Benchmark of `hutch serve` with the Python SDK, next to the same operations on the
CLI/library path measured in the same run (method in docs/BENCHMARKS.md).

    scripts/bench-serve.sh            # or: PYTHONPATH=sdk/python python bench/serve.py
"""

import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import API_KEY, HUTCH, free_port, new_home  # noqa: E402
from common import pct  # noqa: E402

from hutch import Sandbox  # noqa: E402

RUNS = int(os.environ.get("BENCH_RUNS", "20"))
CONCURRENT = 10


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cli_run_true(env):
    subprocess.run([str(HUTCH), "run", "--accel", "tcg", "--", "true"], env=env, check=True, capture_output=True)


def main():
    home = new_home("hutch-bench-")
    port = free_port()
    env = dict(os.environ, HUTCH_HOME=str(home), HUTCH_API_KEY=API_KEY)
    server = subprocess.Popen([str(HUTCH), "serve", "--listen", f"127.0.0.1:{port}", "--accel", "tcg", "--max-sandboxes", "12"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(HUTCH_API_URL=f"http://127.0.0.1:{port}", HUTCH_API_KEY=API_KEY)
    try:
        deadline = time.time() + 120
        while True:
            try:
                Sandbox.list()
                break
            except Exception:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        rows = []

        def sdk_create_first_result():
            sbx = Sandbox.create()
            sbx.commands.run("true")
            return sbx

        api = []
        for _ in range(RUNS):
            t = time.perf_counter()
            sbx = sdk_create_first_result()
            api.append(time.perf_counter() - t)
            sbx.kill()
        cli = [timed(lambda: cli_run_true(env)) for _ in range(RUNS)]
        rows.append(("create -> first command result", "Python SDK via hutch serve", api, "hutch run -- true (CLI, local)", cli))

        sbx = Sandbox.create()
        for _ in range(3):
            sbx.commands.run("true")
        api_exec = [timed(lambda: sbx.commands.run("true")) for _ in range(max(RUNS, 50))]
        sbx.kill()
        bench = subprocess.run([str(HUTCH), "bench", "--runs", "3", "--accel", "tcg"], env=env, capture_output=True, text=True, check=True).stdout
        m = re.search(r"\| exec round trip of `bash -l -c true`[^|]*\| ([\d.]+) \| ([\d.]+) \|", bench)
        lib_exec = [float(m.group(1)) / 1000, float(m.group(2)) / 1000] if m else [float("nan")] * 2
        rows.append(("exec round trip of `bash -l -c true` (what SDKs start)", "Python SDK via hutch serve", api_exec, "same command, agent client direct (hutch bench)", lib_exec))

        ci = Sandbox.create(template="code-interpreter")
        for _ in range(3):
            ci.run_code("1+1")
            ci.commands.run("true")
        code_rt, cmd_rt = [], []
        for _ in range(max(RUNS, 30)):
            code_rt.append(timed(lambda: ci.run_code("1+1")))
            cmd_rt.append(timed(lambda: ci.commands.run("true")))
        ci.kill()
        rows.append(("run_code(\"1+1\") round trip", "Python SDK via hutch serve", code_rt, "commands.run(\"true\"), same sandbox", cmd_rt))

        def burst(fn):
            with ThreadPoolExecutor(CONCURRENT) as pool:
                t = time.perf_counter()
                results = list(pool.map(lambda _: fn(), range(CONCURRENT)))
                return time.perf_counter() - t, results

        wall_api, sandboxes = burst(sdk_create_first_result)
        for s in sandboxes:
            s.kill()
        wall_cli, _ = burst(lambda: cli_run_true(env))
        rows.append((f"{CONCURRENT} concurrent creates, wall for all", "Python SDK via hutch serve", [wall_api], f"{CONCURRENT} concurrent hutch run -- true", [wall_cli]))

        print(f"| operation | path | p50 ms | p95 ms | reference path | p50 ms | p95 ms | ratio (p50) |")
        print("|---|---|---:|---:|---|---:|---:|---:|")
        for op, a_name, a, b_name, b in rows:
            ratio = pct(a, 0.5) / pct(b, 0.5)
            print(f"| {op} | {a_name} | {pct(a, .5)*1000:.1f} | {pct(a, .95)*1000:.1f} | {b_name} | {pct(b, .5)*1000:.1f} | {pct(b, .95)*1000:.1f} | {ratio:.2f} |")
        print(f"\nruns: {RUNS} (exec: {max(RUNS, 50)}); host: {os.cpu_count()} cores")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        if sys.exc_info()[0] is None:
            shutil.rmtree(home, ignore_errors=True)
        else:
            print(f"kept {home} for a look (serve.log, sandboxes/)", file=sys.stderr)


if __name__ == "__main__":
    main()
