"""The chat page's routes in-process (no model needed): GET / and /static/ load without the API key and with the
page's headers, every file the page refers to is there, the API itself still needs the key, and the package data
ships every file. The page's behaviour in a browser is tests/e2e/test_chat_page.py's part."""
from __future__ import annotations

import asyncio
import re
import tomllib
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from server.api.app import create_app
from server.api.chat_page.page import STATIC_DIR
from server.config.presets import PRESETS
from server.config.settings import Settings

KEY = "page-key"
ROOT = Path(__file__).resolve().parents[4]
# What the page's files refer to: <script src>, <link href>, and the JS modules' static imports.
_REFERENCE = re.compile(r'(?:src|href)="(/static/[^"]+)"|from "\./([^"]+)"')


def _run(scenario: Callable[[httpx.AsyncClient], Awaitable[None]], **settings: object) -> None:
    app = create_app(Settings(**settings))  # no lifespan: the model never loads, the page needs none

    async def main() -> None:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            await scenario(http)

    asyncio.run(main())


def test_the_page_and_its_files_load_without_the_key_with_the_pages_headers() -> None:
    async def scenario(http: httpx.AsyncClient) -> None:
        page = await http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html"), page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert "'unsafe-inline'" not in page.headers["content-security-policy"]
        assert page.headers["cache-control"] == "no-cache"
        seen, queue = set(), [page.text]
        while queue:  # follow every reference, from the HTML through the modules' imports
            for absolute, relative in _REFERENCE.findall(queue.pop()):
                path = absolute or f"/static/{relative}"
                if path in seen:
                    continue
                seen.add(path)
                r = await http.get(path)
                assert r.status_code == 200, (path, r.text)
                assert r.headers["content-security-policy"] == page.headers["content-security-policy"], path
                if path.endswith(".js"):
                    assert "javascript" in r.headers["content-type"], (path, r.headers["content-type"])
                    queue.append(r.text)
        assert {"/static/app.js", "/static/api.js", "/static/markdown.js", "/static/style.css",
                "/static/vendor/marked/marked.umd.js", "/static/vendor/dompurify/purify.min.js"} <= seen

    _run(scenario, api_key=KEY)


def test_the_api_still_needs_the_key() -> None:
    async def scenario(http: httpx.AsyncClient) -> None:
        for path in ("/v1/models", "/v1/presets", "/presets", "/openapi.json"):
            r = await http.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        r = await http.get("/v1/presets", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text

    _run(scenario, api_key=KEY)


def test_presets_are_listed_with_the_servers_default() -> None:
    async def scenario(http: httpx.AsyncClient) -> None:
        body = (await http.get("/v1/presets")).json()
        assert body["default"] == "code"
        assert [p["name"] for p in body["data"]] == list(PRESETS)
        assert body["data"][0]["max_tokens"] == next(iter(PRESETS.values())).max_tokens
        assert (await http.get("/presets/")).json() == body  # the no-/v1 alias and a trailing slash

    _run(scenario, preset="code")


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/static/nothing.js", 404), ("GET", "/static/%2e%2e/page.py", 404), ("GET", "/nothing", 404),
    ("POST", "/", 405), ("GET", "/static", 404),
])
def test_other_paths_are_still_error_envelopes(method: str, path: str, status: int) -> None:
    async def scenario(http: httpx.AsyncClient) -> None:
        r = await http.request(method, path)
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text

    _run(scenario)


def test_the_api_documentation_is_still_served() -> None:
    async def scenario(http: httpx.AsyncClient) -> None:
        docs = await http.get("/docs")
        assert docs.status_code == 200 and "swagger" in docs.text.lower(), docs.text
        assert "/v1/presets" in (await http.get("/openapi.json")).json()["paths"]

    _run(scenario)


def test_the_package_data_ships_every_static_file() -> None:
    """A non-editable install (the container's `pip install .`) copies only what [tool.setuptools.package-data]
    names: every file under static/ must match one of its patterns."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "server.api.chat_page"]
    package = STATIC_DIR.parent
    shipped = {p for pattern in patterns for p in package.glob(pattern) if p.is_file()}
    files = {p for p in STATIC_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert files and files <= shipped, sorted(str(p.relative_to(package)) for p in files - shipped)
