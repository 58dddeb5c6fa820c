"""Named generation presets: documented sampling profiles a server (`--preset`), a request (`"preset"`) or a
`Generator` names instead of spelling out temperature, top-p/top-k/min-p, repetition penalty and max_tokens.

Precedence, per field (`OpenAIServing.sampling_params` and `.completion_budget` apply it, in one place): what the
request sets itself, then the request's preset, then the server's preset, then the model's own generation
defaults (engine/registry.py, generation_config.json), then the neutral value (temperature 1, no truncation, no
penalty). A preset's `max_tokens` is a default budget, clipped to what the context leaves after the prompt.

Each preset also names the model the registry recommends for its tier (and its approximate memory), always a
chat-tuned one; that is advice shown by `emberserve presets`: a preset never changes which model is served.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from engine.registry import KNOWN_MODELS, KnownModel

# The request and settings fields a preset fills (the sampling ones, then the budget).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class Preset:
    """One named profile: sampling values, a default completion budget and the model recommended for it."""

    name: str
    description: str
    temperature: float
    top_p: float
    top_k: int          # 0: off
    min_p: float        # 0: off
    repetition_penalty: float  # 1: off
    max_tokens: int
    model: str          # a chat-tuned model's name in engine.registry.KNOWN_MODELS (a base model does not chat)

    def sampling(self) -> dict[str, float | int]:
        """The sampling fields, as the request schema names them."""
        values = asdict(self)
        return {name: values[name] for name in SAMPLING_FIELDS}

    @property
    def recommended(self) -> KnownModel:
        return KNOWN_MODELS[self.model]


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("fast", "short answers from the smallest model: light nucleus and top-k truncation, no penalty",
           temperature=0.7, top_p=0.9, top_k=40, min_p=0.0, repetition_penalty=1.0, max_tokens=256,
           model="smollm2-135m"),
    Preset("balanced", "general chat: moderate temperature, min-p cuts the long tail, a light repetition penalty",
           temperature=0.7, top_p=0.95, top_k=0, min_p=0.05, repetition_penalty=1.05, max_tokens=512,
           model="smollm2-135m"),
    Preset("quality", "careful answers: cooler sampling, top-k 20, longer budget",
           temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, repetition_penalty=1.05, max_tokens=1024,
           model="smollm2-135m"),
    Preset("creative", "stories and brainstorming: full temperature, wide nucleus, min-p against nonsense, a "
                       "stronger repetition penalty",
           temperature=1.0, top_p=0.95, top_k=64, min_p=0.05, repetition_penalty=1.1, max_tokens=1024,
           model="smollm2-135m"),
    Preset("code", "code: low temperature and no repetition penalty (code repeats its identifiers on purpose)",
           temperature=0.2, top_p=0.95, top_k=0, min_p=0.0, repetition_penalty=1.0, max_tokens=1024,
           model="smollm2-135m"),
    Preset("precise", "extraction, classification, tests: greedy decoding, reproducible outputs",
           temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, max_tokens=512,
           model="smollm2-135m"),
)}

# The type of a preset name in requests and settings: pydantic refuses any other, listing these.
PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]


def get_preset(name: str) -> Preset:
    """The preset called `name`; ValueError listing the known ones otherwise."""
    preset = PRESETS.get(name)
    if preset is None:
        raise ValueError(f"unknown preset {name!r}; the presets are {', '.join(PRESETS)}")
    return preset


def layered_defaults(model_defaults: dict[str, Any], *presets: Preset | None) -> dict[str, Any]:
    """The defaults for fields a request leaves out: the model's, each preset in turn over them (last wins)."""
    out = dict(model_defaults)
    for preset in presets:
        if preset is not None:
            out |= preset.sampling() | {"max_tokens": preset.max_tokens}
    return out


def _memory(model: KnownModel) -> str:
    return f"~{model.memory_mib} MiB" if model.memory_mib else "?"


def presets_table() -> str:
    """The Markdown table of the presets (kept in the README; `emberserve presets` prints the same rows)."""
    rows = ["| preset | temperature | top_p | top_k | min_p | repetition_penalty | max_tokens | recommended model "
            "(memory) | for |", "|---|---|---|---|---|---|---|---|---|"]
    for p in PRESETS.values():
        rows.append(f"| `{p.name}` | {p.temperature:g} | {p.top_p:g} | {p.top_k} | {p.min_p:g} | "
                    f"{p.repetition_penalty:g} | {p.max_tokens} | `{p.model}` ({_memory(p.recommended)}) | "
                    f"{p.description} |")
    return "\n".join(rows)


def presets_text() -> str:
    """The presets as aligned plain text, for the terminal."""
    lines = [f"{'preset':<9} {'temp':>4} {'top_p':>5} {'top_k':>5} {'min_p':>5} {'rep':>4} {'max':>5}  "
             f"recommended model"]
    for p in PRESETS.values():
        model = p.recommended
        state = "" if model.installed() else f" (not installed: {model.install})"
        lines.append(f"{p.name:<9} {p.temperature:>4g} {p.top_p:>5g} {p.top_k:>5} {p.min_p:>5g} "
                     f"{p.repetition_penalty:>4g} {p.max_tokens:>5}  {p.model} {_memory(model)}{state}")
        lines.append(f"{'':<9} {p.description}")
    return "\n".join(lines)
