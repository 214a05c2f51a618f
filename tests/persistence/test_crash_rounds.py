"""`kill -9` of `hutch serve` at random points of create, exec, pause, resume, snapshot,
fork, export and import, then a restart, round after round (issue 11). After each
restart the store and the disk agree: every sandbox and snapshot a client was told
about is still there (running ones answer with their marker file), nothing is there
twice, and no QEMU or sandbox directory exists that the API does not list. At the end
everything is deleted through the API and nothing may remain.

HUTCH_CRASH_ROUNDS sets the rounds (20 by default), HUTCH_CRASH_SEED the seed (random,
printed on failure)."""

import os
import random
import shutil
import signal
import threading

import httpx

from hutch import Sandbox
from conftest import API_KEY, free_port, launch, new_home, qemus_under, wait_until

OPS = ["create", "exec", "pause", "resume", "snapshot", "fork", "export", "import", "kill"]
# The server's limit (conftest launches with --max-sandboxes 3): an op that starts a VM
# needs a free slot, a fork two.
MAX_RUNNING = 3


class World:
    """What the test was told exists: sandboxes (id -> marker, None until written) and
    snapshots (name -> id)."""

    def __init__(self, url: str):
        self.url = url
        self.sandboxes: dict[str, str | None] = {}
        self.snapshots: dict[str, str] = {}
        self.archive: str | None = None
        # Sandboxes whose kill was asked for but not confirmed: a crash may come after
        # the VM was stopped and before the answer, so each may be there or gone.
        self.doomed: set[str] = set()

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": API_KEY}, timeout=120)

    def listed(self) -> dict[str, str]:
        with self.api() as c:
            return {s["sandboxID"]: s["state"] for s in c.get("/v2/sandboxes").json()}

    def sdk(self, sid: str) -> Sandbox:
        return Sandbox.connect(sid, api_url=self.url, api_key=API_KEY, timeout=3600)


def run_op(world: World, op: str, target: str | None, n: int, scratch: str) -> None:
    """Runs one operation to its end; the server may die under it at any point, so every
    failure is the test's expectation, not an error. What completes is recorded."""
    url, key = world.url, API_KEY
    try:
        with world.api() as c:
            if op == "create":
                r = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 3600})
                if r.status_code == 201:
                    world.sandboxes[r.json()["sandboxID"]] = None
            elif op == "exec":
                world.sdk(target).commands.run(f"echo {n} >> /home/user/log; sync")
            elif op == "pause":
                c.post(f"/sandboxes/{target}/pause")
            elif op == "resume":
                c.post(f"/sandboxes/{target}/connect", json={"timeout": 3600})
            elif op == "snapshot":
                r = c.post(f"/sandboxes/{target}/snapshots", json={"name": f"snap{n}"})
                if r.status_code == 201:
                    world.snapshots[f"snap{n}"] = r.json()["snapshotID"]
            elif op == "fork":
                r = c.post(f"/sandboxes/{target}/fork", json={"count": 1, "timeout": 3600})
                if r.status_code == 200:
                    for item in r.json():
                        if "sandboxID" in item:
                            world.sandboxes[item["sandboxID"]] = None
            elif op == "export":
                path = os.path.join(scratch, f"export{n}.tar")
                Sandbox.export_snapshot(target, path, api_url=url, api_key=key)
                world.archive = path
            elif op == "import":
                imported = Sandbox.import_snapshot(world.archive, name=f"imported{n}", api_url=url, api_key=key)
                world.snapshots[f"imported{n}"] = imported.snapshot_id
            elif op == "kill":
                world.doomed.add(target)
                if c.delete(f"/sandboxes/{target}").status_code == 204:
                    world.sandboxes.pop(target, None)
    except Exception:  # the server was killed under it: what happened is checked after the restart
        pass


def pick(world: World, rng: random.Random, listed: dict[str, str]) -> tuple[str, str | None]:
    running = [s for s, st in listed.items() if st == "running"]
    paused = [s for s, st in listed.items() if st == "paused"]
    choices = []
    for op in OPS:
        if op == "create" and len(running) < MAX_RUNNING:
            choices.append((op, None))
        elif op in ("exec", "pause", "snapshot", "kill") and running:
            choices.append((op, rng.choice(running)))
        elif op == "fork" and running and len(running) + 1 < MAX_RUNNING:
            choices.append((op, rng.choice(running)))
        elif op == "resume" and paused and len(running) < MAX_RUNNING:
            choices.append((op, rng.choice(paused)))
        elif op == "export" and world.snapshots:
            choices.append((op, rng.choice(sorted(world.snapshots))))
        elif op == "import" and world.archive:
            choices.append((op, None))
        elif op == "kill" and paused:
            choices.append((op, rng.choice(paused)))
    return rng.choice(choices)


def check(world: World, home, round_no: int, op: str) -> None:
    listed = world.listed()
    for sid in world.doomed - set(listed):
        world.sandboxes.pop(sid, None)
    world.doomed.clear()
    lost = [s for s in world.sandboxes if s not in listed]
    assert not lost, f"round {round_no} ({op}): sandboxes lost: {lost} (listed: {listed})"
    # A sandbox whose create or fork the client never heard of still counts: the API
    # lists it, so it is the user's to see and kill.
    for sid in listed:
        world.sandboxes.setdefault(sid, None)
    dirs = sorted(p.name for p in (home / "sandboxes").glob("*")) if (home / "sandboxes").exists() else []
    assert dirs == sorted(listed), f"round {round_no} ({op}): sandbox directories {dirs}, listed {sorted(listed)}"
    running = [s for s, st in listed.items() if st == "running"]
    wait_until(lambda: len(qemus_under(home)) == len(running), f"round {round_no} ({op}): one QEMU per running sandbox", timeout=30,
               detail=lambda: f"QEMUs {qemus_under(home)}, running {running}")
    for sid in running:
        sbx = world.sdk(sid)
        if world.sandboxes[sid] is None:
            sbx.files.write("/home/user/marker", sid)
            world.sandboxes[sid] = sid
        assert sbx.files.read("/home/user/marker") == world.sandboxes[sid], f"round {round_no} ({op}): {sid}'s files changed"
    with world.api() as c:
        stored = {n for s in c.get("/snapshots").json() for n in s["names"]}
    missing = set(world.snapshots) - stored
    assert not missing, f"round {round_no} ({op}): snapshots lost: {missing}"


def test_kill_9_at_random_points_loses_and_leaks_nothing(tmp_path):
    rounds = int(os.environ.get("HUTCH_CRASH_ROUNDS", "20"))
    seed = int(os.environ.get("HUTCH_CRASH_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    home, port = new_home("hutch-crash-"), free_port()
    world = World(f"http://127.0.0.1:{port}")
    # The manager's lifecycle at info (adoptions, pauses): what a failure's report shows.
    logged = {"HUTCH_LOG": "warn,hutch_core::manager=info"}
    proc = launch(home, port, env_extra=logged)
    history = []
    try:
        run_op(world, "create", None, 0, str(tmp_path))
        check(world, home, 0, "create")
        for n in range(1, rounds + 1):
            op, target = pick(world, rng, world.listed())
            # The random point of the kill: how long the operation gets before it.
            delay = rng.uniform(0.0, 4.0)
            history.append(f"{n}:{op}@{delay:.2f}s")
            worker = threading.Thread(target=run_op, args=(world, op, target, n, str(tmp_path)), daemon=True)
            worker.start()
            worker.join(timeout=delay)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
            worker.join(timeout=130)
            assert not worker.is_alive(), f"round {n} ({op}): the client still waits on a dead server"
            proc = launch(home, port, env_extra=logged)
            check(world, home, n, op)
        # Everything goes through the API, and then nothing may remain.
        with world.api() as c:
            for sid in world.listed():
                assert c.delete(f"/sandboxes/{sid}").status_code == 204
            for snap in c.get("/snapshots").json():
                assert c.delete(f"/templates/{snap['snapshotID']}").status_code == 204
        wait_until(lambda: not qemus_under(home), "every QEMU to end after deleting all", timeout=30)
        left = [p for sub in ("sandboxes", "snapshots/sandboxes") for p in (home / sub).glob("*")] if home.exists() else []
        assert not left, f"left after deleting everything: {left}"
        print(f"seed {seed}: {' '.join(history)}")
    except Exception as e:
        log = (home / "serve.log").read_text(errors="replace").splitlines()[-60:]
        raise AssertionError(f"seed {seed}, rounds {' '.join(history)}: {e!r}\nthe server's log, last lines:\n" + "\n".join(log)) from e
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        for pid in qemus_under(home):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(home)
