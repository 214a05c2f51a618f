#!/usr/bin/env bash
# Time to interactive through the official E2B Python SDK (issue 31; docs/BENCHMARKS.md).
source "$(dirname "$0")/lib.sh"
VENV="$E2B_VENV"
[ -x "$VENV/bin/python" ] || bash scripts/python-tests.sh --install-only
[ -x ./target/release/hutch ] || build
"$VENV/bin/python" bench/tti.py
