"""`SyncGenerator`: a `Generator` for scripts without asyncio: the generator lives on an event loop in a thread of
its own, and every method waits for its result there. `generate_batch` submits many prompts at once, which the
worker batches together."""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, TypeVar

from server.generator.generator import GeneratedText, GenerationConfig, Generator, Prompt, StreamedToken

if TYPE_CHECKING:
    from server.generator.builder import GeneratorBuilder

T = TypeVar("T")
Overrides = GenerationConfig | Mapping[str, Any] | None
_END = object()


class SyncGenerator:
    """`Generator.builder(...).build_sync()`; `close()` it, or use it in a `with` block."""

    def __init__(self, builder: GeneratorBuilder) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="emberserve-generator-loop", daemon=True)
        self._thread.start()
        try:
            self.generator: Generator = self._wait(builder.build())
        except BaseException:
            self._stop_loop()
            raise

    def _wait(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ---- what is served ----
    @property
    def model_name(self) -> str:
        return self.generator.model_name

    @property
    def device(self) -> str:
        return self.generator.device

    @property
    def context_size(self) -> int:
        return self.generator.context_size

    @property
    def vocab_size(self) -> int:
        return self.generator.vocab_size

    @property
    def generation_config(self) -> GenerationConfig:
        return self.generator.generation_config

    # ---- generating ----
    def generate(self, prompt: Prompt) -> GeneratedText:
        return self._wait(self.generator.generate(prompt))

    def generate_with_config(self, prompt: Prompt, overrides: Overrides) -> GeneratedText:
        return self._wait(self.generator.generate_with_config(prompt, overrides))

    def generate_batch(self, prompts: Sequence[Prompt], overrides: Overrides = None) -> list[GeneratedText]:
        """Every prompt at once (batched by the worker), the results in the prompts' order."""
        async def every() -> list[GeneratedText]:
            return list(await asyncio.gather(*(self.generator.generate_with_config(p, overrides) for p in prompts)))

        return self._wait(every())

    def stream(self, prompt: Prompt, overrides: Overrides = None) -> Iterator[StreamedToken]:
        """The tokens as they come; leaving the loop early (or closing the iterator) cancels the generation."""
        items: queue.SimpleQueue[Any] = queue.SimpleQueue()

        async def pump() -> None:
            try:
                async with aclosing(self.generator.stream(prompt, overrides)) as tokens:
                    async for token in tokens:
                        items.put(token)
            except BaseException as e:  # handed to the reading thread (a cancellation included)
                items.put(e)
            finally:
                items.put(_END)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := items.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()  # no-op when it is done; else the stream is closed and its generation cancelled

    def stream_text(self, prompt: Prompt, overrides: Overrides = None) -> Iterator[str]:
        for token in self.stream(prompt, overrides):
            if token.text:
                yield token.text

    # ---- closing ----
    def close(self) -> None:
        """Close the generator (its worker threads) and end the loop thread."""
        if self._loop.is_closed():
            return
        try:
            self._wait(self.generator.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
