"""What the benchmarks against `hutch serve` share: percentiles, and waiting (off the
clock) for a warm pool to hold sandboxes."""

import time

import httpx


def pct(samples, p):
    """The `p` percentile (0..1) of `samples`, nearest rank."""
    s = sorted(samples)
    return s[min(len(s) - 1, round((len(s) - 1) * p))]


def pool_ready(url, api_key, template, n, within):
    """Waits until `template`'s pool has `n` sandboxes waiting (GET /status), at most
    `within` seconds."""
    deadline = time.time() + within
    while httpx.get(url + "/status", headers={"X-API-Key": api_key}).json()["pools"].get(template, {}).get("ready", 0) < n:
        if time.time() > deadline:
            raise TimeoutError(f"the {template} pool did not reach {n} within {within} s")
        time.sleep(0.1)  # the poll interval of a deadline-bounded wait, off the clock
