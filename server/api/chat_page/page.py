"""GET / answers the chat page and /static/ its files, from this package's static/ folder.

The page and its files load without the API key (a browser's navigation cannot send a bearer header; they hold no
data); the page sends the key on every API call itself. A strict Content-Security-Policy keeps any script the page
did not ship from running, behind the page's own sanitizing of model output.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.responses import Response
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
PAGE_PATH = "/"
STATIC_PREFIX = "/static"
# Only this origin's own files; model output may hold links and images, which render inert or not at all.
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
                           "frame-ancestors 'none'")
# Revalidate every time (a cheap 304): a server upgraded under an open browser serves its new files at once.
HEADERS = {"Cache-Control": "no-cache", "Content-Security-Policy": CONTENT_SECURITY_POLICY,
           "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


def is_page_path(path: str) -> bool:
    """Whether `path` is the page or one of its files (which need no API key)."""
    return path == PAGE_PATH or path.startswith(STATIC_PREFIX + "/")


class _PageFiles(StaticFiles):
    """StaticFiles whose answers carry the page's headers."""

    def file_response(self, *args: object, **kwargs: object) -> Response:
        response = super().file_response(*args, **kwargs)  # type: ignore[arg-type]
        response.headers.update(HEADERS)
        return response


def install_chat_page(app: FastAPI) -> None:
    """Serve the page at / and its files under /static/ (neither is part of the API's OpenAPI document)."""

    @app.get(PAGE_PATH, include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers=HEADERS)

    app.mount(STATIC_PREFIX, _PageFiles(directory=STATIC_DIR), name="static")
