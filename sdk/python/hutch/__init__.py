"""hutch: microVM sandboxes for untrusted code, with an E2B-shaped API.

    from hutch import Sandbox
    with Sandbox.create() as sbx:
        print(sbx.commands.run("python3 -c 'print(6*7)'").stdout)

Configured by HUTCH_API_URL and HUTCH_API_KEY (or the api_url / api_key arguments)."""

from ._wire import CommandResult, EntryInfo, FilesystemEvent, SandboxInfo, SnapshotInfo
from .code import Context, Execution, ExecutionError, Logs, Result
from .aio import AsyncCommandHandle, AsyncSandbox
from .errors import (
    AuthenticationError,
    CommandExitError,
    ConflictError,
    HutchError,
    InvalidArgumentError,
    NotFoundError,
    RateLimitError,
    TimeoutError,
)
from .sandbox import CommandHandle, Sandbox

__all__ = [
    "Sandbox", "AsyncSandbox", "CommandHandle", "AsyncCommandHandle", "CommandResult", "EntryInfo",
    "FilesystemEvent", "SandboxInfo", "SnapshotInfo", "HutchError", "ConflictError", "AuthenticationError", "CommandExitError",
    "InvalidArgumentError", "NotFoundError", "RateLimitError", "TimeoutError",
    "Context", "Execution", "ExecutionError", "Logs", "Result",
]
