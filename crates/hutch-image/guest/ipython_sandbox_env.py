"""Run in every Python kernel hutch's code interpreter starts: before each cell, the
sandbox's environment, from the identity file hutch's agent writes at every sandbox's
init, is set in `os.environ` if the file changed since the last cell.

A kernel outlives the template snapshot it started in, so a restored or pooled
sandbox's first cell meets a new file (its `E2B_SANDBOX_ID` at least). Setting it here,
inside that cell's own request, costs a `stat` per cell. The server's way for the other
languages, a silent cell sent first, made a pooled sandbox's first `run_code` ~57 ms
slower under TCG (docs/BENCHMARKS.md)."""

import json
import os

from IPython import get_ipython

IDENTITY = "/run/hutch/sandbox.json"


def _sandbox_env_hook():
    # The file's (inode, mtime, size) when last read: the agent replaces it whole.
    seen = [None]
    applied = {}

    def apply(*_):
        try:
            st = os.stat(IDENTITY)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp == seen[0]:
            return
        seen[0] = stamp
        try:
            with open(IDENTITY) as f:
                values = json.load(f).get("envVars") or {}
        except (OSError, ValueError, AttributeError):
            values = {}
        if not isinstance(values, dict):
            values = {}
        # Only what a process environment can hold: a name without `=` or NUL (and not
        # empty), a value without NUL. Each is set on its own, so one refused by the
        # OS leaves the others set and this cell unharmed.
        values = {str(k): str(v) for k, v in values.items() if str(k) and "=" not in str(k) and "\0" not in str(k) + str(v)}
        for name in [n for n in applied if n not in values]:
            os.environ.pop(name, None)
            del applied[name]
        for name, value in values.items():
            try:
                os.environ[name] = value
                applied[name] = value
            except (ValueError, OSError):
                pass

    # pre_execute, not pre_run_cell: it fires for silent cells too, so a cell's own
    # envs (set by a silent cell the server sends first) are never undone by it.
    get_ipython().events.register("pre_execute", apply)
    apply()


_sandbox_env_hook()
del _sandbox_env_hook
