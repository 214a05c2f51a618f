"""The asyncio client: `AsyncSandbox`, mirroring `Sandbox` method for method."""

from __future__ import annotations

import asyncio
import base64
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Union
from urllib.parse import quote

import httpx

from . import _wire as w
from . import code, errors
from ._wire import CommandResult, Config, EntryInfo, FilesystemEvent, SandboxInfo, SnapshotInfo
from .sandbox import _Hybrid


class _AsyncApi:
    def __init__(self, config: Config):
        self.config = config
        self.http = httpx.AsyncClient(base_url=config.api_url, timeout=httpx.Timeout(config.request_timeout, connect=10))

    async def rest(self, method: str, path: str, json: Any = None, params=None) -> httpx.Response:
        r = await self.http.request(method, path, json=json, params=params, headers={"X-API-Key": self.config.api_key})
        w.raise_for_api(r.status_code, r.content)
        return r

    async def open_stream(self, sandbox: "AsyncSandbox", method: str, message: Dict[str, Any], user: Optional[str] = None) -> httpx.Response:
        """A server-streaming Connect call; the response is returned open, status checked."""
        headers = w.data_headers(sandbox.sandbox_id, sandbox._token, user)
        headers.update({"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"})
        request = self.http.build_request("POST", f"/{method}", content=w.envelope(message), headers=headers,
                                          timeout=httpx.Timeout(self.config.request_timeout, read=None))
        response = await self.http.send(request, stream=True)
        if response.status_code != 200:
            body = await response.aread()
            await response.aclose()
            w.raise_for_rpc(response.status_code, body)
        return response

    async def rpc(self, sandbox: "AsyncSandbox", method: str, body: Dict[str, Any], user: Optional[str] = None) -> Dict[str, Any]:
        r = await self.http.post(f"/{method}", json=body, headers=w.data_headers(sandbox.sandbox_id, sandbox._token, user))
        w.raise_for_rpc(r.status_code, r.content)
        return r.json()


class AsyncSandbox:
    def __init__(self, info: Dict[str, Any], api: _AsyncApi):
        self.sandbox_id: str = info["sandboxID"]
        self.template_id: str = info.get("templateID", "")
        self._token: Optional[str] = info.get("envdAccessToken")
        self._api = api
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)

    @classmethod
    async def create(cls, template: str = "base", timeout: Optional[int] = None, metadata=None, envs=None, secure: bool = True,
                     api_url=None, api_key=None, request_timeout=None, auto_pause: bool = False, cold: bool = False,
                     egress: Optional[List[str]] = None, secrets=None) -> "AsyncSandbox":
        api = _AsyncApi(Config.resolve(api_url, api_key, request_timeout))
        body = w.new_sandbox_body(template, timeout, metadata, envs, secure, auto_pause, cold, egress, secrets)
        return cls((await api.rest("POST", "/v2/sandboxes", json=body)).json(), api)

    @classmethod
    async def connect(cls, sandbox_id: str, timeout: Optional[int] = None, api_url=None, api_key=None, on_resume: str = "restore") -> "AsyncSandbox":
        api = _AsyncApi(Config.resolve(api_url, api_key, None))
        body = w.connect_body(timeout, on_resume)
        return cls((await api.rest("POST", f"/v2/sandboxes/{quote(sandbox_id)}/connect", json=body)).json(), api)

    resume = connect

    async def pause(self, mode: str = "full") -> bool:
        """Saves memory, processes and files (mode="filesystem": the files only; a resume
        boots) and stops the VM; False if already paused."""
        try:
            await self._api.rest("POST", f"/sandboxes/{quote(self.sandbox_id)}/pause", json=w.pause_body(mode))
            return True
        except errors.ConflictError:
            return False

    async def fork(self, count: int = 1, timeout: Optional[int] = None) -> List[Any]:
        body: Dict[str, Any] = {"count": count}
        if timeout is not None:
            body["timeout"] = timeout
        items = (await self._api.rest("POST", f"/sandboxes/{quote(self.sandbox_id)}/fork", json=body)).json()
        return w.fork_results(items, lambda info: AsyncSandbox(info, _AsyncApi(self._api.config)))

    async def create_snapshot(self, name: Optional[str] = None, mode: str = "full") -> SnapshotInfo:
        body = w.snapshot_body(name, mode)
        return SnapshotInfo.parse((await self._api.rest("POST", f"/sandboxes/{quote(self.sandbox_id)}/snapshots", json=body)).json())

    @classmethod
    async def list(cls, metadata=None, state=None, api_url=None, api_key=None) -> List[SandboxInfo]:
        api = _AsyncApi(Config.resolve(api_url, api_key, None))
        params: Dict[str, str] = {"limit": "100"}
        if metadata:
            # E2B's server decodes the value whole, then each key and value: encode twice.
            params["metadata"] = "&".join(f"{quote(quote(k, safe=''), safe='')}={quote(quote(v, safe=''), safe='')}" for k, v in metadata.items())
        if state:
            params["state"] = ",".join(state)
        out: List[SandboxInfo] = []
        while True:
            r = await api.rest("GET", "/v2/sandboxes", params=params)
            out.extend(SandboxInfo.parse(d) for d in r.json())
            token = r.headers.get("x-next-token")
            if not token:
                return out
            params["nextToken"] = token

    @classmethod
    async def _kill_by_id(cls, sandbox_id: str, api_url=None, api_key=None) -> bool:
        api = _AsyncApi(Config.resolve(api_url, api_key, None))
        try:
            await api.rest("DELETE", f"/sandboxes/{quote(sandbox_id)}")
            return True
        except errors.NotFoundError:
            return False

    async def _kill(self) -> bool:
        try:
            await self._api.rest("DELETE", f"/sandboxes/{quote(self.sandbox_id)}")
            return True
        except errors.NotFoundError:
            return False

    kill = _Hybrid(_kill_by_id, _kill)

    async def update_network(self, egress: List[str]) -> None:
        """Replaces the sandbox's egress rules; open connections stay, new ones follow them."""
        await self._api.rest("PUT", f"/sandboxes/{quote(self.sandbox_id)}/network", json={"egress": list(egress)})

    async def network(self) -> Dict[str, Any]:
        """The rules in force, and what the sandbox's network refused (counters, latest denials)."""
        return (await self._api.rest("GET", f"/sandboxes/{quote(self.sandbox_id)}/network")).json()

    async def set_timeout(self, timeout: int) -> None:
        await self._api.rest("POST", f"/sandboxes/{quote(self.sandbox_id)}/timeout", json={"timeout": timeout})

    async def get_info(self) -> SandboxInfo:
        return SandboxInfo.parse((await self._api.rest("GET", f"/sandboxes/{quote(self.sandbox_id)}")).json())

    async def is_running(self) -> bool:
        r = await self._api.http.get("/health", headers=w.data_headers(self.sandbox_id, self._token))
        return r.status_code < 300

    def get_host(self, port: int) -> str:
        return f"{port}-{self.sandbox_id}.{httpx.URL(self._api.config.api_url).host}"

    def _interp_headers(self) -> Dict[str, str]:
        h = w.data_headers(self.sandbox_id, self._token)
        h["E2b-Sandbox-Port"] = str(code.PORT)
        return h

    async def run_code(self, source: str, language: Optional[str] = None, context: Optional[code.Context] = None,
                       on_stdout=None, on_stderr=None, on_result=None, on_error=None,
                       envs: Optional[Dict[str, str]] = None, timeout: Optional[float] = 300) -> code.Execution:
        body = code.execute_body(source, language, context, envs)
        collector = code.Collector(on_stdout, on_stderr, on_result, on_error)
        try:
            async with self._api.http.stream("POST", "/execute", json=body, headers=self._interp_headers(),
                                             timeout=httpx.Timeout(timeout, connect=10)) as r:
                if r.status_code != 200:
                    code.raise_for_interpreter(r.status_code, await r.aread())
                async for line in r.aiter_lines():
                    collector.line(line.encode())
        except httpx.ReadTimeout:
            raise errors.TimeoutError(f"the code did not finish within {timeout} s; the kernel was interrupted") from None
        return collector.execution

    async def create_code_context(self, language: Optional[str] = None, cwd: Optional[str] = None) -> code.Context:
        r = await self._api.http.post("/contexts", json={"language": language or "python", "cwd": cwd or "/home/user"}, headers=self._interp_headers())
        code.raise_for_interpreter(r.status_code, r.content)
        d = r.json()
        return code.Context(d["id"], d["language"], d["cwd"])

    async def list_code_contexts(self) -> List[code.Context]:
        r = await self._api.http.get("/contexts", headers=self._interp_headers())
        code.raise_for_interpreter(r.status_code, r.content)
        return [code.Context(d["id"], d["language"], d["cwd"]) for d in r.json()]

    async def restart_code_context(self, context: code.Context) -> None:
        r = await self._api.http.post(f"/contexts/{context.id}/restart", headers=self._interp_headers())
        code.raise_for_interpreter(r.status_code, r.content)

    async def remove_code_context(self, context: code.Context) -> None:
        r = await self._api.http.delete(f"/contexts/{context.id}", headers=self._interp_headers())
        code.raise_for_interpreter(r.status_code, r.content)

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.kill()
        await self._api.http.aclose()


class AsyncCommandHandle:
    def __init__(self, sandbox: AsyncSandbox, response: httpx.Response, out: w.Output, decoder: w.EnvelopeDecoder, chunks: AsyncIterator[bytes]):
        self._sandbox, self._out = sandbox, out
        self.pid: int = out.pid or 0
        self._task = asyncio.ensure_future(self._pump(response, decoder, chunks))

    async def _pump(self, response, decoder, chunks) -> None:
        try:
            async for chunk in chunks:
                for msg in decoder.feed(chunk):
                    self._out.handle(msg)
                if self._out.end is not None:
                    break
        finally:
            await response.aclose()

    async def wait(self, timeout: Optional[float] = None) -> CommandResult:
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except asyncio.TimeoutError:
            await self.kill()
            raise errors.TimeoutError(f"command {self.pid} did not finish within {timeout} s and was killed") from None
        return w.checked(self._out.result())

    async def kill(self) -> bool:
        return await self._sandbox.commands.kill(self.pid)

    async def send_stdin(self, data: Union[str, bytes]) -> None:
        await self._sandbox.commands.send_stdin(self.pid, data)


class AsyncCommands:
    def __init__(self, sandbox: AsyncSandbox):
        self._sb = sandbox

    async def run(self, cmd: str, background: bool = False, envs=None, cwd=None, user=None, timeout: Optional[float] = 60,
                  on_stdout: Optional[Callable[[str], None]] = None, on_stderr: Optional[Callable[[str], None]] = None,
                  stdin: bool = False) -> Union[CommandResult, AsyncCommandHandle]:
        response = await self._sb._api.open_stream(self._sb, "process.Process/Start", w.start_request(cmd, envs, cwd, stdin), user)
        out, decoder = w.Output(on_stdout, on_stderr), w.EnvelopeDecoder()
        chunks = response.aiter_raw()
        try:
            while out.pid is None:
                for msg in decoder.feed(await chunks.__anext__()):
                    out.handle(msg)
        except StopAsyncIteration:
            await response.aclose()
            raise errors.HutchError("the command's stream ended before it started")
        except BaseException:
            await response.aclose()
            raise
        handle = AsyncCommandHandle(self._sb, response, out, decoder, chunks)
        return handle if background else await handle.wait(timeout)

    async def list(self) -> List[Dict[str, Any]]:
        procs = (await self._sb._api.rpc(self._sb, "process.Process/List", {})).get("processes", [])
        return [{"pid": p["pid"], "cmd": p["config"]["cmd"], "args": p["config"].get("args", []), "tag": p.get("tag")} for p in procs]

    async def kill(self, pid: int) -> bool:
        try:
            await self._sb._api.rpc(self._sb, "process.Process/SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"})
            return True
        except errors.NotFoundError:
            return False

    async def send_stdin(self, pid: int, data: Union[str, bytes]) -> None:
        raw = data.encode() if isinstance(data, str) else data
        await self._sb._api.rpc(self._sb, "process.Process/SendInput", {"process": {"pid": pid}, "input": {"stdin": base64.b64encode(raw).decode()}})


class AsyncWatchHandle:
    def __init__(self, task: "asyncio.Task[None]"):
        self._task = task

    async def stop(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass


class AsyncFiles:
    def __init__(self, sandbox: AsyncSandbox):
        self._sb = sandbox

    async def _rpc(self, method: str, body: Dict[str, Any], user: Optional[str] = None) -> Dict[str, Any]:
        return await self._sb._api.rpc(self._sb, f"filesystem.Filesystem/{method}", body, user)

    def _files_url(self, path: str, user: Optional[str]) -> str:
        return f"/files?path={quote(path, safe='')}" + (f"&username={quote(user)}" if user else "")

    async def read(self, path: str, format: str = "text", user: Optional[str] = None):
        r = await self._sb._api.http.get(self._files_url(path, user), headers=w.data_headers(self._sb.sandbox_id, self._sb._token))
        w.raise_for_rpc(r.status_code, r.content)
        return r.content if format == "bytes" else r.content.decode("utf-8", errors="replace")

    async def write(self, path: str, data: Union[str, bytes], user: Optional[str] = None) -> EntryInfo:
        content = data.encode() if isinstance(data, str) else data
        headers = w.data_headers(self._sb.sandbox_id, self._sb._token)
        headers["Content-Type"] = "application/octet-stream"
        r = await self._sb._api.http.post(self._files_url(path, user), content=content, headers=headers)
        w.raise_for_rpc(r.status_code, r.content)
        written = r.json()[0]
        return EntryInfo(written["name"], written["path"], written.get("type", "file"))

    async def list(self, path: str, depth: int = 1, user: Optional[str] = None) -> List[EntryInfo]:
        return [EntryInfo.parse(e) for e in (await self._rpc("ListDir", {"path": path, "depth": depth}, user)).get("entries", [])]

    async def get_info(self, path: str, user: Optional[str] = None) -> EntryInfo:
        return EntryInfo.parse((await self._rpc("Stat", {"path": path}, user))["entry"])

    async def exists(self, path: str, user: Optional[str] = None) -> bool:
        try:
            await self.get_info(path, user)
            return True
        except errors.NotFoundError:
            return False

    async def remove(self, path: str, user: Optional[str] = None) -> None:
        await self._rpc("Remove", {"path": path}, user)

    async def make_dir(self, path: str, user: Optional[str] = None) -> bool:
        try:
            await self._rpc("MakeDir", {"path": path}, user)
            return True
        except errors.HutchError as e:
            if str(e).startswith("already_exists"):
                return False
            raise

    async def rename(self, old_path: str, new_path: str, user: Optional[str] = None) -> EntryInfo:
        return EntryInfo.parse((await self._rpc("Move", {"source": old_path, "destination": new_path}, user))["entry"])

    async def watch_dir(self, path: str, on_event: Callable[[FilesystemEvent], None], recursive: bool = False) -> AsyncWatchHandle:
        """Streams events (the `WatchDir` RPC) until `stop()`."""
        response = await self._sb._api.open_stream(self._sb, "filesystem.Filesystem/WatchDir", {"path": path, "recursive": recursive})
        decoder = w.EnvelopeDecoder()
        chunks = response.aiter_raw()
        started = asyncio.get_running_loop().create_future()

        async def pump() -> None:
            try:
                async for chunk in chunks:
                    for msg in decoder.feed(chunk):
                        if "start" in msg and not started.done():
                            started.set_result(None)
                        elif "filesystem" in msg:
                            on_event(FilesystemEvent.parse(msg["filesystem"]))
            except BaseException as e:
                if not started.done():
                    started.set_exception(e)
                raise
            finally:
                await response.aclose()

        task = asyncio.ensure_future(pump())
        await started
        return AsyncWatchHandle(task)
