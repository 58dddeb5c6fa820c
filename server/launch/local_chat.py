"""`LocalChat`: the chat's answers from a model run in this process (the in-process `Generator`)."""
from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from server.launch.chat_session import ChatError

if TYPE_CHECKING:
    from server.generator.generator import SyncGenerator


class LocalChat:
    """A loaded generator's chat: each answer is a chat completion through the same preparation as the server's."""

    def __init__(self, generator: SyncGenerator) -> None:
        self.generator = generator
        self.model = generator.model_name

    def stream(self, messages: list[dict[str, str]], options: dict[str, Any]) -> Generator[str, None, None]:
        """The answer's text in pieces; leaving early (closing the iterator, Ctrl-C) cancels the generation."""
        from server.generator.config import GenerationError  # loaded with the generator

        try:
            yield from self.generator.stream_text(messages, options)
        except GenerationError as e:
            raise ChatError(e.message) from None

    def close(self) -> None:
        self.generator.close()
