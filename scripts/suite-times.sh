#!/usr/bin/env bash
# The suite's time, phase by phase and test by test (docs/BENCHMARKS.md, "The test
# suite's own time"): runs the README's test command (or, with --ci, all of .ci/run)
# with every line timestamped and pytest's --durations=0, then prints the tables
# scripts/suite_times.py reads from that log. For a fresh run, clone first and give it a
# new HUTCH_HOME: git clone . /tmp/verify && HUTCH_HOME=/tmp/verify-home
# /tmp/verify/scripts/suite-times.sh
set -euo pipefail
cd "$(dirname "$0")/.."
command=(bash scripts/test.sh)
[ "${1:-}" = "--ci" ] && command=(bash .ci/run)
home="${HUTCH_HOME:-$HOME/.local/share/hutch}"
mkdir -p "$home/cache"
log="$home/cache/suite-times-$(date +%Y%m%d-%H%M%S).log"
echo "==> running ${command[*]}, every line timestamped into $log" >&2
status=0
PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} --durations=0" "${command[@]}" 2>&1 \
  | perl -MPOSIX -pe 'BEGIN { $| = 1 } print strftime("%H:%M:%S ", localtime)' | tee "$log" || status=$?
python3 scripts/suite_times.py "$log"
exit "$status"
