#!/usr/bin/env bash
# Benchmark of hutch serve with the Python SDK (see docs/BENCHMARKS.md).
source "$(dirname "$0")/lib.sh"
VENV="$HUTCH_HOME/cache/py-e2b-2.63.0-ci-2.11.5"
[ -x "$VENV/bin/python" ] || bash scripts/python-tests.sh --co -q >/dev/null
PYTHONPATH="$PWD/sdk/python" "$VENV/bin/python" bench/serve.py
