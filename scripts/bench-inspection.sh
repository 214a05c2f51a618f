#!/usr/bin/env bash
# Inspected against relayed HTTPS from one sandbox, in the same run (issue 32;
# bench/inspection.py says how, docs/BENCHMARKS.md has the figures). Every byte goes to
# loopback through hutch's test map.
source "$(dirname "$0")/lib.sh"
VENV="$E2B_VENV"
[ -x "$VENV/bin/python" ] || bash scripts/python-tests.sh --install-only
[ -x ./target/release/hutch ] || build
"$VENV/bin/python" bench/inspection.py "$@"
