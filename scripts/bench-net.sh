#!/usr/bin/env bash
# Network benchmark: iperf3 both ways and TCP connects per second from one guest to
# servers on loopback, through hutch's stack, passt and QEMU's user-mode network, rounds
# interleaved in one run (method and results: docs/BENCHMARKS.md).
# Usage: scripts/bench-net.sh [ROUNDS]   (default 5)
source "$(dirname "$0")/lib.sh"
ROUNDS="${1:-5}"
ensure_host_packages
ensure_rust
ensure_tools "the benchmark's tools" iperf3=iperf3 passt=passt cc=gcc,libc6-dev
build
# Unconfined: QEMU's user-mode network needs the host's network namespace, and the
# other two run alike so the three compare on equal terms.
HUTCH_JAIL=off ./target/release/hutch bench --suite net --runs "$ROUNDS"
