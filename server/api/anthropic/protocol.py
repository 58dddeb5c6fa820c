"""Request and response models of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens).

Field names are Anthropic's. Requests keep unknown fields (`metadata`, `cache_control` on a block...): logged, then
ignored, as for the OpenAI routes.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from server.api.openai.protocol import STRICT_ALLOW_EXTRA, Text


class TextBlock(BaseModel):
    model_config = STRICT_ALLOW_EXTRA

    type: Literal["text"]
    text: Text


class ToolUseBlock(BaseModel):
    """A call the assistant made, given back with the conversation."""

    model_config = STRICT_ALLOW_EXTRA

    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    """The result of the call `tool_use_id`, in the user's next turn."""

    model_config = STRICT_ALLOW_EXTRA

    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] | None = None
    is_error: bool | None = Field(None, description="the model reads the result prefixed with 'Error: '")

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        return _blocks_of(v, "tool_result content", ("text",))


class ThinkingBlock(BaseModel):
    """An assistant's thinking, given back with the conversation: the `reasoning_content` of that turn for the
    chat template (the signature is not checked)."""

    model_config = STRICT_ALLOW_EXTRA

    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None


class RedactedThinkingBlock(BaseModel):
    """Thinking that another server encrypted: accepted, not read."""

    model_config = STRICT_ALLOW_EXTRA

    type: Literal["redacted_thinking"]
    data: Text | None = None


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                         Field(discriminator="type")]


def _blocks_of(blocks: Any, what: str, kinds: tuple[str, ...]) -> Any:
    """Name the block type that is not supported (the schema's own error would only list the expected ones)."""
    if isinstance(blocks, list):
        for i, block in enumerate(blocks):
            if isinstance(block, dict) and block.get("type") not in kinds:
                names = ", ".join(repr(k) for k in kinds)
                raise ValueError(f"{what} block {i} is of type {block.get('type')!r}: only {names} blocks are "
                                 "supported yet")
    return blocks


def joined(content: str | list[Any] | None) -> str:
    """A content given as a string or as blocks, as one string (the text blocks' texts in order)."""
    if isinstance(content, list):
        return "".join(block.text for block in content if isinstance(block, TextBlock))
    return content or ""


class AnthropicMessage(BaseModel):
    model_config = STRICT_ALLOW_EXTRA

    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock] = Field(
        ..., description="text, or text blocks with tool_use and thinking blocks (assistant) or tool_result blocks "
                         "(user)")

    @field_validator("content", mode="before")
    @classmethod
    def _supported_blocks(cls, v: Any) -> Any:
        return _blocks_of(v, "content", ("text", "tool_use", "tool_result", "thinking", "redacted_thinking"))


# What the document says a `tools` entry is; the server checks it (a server tool's type is a 400 naming it).
TOOL_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["name", "input_schema"],
    "properties": {"type": {"const": "custom"}, "name": {"type": "string", "pattern": "^[a-zA-Z0-9_.-]{1,64}$"},
                   "description": {"type": "string"},
                   "input_schema": {"type": "object", "description": "a JSON schema of type object"}}}


class ToolChoice(BaseModel):
    model_config = STRICT_ALLOW_EXTRA

    type: Literal["auto", "any", "tool", "none"] = Field(
        ..., description="auto: the model decides; any: it calls a tool; tool: it calls `name`; none: no call")
    name: Text | None = Field(None, description="type tool: the tool to call")
    disable_parallel_tool_use: bool | None = Field(None, description="true: at most one call")


class AnthropicConversation(BaseModel):
    """What /v1/messages and /v1/messages/count_tokens share: the model, the system prompt, the turns, tools."""

    model_config = STRICT_ALLOW_EXTRA

    model: Text
    messages: list[AnthropicMessage] = Field(..., min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = Field(
        None, description="client tools, `{name, description, input_schema}`; server tools (a `type` other than "
                          "custom) answer 400", json_schema_extra={"items": TOOL_SCHEMA})
    tool_choice: ToolChoice | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_text_only(cls, v: Any) -> Any:
        return _blocks_of(v, "system", ("text",))


class ThinkingConfig(BaseModel):
    """Whether the answer shows a reasoning model's thinking, and its budget."""

    model_config = STRICT_ALLOW_EXTRA

    type: Literal["enabled", "adaptive", "disabled"] = Field(
        ..., description="enabled: a thinking block first, the thinking held to budget_tokens; adaptive: the same "
                         "with no budget; disabled: no thinking block, and the chat template asked to skip the "
                         "thinking (enable_thinking false) where it can")
    budget_tokens: int | None = Field(None, ge=0, description="enabled: thinking tokens before the closing tag is "
                                                              "forced (max_tokens still bounds the whole output)")
    display: Literal["summarized", "omitted"] | None = Field(
        None, description="omitted: the thinking block comes with its text left out; summarized (the default): "
                          "the thinking as written (no summary is made)")

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> ThinkingConfig:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("budget_tokens is required with type 'enabled'")
        return self


class MessagesRequest(AnthropicConversation):
    max_tokens: int = Field(..., ge=1)
    stop_sequences: list[Text] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    thinking: ThinkingConfig | None = Field(
        None, description="a reasoning model's thinking: shown as a thinking block (enabled, adaptive), or not "
                          "(left out, disabled: it is still generated where the template cannot skip it)")


class CountTokensRequest(AnthropicConversation):
    pass


# ---- responses ----

class AnthropicUsage(BaseModel):
    """Anthropic counts cache reads apart: input_tokens + cache_read_input_tokens is the whole prompt."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicResponseText(BaseModel):
    type: Literal["text"] = "text"
    text: str


class AnthropicThinking(BaseModel):
    """A reasoning model's thinking, the answer's first block; the signature is empty (nothing signs it)."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class AnthropicToolUse(BaseModel):
    """A call the model made; in a stream's content_block_start its input is {} (input_json_delta follows)."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any] = Field(description="the arguments, valid against the tool's input_schema (unless cut "
                                              "by max_tokens: then what parsed, or {})")


ResponseBlock = Annotated[AnthropicThinking | AnthropicResponseText | AnthropicToolUse, Field(discriminator="type")]


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ResponseBlock]
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
    content_block: ResponseBlock


class TextDelta(BaseModel):
    type: Literal["text_delta"]
    text: str


class InputJsonDelta(BaseModel):
    """A fragment of a tool_use block's input: the fragments concatenate to its JSON."""

    type: Literal["input_json_delta"]
    partial_json: str


class ThinkingDelta(BaseModel):
    """A piece of a thinking block: the pieces concatenate to its thinking."""

    type: Literal["thinking_delta"]
    thinking: str


class SignatureDelta(BaseModel):
    """A thinking block's signature (empty), just before its content_block_stop, as Anthropic sends it."""

    type: Literal["signature_delta"]
    signature: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"]
    index: int
    delta: Annotated[TextDelta | InputJsonDelta | ThinkingDelta | SignatureDelta, Field(discriminator="type")]


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
