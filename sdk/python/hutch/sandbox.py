"""The synchronous client: `Sandbox`, its `commands` and `files`."""

from __future__ import annotations

import threading
import time
from typing import IO, Any, Callable, Dict, Iterator, List, Optional, Union
from urllib.parse import quote

import httpx

from . import _wire as w
from . import code, errors
from ._wire import CommandResult, Config, EntryInfo, FilesystemEvent, SandboxInfo, SnapshotInfo


class _Api:
    """REST and data-plane calls for one configuration."""

    def __init__(self, config: Config):
        self.config = config
        self.http = httpx.Client(base_url=config.api_url, timeout=httpx.Timeout(config.request_timeout, connect=10))

    def rest(self, method: str, path: str, json: Any = None, params=None) -> httpx.Response:
        r = self.http.request(method, path, json=json, params=params, headers={"X-API-Key": self.config.api_key})
        w.raise_for_api(r.status_code, r.content)
        return r

    def rpc(self, sandbox: "Sandbox", method: str, body: Dict[str, Any], user: Optional[str] = None) -> Dict[str, Any]:
        headers = w.data_headers(sandbox.sandbox_id, sandbox._token, user)
        r = self.http.post(f"/{method}", json=body, headers=headers)
        w.raise_for_rpc(r.status_code, r.content)
        return r.json()


class _Hybrid:
    """A method callable on the class (with a sandbox id) and on an instance."""

    def __init__(self, on_class, on_instance):
        self.on_class, self.on_instance = on_class, on_instance

    def __get__(self, obj, owner):
        if obj is None:
            return self.on_class.__get__(owner, owner)
        return self.on_instance.__get__(obj, owner)


class Sandbox:
    """A running microVM sandbox. Use as a context manager to kill it on exit."""

    def __init__(self, info: Dict[str, Any], api: _Api):
        self.sandbox_id: str = info["sandboxID"]
        self.template_id: str = info.get("templateID", "")
        self._token: Optional[str] = info.get("envdAccessToken")
        self._api = api
        self.commands = Commands(self)
        self.files = Files(self)

    @classmethod
    def create(
        cls,
        template: str = "base",
        timeout: Optional[int] = None,
        metadata: Optional[Dict[str, str]] = None,
        envs: Optional[Dict[str, str]] = None,
        secure: bool = True,
        api_url: Optional[str] = None,
        api_key: Optional[str] = None,
        request_timeout: Optional[float] = None,
        auto_pause: bool = False,
        cold: bool = False,
        egress: Optional[List[str]] = None,
        secrets: Optional[Dict[str, Dict[str, Any]]] = None,
    ) -> "Sandbox":
        """A new sandbox of `template` (a template name, or a snapshot's id or name).
        `auto_pause` pauses it instead of killing it at the timeout; `cold` boots the
        kernel instead of restoring the template's memory snapshot. `egress` lists where
        it may connect (`["allow@public"]`, `["allow@*.pypi.org:tcp:443"]`): nowhere
        when left out. `secrets` binds the API key's secrets to variables, which hold
        placeholders, and to the hosts hutch fills the values in for:
        `{"OPENAI_API_KEY": {"name": "openai", "hosts": ["api.openai.com"]}}`; it is
        filled in credential headers (or the binding's `"headers"`), and in the values of
        the query parameters its `"query"` names."""
        api = _Api(Config.resolve(api_url, api_key, request_timeout))
        body = w.new_sandbox_body(template, timeout, metadata, envs, secure, auto_pause, cold, egress, secrets)
        return cls(api.rest("POST", "/v2/sandboxes", json=body).json(), api)

    @classmethod
    def connect(cls, sandbox_id: str, timeout: Optional[int] = None, api_url=None, api_key=None, request_timeout=None,
                on_resume: str = "restore") -> "Sandbox":
        """A sandbox by id; a paused one is resumed first: from its memory ("restore",
        when its pause kept it) or booted on its disk ("reboot": its processes are gone,
        its files stay)."""
        api = _Api(Config.resolve(api_url, api_key, request_timeout))
        body = w.connect_body(timeout, on_resume)
        return cls(api.rest("POST", f"/v2/sandboxes/{quote(sandbox_id)}/connect", json=body).json(), api)

    resume = connect

    @classmethod
    def _pause_by_id(cls, sandbox_id: str, api_url=None, api_key=None, mode: str = "full") -> bool:
        return _pause(_Api(Config.resolve(api_url, api_key, None)), sandbox_id, mode)

    def _pause(self, mode: str = "full") -> bool:
        return _pause(self._api, self.sandbox_id, mode)

    pause = _Hybrid(_pause_by_id, _pause)
    pause.__doc__ = ("Saves memory, processes and files (mode=\"filesystem\": the files only; a resume boots) "
                     "and stops the VM; False if already paused.")

    def fork(self, count: int = 1, timeout: Optional[int] = None) -> List[Union["Sandbox", errors.HutchError]]:
        """`count` new sandboxes continuing from this one's state now; an error in place
        of each one that did not start."""
        body: Dict[str, Any] = {"count": count}
        if timeout is not None:
            body["timeout"] = timeout
        items = self._api.rest("POST", f"/sandboxes/{quote(self.sandbox_id)}/fork", json=body).json()
        return w.fork_results(items, lambda info: Sandbox(info, _Api(self._api.config)))

    def create_snapshot(self, name: Optional[str] = None, mode: str = "full") -> SnapshotInfo:
        """Saves memory and disk (mode="filesystem": the disk only, and sandboxes started
        from it boot); `Sandbox.create(snapshot.snapshot_id)` (or the name) starts new
        sandboxes from it."""
        body = w.snapshot_body(name, mode)
        return SnapshotInfo.parse(self._api.rest("POST", f"/sandboxes/{quote(self.sandbox_id)}/snapshots", json=body).json())

    @classmethod
    def list_snapshots(cls, api_url=None, api_key=None) -> List[SnapshotInfo]:
        api = _Api(Config.resolve(api_url, api_key, None))
        return [SnapshotInfo.parse(d) for d in api.rest("GET", "/snapshots").json()]

    @classmethod
    def delete_snapshot(cls, snapshot_id: str, api_url=None, api_key=None) -> bool:
        api = _Api(Config.resolve(api_url, api_key, None))
        try:
            api.rest("DELETE", f"/templates/{quote(snapshot_id)}")
            return True
        except errors.NotFoundError:
            return False

    @classmethod
    def export_snapshot(cls, snapshot_id: str, path: str, api_url=None, api_key=None) -> int:
        """Writes the snapshot's filesystem to `path` as a portable archive; returns its size."""
        api = _Api(Config.resolve(api_url, api_key, None))
        headers = {"X-API-Key": api.config.api_key}
        written = 0
        with api.http.stream("GET", f"/snapshots/{quote(snapshot_id)}/archive", headers=headers, timeout=None) as r:
            if r.status_code >= 300:
                w.raise_for_api(r.status_code, r.read())
            with open(path, "wb") as f:
                for chunk in r.iter_bytes(1 << 20):
                    f.write(chunk)
                    written += len(chunk)
        return written

    @classmethod
    def import_snapshot(cls, path: str, name: Optional[str] = None, api_url=None, api_key=None) -> SnapshotInfo:
        """Uploads an exported archive; the server verifies its hash and disk first."""
        api = _Api(Config.resolve(api_url, api_key, None))
        params = {"name": name} if name else None
        headers = {"X-API-Key": api.config.api_key, "Content-Type": "application/x-tar"}
        with open(path, "rb") as f:
            r = api.http.post("/snapshots/archive", content=f, params=params, headers=headers, timeout=None)
        w.raise_for_api(r.status_code, r.content)
        return SnapshotInfo.parse(r.json())

    @classmethod
    def list(cls, metadata: Optional[Dict[str, str]] = None, state: Optional[List[str]] = None, api_url=None, api_key=None) -> List[SandboxInfo]:
        api = _Api(Config.resolve(api_url, api_key, None))
        params: Dict[str, str] = {"limit": "100"}
        if metadata:
            # E2B's server decodes the value whole, then each key and value: encode twice.
            params["metadata"] = "&".join(f"{quote(quote(k, safe=''), safe='')}={quote(quote(v, safe=''), safe='')}" for k, v in metadata.items())
        if state:
            params["state"] = ",".join(state)
        out: List[SandboxInfo] = []
        while True:
            r = api.rest("GET", "/v2/sandboxes", params=params)
            out.extend(SandboxInfo.parse(d) for d in r.json())
            token = r.headers.get("x-next-token")
            if not token:
                return out
            params["nextToken"] = token

    @classmethod
    def _kill_by_id(cls, sandbox_id: str, api_url=None, api_key=None) -> bool:
        api = _Api(Config.resolve(api_url, api_key, None))
        try:
            api.rest("DELETE", f"/sandboxes/{quote(sandbox_id)}")
            return True
        except errors.NotFoundError:
            return False

    def _kill(self) -> bool:
        try:
            self._api.rest("DELETE", f"/sandboxes/{quote(self.sandbox_id)}")
            return True
        except errors.NotFoundError:
            return False

    kill = _Hybrid(_kill_by_id, _kill)

    def update_network(self, egress: List[str]) -> None:
        """Replaces the sandbox's egress rules; open connections stay, new ones follow them."""
        self._api.rest("PUT", f"/sandboxes/{quote(self.sandbox_id)}/network", json={"egress": list(egress)})

    def network(self) -> Dict[str, Any]:
        """The rules in force, and what the sandbox's network refused (counters, latest denials)."""
        return (self._api.rest("GET", f"/sandboxes/{quote(self.sandbox_id)}/network")).json()

    def set_timeout(self, timeout: int) -> None:
        self._api.rest("POST", f"/sandboxes/{quote(self.sandbox_id)}/timeout", json={"timeout": timeout})

    def get_info(self) -> SandboxInfo:
        return SandboxInfo.parse(self._api.rest("GET", f"/sandboxes/{quote(self.sandbox_id)}").json())

    def is_running(self) -> bool:
        r = self._api.http.get("/health", headers=w.data_headers(self.sandbox_id, self._token))
        return r.status_code < 300

    def get_host(self, port: int) -> str:
        host = httpx.URL(self._api.config.api_url).host
        return f"{port}-{self.sandbox_id}.{host}"

    # --- code interpreter (the `code-interpreter` template) ---

    def _interp_headers(self) -> Dict[str, str]:
        h = w.data_headers(self.sandbox_id, self._token)
        h["E2b-Sandbox-Port"] = str(code.PORT)
        return h

    def run_code(self, source: str, language: Optional[str] = None, context: Optional[code.Context] = None,
                 on_stdout=None, on_stderr=None, on_result=None, on_error=None,
                 envs: Optional[Dict[str, str]] = None, timeout: Optional[float] = 300) -> code.Execution:
        """Runs code in a Jupyter kernel; state persists between calls in a context."""
        body = code.execute_body(source, language, context, envs)
        collector = code.Collector(on_stdout, on_stderr, on_result, on_error)
        try:
            with self._api.http.stream("POST", "/execute", json=body, headers=self._interp_headers(),
                                       timeout=httpx.Timeout(timeout, connect=10)) as r:
                if r.status_code != 200:
                    code.raise_for_interpreter(r.status_code, r.read())
                for line in r.iter_lines():
                    collector.line(line.encode())
        except httpx.ReadTimeout:
            raise errors.TimeoutError(f"the code did not finish within {timeout} s; the kernel was interrupted") from None
        return collector.execution

    def create_code_context(self, language: Optional[str] = None, cwd: Optional[str] = None) -> code.Context:
        r = self._api.http.post("/contexts", json={"language": language or "python", "cwd": cwd or "/home/user"}, headers=self._interp_headers())
        code.raise_for_interpreter(r.status_code, r.content)
        d = r.json()
        return code.Context(d["id"], d["language"], d["cwd"])

    def list_code_contexts(self) -> List[code.Context]:
        r = self._api.http.get("/contexts", headers=self._interp_headers())
        code.raise_for_interpreter(r.status_code, r.content)
        return [code.Context(d["id"], d["language"], d["cwd"]) for d in r.json()]

    def restart_code_context(self, context: code.Context) -> None:
        r = self._api.http.post(f"/contexts/{context.id}/restart", headers=self._interp_headers())
        code.raise_for_interpreter(r.status_code, r.content)

    def remove_code_context(self, context: code.Context) -> None:
        r = self._api.http.delete(f"/contexts/{context.id}", headers=self._interp_headers())
        code.raise_for_interpreter(r.status_code, r.content)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def _pause(api: _Api, sandbox_id: str, mode: str = "full") -> bool:
    try:
        api.rest("POST", f"/sandboxes/{quote(sandbox_id)}/pause", json=w.pause_body(mode))
        return True
    except errors.ConflictError:
        return False


class CommandHandle:
    """A started command. `wait()` returns its result (raising CommandExitError on a
    non-zero exit); output callbacks run on a background thread."""

    def __init__(self, sandbox: Sandbox, response: httpx.Response, out: w.Output, decoder: w.EnvelopeDecoder, chunks: Iterator[bytes]):
        self._sandbox, self._response, self._out, self._decoder, self._chunks = sandbox, response, out, decoder, chunks
        self.pid: int = out.pid or 0
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            for chunk in self._chunks:
                for msg in self._decoder.feed(chunk):
                    self._out.handle(msg)
                if self._out.end is not None:
                    break
        except BaseException as e:  # surfaced by wait()
            self._error = e
        finally:
            self._response.close()

    def wait(self, timeout: Optional[float] = None) -> CommandResult:
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.kill()
            raise errors.TimeoutError(f"command {self.pid} did not finish within {timeout} s and was killed")
        if self._error is not None:
            raise errors.HutchError(f"reading the command's output: {self._error}") from self._error
        return w.checked(self._out.result())

    def kill(self) -> bool:
        return self._sandbox.commands.kill(self.pid)

    def send_stdin(self, data: Union[str, bytes]) -> None:
        self._sandbox.commands.send_stdin(self.pid, data)


class Commands:
    def __init__(self, sandbox: Sandbox):
        self._sb = sandbox

    def run(
        self,
        cmd: str,
        background: bool = False,
        envs: Optional[Dict[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        timeout: Optional[float] = 60,
        on_stdout: Optional[Callable[[str], None]] = None,
        on_stderr: Optional[Callable[[str], None]] = None,
        stdin: bool = False,
    ) -> Union[CommandResult, CommandHandle]:
        api = self._sb._api
        headers = w.data_headers(self._sb.sandbox_id, self._sb._token, user)
        headers.update({"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"})
        request = api.http.build_request(
            "POST", "/process.Process/Start", content=w.envelope(w.start_request(cmd, envs, cwd, stdin)), headers=headers,
            timeout=httpx.Timeout(api.config.request_timeout, read=None),
        )
        response = api.http.send(request, stream=True)
        if response.status_code != 200:
            body = response.read()
            response.close()
            w.raise_for_rpc(response.status_code, body)
        out, decoder = w.Output(on_stdout, on_stderr), w.EnvelopeDecoder()
        chunks = response.iter_raw()
        try:
            while out.pid is None:
                chunk = next(chunks)
                for msg in decoder.feed(chunk):
                    out.handle(msg)
        except StopIteration:
            response.close()
            raise errors.HutchError("the command's stream ended before it started")
        except BaseException:
            response.close()
            raise
        handle = CommandHandle(self._sb, response, out, decoder, chunks)
        return handle if background else handle.wait(timeout)

    def list(self) -> List[Dict[str, Any]]:
        return [{"pid": p["pid"], "cmd": p["config"]["cmd"], "args": p["config"].get("args", []), "tag": p.get("tag")}
                for p in self._sb._api.rpc(self._sb, "process.Process/List", {}).get("processes", [])]

    def kill(self, pid: int) -> bool:
        try:
            self._sb._api.rpc(self._sb, "process.Process/SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"})
            return True
        except errors.NotFoundError:
            return False

    def send_stdin(self, pid: int, data: Union[str, bytes]) -> None:
        raw = data.encode() if isinstance(data, str) else data
        import base64

        self._sb._api.rpc(self._sb, "process.Process/SendInput", {"process": {"pid": pid}, "input": {"stdin": base64.b64encode(raw).decode()}})


class WatchHandle:
    def __init__(self, files: "Files", watcher_id: str, on_event: Callable[[FilesystemEvent], None], interval: float):
        self._files, self._id, self._stop = files, watcher_id, threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(on_event, interval), daemon=True)
        self._thread.start()

    def _poll(self, on_event, interval) -> None:
        while not self._stop.is_set():
            for ev in self._files._rpc("GetWatcherEvents", {"watcherId": self._id}).get("events", []):
                on_event(FilesystemEvent.parse(ev))
            self._stop.wait(interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self._files._rpc("RemoveWatcher", {"watcherId": self._id})
        except errors.NotFoundError:
            pass


class Files:
    def __init__(self, sandbox: Sandbox):
        self._sb = sandbox

    def _rpc(self, method: str, body: Dict[str, Any], user: Optional[str] = None) -> Dict[str, Any]:
        return self._sb._api.rpc(self._sb, f"filesystem.Filesystem/{method}", body, user)

    def _files_url(self, path: str, user: Optional[str]) -> str:
        url = f"/files?path={quote(path, safe='')}"
        return url + (f"&username={quote(user)}" if user else "")

    def read(self, path: str, format: str = "text", user: Optional[str] = None):
        """`format`: "text" (str), "bytes", or "stream" (an iterator of bytes chunks)."""
        api = self._sb._api
        headers = w.data_headers(self._sb.sandbox_id, self._sb._token)
        if format == "stream":
            resp = api.http.send(api.http.build_request("GET", self._files_url(path, user), headers=headers), stream=True)
            if resp.status_code != 200:
                body = resp.read()
                resp.close()
                w.raise_for_rpc(resp.status_code, body)

            def chunks() -> Iterator[bytes]:
                try:
                    yield from resp.iter_bytes()
                finally:
                    resp.close()

            return chunks()
        r = api.http.get(self._files_url(path, user), headers=headers)
        w.raise_for_rpc(r.status_code, r.content)
        return r.content if format == "bytes" else r.content.decode("utf-8", errors="replace")

    def write(self, path: str, data: Union[str, bytes, IO[bytes]], user: Optional[str] = None) -> EntryInfo:
        content = data.encode() if isinstance(data, str) else data
        headers = w.data_headers(self._sb.sandbox_id, self._sb._token)
        headers["Content-Type"] = "application/octet-stream"
        r = self._sb._api.http.post(self._files_url(path, user), content=content, headers=headers)
        w.raise_for_rpc(r.status_code, r.content)
        written = r.json()[0]
        return EntryInfo(written["name"], written["path"], written.get("type", "file"))

    def list(self, path: str, depth: int = 1, user: Optional[str] = None) -> List[EntryInfo]:
        return [EntryInfo.parse(e) for e in self._rpc("ListDir", {"path": path, "depth": depth}, user).get("entries", [])]

    def get_info(self, path: str, user: Optional[str] = None) -> EntryInfo:
        return EntryInfo.parse(self._rpc("Stat", {"path": path}, user)["entry"])

    def exists(self, path: str, user: Optional[str] = None) -> bool:
        try:
            self.get_info(path, user)
            return True
        except errors.NotFoundError:
            return False

    def remove(self, path: str, user: Optional[str] = None) -> None:
        self._rpc("Remove", {"path": path}, user)

    def make_dir(self, path: str, user: Optional[str] = None) -> bool:
        """Creates the directory (and parents); False when it already existed."""
        try:
            self._rpc("MakeDir", {"path": path}, user)
            return True
        except errors.HutchError as e:
            if str(e).startswith("already_exists"):
                return False
            raise

    def rename(self, old_path: str, new_path: str, user: Optional[str] = None) -> EntryInfo:
        return EntryInfo.parse(self._rpc("Move", {"source": old_path, "destination": new_path}, user)["entry"])

    def watch_dir(self, path: str, on_event: Callable[[FilesystemEvent], None], recursive: bool = False, interval: float = 0.2) -> WatchHandle:
        watcher = self._rpc("CreateWatcher", {"path": path, "recursive": recursive})
        return WatchHandle(self, watcher["watcherId"], on_event, interval)
