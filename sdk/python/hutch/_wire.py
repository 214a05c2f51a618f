"""Sans-I/O pieces shared by the sync and async clients: configuration, request shapes,
the Connect protocol (JSON codec) and response parsing."""

from __future__ import annotations

import base64
import json
import os
import struct
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Dict, Iterator, List, Optional

from . import errors

ENVD_PORT = 49983
DEFAULT_TIMEOUT = 300


@dataclass
class Config:
    api_url: str
    api_key: str
    request_timeout: float = 120.0

    @staticmethod
    def resolve(api_url: Optional[str], api_key: Optional[str], request_timeout: Optional[float]) -> "Config":
        url = api_url or os.environ.get("HUTCH_API_URL") or "http://127.0.0.1:3000"
        key = api_key or os.environ.get("HUTCH_API_KEY")
        if not key:
            raise errors.AuthenticationError("no API key: pass api_key= or set HUTCH_API_KEY (create one with `hutch keys create`)")
        return Config(url.rstrip("/"), key, request_timeout or 120.0)


@dataclass
class SandboxInfo:
    sandbox_id: str
    template_id: str
    started_at: Optional[datetime] = None
    end_at: Optional[datetime] = None
    state: str = "running"
    metadata: Dict[str, str] = field(default_factory=dict)
    cpu_count: int = 0
    memory_mb: int = 0
    envd_access_token: Optional[str] = None
    # While paused: "full" (memory and disk) or "filesystem" (the disk; a resume boots).
    pause_mode: Optional[str] = None

    @staticmethod
    def parse(d: Dict[str, Any]) -> "SandboxInfo":
        def ts(v):
            return datetime.fromisoformat(v.replace("Z", "+00:00")) if v else None

        return SandboxInfo(
            sandbox_id=d["sandboxID"],
            template_id=d.get("templateID", ""),
            started_at=ts(d.get("startedAt")),
            end_at=ts(d.get("endAt")),
            state=d.get("state", "running"),
            metadata=d.get("metadata") or {},
            cpu_count=d.get("cpuCount", 0),
            memory_mb=d.get("memoryMB", 0),
            envd_access_token=d.get("envdAccessToken"),
            pause_mode=d.get("pauseMode"),
        )


@dataclass
class SnapshotInfo:
    """A snapshot: `snapshot_id` (or its name) works as a template for new sandboxes."""

    snapshot_id: str
    names: List[str]
    template_id: str
    sandbox_id: Optional[str]
    created_at: str
    memory: bool

    @staticmethod
    def parse(d: Dict[str, Any]) -> "SnapshotInfo":
        return SnapshotInfo(
            d["snapshotID"], list(d.get("names") or []), d.get("templateID", ""), d.get("sandboxID"),
            d.get("createdAt", ""), bool(d.get("memory")),
        )


def new_sandbox_body(template, timeout, metadata, envs, secure, auto_pause, cold, egress=None, secrets=None) -> Dict[str, Any]:
    body: Dict[str, Any] = {
        "templateID": template, "metadata": metadata or {}, "envVars": envs or {}, "secure": secure,
        "autoPause": auto_pause, "cold": cold,
        # hutch's own clients say where the sandbox may connect: nowhere unless told.
        "egress": list(egress or []),
    }
    if timeout is not None:
        body["timeout"] = timeout
    if secrets:
        # Variable -> {"name": secret (the variable's, lower-cased, if absent), "hosts": [...]}.
        body["secrets"] = {var: dict(binding) for var, binding in secrets.items()}
    return body


def _memory_flag(what: str, mode: str) -> bool:
    """E2B's `mode` of a pause or snapshot as the API's `memory` flag."""
    if mode not in ("full", "filesystem"):
        raise ValueError(f"{what} mode must be 'full' or 'filesystem', got {mode!r}")
    return mode == "full"


def pause_body(mode: str) -> Dict[str, Any]:
    return {"memory": _memory_flag("pause", mode)}


def snapshot_body(name: Optional[str], mode: str) -> Dict[str, Any]:
    body: Dict[str, Any] = {"memory": _memory_flag("snapshot", mode)}
    if name:
        body["name"] = name
    return body


def connect_body(timeout: Optional[int], on_resume: str) -> Dict[str, Any]:
    if on_resume not in ("restore", "reboot"):
        raise ValueError(f"on_resume must be 'restore' or 'reboot', got {on_resume!r}")
    body: Dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if on_resume == "reboot":
        body["memory"] = False
    return body


def fork_results(items: List[Dict[str, Any]], make: Callable[[Dict[str, Any]], Any]) -> List[Any]:
    """One sandbox, or the error that kept it from starting, per requested fork."""
    out: List[Any] = []
    for item in items:
        if item.get("sandbox"):
            out.append(make(item["sandbox"]))
        else:
            e = item.get("error") or {}
            out.append(errors.from_status(int(e.get("code", 500)), e.get("message", "the fork did not start")))
    return out


@dataclass
class CommandResult:
    stdout: str
    stderr: str
    exit_code: int
    error: Optional[str] = None


@dataclass
class EntryInfo:
    name: str
    path: str
    type: str  # "file", "dir" or "symlink"
    size: int = 0
    permissions: str = ""
    owner: str = ""
    modified_time: Optional[str] = None

    @staticmethod
    def parse(d: Dict[str, Any]) -> "EntryInfo":
        kind = {"FILE_TYPE_FILE": "file", "FILE_TYPE_DIRECTORY": "dir", "FILE_TYPE_SYMLINK": "symlink"}.get(d.get("type", ""), "unknown")
        return EntryInfo(d["name"], d["path"], kind, int(d.get("size", 0)), d.get("permissions", ""), d.get("owner", ""), d.get("modifiedTime"))


@dataclass
class FilesystemEvent:
    name: str
    type: str  # create, write, remove, rename, chmod

    @staticmethod
    def parse(d: Dict[str, Any]) -> "FilesystemEvent":
        return FilesystemEvent(d.get("name", ""), d.get("type", "").replace("EVENT_TYPE_", "").lower())


def raise_for_api(status: int, body: bytes) -> None:
    if status < 300:
        return
    try:
        message = json.loads(body).get("message") or body.decode(errors="replace")
    except ValueError:
        message = body.decode(errors="replace")
    raise errors.from_status(status, message)


def raise_for_rpc(status: int, body: bytes) -> None:
    if status == 200:
        return
    try:
        d = json.loads(body)
        code = d.get("code")
        if isinstance(code, str):
            raise errors.from_connect(code, d.get("message", ""))
        message = d.get("message", "")
    except ValueError:
        message = body.decode(errors="replace")
    if status == 502:
        raise errors.NotFoundError(f"the sandbox is not running: {message}")
    raise errors.from_status(status, message)


def data_headers(sandbox_id: str, token: Optional[str], user: Optional[str] = None) -> Dict[str, str]:
    h = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT)}
    if token:
        h["X-Access-Token"] = token
    if user:
        h["Authorization"] = "Basic " + base64.b64encode(f"{user}:".encode()).decode()
    return h


def envelope(message: Dict[str, Any]) -> bytes:
    payload = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(payload)) + payload


class EnvelopeDecoder:
    """Feeds on body chunks; yields decoded messages. Raises on end-of-stream errors."""

    def __init__(self):
        self.buf = b""
        self.ended = False

    def feed(self, chunk: bytes) -> Iterator[Dict[str, Any]]:
        self.buf += chunk
        while len(self.buf) >= 5:
            flags, length = struct.unpack(">BI", self.buf[:5])
            if len(self.buf) < 5 + length:
                return
            payload, self.buf = self.buf[5 : 5 + length], self.buf[5 + length :]
            msg = json.loads(payload) if payload else {}
            if flags & 0x02:
                self.ended = True
                err = msg.get("error")
                if err:
                    raise errors.from_connect(err.get("code", "unknown"), err.get("message", ""))
                return
            yield msg


def start_request(cmd: str, envs, cwd, stdin: bool) -> Dict[str, Any]:
    process: Dict[str, Any] = {"cmd": "/bin/bash", "args": ["-l", "-c", cmd]}
    if envs:
        process["envs"] = dict(envs)
    if cwd:
        process["cwd"] = cwd
    return {"process": process, "stdin": stdin}


class Output:
    """Accumulates a process's events into a CommandResult."""

    def __init__(self, on_stdout=None, on_stderr=None):
        self.stdout: List[str] = []
        self.stderr: List[str] = []
        self.on_stdout, self.on_stderr = on_stdout, on_stderr
        self.pid: Optional[int] = None
        self.end: Optional[Dict[str, Any]] = None

    def handle(self, msg: Dict[str, Any]) -> None:
        event = msg.get("event", {})
        if "start" in event:
            self.pid = event["start"].get("pid")
        elif "data" in event:
            data = event["data"]
            for key, sink, cb in (("stdout", self.stdout, self.on_stdout), ("stderr", self.stderr, self.on_stderr), ("pty", self.stdout, self.on_stdout)):
                if key in data:
                    text = base64.b64decode(data[key]).decode("utf-8", errors="replace")
                    sink.append(text)
                    if cb:
                        cb(text)
        elif "end" in event:
            self.end = event["end"]

    def result(self) -> CommandResult:
        if self.end is None:
            raise errors.HutchError("the command's stream ended without an exit status")
        end = self.end
        code = end.get("exitCode", 0) if end.get("exited", False) else end.get("exitCode", -1)
        return CommandResult("".join(self.stdout), "".join(self.stderr), code, end.get("error"))


def checked(result: CommandResult) -> CommandResult:
    if result.exit_code != 0:
        raise errors.CommandExitError(result)
    return result
