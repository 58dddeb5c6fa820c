"""Server-sent events as the OpenAI client reads them: `data: <json>` events, then `data: [DONE]`."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette.sse import EventSourceResponse

from .errors import APIError

DONE = "[DONE]"
PING_SECONDS = 15  # keep-alive comments for proxies; the client ignores lines starting with ':'


def sse_response(events: AsyncIterator[str]) -> EventSourceResponse:
    """Stream each yielded string as one `data:` event; a client that disconnects cancels the iterator."""
    return EventSourceResponse(events, sep="\n", ping=PING_SECONDS, headers={"Cache-Control": "no-cache"})


def event_json(body: dict[str, Any]) -> str:
    """One event's compact JSON payload."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def sse_error(error: APIError) -> str:
    """A failure after the stream started, as the event the client raises on."""
    return event_json(error.body())
