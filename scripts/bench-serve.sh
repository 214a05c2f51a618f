#!/usr/bin/env bash
# Benchmark of hutch serve with the Python SDK (see docs/BENCHMARKS.md).
source "$(dirname "$0")/lib.sh"
VENV="$E2B_VENV"
[ -x "$VENV/bin/python" ] || bash scripts/python-tests.sh --co -q >/dev/null
PYTHONPATH="$PWD/sdk/python" "$VENV/bin/python" bench/serve.py
