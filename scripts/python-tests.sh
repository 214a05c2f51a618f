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
