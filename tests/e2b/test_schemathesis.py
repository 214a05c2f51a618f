"""Schemathesis generates requests from /openapi.json against a real `hutch serve`
(its own home and `--kill-on-exit`, so whatever the generated requests create dies with it) and fails on
any 5xx: whatever a client sends, the server's answer is a 4xx or a success."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from conftest import API_KEY, free_port, launch, new_home


def test_no_request_from_the_schema_gets_a_5xx():
    home, port = new_home("hutch-schemathesis-"), free_port()
    proc = launch(home, port, "--kill-on-exit")
    try:
        st = Path(sys.executable).with_name("st")
        env = dict(os.environ, SCHEMATHESIS_HOOKS="schemathesis_hooks", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        out = subprocess.run(
            [str(st), "run", f"http://127.0.0.1:{port}/openapi.json", "-H", f"X-API-Key: {API_KEY}",
             "--checks", "not_a_server_error", "--hypothesis-max-examples", os.environ.get("HUTCH_SCHEMATHESIS_EXAMPLES", "50"),
             "--hypothesis-seed", "1", "--request-timeout", "120000", "--workers", "1"],
            env=env, capture_output=True, text=True, timeout=1200)
        assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
        assert "not_a_server_error" in out.stdout and "FAILED" not in out.stdout, out.stdout[-6000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        shutil.rmtree(home, ignore_errors=True)
