#!/usr/bin/env bash
# The Python tests against a real `hutch serve`: the official e2b SDK (pinned), hutch's
# own Python SDK (sdk/python, used from the tree), REST error handling, the quickstart
# example. The virtualenv is cached under $HUTCH_HOME.
source "$(dirname "$0")/lib.sh"
VENV="$HUTCH_HOME/cache/py-e2b-2.63.0-ci-2.11.5"
if [ ! -x "$VENV/bin/pytest" ]; then
  step "installing the official e2b SDKs (e2b 2.63.0, e2b-code-interpreter 2.11.5) and pytest into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "e2b==2.63.0" "e2b-code-interpreter==2.11.5" "pytest==8.3.4"
fi
if [ ! -x "$VENV/bin/st" ]; then
  # 3.39's data generation breaks on newer hypothesis ('many' object has no attribute 'more').
  step "installing schemathesis 3.39.16 (with hypothesis 6.115.0) into $VENV"
  "$VENV/bin/pip" install -q "schemathesis==3.39.16" "hypothesis==6.115.0"
fi
step "running the Python tests against hutch serve"
PYTHONPATH="$PWD/sdk/python" "$VENV/bin/pytest" -q tests "$@"

# The official-SDK tests again with the oldest SDK set hutch supports (README): E2B
# users do not all upgrade at once.
OLD_VENV="$HUTCH_HOME/cache/py-e2b-2.45.1-ci-2.9.1"
if [ ! -x "$OLD_VENV/bin/pytest" ]; then
  step "installing the oldest supported official SDKs (e2b 2.45.1, e2b-code-interpreter 2.9.1) and pytest into $OLD_VENV"
  python3 -m venv "$OLD_VENV"
  "$OLD_VENV/bin/pip" install -q "e2b==2.45.1" "e2b-code-interpreter==2.9.1" "pytest==8.3.4"
fi
if [ "$#" -eq 0 ]; then
  step "running the official-SDK tests with e2b 2.45.1 and e2b-code-interpreter 2.9.1"
  PYTHONPATH="$PWD/sdk/python" "$OLD_VENV/bin/pytest" -q tests/e2b/test_official_sdk.py tests/e2b/test_official_list.py \
    tests/persistence/test_official_persistence.py tests/code_interpreter/test_official_code_interpreter.py
fi
