"""Request and response models of the OpenAI API (and the vLLM-style extras users expect), as pydantic models."""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from server.config.presets import PresetName
from server.sampling.params import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, logit_bias_entry
from server.config.settings import SpeculativeMethod
from server.reasoning.plan import ReasoningEffort, efforts_described


# Numbers OpenAI documents as limits.
MAX_STOP_STRINGS = 4
MAX_N = 128
MAX_EMBEDDING_INPUTS = 2048  # inputs of one embeddings request, as OpenAI's


def _whole_characters(text: str) -> str:
    """Refuse lone surrogates: JSON escapes such as \\ud800 that pair with nothing are no text, and neither the
    tokenizer nor a UTF-8 response body can carry them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x}) at character {e.start}, "
                         "which is not a Unicode character") from None
    return text


# Every request string that reaches the tokenizer or comes back in a response.
Text = Annotated[str, AfterValidator(_whole_characters)]
# Request values must have the JSON types the schema gives them: no "5" or true for an integer, no 1 for a boolean
# (JSON integers for numbers are fine). Unknown fields are kept where OpenAI clients send extra ones.
STRICT = ConfigDict(strict=True)
STRICT_ALLOW_EXTRA = ConfigDict(strict=True, extra="allow")


class OpenAIRequest(BaseModel):
    """Fields shared by completions and chat; unknown fields are kept in `model_extra` (logged, then ignored)."""

    model_config = STRICT_ALLOW_EXTRA

    model: Text
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    seed: int | None = None
    # The validators below check these; the schema says the same for clients (JSON Schema keywords beside anyOf
    # apply to the matching type only: maxItems to the list form, propertyNames to the object).
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={
        "propertyNames": {"pattern": "^-?[0-9]+$"}, "additionalProperties": {"minimum": -100, "maximum": 100}})
    stop: Text | list[Text] | None = Field(None, validate_default=True,
                                           json_schema_extra={"maxItems": MAX_STOP_STRINGS})
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    preset: PresetName | None = Field(
        None, description="a named sampling profile (emberserve's extension): fills the sampling fields and "
                          "max_tokens this request leaves out")

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(stops)}")
        return [s for s in stops if s]

    @field_validator("logit_bias")
    @classmethod
    def _bias_values(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            logit_bias_entry(key, bias, MAX_LOGIT_BIAS)  # the sampler's rule, with the API's limit
        return v


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: Text


class FunctionCall(BaseModel):
    model_config = STRICT_ALLOW_EXTRA

    name: Text
    arguments: Text  # a JSON object, as text


class ToolCall(BaseModel):
    """A call an assistant message made (request history and responses alike)."""

    model_config = STRICT_ALLOW_EXTRA

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = STRICT_ALLOW_EXTRA

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: Text | None = None          # tool messages: the call this is the result of
    # An earlier answer's thinking, given back to the template (vLLM's and DeepSeek's names); templates that drop
    # old thinking keep dropping it.
    reasoning_content: Text | None = None
    reasoning: Text | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        """Name the part type that is not text (the schema's own error would only say that 'text' was expected)."""
        if isinstance(v, list):
            for part in v:
                if isinstance(part, dict) and part.get("type") != "text":
                    raise ValueError(f"content part of type {part.get('type')!r} is not supported; only 'text'")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT_ALLOW_EXTRA

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one constraint on the output."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    json_: dict[str, Any] | bool | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = Field(None, min_length=1)
    grammar: Text | None = None  # Lark, or GBNF/EBNF
    json_object: bool | None = None


class FunctionDefinition(BaseModel):
    model_config = STRICT_ALLOW_EXTRA

    name: Text = Field(..., pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = STRICT_ALLOW_EXTRA

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = STRICT_ALLOW_EXTRA

    name: Text


class NamedToolChoice(BaseModel):
    model_config = STRICT_ALLOW_EXTRA

    type: Literal["function"]
    function: NamedFunction


class StructuredRequest(OpenAIRequest):
    """Output constraints, on chat and completions alike."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None


class ChatCompletionRequest(StructuredRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    # Reasoning models: the thinking is in `message.reasoning` (and `reasoning_content`), apart from the answer.
    include_reasoning: bool = Field(True, description="false drops the thinking from the response (it is still "
                                                      "generated and counted)")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="variables for the chat template, e.g. {\"enable_thinking\": false}; over the server's")
    thinking_token_budget: int | None = Field(
        None, ge=0, description="thinking tokens before the closing tag is forced (0: answer at once)")
    reasoning_effort: ReasoningEffort | None = Field(
        None, description=f"a thinking budget by name (thinking tokens): {efforts_described()}; a harmony model "
                          "(gpt-oss) gets it in its chat template instead (low, medium or high)")


class CompletionRequest(StructuredRequest):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: Text | None = Field(None, description="not supported: only empty or null")
    best_of: int | None = Field(None, description="only equal to n")


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings; unknown fields are kept in `model_extra` (logged, then ignored)."""

    model_config = STRICT_ALLOW_EXTRA

    model: Text
    input: Text | list[Text] | list[int] | list[list[int]] = Field(
        ..., description=f"a string, a list of strings, token ids or lists of token ids; at most "
                         f"{MAX_EMBEDDING_INPUTS} inputs, none empty")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each embedding's little-endian float32 bytes, base64-encoded")
    dimensions: int | None = Field(None, ge=1, description="keep the first `dimensions` values, renormalised to "
                                                           "unit length (at most the model's size)")
    user: Text | None = None


class TokenizeRequest(BaseModel):
    model_config = STRICT

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # a chat's template variables, as a chat completion gives them
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None


class DetokenizeRequest(BaseModel):
    model_config = STRICT

    model: Text | None = None
    tokens: list[int]


# ---- responses (non-streaming bodies; streaming chunks follow the same field names) ----

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None
    completion_tokens_details: dict[str, int] | None = None  # reasoning_tokens: the thinking's share


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    # A reasoning model's thinking, under both names clients read (vLLM's current one, DeepSeek's and llama-server's)
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class _CompletionEnvelope(BaseModel):
    """Fields every non-streaming completion body carries around its choices."""

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    usage: Usage


class ChatCompletionResponse(_CompletionEnvelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(_CompletionEnvelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of the float32 values


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ModelDetails(BaseModel):
    """What the served model is, an entry's `details` (named as Ollama's `details` and llama-server's `meta`): read
    from its weights files' headers and the model registry."""

    family: str = Field(description="the architecture: llama, qwen2, qwen3, gemma3, qwen3_moe, qwen2_moe, mixtral, "
                                    "olmoe, gpt_oss, bert")
    format: Literal["gguf", "safetensors"] | None = Field(description="the weights' file format")
    parameters: int | None = Field(description="the parameter count: every weight tensor's elements (llama-server's "
                                               "n_params)")
    parameter_size: str | None = Field(description="the parameter count, rounded as Ollama shows it: 135M, 8.03B")
    quantization_level: str | None = Field(
        description="the weights' type in the file, as llama.cpp and Ollama name it: the GGUF file type (Q4_1, "
                    "Q4_K_M, Q8_0, F16, ...) or a safetensors checkpoint's dtype (BF16, F32, ...)")
    quant: str = Field(description="how the weights are held in memory while served: none (dtype), int8 or int4")
    dtype: str = Field(description="the compute dtype: float32, bfloat16, ...")
    context_length: int | None = Field(description="the context the model was trained for (llama-server's "
                                                   "n_ctx_train); max_model_len is what this server serves")
    chat_tuned: bool = Field(description="tuned to chat (an instruct model): a base model only continues text and "
                                         "an embedding model only embeds")
    embedding: bool = Field(description="an embedding model (an encoder): it serves /v1/embeddings only")
    size: int | None = Field(description="the weights files' size on disk, in bytes")
    expert_count: int | None = Field(None, description="a mixture of experts: the experts of each MoE layer "
                                                       "(llama.cpp's expert_count); absent for a dense model")
    expert_used_count: int | None = Field(None, description="a mixture of experts: the experts each token is routed "
                                                            "to (llama.cpp's expert_used_count)")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "emberserve"
    max_model_len: int | None = None
    details: ModelDetails | None = Field(description="what the model is, once loaded (a multi-model server's "
                                                     "unloaded models have none)")
    state: Literal["loaded", "loading", "unloaded"] | None = Field(
        None, exclude_if=lambda state: state is None,
        description="a multi-model server's: whether the model is loaded, loading, or loaded on its first request")


class ModelRequest(BaseModel):
    """POST /models/load and /models/unload (a multi-model server's)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="the model's id, as /v1/models lists it")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- streaming chunks: each `data:` event of an SSE response, as the serving layer writes them ----

class FunctionCallDelta(BaseModel):
    name: str | None = None       # in a call's first delta only
    arguments: str | None = None  # a fragment: a call's fragments concatenate to its arguments


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None                       # in a call's first delta only
    type: Literal["function"] | None = None     # in a call's first delta only
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class _ChunkEnvelope(BaseModel):
    id: str
    created: int
    model: str
    system_fingerprint: str | None
    usage: Usage | None = None  # only with stream_options.include_usage: null, then the totals in the last chunk


class ChatCompletionChunk(_ChunkEnvelope):
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]


class CompletionChunk(_ChunkEnvelope):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]


# ---- errors and probes ----

class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The OpenAI error envelope: the body of every 4xx and 5xx, and the `data:` event of a failure mid-stream."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorDetail


class Liveness(BaseModel):
    status: Literal["alive"]


class VersionInfo(BaseModel):
    """GET /version: the server's version (the same as `emberserve --version`)."""

    version: str


class PresetCard(BaseModel):
    """One named preset (server/config/presets.py): what a request's `"preset": name` fills in."""

    name: str
    object: Literal["preset"] = "preset"
    description: str
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    max_tokens: int
    model: str = Field(description="the model recommended for it (advice: a preset never changes the served model)")


class PresetList(BaseModel):
    """GET /v1/presets: the presets a request may name, and the one the server applies by default (--preset)."""

    object: Literal["list"] = "list"
    data: list[PresetCard]
    default: str | None = None


class Health(BaseModel):
    """GET /health when ready: the served model, its device and weight format, and the worker pool's figures."""

    model_config = ConfigDict(extra="allow")  # further pool figures pass through

    status: Literal["ok"]
    model: str
    device: str
    dtype: str
    quant: str
    deterministic: bool
    running: int
    queued: int
    generated_tokens: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    preemptions: int
    speculative: SpeculativeMethod | None = None  # speculative decoding in force, if any
    spec_decode_num_drafts: int = 0  # sequence steps that verified drafted tokens
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []  # accepted drafts by their position in the draft
    spec_decode_acceptance_rate: float | None = None  # accepted / drafted tokens; None before any draft
    spec_decode_mean_acceptance_length: float | None = None  # tokens per speculating step: 1 + accepted / drafts


class HealthUnavailable(BaseModel):
    """GET /health's 503: the model is still loading, or SIGTERM started a drain."""

    status: Literal["loading", "draining", "unhealthy"]
    error: str | None = None  # unhealthy: why (a worker stopped serving; the server is exiting)


OpenAIRequest.model_rebuild()
StructuredRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()
