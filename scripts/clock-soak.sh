#!/usr/bin/env bash
# The guest-clock check of the VM suite held for 30 minutes (not part of CI): one sandbox,
# a host core kept busy, the guest clock sampled every 5 s against the host's. Prints the
# worst certain skew; docs/BENCHMARKS.md records the result.
#   scripts/clock-soak.sh [SECONDS]    (default 1800)
source "$(dirname "$0")/lib.sh"
ensure_host_packages
ensure_rust
build
./target/release/hutch setup --template base
HUTCH_CLOCK_HOLD_SECS="${1:-1800}" cargo test --release --locked -p hutch-core --test vm -- --nocapture clock::
