"""`AppState`: everything the app keeps beside its routes, one typed object stored as `app.state.server` (read it
with `app_state(app)`), in place of loose attributes on Starlette's `app.state`.

`create_app` (server/api/app.py) makes it; the background load fills in the model and its serving objects; the
request-context middleware counts requests in flight and refuses them while draining; the launch code
(server/launch/) sets how to shut down and the shared socket, drains on SIGTERM, and reads why the server stopped.

server/api/errors.py and server/api/sse.py, which count error responses, do not import this module: the serving
classes typed here import them (an import cycle). They read the metrics through `metrics_of` in server/api/errors.py.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from socket import socket
from typing import Protocol

from starlette.applications import Starlette

from server.api.anthropic.serving import MessagesServing
from server.api.metrics import ServerMetrics
from server.api.model_router import ModelRouter
from server.api.openai.chat import ChatServing
from server.api.openai.completions import CompletionServing
from server.api.openai.embeddings import EmbeddingServing
from server.api.responses.serving import ResponsesServing, StoredResponseReads
from server.config.settings import Settings
from server.process.response_store import StoredResponses
from server.scheduling.model_state import ModelState


class Fronts(Protocol):
    """The other HTTP processes this one started (server/launch/http_fronts.py)."""

    @property
    def pids(self) -> list[int]: ...

    def terminate(self) -> None: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class Servings:
    """The API's serving objects over the loaded model, one per API (made together once it has loaded)."""

    chat: ChatServing              # POST /v1/chat/completions
    completions: CompletionServing  # POST /v1/completions
    responses: ResponsesServing    # /v1/responses (create, retrieve, delete, input items)
    messages: MessagesServing      # POST /v1/messages and its count_tokens
    embeddings: EmbeddingServing   # POST /v1/embeddings

    @classmethod
    def of(cls, state: ModelState, metrics: ServerMetrics, store: StoredResponses) -> Servings:
        """Every API's serving object over `state` (`store`: where /v1/responses keeps the responses it stores)."""
        return cls(chat=ChatServing(state, metrics), completions=CompletionServing(state, metrics),
                   responses=ResponsesServing(state, metrics, store), messages=MessagesServing(state, metrics),
                   embeddings=EmbeddingServing(state, metrics))


@dataclass
class AppState:
    """What the app keeps: its settings and metrics, the served model once loaded, why it stopped, and the state of
    a drain. Written on the event loop, except `in_flight` and `draining`, which the drain thread reads."""

    settings: Settings
    metrics: ServerMetrics  # this app's Prometheus metrics (GET /metrics), the pool's figures read at scrape time
    # How the server stops itself (a load that failed, a worker that died): a SIGTERM to this process by default;
    # the command line's server replaces it with a graceful stop of its uvicorn server (server/launch/lifecycle.py).
    request_shutdown: Callable[[], None]
    router: ModelRouter[Servings] | None = None  # the models of a multi-model server (None: one model, `model`)
    stored_responses: StoredResponseReads | None = None  # a multi-model server's stored /v1/responses (shared)
    model: ModelState | None = None       # the served model; None while it loads (the API answers 503)
    serving: Servings | None = None       # the API's serving objects, set with `model`
    load_error: str | None = None         # why the model could not load (the server then stops, exit status 3)
    fatal_error: str | None = None        # set when a worker stopped serving: unhealthy, and the server exits (4)
    listen_socket: socket | None = None   # the port's socket, bound by the CLI for the HTTP processes that share it
    fronts: Fronts | None = None          # the other HTTP processes (--api-server-count), started by this one
    in_flight: int = 0                    # requests being answered, probes and scrapes aside
    draining: bool = False                # set by SIGTERM: /health answers 503 and new requests are refused


def app_state(app: Starlette) -> AppState:
    """The app's `AppState` (set by `create_app`)."""
    state: AppState = app.state.server
    return state
