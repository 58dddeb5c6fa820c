"""The real app in-process: its lifespan (which loads the — usually patched — runner and starts its worker), then
a scenario against it through httpx's ASGI transport. Shared by the tests/server files that need the whole app."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from server.api.app import create_app
from server.api.state import app_state
from server.config.settings import Settings


def run_app(settings: Settings, scenario: Callable[[httpx.AsyncClient, Any], Awaitable[None]]) -> None:
    """Start the app of `settings`, wait for its model, run `scenario(http, app)`, shut it down."""

    async def main() -> None:
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            for _ in range(500):
                if app_state(app).model is not None:
                    break
                await asyncio.sleep(0.01)
            assert app_state(app).model is not None, app_state(app).load_error
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
                await scenario(http, app)

    asyncio.run(main())
