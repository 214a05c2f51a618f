#!/usr/bin/env bash
# Network benchmark: iperf3 both ways and TCP connects per second from one guest to
# servers on loopback, through hutch's stack, passt and QEMU's user-mode network, rounds
# interleaved in one run (method and results: docs/BENCHMARKS.md).
# Usage: scripts/bench-net.sh [ROUNDS]   (default 5)
source "$(dirname "$0")/lib.sh"
ROUNDS="${1:-5}"
ensure_host_packages
ensure_rust
missing=()
for tool in iperf3 passt cc; do command -v "$tool" >/dev/null 2>&1 || missing+=("$tool"); done
if [ "${#missing[@]}" -gt 0 ]; then
  [ "$(id -u)" = 0 ] || die "missing ${missing[*]}; run this as root so it can install iperf3, passt and gcc from Debian"
  step "installing iperf3, passt and gcc from Debian (the benchmark's tools)"
  apt-get update -qq || die "apt-get update failed (see above)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends iperf3 passt gcc libc6-dev >/dev/null \
    || die "apt-get could not install iperf3, passt and gcc (see above)"
fi
build
# Unconfined: QEMU's user-mode network needs the host's network namespace, and the
# other two run alike so the three compare on equal terms.
HUTCH_JAIL=off ./target/release/hutch bench --suite net --runs "$ROUNDS"
