"""The official JS SDKs from npm (e2b 2.51.0, @e2b/code-interpreter 2.8.0), unchanged,
against `hutch serve`: each file under tests/js runs with node's test runner, pointed at
the server by E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY only (issue 12). The SDKs are
installed under $HUTCH_HOME by scripts/python-tests.sh, which names them and the node
that runs them (HUTCH_JS_SDK, HUTCH_NODE)."""

import os
import subprocess
from pathlib import Path

import pytest

JS = Path(__file__).resolve().parent.parent / "js"
JS_SDK = "js-e2b-2.51.0-ci-2.8.0"


def js_sdk() -> Path:
    home = Path(os.environ.get("HUTCH_HOME", Path.home() / ".local/share/hutch"))
    sdk = Path(os.environ.get("HUTCH_JS_SDK", home / "cache" / JS_SDK))
    if not (sdk / "node_modules" / "e2b").is_dir():
        pytest.fail(f"the official JS SDKs are not installed in {sdk}: run scripts/python-tests.sh once, which installs them")
    return sdk


@pytest.mark.parametrize("suite", sorted(p.name for p in JS.glob("*.test.mjs")))
def test_official_js_sdk(server, suite):
    env = dict(os.environ, HUTCH_JS_SDK=str(js_sdk()))
    node = os.environ.get("HUTCH_NODE", "node")
    run = subprocess.run([node, "--test", "--test-reporter=spec", str(JS / suite)], env=env, cwd=JS,
                         capture_output=True, text=True, timeout=900)
    print(run.stdout[-20000:], run.stderr[-5000:])
    assert run.returncode == 0, f"{suite} failed:\n{run.stdout[-8000:]}\n{run.stderr[-3000:]}"
    assert "# fail 0" in run.stdout or "\u2139 fail 0" in run.stdout, run.stdout[-3000:]
