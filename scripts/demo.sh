#!/usr/bin/env bash
# Quick start, part 1: install what is needed, build hutch, and run Python in a microVM.
# Artifacts (kernel, initramfs, the base template) are cached under $HUTCH_HOME.
source "$(dirname "$0")/lib.sh"
ensure_host_packages
ensure_rust
build
step "running Python inside a fresh microVM (the first run builds the base template, ~1 min)"
./target/release/hutch run -- python3 -c 'import platform, os; print(f"hello from {platform.node()}: Linux {platform.release()}, Python {platform.python_version()}, uid {os.getuid()}")'
