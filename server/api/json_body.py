"""Request bodies are JSON whatever their content type says: `curl -d` sends form encoding, a browser's simple
request `text/plain`, some clients nothing at all. Every route with a body takes JSON only, so reading such a body as
JSON (and reporting a syntax error with its line and column) beats refusing a valid object for its label."""
from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

_JSON = b"application/json"
_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})


def is_json_type(content_type: bytes) -> bool:
    """application/json, or a `+json` subtype (application/vnd.api+json), parameters aside."""
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == _JSON or (media.startswith(b"application/") and media.endswith(b"+json"))


class JsonBodies:
    """ASGI middleware: a request with a body and a content type other than JSON's is relabelled
    `application/json` before routing, keeping its charset."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in _WITH_BODY:
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            given = [v for k, v in scope["headers"] if k == b"content-type"]
            if not given or not is_json_type(given[0]):
                charset = [p.strip() for p in given[0].split(b";")[1:] if p.strip().lower().startswith(b"charset=")] \
                    if given else []
                headers.append((b"content-type", b"; ".join([_JSON, *charset[:1]])))
                scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)
