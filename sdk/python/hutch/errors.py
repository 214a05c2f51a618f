"""Typed errors. Every error hutch raises is a HutchError."""

import builtins


class HutchError(Exception):
    """Something went wrong talking to hutch or inside a sandbox."""


class AuthenticationError(HutchError):
    """The API key is missing, wrong or revoked (HTTP 401)."""


class NotFoundError(HutchError):
    """The sandbox, process or path does not exist (HTTP 404 / not_found)."""


class InvalidArgumentError(HutchError):
    """The request was malformed or asked for something impossible (HTTP 400)."""


class ConflictError(HutchError):
    """The sandbox is in the wrong state for the call (paused, running), or a name is taken (HTTP 409)."""


class RateLimitError(HutchError):
    """The server is at its sandbox limit (HTTP 429); kill one or retry later."""


class TimeoutError(HutchError, builtins.TimeoutError):
    """An operation or command did not finish in time."""


class CommandExitError(HutchError):
    """A command exited with a non-zero code; carries its result."""

    def __init__(self, result):
        self.result = result
        self.exit_code = result.exit_code
        self.stdout = result.stdout
        self.stderr = result.stderr
        super().__init__(f"command exited with code {result.exit_code}: {result.stderr.strip()[-500:]}")


_BY_STATUS = {
    400: InvalidArgumentError, 401: AuthenticationError, 404: NotFoundError, 409: ConflictError, 413: InvalidArgumentError,
    429: RateLimitError,
}
_BY_CODE = {
    "not_found": NotFoundError,
    "invalid_argument": InvalidArgumentError,
    "failed_precondition": InvalidArgumentError,
    "unauthenticated": AuthenticationError,
    "permission_denied": AuthenticationError,
    "resource_exhausted": RateLimitError,
    "deadline_exceeded": TimeoutError,
    "canceled": TimeoutError,
}


def from_status(status: int, message: str) -> HutchError:
    return _BY_STATUS.get(status, HutchError)(f"{status}: {message}")


def from_connect(code: str, message: str) -> HutchError:
    return _BY_CODE.get(code, HutchError)(f"{code}: {message}")
