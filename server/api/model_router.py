"""`ModelRouter`: the API's side of a multi-model server (--model given more than once, --models-dir,
--idle-unload). It resolves the `model` a request names to that model's serving objects, loading it first if it
is not loaded (server/process/model_manager.py keeps the models, their engine processes and the unload policies),
and holds it while the request runs; it answers /v1/models' cards, /health's and /metrics' view of the models.

The one-model server does not come here: its routes serve `AppState.serving` as they always have.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Generic, TypeVar

from server.api.metrics import ServerMetrics
from server.api.openai.protocol import ModelCard, ModelDetails
from server.config.settings import Settings
from server.process.model_manager import ManagedModel, ModelManager
from server.scheduling.model_state import ModelState, PoolStats

T = TypeVar("T")


def model_card(state: ModelState) -> ModelCard:
    """A loaded model's entry in /v1/models: OpenAI's fields, its context and what its files say (`details`)."""
    model, weights = state.model, state.model.weights
    details = ModelDetails(
        family=model.family, format=weights and weights.format, parameters=weights and weights.parameters,
        parameter_size=weights and weights.parameter_size, quantization_level=weights and weights.file_type,
        quant=model.quant, dtype=str(model.dtype).removeprefix("torch."),
        context_length=weights and weights.context_length, chat_tuned=model.chat_tuned,
        embedding=model.is_encoder, size=weights and weights.size_bytes,
        expert_count=weights.experts if weights and weights.experts else None,
        expert_used_count=weights.experts_used if weights and weights.experts else None)
    return ModelCard(id=state.model_id, created=state.created, max_model_len=model.context_size, details=details)


class ModelRouter(Generic[T]):
    """The models of a multi-model server as the API sees them. `make_serving(state, metrics)` makes a loaded
    model's serving objects (`metrics`: its view of the server's, labelled by model)."""

    def __init__(self, settings: Settings, make_serving: Callable[[ModelState, ServerMetrics], T]) -> None:
        self.metrics = ServerMetrics(None, self._scrape)
        self.manager: ModelManager[T] = ModelManager(
            settings, lambda state: make_serving(state, self.metrics.for_model(state.model_id)))
        self.created = int(time.time())
        self.started = False  # the default model has loaded once: the server is ready (and stays so)

    @property
    def default(self) -> ManagedModel[T]:
        return self.manager.default

    async def start(self) -> None:
        """Load the default model (its failure raised: the server cannot start)."""
        await self.manager.start()
        self.started = True

    @asynccontextmanager
    async def use(self, name: str | None) -> AsyncIterator[ManagedModel[T]]:
        """The model a request names (None: the default), loaded, and held until the request's handler returns
        (a stream it started holds it until it ends: its engine's `in_flight`)."""
        model = await self.manager.acquire(self.default.id if name is None else name)
        try:
            yield model
        finally:
            self.manager.release(model)

    def card(self, model: ManagedModel[T]) -> ModelCard:
        """The model's /v1/models entry with its state; what its files say (`details`) once it is loaded."""
        if model.model is not None:
            card = model_card(model.model)
        else:
            context = None if model.facts is None else model.facts.context_size
            card = ModelCard(id=model.id, created=self.created, max_model_len=context, details=None)
        card.state = model.state.label
        return card

    def cards(self) -> list[ModelCard]:
        return [self.card(m) for m in self.manager.models.values()]

    def states(self) -> dict[str, str]:
        """Each model's state, by id (/health's `models`)."""
        return {m.id: m.state.label for m in self.manager.models.values()}

    async def refresh_stats(self) -> None:
        """Bring every loaded model's pool figures up to date (before a scrape)."""
        for model in list(self.manager.models.values()):
            if model.model is not None:
                await model.model.pool.refresh_stats()

    def _scrape(self) -> list[tuple[str, int, PoolStats | None]]:
        return [(m.id, int(m.state), None if m.model is None else m.model.pool.stats())
                for m in self.manager.models.values()]

    async def load(self, name: str) -> ManagedModel[T]:
        """POST /models/load: the model, loaded."""
        model = self.manager.find(name)
        await self.manager.loaded(model)
        return model

    async def unload(self, name: str) -> ManagedModel[T]:
        """POST /models/unload: the model, unloaded (409 while it is in use or loading)."""
        return await self.manager.unload(name)

    async def stop(self) -> None:
        await self.manager.stop()

