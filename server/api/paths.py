"""Friendlier paths: the OpenAI routes also answer without their `/v1` prefix (a client given the server's root as
its base URL, as llama-server's routes allow), and any route with a trailing slash (no 307 redirect with an empty
body). The request is answered, logged and counted under its canonical path."""
from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

V1 = "/v1"


class PathAliases:
    """ASGI middleware: rewrites `/chat/completions` to `/v1/chat/completions` (for each first segment under /v1)
    and drops a trailing slash, before routing."""

    def __init__(self, app: ASGIApp, v1_paths: Iterable[str], own_paths: Iterable[str] = ()) -> None:
        self.app = app
        self.own_paths = frozenset(own_paths)  # outside /v1 whatever their first segment (POST /models/load)
        # The first segments of the /v1 routes: "models", "chat", "completions", "responses", "messages", ...
        self.v1_segments = frozenset(p.removeprefix(V1 + "/").split("/", 1)[0] for p in v1_paths
                                     if p.startswith(V1 + "/"))

    def canonical(self, path: str) -> str:
        """The path a request for `path` is answered on."""
        if len(path) > 1 and path.endswith("/"):
            path = path.rstrip("/") or "/"
        if path in self.own_paths:
            return path
        if not path.startswith(V1 + "/") and path.lstrip("/").split("/", 1)[0] in self.v1_segments:
            path = V1 + path
        return path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = self.canonical(scope["path"])
            if path != scope["path"]:
                scope = {**scope, "path": path, "raw_path": path.encode()}
        await self.app(scope, receive, send)
