"""Code interpreter types and the NDJSON stream of `/execute` (sans I/O)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from . import errors

PORT = 49999
RESULT_KEYS = ("text", "html", "markdown", "svg", "png", "jpeg", "pdf", "latex", "json", "javascript", "data", "chart")


@dataclass
class Result:
    """One rich result: `execute_result` (is_main_result) or `display_data`."""

    is_main_result: bool = False
    text: Optional[str] = None
    html: Optional[str] = None
    markdown: Optional[str] = None
    svg: Optional[str] = None
    png: Optional[str] = None  # base64
    jpeg: Optional[str] = None  # base64
    pdf: Optional[str] = None
    latex: Optional[str] = None
    json: Optional[Any] = None
    javascript: Optional[str] = None
    data: Optional[Any] = None
    chart: Optional[Any] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    def formats(self) -> List[str]:
        return [k for k in RESULT_KEYS if getattr(self, k) is not None]


@dataclass
class ExecutionError:
    name: str
    value: str
    traceback: str


@dataclass
class Logs:
    stdout: List[str] = field(default_factory=list)
    stderr: List[str] = field(default_factory=list)


@dataclass
class Execution:
    results: List[Result] = field(default_factory=list)
    logs: Logs = field(default_factory=Logs)
    error: Optional[ExecutionError] = None
    execution_count: Optional[int] = None

    @property
    def text(self) -> Optional[str]:
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None


@dataclass
class Context:
    id: str
    language: str
    cwd: str


class Collector:
    """Feeds `/execute` lines into an Execution, calling the callbacks as they come."""

    def __init__(self, on_stdout=None, on_stderr=None, on_result=None, on_error=None):
        self.execution = Execution()
        self.cb: Dict[str, Optional[Callable]] = {"stdout": on_stdout, "stderr": on_stderr, "result": on_result, "error": on_error}
        self.ended = False

    def line(self, raw: bytes) -> None:
        if not raw.strip():
            return
        msg = json.loads(raw)
        kind = msg.get("type")
        ex = self.execution
        if kind in ("stdout", "stderr"):
            getattr(ex.logs, kind).append(msg.get("text", ""))
            if self.cb[kind]:
                self.cb[kind](msg.get("text", ""))
        elif kind == "result":
            r = Result(is_main_result=bool(msg.get("is_main_result")), extra=msg.get("extra") or {},
                       **{k: msg[k] for k in RESULT_KEYS if k in msg})
            ex.results.append(r)
            if self.cb["result"]:
                self.cb["result"](r)
        elif kind == "error":
            ex.error = ExecutionError(msg.get("name", ""), msg.get("value", ""), msg.get("traceback", ""))
            if self.cb["error"]:
                self.cb["error"](ex.error)
        elif kind == "number_of_executions":
            ex.execution_count = msg.get("execution_count")
        elif kind == "end_of_execution":
            self.ended = True


def execute_body(code: str, language, context, envs) -> Dict[str, Any]:
    if language and context:
        raise errors.InvalidArgumentError("pass either language or context, not both")
    return {"code": code, "language": language, "context_id": context.id if context else None, "env_vars": envs or None}


def raise_for_interpreter(status: int, body: bytes) -> None:
    if status < 300:
        return
    message = body.decode(errors="replace")
    if status == 404:
        raise errors.NotFoundError(message)
    if status in (400, 422):
        raise errors.InvalidArgumentError(message)
    if status == 502:
        raise errors.HutchError(f"the code interpreter is not reachable: {message} (is the sandbox from the code-interpreter template?)")
    raise errors.HutchError(f"{status}: {message}")
