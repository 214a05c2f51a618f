#!/usr/bin/env bash
# Density (idle sandboxes on one machine) and bursts of concurrent creates through the
# official E2B Python SDK (issue 31; docs/BENCHMARKS.md). Arguments: density, bursts.
source "$(dirname "$0")/lib.sh"
VENV="$E2B_VENV"
[ -x "$VENV/bin/python" ] || bash scripts/python-tests.sh --install-only
[ -x ./target/release/hutch ] || build
"$VENV/bin/python" bench/density.py "$@"
