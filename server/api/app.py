"""The FastAPI application: load the model in the background, start its workers, install routes and error handlers."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from multiprocessing.connection import Connection
from socket import socket
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from server import __version__
from server.api.chat_page.page import install_chat_page
from server.api.errors import install_error_handlers
from server.api.metrics import ServerMetrics
from server.api.openapi import install_openapi
from server.api.json_body import JsonBodies
from server.api.paths import PathAliases
from server.api.request_context import REQUEST_ID_HEADER, RequestContext
from server.api.model_router import ModelRouter
from server.api.routes import models_router, router
from server.api.security import ApiKeyAuth, BodySizeLimit
from server.api.state import AppState, Fronts, Servings, app_state
from server.api.responses.serving import StoredResponseReads
from server.config.settings import Settings, device_default
from server.process.client import EngineClient, EngineResponses
from server.process.response_store import LocalResponses, ResponseStore
from server.scheduling.loading import load_model, model_state, stop_workers
from server.scheduling.model_state import ModelState, PoolStats, ServedModel
from server.scheduling.threads import GIL_SWITCH_INTERVAL_S, in_own_thread
from server.scheduling.worker import freeze_heap


# Starts the other HTTP processes: (settings, the engine's pipes for them, the model, the shared socket, on_exit).
StartFronts = Callable[[Settings, list[Connection], ServedModel, socket, Callable[[str], None]], Fronts]

log = logging.getLogger("emberserve")


async def _load_engine_process(app: FastAPI, settings: Settings, on_failure: Callable[[str], None],
                               start_fronts: StartFronts | None) -> ModelState:
    """Start the engine process (server/process/client.py) and serve from it once its model is loaded; then the
    other HTTP processes, if there are to be more (server/launch/http_fronts.py)."""
    fronts = settings.api_server_count - 1
    server = app_state(app)
    sock = server.listen_socket
    if fronts and (sock is None or start_fronts is None):
        raise ValueError("--api-server-count above 1 needs the command line's server (`emberserve serve`), which "
                         "binds the port that the HTTP processes share")
    client = EngineClient(settings, on_failure, fronts=fronts)
    served = await in_own_thread(client.wait_ready, lambda _: client.stop(), client.kill)
    await client.attach()
    log.info("the engine runs in process %d beside this one (the HTTP server's)", client.pid)
    if fronts:
        server.fronts = start_fronts(settings, client.front_conns, served, sock, on_failure)
        log.info("%d more HTTP processes serve the port: %s", fronts, ", ".join(map(str, server.fronts.pids)))
    return _served_from(settings, served, client)


async def _attach_engine(settings: Settings, conn: Any, served: ServedModel,
                         on_failure: Callable[[str], None]) -> ModelState:
    """Serve from an engine process that the main HTTP process started (in one of the others it started)."""
    client = EngineClient(settings, on_failure, conn=conn)
    await client.attach()
    return _served_from(settings, served, client)


def _served_from(settings: Settings, served: ServedModel, client: EngineClient) -> ModelState:
    state = model_state(settings, served, client)
    freeze_heap()  # this process's own heap: torch, the tokenizer, the app (the engine process froze its own)
    return state


async def _load_in_background(app: FastAPI, settings: Settings, engine: tuple[Any, ServedModel] | None,
                              start_fronts: StartFronts | None) -> None:
    loop = asyncio.get_running_loop()
    server = app_state(app)

    def stopped_serving(reason: str) -> None:  # on a worker's thread, or the engine process reader's
        loop.call_soon_threadsafe(_stop_serving, app, reason)

    try:
        if server.router is not None:
            await server.router.start()
            log.info("serving %s (default) and %d more models at http://%s:%d/v1%s", server.router.default.id,
                     len(server.router.manager.models) - 1, settings.host, settings.port,
                     " (API key required)" if settings.api_key else "")
            return
        if engine is not None:
            state = await _attach_engine(settings, *engine, stopped_serving)
        elif device_default(settings, "engine_process"):
            state = await _load_engine_process(app, settings, stopped_serving, start_fronts)
        else:
            state = await in_own_thread(
                lambda: load_model(settings, lambda w: stopped_serving(f"{w.name} stopped serving: {w.failure}")),
                stop_workers)
    except Exception as e:  # a model that cannot load leaves nothing to serve: stop the server with the reason
        log.error("cannot load model %r: %s", settings.model, e)
        server.load_error = str(e)
        server.request_shutdown()
        return
    metrics = server.metrics
    # One store for every HTTP process when there are several: the engine process's.
    store = EngineResponses(state.pool) if settings.api_server_count > 1 else _local_store(settings)
    server.serving = Servings.of(state, metrics, store)
    server.model = state
    log.info("serving %s at http://%s:%d/v1%s%s", state.model_id, settings.host, settings.port,
             f" with the {settings.preset} preset" if settings.preset else "",
             " (API key required)" if settings.api_key else "")


def _local_store(settings: Settings) -> LocalResponses:
    return LocalResponses(ResponseStore(settings.responses_store_size, settings.responses_store_ttl))


def _stop_serving(app: FastAPI, reason: str) -> None:
    """A worker died: /health turns 503 and the server exits (non-zero) so that its supervisor restarts it."""
    server = app_state(app)
    if server.fatal_error is None:
        log.critical("%s; shutting down", reason)
        server.fatal_error = reason
        server.request_shutdown()


def create_app(settings: Settings, engine: tuple[Any, ServedModel] | None = None,
               start_fronts: StartFronts | None = None) -> FastAPI:
    """An app that answers /health with 503 while the model loads, then serves the OpenAI API (`engine`: the pipe
    to an engine process that another process started, and its model: server/launch/http_fronts.py; `start_fronts`:
    how this one starts the other HTTP processes under --api-server-count, given by the command line)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        loading = asyncio.create_task(_load_in_background(app, settings, engine, start_fronts))
        if engine is not None:
            # One of several HTTP processes: attaching to the loaded engine is quick, and done before this one takes
            # connections on the shared port, so none of them lands on a process that would answer "loading".
            await asyncio.shield(loading)
        try:
            yield
        finally:
            loading.cancel()
            with suppress(asyncio.CancelledError):
                await loading  # a load still running ends first (in_own_thread)
            server = app_state(app)
            if server.fronts is not None:
                server.fronts.stop()  # they drain, and need the engine until they are done
            state = server.model
            if state is not None:
                state.pool.stop()
            if server.router is not None:
                await server.router.stop()

    # No redirect_slashes: a trailing slash is dropped before routing (server/api/paths.py), and a path that only
    # a slash more would match (/static, the chat page's folder) is a 404 envelope, not a 307 with an empty body.
    app = FastAPI(title="emberserve", version=__version__, lifespan=lifespan, redirect_slashes=False,
                  description="An OpenAI-compatible LLM inference server with its own torch engine.")

    def pool_stats() -> PoolStats | None:  # what /metrics reads of the pool: nothing while the model loads
        return None if server.model is None else server.model.pool.stats()

    # The CLI replaces request_shutdown with a graceful stop of its uvicorn server; embedded uses get a SIGTERM.
    shutdown = lambda: os.kill(os.getpid(), signal.SIGTERM)  # noqa: E731
    if settings.serves_many:  # several models, each loaded when asked for (server/api/model_router.py)
        store = _local_store(settings)  # one for every model: a response's id names no model
        models = ModelRouter(settings, lambda state, metrics: Servings.of(state, metrics, store))
        server = AppState(settings=settings, metrics=models.metrics, request_shutdown=shutdown, router=models,
                          stored_responses=StoredResponseReads(store))
    else:
        server = AppState(settings=settings, metrics=ServerMetrics(pool_stats), request_shutdown=shutdown)
    app.state.server = server  # the app's one state object (server/api/state.py): read it with app_state(app)
    install_error_handlers(app)
    app.include_router(router)
    if server.router is not None:
        app.include_router(models_router)
    install_chat_page(app)
    install_openapi(app, api_key=settings.api_key is not None)
    _add_middleware(app, settings)
    return app


def _add_middleware(app: FastAPI, settings: Settings) -> None:
    """Outermost first: path aliases (everything after sees the canonical path), CORS (preflights need no key),
    request context, API key, body size, bodies read as JSON."""
    app.add_middleware(JsonBodies)
    app.add_middleware(BodySizeLimit, limit=settings.max_request_bytes)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyAuth, api_key=settings.api_key.get_secret_value())
    app.add_middleware(RequestContext)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id", "X-Api-Key",
                                          "Anthropic-Version"],
                           expose_headers=[REQUEST_ID_HEADER], allow_credentials="*" not in settings.allowed_origins)
    own = [route.path for route in models_router.routes] if settings.serves_many else []
    app.add_middleware(PathAliases, v1_paths=[route.path for route in router.routes if hasattr(route, "path")],
                       own_paths=own)
