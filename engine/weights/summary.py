"""`read_summary`: what a model's files say about it (family, parameter count, the weights' type, trained context,
chat template, size on disk), read from the GGUF header or the safetensors headers alone, never the tensor data."""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gguf.constants import GGMLQuantizationType, LlamaFileType

from engine.config import ENCODER_FAMILIES, EncoderConfig, ModelConfig, config_from_gguf, config_from_hf
from engine.errors import ModelFormatError
from engine.registry import KnownModel
from engine.tokenizer.tokenizer import Tokenizer, pretrained_chat_template
from engine.weights.gguf_format import GGUFFile
from engine.weights.safetensors_files import shard_files

# generation_config.json's sampling values that requests fall back on
_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# safetensors dtypes that hold weights (an integer tensor is an index buffer, such as BERT's position ids)
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


@dataclass(frozen=True)
class WeightsSummary:
    """A model's facts from its files. `file_type` is the weights' type as llama.cpp and Ollama name it: the GGUF
    file type (`Q4_1`, `Q4_K_M`, `F32`, ...), or the dtype holding most of a safetensors checkpoint's weights
    (`BF16`, `F32`, ...). `parameters` counts every weight tensor's elements (ties stored once count once)."""

    format: Literal["gguf", "safetensors"]
    family: str
    parameters: int
    file_type: str
    context_length: int
    has_chat_template: bool
    size_bytes: int  # the weights files on disk
    experts: int = 0       # a mixture of experts: experts per layer (0: a dense model)
    experts_used: int = 0  # experts each token is routed to

    @property
    def parameter_size(self) -> str:
        return parameter_size(self.parameters)


def parameter_size(count: int) -> str:
    """A parameter count as Ollama's `parameter_size` shows it, to three significant digits: 135M, 22.7M, 8.03B."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            value = count / scale
            return f"{value:.{max(0, 2 - int(math.log10(value)))}f}{unit}"
    return str(count)


def read_summary(path: str | Path) -> WeightsSummary:
    """The summary of a .gguf file or a safetensors directory (ModelFormatError or UnsupportedModelError when it is
    neither, or not a model the engine runs)."""
    path = Path(path)
    if path.is_dir():
        return _safetensors_summary(path)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_summary(path)
    raise ModelFormatError(f"{path}: not a model: expected a .gguf file or a safetensors directory")


def model_config(path: Path) -> ModelConfig | EncoderConfig:
    """The config of a .gguf file or a safetensors directory alone (its metadata or config.json)."""
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ModelFormatError(f"{path}: not a model directory (no config.json)")
        return config_from_hf(json.loads(config.read_text()))
    return config_from_gguf(GGUFFile(path).metadata, has_output_tensor=True)  # tying does not matter here


def generation_defaults(path: Path, known: KnownModel | None) -> dict[str, Any]:
    """The sampling values the model comes with: the registry's for a known model, then those of a checkpoint's
    generation_config.json."""
    defaults = dict(known.generation_defaults) if known is not None else {}
    config = path / "generation_config.json"
    if path.is_dir() and config.is_file():
        chosen = json.loads(config.read_text())
        defaults |= {k: chosen[k] for k in _GENERATION_KEYS if k in chosen}
    return defaults


def model_tokenizer(path: Path, known: KnownModel | None, metadata: dict[str, Any] | None = None) -> Tokenizer:
    """The model's tokenizer (from a GGUF file's metadata, given when already read, or a directory's tokenizer
    files) with the chat template chats are rendered with: the registry's for a known model that sets one, else the
    files' own, else the fallback the tokenizer picks by its vocabulary."""
    if path.is_dir():
        tokenizer = Tokenizer.from_pretrained_dir(path)
    else:
        tokenizer = Tokenizer.from_gguf_metadata(metadata if metadata is not None else GGUFFile(path).metadata)
    if known is not None and known.chat_template is not None:
        tokenizer.set_chat_template(known.chat_template)
    return tokenizer


def chat_tuned(summary: WeightsSummary, known: KnownModel | None) -> bool:
    """Whether the model is tuned to chat: as the registry says for a known model (a base model may still ship a
    template), else whether its files carry a chat template (an encoder never is)."""
    if known is not None:
        return known.chat_tuned
    return summary.has_chat_template and summary.family not in ENCODER_FAMILIES


def _gguf_summary(path: Path) -> WeightsSummary:
    gguf = GGUFFile(path)
    cfg = config_from_gguf(gguf.metadata, has_output_tensor="output.weight" in gguf.tensors)
    counts = {name: math.prod(entry.shape) for name, entry in gguf.tensors.items()}
    return WeightsSummary("gguf", cfg.family, sum(counts.values()), _gguf_file_type(gguf, counts),
                          cfg.max_position, bool(gguf.metadata.get("tokenizer.chat_template")), gguf.size_bytes,
                          *_experts(cfg))


def _gguf_file_type(gguf: GGUFFile, counts: dict[str, int]) -> str:
    """`general.file_type` by its llama.cpp name; without it, the tensor type holding the most elements."""
    try:
        return LlamaFileType(int(gguf.metadata["general.file_type"])).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (KeyError, ValueError, TypeError):
        by_type: dict[int, int] = {}
        for name, entry in gguf.tensors.items():
            by_type[entry.ggml_type] = by_type.get(entry.ggml_type, 0) + counts[name]
        return GGMLQuantizationType(max(by_type, key=by_type.__getitem__)).name


def _safetensors_summary(directory: Path) -> WeightsSummary:
    config = directory / "config.json"
    if not config.is_file():
        raise ModelFormatError(f"{directory}: not a model directory (no config.json)")
    cfg = config_from_hf(json.loads(config.read_text()))
    by_dtype: dict[str, int] = {}
    files = shard_files(directory)
    for file in files:
        for name, entry in _safetensors_header(file).items():
            if entry["dtype"] in _FLOAT_DTYPES:
                by_dtype[entry["dtype"]] = by_dtype.get(entry["dtype"], 0) + math.prod(entry["shape"])
            elif name.endswith("_blocks") and entry["dtype"] == "U8":  # MXFP4 experts: two weights a byte
                by_dtype["MXFP4"] = by_dtype.get("MXFP4", 0) + 2 * math.prod(entry["shape"])
    if not by_dtype:
        raise ModelFormatError(f"{directory}: no floating-point weights in its safetensors files")
    return WeightsSummary("safetensors", cfg.family, sum(by_dtype.values()), max(by_dtype, key=by_dtype.__getitem__),
                          cfg.max_position, pretrained_chat_template(directory) is not None,
                          sum(f.stat().st_size for f in files), *_experts(cfg))


def _experts(cfg: ModelConfig | EncoderConfig) -> tuple[int, int]:
    moe = getattr(cfg, "moe", None)
    return (moe.num_experts, moe.top_k) if moe is not None else (0, 0)


def _safetensors_header(file: Path) -> dict[str, dict[str, Any]]:
    """A safetensors file's tensor directory: its leading 8-byte length, then that much JSON."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as e:
        raise ModelFormatError(f"{file}: cannot read safetensors header: {e}") from None
    header.pop("__metadata__", None)
    return header
