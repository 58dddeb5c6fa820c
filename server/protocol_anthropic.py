"""Request and response models of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens).

Field names are Anthropic's. Requests keep unknown fields (`metadata`, `thinking`, `cache_control` on a block...):
logged, then ignored, as for the OpenAI routes.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .protocol import STRICT_ALLOW_EXTRA, Text


class TextBlock(BaseModel):
    model_config = STRICT_ALLOW_EXTRA

    type: Literal["text"]
    text: Text


def _text_blocks_only(blocks: Any, what: str) -> Any:
    """Name the block type that is not text (the schema's own error would only say that 'text' was expected)."""
    if isinstance(blocks, list):
        for i, block in enumerate(blocks):
            if isinstance(block, dict) and block.get("type") != "text":
                raise ValueError(f"{what} block {i} is of type {block.get('type')!r}: only 'text' blocks are "
                                 "supported yet")
    return blocks


def joined(content: str | list[TextBlock] | None) -> str:
    """A content given as a string or as text blocks, as one string (the blocks' texts in order)."""
    if isinstance(content, list):
        return "".join(block.text for block in content)
    return content or ""


class AnthropicMessage(BaseModel):
    model_config = STRICT_ALLOW_EXTRA

    role: Literal["user", "assistant"]
    content: Text | list[TextBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        return _text_blocks_only(v, "content")


class AnthropicConversation(BaseModel):
    """What /v1/messages and /v1/messages/count_tokens share: the model, the system prompt, the turns, tools."""

    model_config = STRICT_ALLOW_EXTRA

    model: Text
    messages: list[AnthropicMessage] = Field(..., min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = Field(None, description="not supported yet: only empty")
    tool_choice: dict[str, Any] | None = Field(None, description="not supported yet: only {'type': 'none'} or "
                                                                 "'auto' without tools")

    @field_validator("system", mode="before")
    @classmethod
    def _system_text_only(cls, v: Any) -> Any:
        return _text_blocks_only(v, "system")


class MessagesRequest(AnthropicConversation):
    max_tokens: int = Field(..., ge=1)
    stop_sequences: list[Text] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False


class CountTokensRequest(AnthropicConversation):
    pass


# ---- responses ----

class AnthropicUsage(BaseModel):
    """Anthropic counts cache reads apart: input_tokens + cache_read_input_tokens is the whole prompt."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


StopReason = Literal["end_turn", "max_tokens", "stop_sequence"]


class AnthropicResponseText(BaseModel):
    type: Literal["text"] = "text"
    text: str


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[AnthropicResponseText]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: AnthropicUsage


class TokenCount(BaseModel):
    input_tokens: int


# ---- streaming events: each `event:` name with its `data:` object ----

class MessageStartEvent(BaseModel):
    type: Literal["message_start"]
    message: MessageResponse


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"]
    index: int
    content_block: AnthropicResponseText


class TextDelta(BaseModel):
    type: Literal["text_delta"]
    text: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"]
    index: int
    delta: TextDelta


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"]
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason | None
    stop_sequence: str | None


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"]
    delta: MessageDelta
    usage: AnthropicUsage  # the totals, as Anthropic's message_delta carries them


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"]


class PingEvent(BaseModel):
    type: Literal["ping"]


# ---- errors ----

class AnthropicError(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error envelope: the body of every 4xx and 5xx under /v1/messages, and a stream's `error` event."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["error"] = "error"
    error: AnthropicError


MESSAGE_STREAM_EVENTS: list[type[BaseModel]] = [
    MessageStartEvent, ContentBlockStartEvent, PingEvent, ContentBlockDeltaEvent, ContentBlockStopEvent,
    MessageDeltaEvent, MessageStopEvent, AnthropicErrorResponse]
