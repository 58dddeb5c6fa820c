"""`ModelManager`: the models of a multi-model server, each served by an engine process of its own
(`EngineClient`) while it is loaded: their states (unloaded, loading, loaded), loads on demand, and the policies that
unload them (the least recently used idle one past --max-loaded-models or the memory budget, the idle ones past
--idle-unload). A model is never unloaded while a request or a stream uses it; unloading stops its engine process,
which gives its memory back.

Everything here runs on the event loop; a load waits for its engine process on a thread of its own
(`in_own_thread`), so that the other models' streams flow meanwhile.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Generic, TypeVar

from server.config.served_models import ServableModel, servable_models
from server.config.settings import Settings
from server.errors import APIError
from server.process.client import EngineClient
from server.process.memory import kv_cache_memory, memory_budget, tree_rss, weights_size
from server.scheduling.loading import model_state
from server.scheduling.model_state import ModelState, ServedModel
from server.scheduling.threads import in_own_thread, trim_malloc

log = logging.getLogger("emberserve")
T = TypeVar("T")
WATCH_S = 0.25       # how often idle models are looked for (and busy ones marked used)
ROOM_POLL_S = 0.1    # how often a load waiting for room looks again
RETRY_AFTER_S = "5"  # what a 503 of a load that did not finish (or find room) in time tells the client


class Load(IntEnum):
    """A model's state, as /v1/models names it and the model_state metric counts it."""

    UNLOADED = 0
    LOADING = 1
    LOADED = 2

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class ModelFacts:
    """What a model that has loaded once is, kept when it unloads (its ServedModel, tokenizer and all, is not)."""

    device: str
    dtype: str
    quant: str
    deterministic: bool
    context_size: int

    @classmethod
    def of(cls, served: ServedModel) -> ModelFacts:
        return cls(str(served.device), str(served.dtype).removeprefix("torch."), served.quant, served.deterministic,
                   served.context_size)


@dataclass(eq=False)
class ManagedModel(Generic[T]):
    """One servable model and, while it is loaded, its engine process, state and serving objects."""

    spec: ServableModel
    state: Load = Load.UNLOADED
    client: EngineClient | None = None
    model: ModelState | None = None      # set while loaded
    serving: T | None = None             # what the API serves it with (the manager's `make_serving`), while loaded
    loading: asyncio.Task[None] | None = None
    leases: int = 0                      # requests using it (a stream's generation is the pool's `in_flight`)
    last_used: float = 0.0               # time.monotonic() of its last use
    memory: int = 0                      # what it takes (bytes): measured while loaded, else expected
    facts: ModelFacts | None = None      # known once it has loaded
    no_room: APIError | None = None      # why its load waits, while it waits for room

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def busy(self) -> bool:
        """A request holds it, or its engine is working on (or holding a stream for) one."""
        return self.leases > 0 or (self.client is not None and self.client.in_flight > 0)


def _no_room(model: ManagedModel[T], why: str) -> APIError:
    return APIError(503, f"no room to load the model `{model.id}`: {why}; retry once their requests finish",
                    code="no_room_for_model", headers={"Retry-After": RETRY_AFTER_S})


class ModelManager(Generic[T]):
    """The servable models (the first the default), loaded on demand and unloaded by policy. `make_serving` makes
    what the API serves a model with, once it has loaded (server/api/model_router.py)."""

    def __init__(self, settings: Settings, make_serving: Callable[[ModelState], T]) -> None:
        self.settings = settings
        self.make_serving = make_serving
        self.models: dict[str, ManagedModel[T]] = {m.id: ManagedModel(m) for m in servable_models(settings)}
        self.default = next(iter(self.models.values()))
        self.budget = memory_budget(settings)
        # A model's share of the budget bounds its KV cache: one --max-loaded-models'th, else all of it (on a GPU,
        # where the KV cache takes what the share leaves, that is one model at a time, as the one-model server).
        self.share = self.budget // (settings.max_loaded_models or 1)
        # On CPU what a loaded model takes is measured (its engine process tree's RSS), and what an engine process
        # takes beside its weights and KV cache learnt from it; on a GPU the weights and KV cache are counted.
        self.measured = settings.device == "cpu"
        self.overhead = 0
        self._room = asyncio.Lock()  # one load at a time decides what to unload for its room
        self._watch: asyncio.Task[None] | None = None
        log.info("%d models servable (%s), the default %s; memory budget %d MiB", len(self.models),
                 ", ".join(self.models), self.default.id, self.budget >> 20)

    # ---- the API's side ----
    def find(self, name: str) -> ManagedModel[T]:
        """The model of that id: 404 `model_not_found` listing the servable ones."""
        model = self.models.get(name)
        if model is None:
            listed = ", ".join(f"`{m}`" for m in self.models)
            raise APIError(404, f"The model `{name}` does not exist; this server serves {listed}.", param="model",
                           code="model_not_found")
        return model

    async def acquire(self, name: str) -> ManagedModel[T]:
        """The model, loaded (waiting for its load, up to --load-timeout) and held until `release`: not unloaded
        meanwhile."""
        model = self.find(name)
        await self.loaded(model)
        model.leases += 1  # in the same turn of the loop as the check that it is loaded
        model.last_used = time.monotonic()
        return model

    def release(self, model: ManagedModel[T]) -> None:
        model.leases -= 1
        model.last_used = time.monotonic()

    async def loaded(self, model: ManagedModel[T], wait: bool = False) -> None:
        """Return once `model` is loaded: start its load if none runs; 503 with Retry-After past --load-timeout
        (`wait`: no time limit), or the load's own error."""
        while model.state is not Load.LOADED:
            if model.loading is None:
                model.loading = asyncio.get_running_loop().create_task(self._load(model))
                # A load nobody waits for any more (they timed out) may still fail: its error is theirs, not
                # asyncio's "never retrieved".
                model.loading.add_done_callback(lambda task: task.cancelled() or task.exception())
            try:  # shielded: a request that gives up leaves the load to finish for the next one
                await asyncio.wait_for(asyncio.shield(model.loading), None if wait else self.settings.load_timeout)
            except TimeoutError:
                if model.no_room is not None:  # its load waits for models in use to finish
                    raise model.no_room from None
                raise APIError(503, f"the model `{model.id}` is still loading after {self.settings.load_timeout:g} "
                               "s (--load-timeout); retry shortly", code="model_loading",
                               headers={"Retry-After": RETRY_AFTER_S}) from None

    async def unload(self, name: str) -> ManagedModel[T]:
        """Unload the model now (POST /models/unload): 409 while a request uses it or it loads."""
        model = self.find(name)
        if model.state is Load.LOADING:
            raise APIError(409, f"the model `{model.id}` is loading; unload it once it has loaded",
                           code="model_loading")
        if model.busy:
            raise APIError(409, f"the model `{model.id}` is in use; unload it once its requests have finished",
                           code="model_busy")
        if model.state is Load.LOADED:
            await self._unload(model, "asked to")
        return model

    # ---- start and stop ----
    async def start(self) -> None:
        """Load the default model (its failure raised: the server cannot start) and start watching for idle ones."""
        await self.loaded(self.default, wait=True)  # as long as it takes, as the one-model server's start
        self._watch = asyncio.get_running_loop().create_task(self._watch_idle())

    async def stop(self) -> None:
        """Stop every engine process (the server's last act): loads under way end first."""
        if self._watch is not None:
            self._watch.cancel()
        for model in self.models.values():
            if model.loading is not None:
                model.loading.cancel()
        await asyncio.gather(*(m.loading for m in self.models.values() if m.loading is not None),
                             return_exceptions=True)
        await asyncio.gather(*(self._unload(m, "the server stops") for m in self.models.values()
                               if m.state is Load.LOADED))

    # ---- loading ----
    async def _load(self, model: ManagedModel[T]) -> None:
        model.state = Load.LOADING
        client = None
        try:
            source = model.spec.source
            weights = await asyncio.to_thread(weights_size, source)
            kv = await asyncio.to_thread(kv_cache_memory, self.settings, source, self.share, weights)
            model.memory = weights + (kv or 0) + self.overhead
            await self._make_room(model)
            settings = self.settings.model_copy(update={"model": model.spec.source, "kv_cache_memory": kv,
                                                        "served_model_name": None})
            started = time.perf_counter()
            client = EngineClient(settings, lambda reason: self._engine_failed(model, client, reason))
            served = await in_own_thread(client.wait_ready, lambda _: client.kill(), client.kill)
            await client.attach()
            # No grammar vocabulary built ahead (its thread would compete with the other models' streams, and it
            # would outlive an unload): the first constrained request builds it.
            state = model_state(settings, served, client, prepare_grammars=False, model_id=model.id)
            model.client, model.model, model.serving = client, state, self.make_serving(state)
            model.facts, model.state = ModelFacts.of(served), Load.LOADED
            model.last_used = time.monotonic()
            if self.measured:  # what the engine process itself takes beside the weights and KV cache, learnt
                self._measure([model])
                self.overhead = max(0, model.memory - weights - (kv or 0))
            log.info("loaded %s in %.1fs (engine process %s, %d MiB)", model.id, time.perf_counter() - started,
                     client.pid, model.memory >> 20)
        except BaseException as e:
            model.state = Load.UNLOADED
            if client is not None and model.client is not client:
                client.kill()
            if isinstance(e, APIError) or not isinstance(e, Exception):  # no room; or cancelled (the server stops)
                raise
            # What the engine process said of a model that cannot load, or what is wrong with its files.
            log.error("cannot load model %s: %s", model.id, e)
            raise APIError(500, f"the model `{model.id}` cannot load: {e}", code="model_load_failed") from None
        finally:
            model.loading = None

    async def _make_room(self, model: ManagedModel[T]) -> None:
        """Unload idle models, least recently used first, until `model` fits --max-loaded-models and the memory
        budget; wait for busy ones up to --load-timeout, then 503 saying why."""
        limit, needed = self.settings.max_loaded_models, model.memory
        if needed > self.budget:  # not even alone: nothing is unloaded for it
            raise APIError(503, f"the model `{model.id}` needs about {-(-needed >> 20)} MiB, more than the memory "
                           f"budget of {self.budget >> 20} MiB (--memory-budget)", code="model_too_large")
        deadline = time.monotonic() + self.settings.load_timeout
        async with self._room:
            try:
                while True:
                    others = [m for m in self.models.values() if m is not model and m.state is not Load.UNLOADED]
                    self._measure(others)
                    used = sum(m.memory for m in others)
                    too_many = limit is not None and len(others) >= limit
                    if not too_many and used + needed <= self.budget:
                        return
                    idle = sorted((m for m in others if m.state is Load.LOADED and not m.busy),
                                  key=lambda m: m.last_used)
                    if idle:
                        await self._unload(idle[0], "least recently used, to make room for " + model.id)
                        continue
                    why = (f"{len(others)} models are loaded (--max-loaded-models {limit})" if too_many else
                           f"it needs about {-(-needed >> 20)} MiB and the loaded models take {used >> 20} MiB "
                           f"of the memory budget of {self.budget >> 20} MiB")
                    model.no_room = _no_room(model, f"{why}, all of them in use ({', '.join(m.id for m in others)})")
                    if time.monotonic() >= deadline:
                        raise model.no_room
                    await asyncio.sleep(ROOM_POLL_S)
            finally:
                model.no_room = None

    def _measure(self, models: list[ManagedModel[T]]) -> None:
        """What the loaded ones of `models` take now (on CPU: their KV caches and heaps grow as they serve)."""
        for model in models:
            if self.measured and model.state is Load.LOADED and model.client is not None and model.client.pid:
                model.memory = tree_rss(model.client.pid)

    # ---- unloading ----
    async def _unload(self, model: ManagedModel[T], reason: str) -> None:
        """Stop the model's engine process; its memory goes back to the system."""
        log.info("unloading %s (%s)", model.id, reason)
        client = model.client
        model.state, model.client, model.model, model.serving = Load.UNLOADED, None, None, None
        if client is not None:
            await client.close()
        gc.collect()  # its tokenizer and serving objects in this process, then the heap pages they held
        trim_malloc()

    def _engine_failed(self, model: ManagedModel[T], client: EngineClient, reason: str) -> None:
        """A model's engine process died or its worker stopped (its requests have failed with a 500): the model is
        unloaded, and loaded again by the next request for it."""
        log.error("model %s: %s; unloading it", model.id, reason)
        if model.client is client and model.state is Load.LOADED:
            asyncio.get_running_loop().create_task(self._unload(model, "its engine failed"))

    async def _watch_idle(self) -> None:
        idle_unload = self.settings.idle_unload
        while True:
            await asyncio.sleep(WATCH_S)
            now = time.monotonic()
            for model in self.models.values():
                if model.state is not Load.LOADED:
                    continue
                if model.busy:
                    model.last_used = now  # a stream in progress is use, however long ago its request came
                elif idle_unload is not None and now - model.last_used >= idle_unload:
                    await self._unload(model, f"idle for {idle_unload:g} s")
