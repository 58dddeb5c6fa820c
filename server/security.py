"""Request guards: the API key (constant-time Bearer check) and the request body size limit."""
from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError
from .request_context import OPEN_PATHS, send_error


class ApiKeyAuth:
    """Every route but the probes and /metrics needs `Authorization: Bearer <key>`; 401 in OpenAI's envelope."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            header = Headers(scope=scope).get("authorization")
            scheme, _, token = (header or "").partition(" ")
            if header is None or scheme.lower() != "bearer":
                message = ("You didn't provide an API key. You need to provide your API key in an Authorization "
                           "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
            # compare_digest: the time taken does not tell how much of a guessed key was right.
            elif not hmac.compare_digest(token.strip().encode(), self.key):
                message = "Incorrect API key provided."
            else:
                message = None
            if message is not None:
                await send_error(scope, receive, send, APIError(
                    401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
                return
        await self.app(scope, receive, send)


class BodySizeLimit:
    """413 for a request body over `limit` bytes, by its Content-Length or, when chunked, as it arrives."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this server's limit of {self.limit} bytes",
                        code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.limit:
                await send_error(scope, receive, send, self._too_large())
                return
            await self.app(scope, receive, send)
            return
        # No length given (chunked): read the body here, within the limit, and hand it on as one message.
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                await send_error(scope, receive, send, self._too_large())
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
