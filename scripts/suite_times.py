#!/usr/bin/env python3
"""Per-phase and per-test times of one run of the README's test command, read from the
timestamped log that scripts/suite-times.sh writes (each line begins HH:MM:SS).

Phases are the `==> ` steps of scripts/test.sh and scripts/python-tests.sh. Rust VM
trials print `trial-time NAME SECONDS` (crates/hutch-core/tests/vm/support.rs), other
Rust test binaries their own `finished in` line; pytest, run with `--durations=0`,
prints setup, call and teardown per test, summed here per test and pass.

Usage: scripts/suite_times.py LOG [--top N]   (prints Markdown tables)"""

import re
import sys
from collections import defaultdict
from datetime import datetime, timedelta

STAMP = re.compile(r"^(\d\d:\d\d:\d\d) ?(.*)$")
STEP = re.compile(r"^==> (.*)$")
# Anywhere in a line: with one test thread, libtest-mimic's "test NAME ... " comes first.
TRIAL = re.compile(r"trial-time (.+?) ([\d.]+)s$")
RUNNING = re.compile(r"^\s*Running (.+) \(\S*/deps/(.+)-[0-9a-f]+\)$")
FINISHED = re.compile(r"^test result: (\w+)\. (\d+) passed.*finished in ([\d.]+)s$")
DURATION = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(\S.*)$")


def clock(text: str, previous: datetime | None) -> datetime:
    t = datetime.strptime(text, "%H:%M:%S")
    # A run that passes midnight: the clock goes back, the day moves on.
    while previous is not None and t < previous:
        t += timedelta(days=1)
    return t


def parse(lines):
    steps = []  # (start, name)
    trials = []  # (name, seconds)
    binaries = []  # (path, tests, seconds)
    passes = defaultdict(lambda: defaultdict(float))  # pass -> test -> seconds
    current_pass = None
    running = None
    last = first = None
    for raw in lines:
        m = STAMP.match(raw.rstrip("\n"))
        if not m:
            continue
        last = clock(m.group(1), last)
        first = first or last
        text = m.group(2)
        if s := STEP.match(text):
            steps.append((last, s.group(1)))
            if "Python tests against hutch serve" in text:
                current_pass = "newest SDKs"
            elif "with e2b 2.45" in text:
                current_pass = "oldest SDKs"
            continue
        if t := TRIAL.search(text):
            trials.append((t.group(1), float(t.group(2))))
        elif r := RUNNING.match(text):
            running = f"{r.group(2)} ({r.group(1)})"
        elif f := FINISHED.match(text):
            binaries.append((running or "?", int(f.group(2)), float(f.group(3))))
        elif (d := DURATION.match(text.strip())) and current_pass:
            passes[current_pass][d.group(3)] += float(d.group(1))
    return steps, trials, binaries, passes, first, last


def minutes(td: timedelta) -> str:
    return f"{td.total_seconds() / 60:.1f}"


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 10
    with open(sys.argv[1], errors="replace") as f:
        steps, trials, binaries, passes, first, last = parse(f)
    if first is None:
        print(f"{sys.argv[1]} has no timestamped lines", file=sys.stderr)
        return 1

    print("| phase (a `==>` step of the scripts) | minutes |\n| --- | ---: |")
    for i, (start, name) in enumerate(steps):
        end = steps[i + 1][0] if i + 1 < len(steps) else last
        # Steps that only print a background job's log take no time of their own.
        if (end - start).total_seconds() >= 3:
            print(f"| {name[:110]} | {minutes(end - start)} |")
    print(f"| **total** | **{minutes(last - first)}** |\n")

    print("| Rust test binary | tests | seconds |\n| --- | ---: | ---: |")
    for path, count, secs in binaries:
        if count:
            print(f"| {path} | {count} | {secs:.1f} |")
    print()
    if trials:
        print("| Rust VM trial (tests/vm) | seconds |\n| --- | ---: |")
        for name, secs in sorted(trials, key=lambda t: -t[1]):
            print(f"| {name} | {secs:.1f} |")
        print()

    everything = []
    for pass_name, tests in passes.items():
        total = sum(tests.values())
        print(f"| Python test ({pass_name}: {len(tests)} tests, {total / 60:.1f} min) | seconds |\n| --- | ---: |")
        for test, secs in sorted(tests.items(), key=lambda t: -t[1]):
            print(f"| {test} | {secs:.1f} |")
            everything.append((secs, f"{test} ({pass_name})"))
        print()
    everything += [(secs, f"{name} (Rust VM trial)") for name, secs in trials]
    print(f"Most expensive {top}:\n")
    for secs, what in sorted(everything, reverse=True)[:top]:
        print(f"1. {what}: {secs:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
