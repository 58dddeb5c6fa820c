"""Hugging Face model names (`owner/repo`, `owner/repo:QUANT`) and which of a repo's files such a name means.

The GGUF choice follows llama.cpp's `-hf owner/repo[:quant]` (common/download.cpp, model resolution): a model file
is a `.gguf` whose name holds none of the sidecar markers (`mmproj`, `imatrix`, `mtp-`, `eagle3-`, `dflash-`); a
quantization tag matches a file whose path holds the tag followed by `.` or `-`, case-insensitively (`q8_0` finds
`Model-Q8_0.gguf` and `Model-Q8_0-00001-of-00003.gguf`, `Q4_K` does not find `Model-Q4_K_M.gguf`), and here also
preceded by no letter or digit (`F16` does not find `Model-BF16.gguf`); with no tag,
`Q4_K_M`, then `Q8_0`, then the first model file by path. A split model (`-00001-of-0000N`) is chosen by its first
part and means all N parts.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
_SIDECARS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-")
_NAME = re.compile(r"([A-Za-z0-9][\w.-]*)/([A-Za-z0-9][\w.-]*)(?::([\w.-]+))?")
_SPLIT = re.compile(r"(.+)-([0-9]{5})-of-([0-9]{5})", re.IGNORECASE)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)

# The files of a safetensors repo that the engine reads: config, generation defaults, tokenizer, chat template,
# the weights and their index, and a sentence-transformers model's pooling configs (modules.json names them).
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_FILES = (
    CONFIG_FILE, "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    INDEX_FILE, "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
)
_POOLING_CONFIG = re.compile(r"\d+_Pooling/config\.json")


@dataclass(frozen=True)
class HubName:
    """`owner/repo` with an optional quantization tag (`owner/repo:Q4_K_M`)."""

    repo: str
    quant: str | None = None

    def __str__(self) -> str:
        return self.repo if self.quant is None else f"{self.repo}:{self.quant}"


def parse_hub_name(name: str) -> HubName | None:
    """The Hub name `name` spells, or None when it is not one (a known short name, an absolute path, ...)."""
    match = _NAME.fullmatch(name)
    if match is None or name.endswith((".", "-")):
        return None
    owner, repo, quant = match.groups()
    return HubName(f"{owner}/{repo}", quant)


@dataclass(frozen=True)
class GGUFPart:
    """A .gguf file name read the llama.cpp way: the name before any split suffix, its quantization tag
    (upper-cased, "" when none), and its place in a split model (index 1 of count 1 when not split)."""

    path: str
    prefix: str
    tag: str
    index: int
    count: int


def gguf_part(path: str) -> GGUFPart | None:
    """How llama.cpp reads the GGUF file name `path` (None when it is not a .gguf file)."""
    if not path.lower().endswith(".gguf"):
        return None
    prefix, index, count = path[:-len(".gguf")], 1, 1
    split = _SPLIT.fullmatch(prefix)
    if split is not None:
        prefix, index, count = split[1], int(split[2]), int(split[3])
    tag = _TAG.search(prefix)
    return GGUFPart(path, prefix, tag[1].upper() if tag else "", index, count)


def split_file_name(prefix: str, index: int, count: int) -> str:
    """The name of the `index`th (from 1) of `count` files of a split model (llama.cpp's `llama_split_path`)."""
    return f"{prefix}-{index:05d}-of-{count:05d}.gguf"


def is_model_file(path: str) -> bool:
    """A .gguf file that holds a model, not a sidecar (a vision projector, an importance matrix, a draft head)."""
    name = path.rsplit("/", 1)[-1]
    return name.lower().endswith(".gguf") and not any(marker in name for marker in _SIDECARS)


def gguf_models(files: Iterable[str]) -> list[GGUFPart]:
    """The GGUF models among `files`: their unsplit files and first parts, by path."""
    parts = (gguf_part(f) for f in sorted(files) if is_model_file(f))
    return [p for p in parts if p is not None and p.index == 1]


def _matches(path: str, quant: str) -> bool:
    # llama.cpp looks for the tag followed by "." or "-"; preceded by no letter or digit here as well, so that F16
    # does not pick a BF16 file
    return re.search(r"(?<![A-Za-z0-9])" + re.escape(quant) + "[.-]", path, re.IGNORECASE) is not None


def select_gguf(files: Iterable[str], quant: str | None) -> list[str]:
    """The files (all parts of a split one, in order) of the GGUF model `quant` picks among `files`; [] when none."""
    files = sorted(files)
    primaries = gguf_models(files)
    chosen = None
    for tag in (quant,) if quant is not None else DEFAULT_QUANTS:
        chosen = next((p for p in primaries if _matches(p.path, tag)), None)
        if chosen is not None:
            break
    if chosen is None and quant is None and primaries:
        chosen = primaries[0]
    if chosen is None:
        return []
    if chosen.count == 1:
        return [chosen.path]
    return [f for f in files
            if (part := gguf_part(f)) is not None and (part.prefix, part.count) == (chosen.prefix, chosen.count)]


def gguf_quants(files: Iterable[str]) -> list[str]:
    """The quantization tags of the GGUF models among `files` (their names' tags), for messages and listings."""
    return list(dict.fromkeys(p.tag for p in gguf_models(files) if p.tag))


def safetensors_files(files: Iterable[str], shards: Iterable[str] | None = None) -> list[str]:
    """What to fetch of a safetensors repo: its config, tokenizer and template files and its weights, as the engine
    reads them (engine/weights/safetensors.py: the shards `model.safetensors.index.json` names, passed as `shards`
    once the index is read; without an index every top-level .safetensors file); [] when it has no config.json or
    no top-level weights."""
    files = sorted(files)
    weights = sorted(set(shards)) if shards is not None else [f for f in files if "/" not in f and
                                                                  f.endswith(".safetensors")]
    if not weights or CONFIG_FILE not in files:
        return []
    return [f for f in files if f in SAFETENSORS_FILES or _POOLING_CONFIG.fullmatch(f)] + weights


def has_torch_bin(files: Iterable[str]) -> bool:
    """Whether the repo holds PyTorch pickle weights (pytorch_model.bin and its shards)."""
    return any(f.endswith(".bin") and "/" not in f and f.startswith("pytorch_model") for f in files)


def hub_name(source: str) -> HubName | None:
    """The Hub name `source` spells when it is no existing path (a local `models/x.gguf` stays a path)."""
    return None if Path(source).exists() else parse_hub_name(source)
