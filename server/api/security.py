"""Request guards: the API key (a constant-time check of the Bearer or x-api-key header) and the request body size
limit."""
from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError
from server.api.chat_page.page import is_page_path
from server.api.request_context import OPEN_PATHS, send_error


def needs_key(path: str) -> bool:
    """Whether a request for `path` must give the key (when the server has one)."""
    return path not in OPEN_PATHS and not is_page_path(path)


class ApiKeyAuth:
    """Every route but the probes, /metrics and the chat page's files needs the key, as `Authorization: Bearer
    <key>` (OpenAI's clients) or `x-api-key: <key>` (Anthropic's); 401 in the envelope of the route's API."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    def _refusal(self, headers: Headers) -> str | None:
        """Why the request is refused, or None when one of the keys it gives is right."""
        given = headers.getlist("x-api-key")
        authorization = headers.get("authorization")
        if authorization is not None:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() == "bearer":
                given.append(token)
        if not given:
            return ("You didn't provide an API key. You need to provide your API key in an Authorization header "
                    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY), or in an x-api-key header.")
        # compare_digest: the time taken does not tell how much of a guessed key was right.
        if any(hmac.compare_digest(key.strip().encode(), self.key) for key in given):
            return None
        return "Incorrect API key provided."

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and needs_key(scope["path"]):
            message = self._refusal(Headers(scope=scope))
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
