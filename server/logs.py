"""Logging: the record of the request being answered (`RequestRecord`, in a context variable that the serving
layer fills in and the access log writes), and the set-up: `text` lines or one JSON object per line, the current
request's id on every record."""
from __future__ import annotations

import json
import logging
import sys
import time
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any


_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass
class RequestRecord:
    """What one request's log line says."""

    id: str
    method: str
    path: str
    started: float = field(default_factory=time.perf_counter)
    status: int | None = None
    model: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None          # seconds from arrival to the first generated token
    finish_reasons: list[str] = field(default_factory=list)
    body_bytes: int | None = None      # the request body's Content-Length (None: not given, a chunked body)

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"request_id": self.id, "method": self.method, "path": self.path,
                               "status": self.status,
                               "duration_ms": round((time.perf_counter() - self.started) * 1000, 1)}
        if self.model is not None:
            reasons = sorted(set(self.finish_reasons))
            out |= {"model": self.model, "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                    "ttft_ms": None if self.ttft is None else round(self.ttft * 1000, 1),
                    "finish_reason": reasons[0] if len(reasons) == 1 else (",".join(reasons) or None)}
        return out


_current: ContextVar[RequestRecord | None] = ContextVar("emberserve_request", default=None)


def current_request() -> RequestRecord | None:
    """The record of the request this code runs for, if any."""
    return _current.get()


def set_current_request(record: RequestRecord | None) -> Token[RequestRecord | None]:
    """Make `record` the current request's (for the code this context runs); `reset_current_request` undoes it."""
    return _current.set(record)


def reset_current_request(token: Token[RequestRecord | None]) -> None:
    _current.reset(token)



class _RequestIdFilter(logging.Filter):
    """Tags each record with the id of the request whose code wrote it (None outside requests)."""

    def filter(self, record: logging.LogRecord) -> bool:
        current = current_request()
        record.request_id = current.id if current is not None else None
        return True


class _CutStreamFilter(logging.Filter):
    """uvicorn reports a response that never completed as an error; ours are streams cut for a client that stopped
    reading (server/api/sse.py logs that at info), the expected end of such a stream: this says so at info level."""

    MESSAGE = "ASGI callable returned without completing response."

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and record.msg == self.MESSAGE:
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg = "closed a stream that was cut for a client that stopped reading"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request id, and a request log's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
            timespec="milliseconds"), "level": record.levelname.lower(), "logger": record.name,
            "message": record.getMessage()}
        if getattr(record, "request_id", None) is not None:
            out["request_id"] = record.request_id
        out |= getattr(record, "request", None) or {}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """The usual text line; a request log adds its fields as key=value."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "request", None)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items() if k not in ("method", "path", "status"))
        return line


def configure_logging(level: str, fmt: str) -> None:
    """Route every logger (uvicorn's too) through one stderr handler in `fmt` ("text" or "json")."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    if not any(isinstance(f, _CutStreamFilter) for f in logging.getLogger("uvicorn.error").filters):
        logging.getLogger("uvicorn.error").addFilter(_CutStreamFilter())
    # emberserve.access writes one line per request with more in it than uvicorn's access line.
    logging.getLogger("uvicorn.access").disabled = True
