"""Request and response models of OpenAI's Responses API (POST /v1/responses and the stored responses' routes)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from .presets import PresetName
from .protocol import STRICT_ALLOW_EXTRA, Text

# Content parts an input message may carry: its own text, or an earlier answer's text given back as input.
TEXT_PARTS = ("input_text", "output_text")


class InputTextPart(BaseModel):
    model_config = STRICT_ALLOW_EXTRA  # output_text parts given back carry annotations and logprobs

    type: Literal["input_text", "output_text"]
    text: Text


class InputMessage(BaseModel):
    """An input item of type message (the `type` may be left out, as in EasyInputMessage)."""

    model_config = STRICT_ALLOW_EXTRA

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputTextPart]

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content


class TextFormat(BaseModel):
    model_config = STRICT_ALLOW_EXTRA

    type: Text = Field(..., description="only 'text' yet; 'json_schema' and 'json_object' answer 400")


class TextConfig(BaseModel):
    model_config = STRICT_ALLOW_EXTRA

    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Unknown fields are kept in `model_extra` (logged, then ignored)."""

    model_config = STRICT_ALLOW_EXTRA

    model: Text
    input: Text | list[InputMessage]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    preset: PresetName | None = Field(
        None, description="a named sampling profile (emberserve's extension): fills temperature, top_p, the other "
                          "sampling values and max_output_tokens where the request leaves them out")
    stream: bool = False
    store: bool = True
    previous_response_id: Text | None = None
    tools: list[dict[str, Any]] | None = Field(None, description="not supported yet: only empty")
    tool_choice: Text | dict[str, Any] | None = Field(None, description="without tools: only 'auto' or 'none'")
    text: TextConfig | None = None
    metadata: dict[str, Text] | None = None
    user: Text | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _messages_of_text(cls, v: Any) -> Any:
        """Name the item or part type that is not supported yet (the union's own errors would list every case)."""
        if isinstance(v, list):
            for i, item in enumerate(v):
                if not isinstance(item, dict):
                    continue
                if item.get("type", "message") != "message":
                    raise ValueError(f"item {i} is of type {item.get('type')!r}: only 'message' items are "
                                     "supported yet")
                parts = item.get("content")
                for j, part in enumerate(parts if isinstance(parts, list) else []):
                    if isinstance(part, dict) and part.get("type") not in TEXT_PARTS:
                        raise ValueError(f"item {i} content part {j} is of type {part.get('type')!r}: only "
                                         "'input_text' and 'output_text' are supported yet")
        return v


# ---- the response object ----

class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int       # prompt tokens read from the prefix cache
    cache_write_tokens: int  # prompt tokens computed here that the prefix cache keeps (its whole blocks)


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A response as POST /v1/responses answers it, GET /v1/responses/{id} returns it and stream events carry it."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputMessage]
    output_text: str = Field(description="the text of every output_text part, as the openai client computes it")
    parallel_tool_calls: bool = True
    previous_response_id: str | None
    store: bool
    temperature: float
    top_p: float
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str = "auto"
    tools: list[Any] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None


class InputMessageItem(BaseModel):
    """A stored input message, as GET /v1/responses/{id}/input_items lists it."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    status: Literal["completed"] = "completed"
    content: list[dict[str, Any]]


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[InputMessageItem]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


# ---- streaming events: each `event:` name with its `data:` object, numbered by `sequence_number` ----

class _Event(BaseModel):
    sequence_number: int


class ResponseLifecycleEvent(_Event):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputMessage


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any]


class OutputTextDoneEvent(_Event):
    type: Literal["response.output_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any]


class ResponseErrorEvent(_Event):
    """A failure after the stream started."""

    type: Literal["error"]
    code: str | None
    message: str
    param: str | None


RESPONSE_STREAM_EVENTS: list[type[BaseModel]] = [
    ResponseLifecycleEvent, OutputItemEvent, ContentPartEvent, OutputTextDeltaEvent, OutputTextDoneEvent,
    ResponseErrorEvent]
