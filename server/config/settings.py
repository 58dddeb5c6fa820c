"""`Settings`: everything the server is started with, from `EMBERSERVE_*` environment variables and CLI flags.

One pydantic-settings model is the single source: the CLI flags, the environment variable names, their
validation and the README's table are all derived from its fields.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, SecretStr, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from engine.config import MAX_CHUNKS, QuantMode
from engine.kernels.switches import KernelSwitches
from engine.registry import DEFAULT_MODEL

from server.config.presets import PresetName
from server.reasoning.formats import AUTO, REASONING_FORMATS, ReasoningParserName

# Speculative decoding's methods: prompt lookup (n-gram) or a draft model.
SpeculativeMethod = Literal["ngram", "draft"]
# --draft-model names that mean the served model itself, quantized (a cheaper copy of the same vocabulary).
SELF_DRAFTS = {"self-int4": "int4", "self-int8": "int8"}

ENV_PREFIX = "EMBERSERVE_"
# Settings renamed to vLLM's names (what users of vLLM type): old name -> new. The old flags, EMBERSERVE_*
# variables and keyword names keep working as aliases of the new ones.
RENAMED = {"max_context": "max_model_len", "max_running": "max_num_seqs",
           "max_batched_tokens": "max_num_batched_tokens"}
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
AUTO_DEVICE = "auto"
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_bytes(text: str | int) -> int:
    """'1GiB', '512MiB', '2G', '1000000' → bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (use e.g. 512MiB, 2GiB, or bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def resolve_device(value: Any) -> Any:
    """`auto` is CUDA when torch sees a GPU, else the CPU; any other device stays as given."""
    if isinstance(value, str) and value.strip().lower() == AUTO_DEVICE:
        import torch  # here: reading settings (the CLI's --help, the README table) needs no torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return value


def _template_file(value: Any) -> Any:
    """A chat template file must be readable text; its path is kept (read when the model loads)."""
    if value in (None, ""):
        return None
    path = Path(str(value)).expanduser()
    try:
        path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the chat template file {str(value)!r}: {getattr(e, 'strerror', None) or e}")
    return str(path)


def _json_object(value: Any) -> Any:
    """A JSON object given as text (a flag or variable) is parsed; an object stays as it is."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    return value


Bytes = Annotated[int, BeforeValidator(parse_bytes)]
# An engine kernel switch: from the environment, off only at "0" (as the engine reads it standalone); a flag's bool.
KernelSwitch = Annotated[bool, BeforeValidator(lambda v: v != "0" if isinstance(v, str) else v)]
PositiveInt = Annotated[int, Field(ge=1)]


class Settings(BaseSettings):
    """The server's configuration. Precedence: CLI flag, then `EMBERSERVE_<NAME>` variable, then default."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid", case_sensitive=False)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """The old names' variables (RENAMED) below the new names' own."""
        return init_settings, env_settings, _RenamedEnv(settings_cls), dotenv_settings, file_secret_settings

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        """A setting given by its old name (RENAMED) as a keyword is the new one; both at once is an error."""
        if isinstance(data, dict) and any(old in data for old in RENAMED):
            data = dict(data)
            for old, new in RENAMED.items():
                if old in data:
                    if new in data:
                        raise ValueError(f"{old} is the old name of {new}: give one of them")
                    data[new] = data.pop(old)
        return data

    model: str = Field(DEFAULT_MODEL, description="a known model name, a .gguf file, a safetensors directory, or a "
                                                  "Hugging Face model pulled into the local cache: owner/repo:QUANT "
                                                  "(a GGUF quantization) or owner/repo (see `emberserve pull`); repeat "
                                                  "--model to serve several (the first is the default)")
    pull: bool = Field(False, description="download the model (and a draft model) from the Hugging Face Hub first "
                                          "when it is a Hugging Face name not in the local cache; without it, "
                                          "serving never touches the network")
    models: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="more models served beside --model, comma-separated, each loaded when "
                                          "a request first names it (the same as more --model flags)")
    models_dir: str | None = Field(
        None, description="also serve every .gguf file and model directory (one with a config.json) in this "
                          "directory, each loaded when a request first names it")
    max_loaded_models: PositiveInt | None = Field(
        None, description="with several models, at most this many loaded at once: loading one more unloads the "
                          "least recently used idle one (default: as many as the memory budget holds)")
    idle_unload: float | None = Field(
        None, gt=0, description="unload a model nobody used for this many seconds (its memory is given back; the "
                                "next request loads it again; default: never)")
    load_timeout: float = Field(
        300.0, gt=0, description="with several models, how long a request for an unloaded model waits for its "
                                 "load before a 503 with Retry-After")
    memory_budget: Bytes | None = Field(
        None, description="with several models, the memory the loaded ones may take together (weights, KV "
                          "caches, their processes): a load that does not fit unloads idle models first, else is "
                          "refused; a model's KV cache is at most its share (the budget over --max-loaded-models) "
                          "less its weights (default: 90% of the memory available at start-up, of the GPU's on "
                          "CUDA)")
    host: str = Field(DEFAULT_HOST, description="address to listen on (0.0.0.0 in the container image)")
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="port to listen on")
    device: Annotated[str, BeforeValidator(resolve_device)] = Field(
        AUTO_DEVICE, validate_default=True, description="torch device: auto (CUDA when a GPU is present, else CPU), cpu, cuda, cuda:1, ...")
    dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="activations (default: bfloat16; float32 for unquantized checkpoints on CPU)")
    quant: QuantMode | None = Field(
        None, description="weights kept as int8 per-channel or int4 group-wise (CPU; CUDA with bfloat16); default: int4 for a GGUF "
                          "model on CPU unless dtype is float32, else none")
    max_model_len: PositiveInt | None = Field(None, description="cap the context below the model's")
    served_model_name: str | None = Field(
        None, description="the model id clients send (default: the model's name); with several models "
                          "MODEL=alias pairs, comma-separated")
    preset: PresetName | None = Field(
        None, description="the sampling profile requests start from: fast, balanced, quality, creative, code or "
                          "precise (`emberserve presets` lists their values); a request's own preset or fields win")
    workers: PositiveInt = Field(1, description="runners, each on its own thread (with device cuda: one per GPU)")
    tensor_parallel_size: PositiveInt = Field(
        1, description="split every layer of the model over this many processes (tensor parallelism through "
                       "torch.distributed: nccl with one GPU each from --device on, gloo on cpu); the server's "
                       "process is rank 0 and spawns the others; decoders only, not with --workers")
    max_queued: int = Field(256, ge=0, description="waiting requests per worker before answering 429; also the "
                                                   "most prompts one completions request may list")
    max_num_seqs: PositiveInt | None = Field(
        None, description="sequences decoding together in one batch (default: 32 on CPU, 256 on a GPU)")
    max_num_batched_tokens: PositiveInt | None = Field(
        None, description="tokens per forward pass; longer prompts are prefilled in chunks (default: 512 on CPU, "
                          "8192 on a GPU or for an encoder model, which has no decoding to keep flowing)")
    cuda_graphs: bool = Field(
        True, description="on a GPU, run decode steps and prompt chunks as CUDA graphs captured at start-up per "
                          "batch-size and chunk-length bucket")
    async_scheduling: bool | None = Field(
        None, description="launch the next step before the host has a greedy step's tokens (it reads them on the "
                          "device), so that scheduling, detokenizing and stop checks run beside the device's work "
                          "(GPU; not with speculative decoding or tensor parallelism; default: on with a GPU)")
    engine_process: bool | None = Field(
        None, description="run the engine (the model, its scheduler and workers) in a process of its own beside the "
                          "HTTP server, so that the two do not take turns on one GIL (default: on with a GPU; off "
                          "on CPU, whose cores the two processes would share)")
    api_server_count: PositiveInt = Field(
        1, description="HTTP processes in front of the one engine process, sharing the port (vLLM's "
                       "--api-server-count): each parses requests and writes streams on a core of its own; more "
                       "than 1 needs the engine process (--engine-process)")
    dense_prefill: bool | None = Field(
        None, description="with int4/int8 weights, also keep a bfloat16 copy of the layer weights for prompts, for 2 "
                          "bytes per weight more memory (default: where it is faster, i.e. unless the int8 "
                          "dot-product kernels serve on a CPU without AMX)")
    deterministic: bool = Field(
        False, description="every token through the same kernels whether prefilled, decoded, chunked, batched or "
                           "read from the prefix cache: greedy outputs and logprobs bit-identical across all of "
                           "these (CPU; slower prefill, see bench/RESULTS.md)")
    kv_cache_memory: Bytes | None = Field(
        None, description="memory for the paged KV cache, e.g. 1GiB (default: 512MiB on CPU, 90% of free GPU memory)")
    prefix_caching: bool = Field(True, description="reuse the KV cache of prompt prefixes seen before")
    max_prompt_tokens: PositiveInt | None = Field(
        None, description="longest prompt accepted, in tokens (default: the context size); longer ones get a 400")
    max_tokens_default: PositiveInt | None = Field(
        None, description="the output budget of a request that sets none (max_tokens, max_completion_tokens, "
                          "max_output_tokens), on every endpoint, as llama-server's -n; a preset's max_tokens "
                          "wins over it (default: the rest of the context, as vLLM and llama-server)")
    speculative: Literal["off", SpeculativeMethod] | None = Field(
        None, description="speculative decoding: ngram (prompt lookup: drafts copied from the prompt and output so "
                          "far) or draft (a draft model, see draft_model); default: draft with a draft model, else off")
    num_speculative_tokens: int = Field(
        4, ge=1, le=16, description="most tokens a sequence drafts per step for the model to verify in one pass")
    ngram_min: PositiveInt = Field(1, description="shortest n-gram prompt lookup matches")
    ngram_max: PositiveInt = Field(4, description="longest n-gram prompt lookup matches (tried first)")
    draft_model: str | None = Field(
        None, description="a draft model of the same vocabulary (a known name or a path; self-int4 or self-int8: "
                          "the served model quantized, on CPU or CUDA), on the same device with its own KV cache")
    speculative_disable_by_batch_size: PositiveInt | None = Field(
        None, description="no speculation in steps of more decoding sequences than this (default: never off on "
                           "CPU; on a GPU 4, the verification rows a CUDA-graph step replays)")
    embeddings: bool = Field(
        False, description="also serve POST /v1/embeddings from a decoder model (an encoder model such as "
                           "all-minilm-l6-v2 serves embeddings only, with or without it)")
    pooling: Literal["last", "mean"] | None = Field(
        None, description="how embeddings pool the hidden states: the last token's or the mean of all (default: the "
                          "model's sentence-transformers config for an encoder, last for a decoder)")
    reasoning_parser: ReasoningParserName = Field(
        AUTO, description="how the thinking of a reasoning model is told from its answer: auto (from the chat "
                          "template and the vocabulary), none (the thinking stays in the answer), or a format: "
                          + ", ".join(REASONING_FORMATS))
    chat_template: Annotated[str | None, BeforeValidator(_template_file)] = Field(
        None, description="a Jinja chat template file that replaces the model's own")
    chat_template_kwargs: Annotated[dict[str, Any], NoDecode, BeforeValidator(_json_object)] = Field(
        default_factory=dict, description="JSON object of variables every chat template render gets (a request's "
                                          "chat_template_kwargs win), e.g. {\"enable_thinking\": false}")
    parse_special_in_messages: bool = Field(
        False, description="trusted callers only: special-token text inside chat messages (say a user's own "
                           "end-of-turn marker) becomes control tokens, as in llama-server and vLLM; off, only the "
                           "chat template's own markers do and the messages' text stays text")
    max_request_bytes: Bytes = Field(
        8 * 2**20, ge=1, description="largest request body accepted; larger ones get a 413")
    api_key: SecretStr | None = Field(
        None, description="when set, every route but /health, /livez and /metrics (the probes and the scrape) "
                          "needs `Authorization: Bearer <key>` or `x-api-key: <key>`")
    allowed_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="comma-separated origins allowed by CORS, or * (default: CORS off)")
    responses_store_size: int = Field(
        1024, ge=0, description="responses of /v1/responses kept in memory for GET and previous_response_id; past "
                                "it the oldest is dropped (0: none kept)")
    responses_store_ttl: float = Field(
        3600.0, gt=0, description="seconds a stored response is kept after it was made")
    stream_interval: int = Field(
        0, ge=0, description="tokens a stream gathers into one chunk (its first token goes at once, its last with "
                             "the finish), as vLLM's --stream-interval: 1 sends every token as it comes; more costs "
                             "the server less per token; 0 (default): 1 while at most 31 sequences run, then one "
                             "more token a chunk per 16 running sequences (8 at 128), at most 16")
    stream_timeout: float = Field(
        30.0, gt=0, description="seconds a stream may wait on a client that stopped reading before it is cut and "
                                "its generation cancelled")
    shutdown_grace: float = Field(
        30.0, ge=0, description="seconds a SIGTERM waits for in-flight requests before exiting")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    log_format: Literal["text", "json"] = Field("text", description="text lines, or one JSON object per line")
    # The engine's kernel switches (engine/kernels/switches.py, which reads the same variables when the engine runs
    # without the server; these override it through `kernel_switches`). As there, a variable turns one off only at "0".
    gemv: KernelSwitch = Field(
        True, description="the Triton GEMV kernel for one-row matmuls on a GPU (off: torch's linear for every call)")
    fused_kernels: KernelSwitch = Field(
        True, description="the fused Triton kernels (RMSNorm, RoPE and KV writes, gated activations; off: torch ops)")
    cpu_kernels: KernelSwitch = Field(
        True, description="the compiled fused CPU kernels (off: torch ops); fixed when the engine's kernels are first "
                          "imported (`emberserve serve` sets it before; in Python, set the variable before importing)")
    kernel_cache: Annotated[str | None, BeforeValidator(lambda v: v or None)] = Field(
        None, description="directory of the compiled CPU kernels' build (default: ~/.cache/emberserve)")

    @model_validator(mode="after")
    def _one_way_to_use_the_devices(self) -> Settings:
        if self.tensor_parallel_size > 1 and self.workers > 1:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} and workers {self.workers}: "
                             "a tensor-parallel model is served by one worker; use one or the other")
        return self

    @model_validator(mode="after")
    def _fronts_need_the_engine_process(self) -> Settings:
        if self.api_server_count > 1 and not device_default(self, "engine_process"):
            raise ValueError(f"api_server_count {self.api_server_count} needs the engine in a process of its own, "
                             f"which is off{' on CPU by default' if self.engine_process is None else ''}: add "
                             "--engine-process")
        return self

    @model_validator(mode="after")
    def _budget_holds_the_batch(self) -> Settings:
        running, budget = device_default(self, "max_num_seqs"), device_default(self, "max_num_batched_tokens")
        if budget < running:
            raise ValueError(f"max_num_batched_tokens ({budget}) must be at least max_num_seqs ({running}): every "
                             "running sequence decodes one token in each forward pass")
        return self

    @model_validator(mode="after")
    def _speculation_is_coherent(self) -> Settings:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")
        if self.speculative == "draft" and self.draft_model is None:
            raise ValueError("speculative draft needs a draft model: set draft_model")
        if self.draft_model is not None and self.speculative in ("off", "ngram"):
            raise ValueError(f"draft_model is set but speculative is {self.speculative}: leave speculative out or "
                             "set it to draft")
        return self

    @property
    def kernel_switches(self) -> KernelSwitches:
        """The engine's kernel switches as these settings have them (put in force before a model loads)."""
        return KernelSwitches(gemv=self.gemv, fused_kernels=self.fused_kernels, cpu_kernels=self.cpu_kernels,
                              kernel_cache=None if self.kernel_cache is None else Path(self.kernel_cache))

    @property
    def serves_many(self) -> bool:
        """Whether these settings ask for the multi-model server (server/api/model_router.py): more than one model,
        a models directory, or models unloaded when idle. Otherwise the one model is served as it always was."""
        return bool(self.models) or self.models_dir is not None or self.idle_unload is not None

    @property
    def speculative_method(self) -> SpeculativeMethod | None:
        """The speculation in force: draft with a draft model, ngram if asked, else None."""
        if self.draft_model is not None:
            return "draft"
        return "ngram" if self.speculative == "ngram" else None

    @model_validator(mode="after")
    def _many_models_run_in_engine_processes(self) -> Settings:
        many = self.serves_many
        if many and self.engine_process is False:
            raise ValueError("several models (or --idle-unload) run each model in an engine process of its own, "
                             "which --no-engine-process turns off")
        if many and self.api_server_count > 1:
            raise ValueError(f"api_server_count {self.api_server_count} serves one model: not with several models "
                             "or --idle-unload")
        return self

    @field_validator("allowed_origins", "models", mode="before")
    @classmethod
    def _split_lists(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [o.strip() for o in value.split(",") if o.strip()]
        return value

    @field_validator("port", mode="before")
    @classmethod
    def _not_a_service_link(cls, value: Any) -> Any:
        if isinstance(value, str) and "://" in value:  # Kubernetes injects EMBERSERVE_PORT=tcp://... for a Service
            raise ValueError(f"{value!r} looks like a Kubernetes service link (a Service named emberserve): set "
                             "enableServiceLinks: false on the pod, or EMBERSERVE_PORT explicitly")
        return value

    @field_validator("dtype", "quant", "preset", "pooling", "speculative", "log_level", "log_format", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value


CPU_DEFAULTS = {"max_num_seqs": 32, "max_num_batched_tokens": 512, "speculative_disable_by_batch_size": None,
                "engine_process": False, "async_scheduling": False}
# Past MAX_CHUNKS drafting sequences a GPU step runs eagerly, and speculation at 8 streams was slower than none
# (bench/RESULTS.md#issue-16-gpu-verification-graphs).
GPU_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "speculative_disable_by_batch_size": MAX_CHUNKS,
                "engine_process": True, "async_scheduling": True}
# An encoder only embeds: its steps need not stay short for decoding streams, and a batch split into small steps
# pays each step's fixed costs again (a request of 64 sentences: 4 steps instead of 1 under the CPU default).
ENCODER_DEFAULTS = {"max_num_batched_tokens": 8192}


def device_default(settings: Settings, name: str, encoder: bool = False) -> int | None:
    """A setting's value, or its default for the settings' device (and an encoder model) when it was left out."""
    value = getattr(settings, name)
    if value is not None:
        return value
    if encoder and name in ENCODER_DEFAULTS:
        return ENCODER_DEFAULTS[name]
    return (CPU_DEFAULTS if settings.device == "cpu" else GPU_DEFAULTS)[name]


def env_name(field: str) -> str:
    return f"{ENV_PREFIX}{field.upper()}"


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _default_text(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return "(none)"
    value = info.default
    if value is None:
        return "(auto)" if "default" in (info.description or "") else "(none)"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and value >= 2**20 and value % 2**20 == 0:
        return f"{value // 2**20}MiB"
    return str(value)


def settings_table() -> str:
    """The Markdown table of every setting: flag, environment variable, default, meaning (kept in the README)."""
    rows = ["| flag | environment variable | default | meaning |", "|---|---|---|---|"]
    for name, info in Settings.model_fields.items():
        rows.append(f"| `{flag_name(name)}` | `{env_name(name)}` | `{_default_text(info)}` | {info.description} |")
    return "\n".join(rows)


class _RenamedEnv(PydanticBaseSettingsSource):
    """The EMBERSERVE_* variables of the settings' old names (RENAMED), read as the new names."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads the environment itself

    def __call__(self) -> dict[str, Any]:
        environ = {k.upper(): v for k, v in os.environ.items()}
        return {new: environ[env_name(old)] for old, new in RENAMED.items() if env_name(old) in environ}
