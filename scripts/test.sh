#!/usr/bin/env bash
# Quick start, part 2: the whole test suite. Tests boot real microVMs.
source "$(dirname "$0")/lib.sh"
ensure_host_packages
ensure_test_packages
ensure_rust
build
# The guest artifacts (mostly mmdebstrap's downloads and dpkg, one core) are made while
# the test binaries compile: on a fresh 2-core machine that overlap is minutes.
mkdir -p "$HUTCH_HOME/cache"
SETUP_LOG="$HUTCH_HOME/cache/test-setup.log"
step "preparing guest artifacts (hutch setup, log: $SETUP_LOG) and the Python tests' SDKs (log: $HUTCH_HOME/cache/test-tools.log) in the background while the test binaries compile"
./target/release/hutch setup --template base --template code-interpreter >"$SETUP_LOG" 2>&1 &
SETUP_PID=$!
# The Python tests' SDKs (PyPI, npm) too: network, not cores.
TOOLS_LOG="$HUTCH_HOME/cache/test-tools.log"
bash scripts/python-tests.sh --install-only >"$TOOLS_LOG" 2>&1 &
TOOLS_PID=$!
# A failed compile still waits for setup, so no hutch is left running behind the script.
compiled=0
cargo test --release --locked --workspace --no-run || compiled=$?
setup=0
wait "$SETUP_PID" || setup=$?
tools=0
wait "$TOOLS_PID" || tools=$?
step "hutch setup's output"
cat "$SETUP_LOG" >&2
step "the test tools' installation"
cat "$TOOLS_LOG" >&2
[ "$compiled" -eq 0 ] || die "compiling the tests failed (cargo test --no-run exited with $compiled)"
[ "$setup" -eq 0 ] || die "hutch setup failed (exit $setup); its output is above"
[ "$tools" -eq 0 ] || die "installing the Python tests' SDKs failed (exit $tools); its output is above"
step "running the test suite"
cargo test --release --locked --workspace
bash scripts/python-tests.sh
