#!/usr/bin/env bash
# Quick start, part 2: the whole test suite. Tests boot real microVMs.
source "$(dirname "$0")/lib.sh"
ensure_host_packages
ensure_test_packages
ensure_rust
build
step "preparing guest artifacts"
./target/release/hutch setup --template base --template code-interpreter
step "running the test suite"
cargo test --release --locked --workspace
bash scripts/python-tests.sh
