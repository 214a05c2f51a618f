#!/usr/bin/env bash
# QEMU 7.2 vs 10.0 on hutch's guest, interleaved in one run (see bench/qemu_versions.py).
# Arguments go to the script, e.g. --rounds 20 --cpus max.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 bench/qemu_versions.py "$@"
