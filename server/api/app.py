"""The FastAPI application: load the model in the background, start its workers, install routes and error handlers."""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any, TypeVar

import torch
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from engine import Runner, load_runner
from engine.weights import Progress
from engine.model.quant import dense_copy_bytes

from server import __version__
from server.errors import install_error_handlers
from server.api.metrics import ServerMetrics
from server.api.openapi import install_openapi
from server.config.presets import get_preset
from server.scheduling.progress import LoadProgress
from server.api.request_context import REQUEST_ID_HEADER, RequestContext
from server.process.response_store import LocalResponses, ResponseStore
from server.api.routes import router
from server.api.security import ApiKeyAuth, BodySizeLimit
from server.api.serving import ModelState
from server.grammar.compiler import GrammarCompiler
from server.api.openai.chat import ChatServing
from server.api.openai.completions import CompletionServing
from server.api.anthropic.serving import MessagesServing
from server.api.responses.serving import ResponsesServing
from server.api.openai.embeddings import EmbeddingServing
from server.config.settings import Settings, device_default
from server.speculative.speculator import SpeculativeConfig, Speculator
from server.speculative.draft_model import DraftModel, vocabulary_mismatch
from server.scheduling.worker import Worker, WorkerPool, freeze_heap
from server.process.client import EngineClient, EngineResponses
from server.process.wire import ServedModel
from server.launch.http_fronts import Fronts

log = logging.getLogger("emberserve")
T = TypeVar("T")


def _worker_device(settings: Settings, index: int) -> str:
    """One device per worker on a multi-GPU host ("cuda" → cuda:0, cuda:1, ...); otherwise the device as given."""
    if settings.workers > 1 and settings.device == "cuda":
        return f"cuda:{index}"
    return settings.device


# --draft-model names that mean the served model itself, quantized (a cheaper copy of the same vocabulary).
SELF_DRAFTS = {"self-int4": "int4", "self-int8": "int8"}


def load_speculator(settings: Settings, runner: Runner, device: str, progress: Progress) -> Speculator | None:
    """The worker's speculative decoding, with its draft model loaded beside the target; None when off."""
    method = settings.speculative_method
    if method is None or runner.is_encoder:
        return None
    config = SpeculativeConfig(method, settings.num_speculative_tokens, settings.ngram_min, settings.ngram_max,
                               device_default(settings, "speculative_disable_by_batch_size"))
    if method == "ngram":
        return Speculator(config)
    name, quant = settings.draft_model, SELF_DRAFTS.get(settings.draft_model)
    draft = load_runner(settings.model if quant else name, device=device, quant=quant,
                        dtype="bfloat16" if quant else settings.dtype, max_context=settings.max_context,
                        prefix_caching=settings.prefix_caching, progress=progress,
                        dense_prefill=settings.dense_prefill)
    mismatch = vocabulary_mismatch(runner, draft)
    if mismatch is not None:
        raise ValueError(mismatch)
    if draft.device.type == "cuda" and settings.cuda_graphs:  # the draft's decode steps replay graphs too
        draft.capture_cuda_graphs(device_default(settings, "max_running"))
    log.info("draft model %s (%s weights) proposes up to %d tokens per step", name,
             draft.quant if draft.quant != "none" else "dense", settings.num_speculative_tokens)
    return Speculator(config, DraftModel(draft))


def _load_runner(settings: Settings, index: int, progress: Progress) -> Runner:
    """Worker `index`'s runner, loaded as the settings say (and its CUDA graphs captured on a GPU)."""
    runner = load_runner(settings.model, device=_worker_device(settings, index), dtype=settings.dtype,
                         quant=settings.quant,
                         max_context=settings.max_context, kv_cache_memory=settings.kv_cache_memory,
                         prefix_caching=settings.prefix_caching, progress=progress,
                         dense_prefill=settings.dense_prefill, deterministic=settings.deterministic,
                         tensor_parallel_size=settings.tensor_parallel_size)
    blocks = runner.blocks
    if blocks is None:
        log.info("worker %d: %s on %s; an encoder: embeddings only, no KV cache", index, runner.name, runner.device)
    else:
        log.info("worker %d: %s on %s; KV cache: %d blocks = %d tokens (%.0f MiB %s), prefix caching %s", index,
                 runner.name, runner.device, blocks.num_blocks, blocks.num_blocks * blocks.block_size,
                 runner.cache.nbytes() / 2**20, str(runner.dtype).removeprefix("torch."),
                 "on" if blocks.prefix_caching else "off")
    if runner.device.type == "cuda" and settings.cuda_graphs and not runner.is_encoder:
        if runner.tensor_parallel is None:
            runner.capture_cuda_graphs(device_default(settings, "max_running"))
        else:
            log.warning("CUDA graphs are not used with tensor parallelism yet: decode steps run eagerly")
    return runner


def start_serving(settings: Settings, runners: list[Runner], on_worker_failure: Callable[[Worker], None] | None = None,
                  prepare_grammars: bool = True, speculators: list[Speculator | None] | None = None) -> ModelState:
    """A worker (thread and scheduler) for each runner, started, and the served model's state over them: what
    the HTTP app and the in-process `Generator` (server/generator.py) both serve from. `prepare_grammars`: build
    the grammar engine's vocabulary now, beside serving (else on the first constrained request); `speculators`:
    each worker's speculative decoding (`load_speculator`), none by default."""
    # CPU workers (and tensor-parallel ranks) share the cores: more OpenMP threads than cores make every one of
    # them sleep at its barriers.
    processes = len(runners) * settings.tensor_parallel_size
    threads = max(1, torch.get_num_threads() // processes) if settings.device == "cpu" else None
    max_running = device_default(settings, "max_running")
    speculators = speculators or [None] * len(runners)
    workers = [Worker(runner, f"worker-{i}", max_running=max_running, threads=threads, on_failure=on_worker_failure,
                      max_batched_tokens=device_default(settings, "max_batched_tokens", encoder=runner.is_encoder),
                      speculator=speculators[i],
                      async_scheduling=bool(device_default(settings, "async_scheduling")))
               for i, runner in enumerate(runners)]
    for i, worker in enumerate(workers):
        tp = worker.runner.tensor_parallel
        if tp is not None:
            log.info("worker %d: tensor parallel over %d ranks (%s)", i, tp.size,
                     torch.distributed.get_backend(tp.group.group))
            tp.on_failure(worker.fail)  # a rank that dies takes the worker, and so the server, down
    pool = WorkerPool(workers, settings.max_queued)
    pool.start()
    return model_state(settings, runners[0], pool, prepare_grammars)


def model_state(settings: Settings, runner: Runner | ServedModel, pool: WorkerPool | EngineClient,
                prepare_grammars: bool = True) -> ModelState:
    """The served model's state over its pool: in this process, or the engine process's (`runner` then its facts)."""
    model_id = settings.served_model_name or runner.name
    digest = hashlib.sha256(f"{__version__}:{model_id}:{runner.dtype}:{runner.quant}:{runner.device}:"
                            f"{runner.deterministic}".encode()).hexdigest()[:10]
    grammars = GrammarCompiler(runner.tokenizer) if prepare_grammars else None
    if grammars is not None:
        # The grammar engine's view of the vocabulary (0.3 s for 49k tokens, 2.4 s for 262k) is built beside
        # serving, not on the first structured request; that request waits for it only if it comes first.
        threading.Thread(target=grammars.vocabulary, name="grammar-vocabulary", daemon=True).start()
    return ModelState(model_id=model_id, runner=runner, pool=pool, fingerprint=f"fp_{digest}",
                      created=int(time.time()), max_prompt_tokens=settings.max_prompt_tokens,
                      stream_timeout=settings.stream_timeout, stream_interval=settings.stream_interval,
                      parse_special_in_messages=settings.parse_special_in_messages, grammars=grammars,
                      embeddings=settings.embeddings or runner.is_encoder, pooling=settings.pooling,
                      preset=get_preset(settings.preset) if settings.preset is not None else None)


def _load(settings: Settings, on_worker_failure: Callable[[Worker], None] | None = None,
          progress: Progress | None = None, prepare_grammars: bool = True) -> ModelState:
    """Load the model for every worker and start serving it (`progress`: default, a bar or log lines)."""
    started = time.perf_counter()
    if progress is None:
        progress = LoadProgress(interactive=None if settings.log_format == "text" else False)
    runners = [_load_runner(settings, i, progress) for i in range(settings.workers)]
    speculators = [load_speculator(settings, r, _worker_device(settings, i), progress) for i, r in enumerate(runners)]
    state = start_serving(settings, runners, on_worker_failure, prepare_grammars, speculators)
    runner, threads = state.runner, state.pool.workers[0].threads
    dense = dense_copy_bytes(runner.model)
    log.info("loaded %s (%s, %s activations, %s weights%s on %s, %d threads, context %d%s) "
             "in %.1fs", state.model_id, runner.family, str(runner.dtype).removeprefix("torch."),
             runner.quant if runner.quant != "none" else "dense",
             f" + a bfloat16 copy for prefill ({dense / 2**20:.0f} MiB)" if dense else "",
             runner.device, threads or torch.get_num_threads(), runner.context_size,
             ", deterministic steps" if runner.deterministic else "", time.perf_counter() - started)
    return state


async def _in_own_thread(fn: Callable[[], T], discard: Callable[[T], None] | None = None,
                         interrupt: Callable[[], None] | None = None) -> T:
    """fn() on a new thread that ends with it; cancelled, calls `interrupt` (what makes fn return sooner), waits for
    fn to return and hands what it made to `discard` (a loaded model's started workers, to stop).

    Loading runs torch's parallel ops, and each thread that does gets its own OpenMP team, kept while the thread
    lives. With more OpenMP threads alive than cores, libgomp stops spinning at its barriers and sleeps instead, so
    every parallel region of the workers then waits on a futex wake-up: one stream decoded at 17 ms/token instead of
    6 with the loader in an executor thread (asyncio.to_thread), which never ends.
    Torch's code cannot be interrupted, and a process that exits while the thread is inside it aborts
    (std::terminate: "terminate called without an active exception", exit 134), so a cancellation (SIGTERM while
    loading) waits for the thread.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.cancelled():
            if error is None and discard is not None:
                discard(result)
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    def run() -> None:
        try:
            result = fn()
        except BaseException as e:  # handed to the awaiting task
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    thread = threading.Thread(target=run, name="model-loader", daemon=True)
    thread.start()
    try:
        return await done
    except asyncio.CancelledError:
        if interrupt is not None:
            interrupt()
        while thread.is_alive():
            await asyncio.sleep(0.05)
        await asyncio.sleep(0)  # settle, called from the thread's last act, runs before this returns
        raise


async def _load_engine_process(app: FastAPI, settings: Settings, on_failure: Callable[[str], None]) -> ModelState:
    """Start the engine process (server/engine_process.py) and serve from it once its model is loaded; then the
    other HTTP processes, if there are to be more (server/http_fronts.py)."""
    fronts = settings.api_server_count - 1
    sock = app.state.listen_socket
    if fronts and sock is None:
        raise ValueError("--api-server-count above 1 needs the command line's server (`emberserve serve`), which "
                         "binds the port that the HTTP processes share")
    client = EngineClient(settings, on_failure, fronts=fronts)
    served = await _in_own_thread(client.wait_ready, lambda _: client.stop(), client.kill)
    await client.attach()
    log.info("the engine runs in process %d beside this one (the HTTP server's)", client.pid)
    if fronts:
        app.state.fronts = Fronts(settings, client.front_conns, served, sock, on_failure)
        log.info("%d more HTTP processes serve the port: %s", fronts, ", ".join(map(str, app.state.fronts.pids)))
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


async def _load_in_background(app: FastAPI, settings: Settings, engine: tuple[Any, ServedModel] | None) -> None:
    loop = asyncio.get_running_loop()

    def stopped_serving(reason: str) -> None:  # on a worker's thread, or the engine process reader's
        loop.call_soon_threadsafe(_stop_serving, app, reason)

    try:
        if engine is not None:
            state = await _attach_engine(settings, *engine, stopped_serving)
        elif device_default(settings, "engine_process"):
            state = await _load_engine_process(app, settings, stopped_serving)
        else:
            state = await _in_own_thread(
                lambda: _load(settings, lambda w: stopped_serving(f"{w.name} stopped serving: {w.failure}")),
                _stop_workers)
    except Exception as e:  # a model that cannot load leaves nothing to serve: stop the server with the reason
        log.error("cannot load model %r: %s", settings.model, e)
        app.state.load_error = str(e)
        app.state.request_shutdown()
        return
    app.state.model = state
    app.state.chat = ChatServing(state, app.state.metrics)
    app.state.completions = CompletionServing(state, app.state.metrics)
    # One store for every HTTP process when there are several: the engine process's.
    store = (EngineResponses(state.pool) if settings.api_server_count > 1 else
             LocalResponses(ResponseStore(settings.responses_store_size, settings.responses_store_ttl)))
    app.state.responses = ResponsesServing(state, app.state.metrics, store)
    app.state.messages = MessagesServing(state, app.state.metrics)
    app.state.embeddings = EmbeddingServing(state, app.state.metrics)
    log.info("serving %s at http://%s:%d/v1%s%s", state.model_id, settings.host, settings.port,
             f" with the {settings.preset} preset" if settings.preset else "",
             " (API key required)" if settings.api_key else "")


def _stop_workers(state: ModelState) -> None:
    """What a load cancelled before it finished (a SIGTERM while loading) started: its workers."""
    state.pool.stop()


def _stop_serving(app: FastAPI, reason: str) -> None:
    """A worker died: /health turns 503 and the server exits (non-zero) so that its supervisor restarts it."""
    if app.state.fatal_error is None:
        log.critical("%s; shutting down", reason)
        app.state.fatal_error = reason
        app.state.request_shutdown()


# How long a thread may hold the GIL while another waits for it (Python's default: 5 ms). The worker thread
# needs the GIL back after every GPU call, and the event loop, busy with a few hundred streams, would keep it for
# the whole default interval each time: the GPU then idles for most of each step.
GIL_SWITCH_INTERVAL_S = 0.0005


def create_app(settings: Settings, engine: tuple[Any, ServedModel] | None = None) -> FastAPI:
    """An app that answers /health with 503 while the model loads, then serves the OpenAI API (`engine`: the pipe
    to an engine process that another process started, and its model: server/http_fronts.py)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        loading = asyncio.create_task(_load_in_background(app, settings, engine))
        try:
            yield
        finally:
            loading.cancel()
            with suppress(asyncio.CancelledError):
                await loading  # a load still running ends first (_in_own_thread)
            if app.state.fronts is not None:
                app.state.fronts.stop()  # they drain, and need the engine until they are done
            state: ModelState | None = app.state.model
            if state is not None:
                state.pool.stop()

    app = FastAPI(title="emberserve", version=__version__, lifespan=lifespan,
                  description="An OpenAI-compatible LLM inference server with its own torch engine.")
    app.state.settings = settings
    app.state.model = None
    app.state.load_error = None
    app.state.fatal_error = None   # set when a worker stopped serving: unhealthy, and the server exits
    app.state.listen_socket = None  # the port's socket, bound by the CLI for the HTTP processes that share it
    app.state.fronts = None        # the other HTTP processes (--api-server-count), started by this one
    app.state.in_flight = 0        # requests being answered, probes and scrapes aside
    app.state.draining = False     # set by SIGTERM: /health answers 503 and new requests are refused
    app.state.metrics = ServerMetrics(lambda: app.state.model.pool.stats() if app.state.model is not None else None)
    # The CLI replaces this with a graceful stop of its uvicorn server; embedded uses get a SIGTERM.
    app.state.request_shutdown = lambda: os.kill(os.getpid(), signal.SIGTERM)
    install_error_handlers(app)
    app.include_router(router)
    install_openapi(app, api_key=settings.api_key is not None)
    _add_middleware(app, settings)
    return app


def _add_middleware(app: FastAPI, settings: Settings) -> None:
    """Outermost first: CORS (preflights need no key), request context, API key, body size."""
    app.add_middleware(BodySizeLimit, limit=settings.max_request_bytes)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyAuth, api_key=settings.api_key.get_secret_value())
    app.add_middleware(RequestContext)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id", "X-Api-Key",
                                          "Anthropic-Version"],
                           expose_headers=[REQUEST_ID_HEADER], allow_credentials="*" not in settings.allowed_origins)
