#!/usr/bin/env python3
"""hutch's code interpreter, inside the guest: E2B's code-interpreter API on port 49999
(POST /execute streaming NDJSON, /contexts) over real Jupyter kernels driven with
jupyter_client. Reached from outside through hutch's port tunnel; see docs/ARCHITECTURE.md
for why a companion process rather than ZeroMQ inside the agent."""

import datetime
import json
import os
import queue
import re
import shlex
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import zmq
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager

PORT = 49999
KEEPALIVE = 5.0
MIME = {
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
    "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
    "application/json": "json", "application/javascript": "javascript", "e2b/data": "data", "e2b/chart": "chart",
}
ALIASES = {"js": "javascript", "ts": "typescript"}
# Written by hutch's agent at each sandbox's init: its id, metadata and environment.
IDENTITY = "/run/hutch/sandbox.json"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Run in each Python kernel as it starts: E2B's extra result representations.
PYTHON_FORMATTERS = "/usr/lib/hutch/ipython_formatters.py"
# Run in each Python kernel as it starts: the sandbox's environment set before each cell
# by the kernel itself (the other languages get it from `execute`, by a silent cell).
PYTHON_SANDBOX_ENV = "/usr/lib/hutch/ipython_sandbox_env.py"
KERNEL_OOM_DEFAULT = "/usr/lib/hutch/kernel-oom-default"
JS_REQUIRE = 'import { createRequire as _hutchRequire } from "node:module"; globalThis.require ??= _hutchRequire(%s);'
# Languages whose kernel (Deno's) may publish a result after the cell's idle status.
LATE_RESULTS = ("javascript", "typescript")
# Kernels each sandbox has ready, as E2B's server starts them (the rest start on first use).
DEFAULT_LANGUAGES = ("python", "javascript")


def sandbox_envs():
    """The sandbox's environment: the kernels outlive the template snapshot they were
    started in, so they take it from the agent's identity file, not from their birth."""
    try:
        with open(IDENTITY) as f:
            return json.load(f).get("envVars") or {}
    except (OSError, ValueError):
        return {}


def env_code(language, values, unset=()):
    """Code that sets `values` (and removes `unset`) in a kernel's environment, or None
    when there is nothing to do. Java cannot change its process environment: as E2B's
    kernel does, it gets them as system properties (`System.getProperty`)."""
    q = json.dumps  # a JSON string is a valid string literal in JS, TS, R and Java
    if language == "python":
        lines = ["import os as _hutch_os"]
        lines += [f"_hutch_os.environ[{k!r}] = {v!r}" for k, v in values.items()]
        lines += [f"_hutch_os.environ.pop({k!r}, None)" for k in unset]
    elif language == "bash":
        lines = [f"export {k}={shlex.quote(v)}" for k, v in values.items() if ENV_NAME.match(k)]
        lines += [f"unset {k}" for k in unset if ENV_NAME.match(k)]
    elif language in ("javascript", "typescript"):
        lines = [f"process.env[{q(k)}] = {q(v)};" for k, v in values.items()]
        lines += [f"delete process.env[{q(k)}];" for k in unset]
    elif language == "r":
        lines = [f"Sys.setenv({q(k)} = {q(v)})" for k, v in values.items()]
        lines += [f"Sys.unsetenv({q(k)})" for k in unset]
    elif language == "java":
        lines = [f"System.setProperty({q(k)}, {q(v)});" for k, v in values.items()]
        lines += [f"System.clearProperty({q(k)});" for k in unset]
    else:
        return None
    return "\n".join(lines) + "\n" if lines else None


def now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def kernel_for(language):
    specs = KernelSpecManager().find_kernel_specs()
    if language == "python":
        return "python3" if "python3" in specs else next(iter(specs))
    for name in specs:
        spec = KernelSpecManager().get_kernel_spec(name)
        if name == language or spec.language.lower() == language:
            return name
    raise LookupError(f"no kernel for language '{language}' is installed (installed: {', '.join(sorted(specs))})")


class Channels:
    """A kernel's shell and IOPub sockets: plain blocking ZeroMQ, framed and signed by
    the kernel's own session. Not jupyter_client's BlockingKernelClient: its 7.x (the
    one Debian has) runs every send, receive and liveness check through a nested
    asyncio loop, which under TCG cost ~30 ms of each cell (docs/BENCHMARKS.md)."""

    def __init__(self, km):
        self.session = km.session
        self.shell = km.connect_shell(identity=self.session.bsession)
        self.iopub = km.connect_iopub()

    def send(self, msg_type, content):
        return self.session.send(self.shell, msg_type, content)["header"]["msg_id"]

    def execute(self, code, silent=False, store_history=True):
        """Sends an execute request; returns its id. Its reply on the shell socket is
        not read (results come on IOPub): `discard_replies` drops it later.
        Never `stop_on_error`: after a failed cell the kernel would abort every request
        that reaches it before it stops aborting (ipykernel's `_abort_queues`), and a
        cell sent right after an error or an interrupt (the next `run_code`, or the
        silent one that restores a cell's envs) came back with no result and no
        error. This server sends a context one cell at a time, so there is no queue
        of the user's to stop."""
        return self.send("execute_request", {
            "code": code, "silent": silent, "store_history": store_history and not silent,
            "user_expressions": {}, "allow_stdin": False, "stop_on_error": False,
        })

    def receive(self, socket, timeout, parents=None):
        """The next message on `socket` within `timeout` seconds (queue.Empty if none).
        With `parents`, a message answering none of those requests comes back as None,
        its parent read without checking the signature or decoding the rest."""
        if not socket.poll(timeout * 1000):
            raise queue.Empty
        _, frames = self.session.feed_identities(socket.recv_multipart())
        if parents is not None and json.loads(frames[2]).get("msg_id") not in parents:
            return None
        return self.session.deserialize(frames)

    def discard_replies(self):
        while self.shell.poll(0):
            self.shell.recv_multipart()

    def wait_ready(self, alive, timeout):
        """As jupyter_client's wait_for_ready: a kernel_info reply on the shell socket,
        then any IOPub message, which proves this subscription is in place (a message
        published before it would be lost)."""
        deadline = time.monotonic() + timeout
        while True:
            self.send("kernel_info_request", {})
            try:
                reply = self.receive(self.shell, 1)
            except queue.Empty:
                reply = None
            if reply is not None and reply["msg_type"] == "kernel_info_reply":
                try:
                    self.receive(self.iopub, 0.2)
                    break
                except queue.Empty:
                    pass
            if not alive():
                raise RuntimeError("the kernel exited before it answered")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the kernel did not answer within {timeout} s")
        while self.iopub.poll(0):
            self.iopub.recv_multipart()
        self.discard_replies()

    def close(self):
        self.shell.close(linger=0)
        self.iopub.close(linger=0)


class Context:
    def __init__(self, language, cwd):
        self.id = str(uuid.uuid4())
        self.language, self.cwd = language, cwd
        self.lock = threading.Lock()
        # The sandbox environment this kernel was last given.
        self.applied = {}
        self.start()

    def start(self):
        self.km = KernelManager(kernel_name=kernel_for(self.language))
        # This server is immune to the guest's OOM killer (/etc/hutch/start); its kernels,
        # which inherit that, drop it first (the wrapper), so a guest short of memory
        # loses a kernel, which `execute` restarts, not the server. Restarts reuse it.
        spec = self.km.kernel_spec
        if os.path.exists(KERNEL_OOM_DEFAULT) and spec.argv[:1] != [KERNEL_OOM_DEFAULT]:
            spec.argv = [KERNEL_OOM_DEFAULT, *spec.argv]
        self.km.start_kernel(cwd=self.cwd if os.path.isdir(self.cwd) else "/")
        self.connect()

    def restart(self):
        self.channels.close()
        self.applied = {}
        self.km.restart_kernel(now=True)
        self.connect()

    def connect(self):
        self.channels = Channels(self.km)
        self.channels.wait_ready(self.alive, timeout=300)
        self.prepare()

    def alive(self):
        # The kernel's process, polled directly: KernelManager.is_alive goes through
        # an asyncio loop (see Channels).
        process = getattr(self.km.provisioner, "process", None)
        return process.poll() is None if process is not None else self.km.is_alive()

    def prepare(self):
        """What a new kernel runs before any cell (in its own namespace, not the user's)."""
        # Whether the kernel sets the sandbox's environment itself, before each cell.
        self.own_env = self.language == "python" and os.path.exists(PYTHON_SANDBOX_ENV)
        if self.language == "python":
            for path, name in ((PYTHON_FORMATTERS, "hutch_formatters"), (PYTHON_SANDBOX_ENV, "hutch_sandbox_env")):
                if os.path.exists(path):
                    self.run_silently(f"exec(open({path!r}).read(), {{'__name__': {name!r}}})")
        elif self.language in ("javascript", "typescript"):
            # Deno's kernel has ES modules and top-level await; code written for Node
            # also calls require(), which resolves from the context's directory.
            self.run_silently(JS_REQUIRE % json.dumps(os.path.join(self.cwd, "")))

    def shutdown(self):
        # The kernel first: a cell running in another thread sees it gone within a
        # second and lets go of the lock; its sockets are closed only under the lock,
        # as ZeroMQ sockets are not for two threads at once.
        self.km.shutdown_kernel(now=True)
        with self.lock:
            self.channels.close()

    def describe(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def run_silently(self, code):
        if code:
            self.channels.execute(code, silent=True)

    def execute(self, code, env_vars, emit, store_history=True):
        """Runs `code`, calling emit(obj) per NDJSON line; emit raises when the client left.
        Without `store_history` (the template's warm-up) the cell is not counted, so a
        user's first cell is number 1."""
        with self.lock:
            if not self.alive():
                self.restart()
                emit({"type": "error", "name": "KernelRestarted", "value": "the kernel had died and was restarted; its state is gone", "traceback": ""})
            base = sandbox_envs() if env_vars or not self.own_env else None
            if not self.own_env and base != self.applied:
                # A new sandbox (restored from the snapshot, or a pooled one taken).
                self.run_silently(env_code(self.language, base, [k for k in self.applied if k not in base]))
                self.applied = base
            self.run_silently(env_code(self.language, env_vars) if env_vars else None)
            self.channels.discard_replies()
            msg_id = self.channels.execute(code, store_history=store_history)
            barrier = None
            last = time.monotonic()
            try:
                while True:
                    try:
                        msg = self.channels.receive(self.channels.iopub, 1, parents=(msg_id, barrier))
                    except queue.Empty:
                        if not self.alive():
                            emit({"type": "error", "name": "KernelDied", "value": "the kernel died during execution", "traceback": ""})
                            break
                        if time.monotonic() - last > KEEPALIVE:
                            emit({"type": "keepalive"})
                            last = time.monotonic()
                        continue
                    if msg is None:
                        continue
                    parent = msg.get("parent_header", {}).get("msg_id")
                    if barrier is not None and parent == barrier:
                        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                            break
                        continue
                    if parent != msg_id:
                        continue
                    kind, content = msg["msg_type"], msg["content"]
                    last = time.monotonic()
                    if kind == "execute_input":
                        emit({"type": "number_of_executions", "execution_count": content.get("execution_count")})
                    elif kind == "stream":
                        emit({"type": content["name"], "text": content["text"], "timestamp": now()})
                    elif kind in ("execute_result", "display_data"):
                        emit(result(content.get("data", {}), kind == "execute_result"))
                    elif kind == "error":
                        emit({"type": "error", "name": content["ename"], "value": content["evalue"], "traceback": "\n".join(content["traceback"])})
                    elif kind == "status" and content["execution_state"] == "idle":
                        if self.language not in LATE_RESULTS:
                            break
                        # Deno's kernel can publish a cell's result after its idle
                        # status; once a second cell's output is through, the first's is.
                        barrier = self.channels.execute('console.log("")', store_history=False)
            except BaseException:
                # The client went away or timed out: stop the code, keep the kernel.
                self.km.interrupt_kernel()
                self.drain(msg_id)
                raise
            finally:
                if env_vars:
                    # Back to the sandbox's own values, not merely unset.
                    restored = {k: base[k] for k in env_vars if k in base}
                    self.run_silently(env_code(self.language, restored, [k for k in env_vars if k not in base]))

    def drain(self, msg_id, limit=30):
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            try:
                msg = self.channels.receive(self.channels.iopub, 1, parents=(msg_id,))
            except queue.Empty:
                continue
            if msg is not None and msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return


def result(data, main):
    out = {"type": "result", "is_main_result": main}
    extra = {}
    for mime, value in data.items():
        key = MIME.get(mime)
        if key is None:
            extra[mime] = value
        elif key == "text" and isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            out[key] = value[1:-1]
        else:
            out[key] = value
    out["extra"] = extra
    return out


class Contexts:
    def __init__(self):
        self.lock = threading.Lock()
        self.by_id = {}
        self.defaults = {}

    def default(self, language):
        language = ALIASES.get(language.lower(), language.lower())
        with self.lock:
            ctx = self.defaults.get(language)
            if ctx is None:
                ctx = Context(language, "/home/user")
                self.defaults[language] = ctx
                self.by_id[ctx.id] = ctx
            return ctx

    def create(self, language, cwd):
        ctx = Context(ALIASES.get(language.lower(), language.lower()), cwd)
        with self.lock:
            self.by_id[ctx.id] = ctx
        return ctx

    def get(self, cid):
        with self.lock:
            return self.by_id.get(cid)

    def remove(self, cid):
        with self.lock:
            ctx = self.by_id.pop(cid, None)
            for lang, d in list(self.defaults.items()):
                if d is ctx:
                    del self.defaults[lang]
        if ctx:
            ctx.shutdown()
        return ctx is not None


CONTEXTS = Contexts()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, status, body, content_type="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def text(self, status, message):
        self.reply(status, message.encode(), "text/plain")

    def body(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        return json.loads(raw) if raw.strip() else {}

    def do_GET(self):
        if self.path == "/health":
            return self.reply(200, "OK")
        if self.path == "/contexts":
            return self.reply(200, [c.describe() for c in list(CONTEXTS.by_id.values())])
        self.text(404, "Not Found")

    def do_DELETE(self):
        if self.path.startswith("/contexts/"):
            cid = self.path.split("/")[2]
            return self.reply(200, None) if CONTEXTS.remove(cid) else self.text(404, f"Context {cid} not found")
        self.text(404, "Not Found")

    def do_POST(self):
        try:
            req = self.body()
        except ValueError as e:
            return self.text(400, f"invalid JSON: {e}")
        parts = self.path.split("?")[0].strip("/").split("/")
        try:
            if parts == ["execute"]:
                return self.execute(req)
            if parts == ["contexts"]:
                return self.reply(200, CONTEXTS.create(req.get("language") or "python", req.get("cwd") or "/home/user").describe())
            if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
                ctx = CONTEXTS.get(parts[1])
                if ctx is None:
                    return self.text(404, f"Context {parts[1]} not found")
                with ctx.lock:
                    ctx.restart()
                return self.reply(200, None)
        except LookupError as e:
            return self.text(400, str(e))
        self.text(404, "Not Found")

    def execute(self, req):
        code = req.get("code")
        if not isinstance(code, str):
            return self.text(422, "'code' (a string) is required")
        if req.get("context_id") and req.get("language"):
            return self.text(400, "Only one of context_id or language can be provided")
        if req.get("context_id"):
            ctx = CONTEXTS.get(req["context_id"])
            if ctx is None:
                return self.text(404, f"Context {req['context_id']} not found")
        else:
            ctx = CONTEXTS.default(req.get("language") or "python")
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def emit(obj):
            line = (json.dumps(obj) + "\n").encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()

        try:
            ctx.execute(code, req.get("env_vars") or {}, emit, store_history=not req.get("warm_up"))
            emit({"type": "end_of_execution"})
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


def main():
    # Start the default kernels now, so the first run_code does not pay for their start.
    def start_defaults():
        for language in DEFAULT_LANGUAGES:
            try:
                CONTEXTS.default(language)
            except Exception as e:  # a broken kernel must not take the others down
                print(f"the default {language} kernel did not start: {e}", flush=True)
    threading.Thread(target=start_defaults, daemon=True).start()
    # A deep accept queue: Python's default of 5 drops the connections of a burst (SDK
    # calls, health probes) while a kernel's start holds the interpreter.
    ThreadingHTTPServer.request_queue_size = 128
    server = ThreadingHTTPServer(("127.0.0.1", PORT), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
