#!/usr/bin/env bash
# Bounded fuzzing of what parses untrusted bytes (fuzz/fuzz_targets): the Connect
# envelope decoder, the channel hello scanner, the /files access check, the console
# ring and the archive importer. Usage: scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
# (default 20 s each, every target). CI runs it briefly after the tests; long runs are
# recorded in docs/SECURITY.md. Needs the nightly toolchain and cargo-fuzz, which it
# installs; builds and corpora are cached under $HUTCH_HOME/cache.
source "$(dirname "$0")/lib.sh"
ensure_rust
SECS="${1:-20}"
shift || true
if ! rustup toolchain list | grep -q '^nightly'; then
  step "installing the nightly Rust toolchain (cargo-fuzz needs it for libFuzzer and sanitizers)"
  rustup toolchain install nightly --profile minimal
fi
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  step "installing cargo-fuzz 0.12.0"
  cargo install cargo-fuzz --version 0.12.0 --locked
fi
export CARGO_TARGET_DIR="$HUTCH_HOME/cache/fuzz-target"
cd fuzz
step "building the fuzz targets (nightly, AddressSanitizer)"
cargo +nightly fuzz build -O
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cargo +nightly fuzz list)
fi
for t in "${targets[@]}"; do
  corpus="$HUTCH_HOME/cache/fuzz-corpus/$t"
  mkdir -p "$corpus"
  step "fuzzing $t for $SECS s (corpus $corpus)"
  log="$HUTCH_HOME/cache/fuzz-logs/$t.log"
  mkdir -p "$(dirname "$log")"
  # The whole output goes to a log; the terminal gets the summary lines.
  status=0
  cargo +nightly fuzz run -O "$t" "$corpus" -- -max_total_time="$SECS" -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1 || status=$?
  grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb)|ERROR|panicked|SUMMARY' "$log" || true
  # A crash leaves an input in artifacts/. (Found with `find`: `ls a* b* c*` fails, and
  # so passed the check, unless all three patterns match.)
  failing=$(find artifacts/"$t" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) 2>/dev/null | head -n1 || true)
  if [ -n "$failing" ]; then
    die "the fuzz target $t found an input that fails: fuzz/$failing"
  fi
  # Any other failure (a target that does not build or start, a bad name) leaves none.
  if [ "$status" -ne 0 ]; then
    tail -n 20 "$log" >&2
    die "cargo fuzz run $t exited with $status without saving a failing input; its output is in $log"
  fi
done
step "every fuzz target ran ${SECS} s without a failure"
