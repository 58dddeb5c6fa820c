"""The one exception type every layer raises for a failure the client is told of, and its two envelopes.

The envelope is OpenAI's everywhere but under /v1/messages, which answers Anthropic's: the clients of each API
parse only their own.
"""
from __future__ import annotations

from typing import Any

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable"}
# Anthropic's error types by status (its own 529 "overloaded_error" is what our 503 means: retry shortly).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}
ANTHROPIC_PATH = "/v1/messages"


def speaks_anthropic(path: str) -> bool:
    """Whether errors on `path` answer Anthropic's envelope (the Messages API and everything under it)."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


class APIError(Exception):
    """A failure reported to the client as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        # What a message quotes from a request must not break the error's own UTF-8 body (lone surrogates).
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's envelope: `{"type": "error", "error": {"type", "message"}}`. It has no `param`: the message
        begins with the field at fault, as Anthropic's own do ("tools.0.input_schema: ...")."""
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        message = self.message
        if self.param is not None and not message.startswith(self.param):
            message = f"{self.param}: {message}"
        return {"type": "error", "error": {"type": kind, "message": message}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 for a request value the server cannot honour."""
    return APIError(400, message, param=param, code=code)


def internal_error() -> APIError:
    """What an unexpected exception answers: no detail of it reaches the client (the log has the traceback)."""
    return APIError(500, "internal server error", type="server_error")
