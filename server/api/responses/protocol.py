"""Request and response models of OpenAI's Responses API (POST /v1/responses and the stored responses' routes)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from server.config.presets import PresetName
from server.api.openai.protocol import STRICT_ALLOW_EXTRA, Text
from server.reasoning.plan import ReasoningEffort, efforts_described

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


class FunctionCallInput(BaseModel):
    """An input item of type function_call: a call the model made, given back with the conversation."""

    model_config = STRICT_ALLOW_EXTRA  # an output item given back carries its id and status

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text = Field(..., description="the call's arguments, a JSON object as text")


class FunctionCallOutputInput(BaseModel):
    """An input item of type function_call_output: the result of the call `call_id`, for the model's next turn."""

    model_config = STRICT_ALLOW_EXTRA

    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[InputTextPart] = Field(..., description="the result, as text or text parts")

    def text(self) -> str:
        if isinstance(self.output, list):
            return "".join(p.text for p in self.output)
        return self.output


class ReasoningTextPart(BaseModel):
    model_config = STRICT_ALLOW_EXTRA

    type: Literal["reasoning_text"]
    text: Text


class ReasoningInput(BaseModel):
    """An input item of type reasoning: an earlier answer's thinking, given back with the conversation; its
    `content` text is the `reasoning_content` of the assistant turn that follows (summaries and encrypted content
    are not read)."""

    model_config = STRICT_ALLOW_EXTRA  # an output item given back carries its id, status, summary...

    type: Literal["reasoning"]
    content: list[ReasoningTextPart] | None = None

    def text(self) -> str:
        return "".join(p.text for p in self.content or [])


# Items of the input that the model reads (a message's `type` may be left out), and the content parts it reads.
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
PARTS_OF = {"message": TEXT_PARTS, "reasoning": ("reasoning_text",)}


def _item_type(item: Any) -> str:
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


InputItem = Annotated[Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallInput, Tag("function_call")]
                      | Annotated[FunctionCallOutputInput, Tag("function_call_output")]
                      | Annotated[ReasoningInput, Tag("reasoning")], Discriminator(_item_type)]


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    type: Literal["text", "json_schema", "json_object"] = Field(
        ..., description="text: free text; json_object: a JSON object; json_schema: JSON valid against `schema`, "
                         "held to it token by token (strict or not)")
    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema", description="json_schema: the JSON Schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = STRICT_ALLOW_EXTRA

    format: TextFormat | None = None


SummaryKind = Literal["auto", "concise", "detailed"]


class ReasoningConfig(BaseModel):
    """How a reasoning model thinks: `effort` is a thinking budget; no summaries are written (accepted, ignored)."""

    model_config = STRICT_ALLOW_EXTRA

    effort: ReasoningEffort | None = Field(
        None, description=f"a thinking budget by name (thinking tokens): {efforts_described()}")
    summary: SummaryKind | None = Field(None, description="accepted; no summary is written (`summary` stays [])")
    generate_summary: SummaryKind | None = Field(None, description="summary's older name; accepted, ignored")


# What the document says a `tools` entry is; the server checks it (a non-function type is a 400 naming it).
FUNCTION_TOOL_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["type", "name"],
    "properties": {"type": {"const": "function"}, "name": {"type": "string", "pattern": "^[a-zA-Z0-9_.-]{1,64}$"},
                   "description": {"type": "string"},
                   "parameters": {"type": "object", "description": "a JSON schema of type object"},
                   "strict": {"type": "boolean"}}}


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Unknown fields are kept in `model_extra` (logged, then ignored)."""

    model_config = STRICT_ALLOW_EXTRA

    model: Text
    input: Text | list[InputItem]
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
    tools: list[dict[str, Any]] | None = Field(
        None, description="function tools, `{type: 'function', name, description, parameters, strict}`; other "
                          "types (web_search, file_search, ...) answer 400",
        json_schema_extra={"items": FUNCTION_TOOL_SCHEMA})
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = Field(
        None, description="none, auto (the default), required, or `{type: 'function', name}`")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (default true)")
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    thinking_token_budget: int | None = Field(
        None, ge=0, description="a thinking budget in tokens (emberserve's extension, as on chat): over "
                                "reasoning.effort's; 0 answers at once")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="variables for the chat template (emberserve's extension, as on chat), e.g. "
                          "{\"enable_thinking\": false}; over the server's --chat-template-kwargs")
    include: list[Text] | None = Field(
        None, description="accepted; nothing more is included (no encrypted reasoning, no output logprobs)")
    metadata: dict[str, Text] | None = None
    user: Text | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _supported_items(cls, v: Any) -> Any:
        """Name the item or part type that is not supported (the union's own errors would list every case)."""
        if isinstance(v, list):
            for i, item in enumerate(v):
                if not isinstance(item, dict):
                    continue
                kind = _item_type(item)
                if kind not in INPUT_ITEM_TYPES:
                    raise ValueError(f"item {i} is of type {kind!r}: only 'message', 'function_call', "
                                     "'function_call_output' and 'reasoning' items are supported yet")
                parts = item.get("content") if kind in PARTS_OF else None
                for j, part in enumerate(parts if isinstance(parts, list) else []):
                    if isinstance(part, dict) and part.get("type") not in PARTS_OF[kind]:
                        names = " and ".join(repr(name) for name in PARTS_OF[kind])
                        raise ValueError(f"item {i} content part {j} is of type {part.get('type')!r}: only "
                                         f"{names} {'are' if len(PARTS_OF[kind]) > 1 else 'is'} supported yet")
        return v


# ---- the response object ----

class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    """A call the model made (an output item), or one given back as input (a stored input item)."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str = Field(description="what the function_call_output of its result names")
    name: str
    arguments: str = Field(description="a JSON object as text, valid against the function's parameters (unless cut "
                                       "by max_output_tokens: then status is incomplete)")
    status: ItemStatus


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """A reasoning model's thinking (an output item before the answer's; a stored input item when given back)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list, description="always []: no summaries are written")
    content: list[ReasoningText] = Field(description="the thinking, as one reasoning_text part")
    status: ItemStatus


OutputItem = Annotated[ReasoningItem | OutputMessage | FunctionCallItem, Field(discriminator="type")]


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
    output: list[OutputItem] = Field(description="a reasoning model's thinking (a reasoning item), then the "
                                                 "answer's messages and function calls, in the order written")
    output_text: str = Field(description="the text of every output_text part, as the openai client computes it")
    parallel_tool_calls: bool = True
    previous_response_id: str | None
    store: bool
    temperature: float
    top_p: float
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = Field(None, description="the request's reasoning options, echoed")
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
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


class FunctionCallOutputItem(BaseModel):
    """A stored function_call_output input item."""

    id: str
    type: Literal["function_call_output"] = "function_call_output"
    call_id: str
    output: str | list[dict[str, Any]]
    status: Literal["completed"] = "completed"


StoredInputItem = Annotated[InputMessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                            Field(discriminator="type")]


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[StoredInputItem]
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
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: Annotated[OutputText | ReasoningText, Field(discriminator="type")]


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


class ReasoningTextDeltaEvent(_Event):
    """A piece of the thinking: the pieces concatenate to the reasoning item's text."""

    type: Literal["response.reasoning_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDoneEvent(_Event):
    type: Literal["response.reasoning_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDeltaEvent(_Event):
    """A fragment of a call's arguments: the fragments concatenate to its final `arguments`."""

    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponseErrorEvent(_Event):
    """A failure after the stream started."""

    type: Literal["error"]
    code: str | None
    message: str
    param: str | None


RESPONSE_STREAM_EVENTS: list[type[BaseModel]] = [
    ResponseLifecycleEvent, OutputItemEvent, ContentPartEvent, OutputTextDeltaEvent, OutputTextDoneEvent,
    ReasoningTextDeltaEvent, ReasoningTextDoneEvent, FunctionCallArgumentsDeltaEvent, FunctionCallArgumentsDoneEvent,
    ResponseErrorEvent]
