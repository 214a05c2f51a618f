#!/usr/bin/env bash
# Quick start, part 2: the whole test suite. Tests boot real microVMs.
# Where its minutes go, test by test: scripts/suite-times.sh (docs/BENCHMARKS.md).
source "$(dirname "$0")/lib.sh"
ensure_host_packages
ensure_test_packages
ensure_rust
# Crates whose unit-test harness is off (`test = false`: compiling it would cost a
# minute and run nothing) must stay without unit tests, or those would never run.
for crate in hutch-envd hutch-sdk; do
  found=0
  grep -rqE '#\[(tokio::)?test' "crates/$crate/src" || found=$?
  [ "$found" -ne 0 ] || die "crates/$crate has unit tests, but its Cargo.toml says test = false; remove that line so they run"
  [ "$found" -eq 1 ] || die "could not read crates/$crate/src to check it has no unit tests"
done
# No new import circle between the files of a crate (issue 30 breaks the known ones).
python3 scripts/import-circles.py --known scripts/import-circles.known >/dev/null || {
  python3 scripts/import-circles.py --known scripts/import-circles.known || true
  die "a new import circle between files (above); give what both files need a file of its own"
}
build
# The guest artifacts (mostly mmdebstrap's downloads and dpkg, one core each) are made
# while the test binaries compile: on a fresh 2-core machine that overlap is minutes.
# Both templates at once: their downloads and unpacking overlap too (the kernel fetch
# and each template snapshot take a lock, so the two setups never race).
mkdir -p "$HUTCH_HOME/cache"
LOGS="$HUTCH_HOME/cache"
step "preparing guest artifacts (hutch setup of base and of code-interpreter, logs: $LOGS/test-setup-*.log) and the Python tests' SDKs (log: $LOGS/test-tools.log) in the background while the test binaries compile"
setsid ./target/release/hutch setup --template base >"$LOGS/test-setup-base.log" 2>&1 &
BASE_PID=$!
setsid ./target/release/hutch setup --template code-interpreter >"$LOGS/test-setup-code-interpreter.log" 2>&1 &
CI_PID=$!
# The Python tests' SDKs (PyPI, npm) too: network, not cores.
setsid bash scripts/python-tests.sh --install-only >"$LOGS/test-tools.log" 2>&1 &
TOOLS_PID=$!
BACKGROUND_GROUPS+=("$BASE_PID" "$CI_PID" "$TOOLS_PID")
# A failed compile still waits for the rest, so no hutch is left running behind the script.
compiled=0
cargo test --release --locked --workspace --no-run || compiled=$?
step "waiting for the background steps (hutch setup, the SDKs' installs)"
failed=()
for job in "base:$BASE_PID:test-setup-base.log" "code-interpreter:$CI_PID:test-setup-code-interpreter.log" "SDKs:$TOOLS_PID:test-tools.log"; do
  IFS=: read -r what pid log <<<"$job"
  status=0
  wait "$pid" || status=$?
  step "output of the background step ($what)"
  cat "$LOGS/$log" >&2
  [ "$status" -eq 0 ] || failed+=("$what (exit $status)")
done
[ "$compiled" -eq 0 ] || die "compiling the tests failed (cargo test --no-run exited with $compiled)"
[ "${#failed[@]}" -eq 0 ] || die "a background step failed: ${failed[*]}; its output is above"
step "running the Rust tests"
cargo test --release --locked --workspace
bash scripts/python-tests.sh
