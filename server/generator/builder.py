"""`GeneratorBuilder`: the fluent set-up of a `Generator` — the model, where it runs, its default generation values.

The builder collects two things: server settings (`Settings`, server/settings.py: the model, the device, the
preset, prefix caching, any other setting through `.setting(name, value)`), which load the model exactly as
`emberserve serve` would; and the generator's own generation values (`GenerationConfig`), which every call starts
from. Values set explicitly (`.temperature(...)`, a call's overrides) win over a preset, as a request's fields win
over its preset on the HTTP API. The `EMBERSERVE_*` variables apply as they do for the server.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from engine import KNOWN_MODELS, ModelFormatError
from engine.weights import no_progress

from server.api.app import _in_own_thread, _load, _stop_workers
from server.generator.generator import GenerationConfig, Generator, generation_request
from server.config.model_catalog import is_generator_model
from server.config.presets import get_preset
from server.config.settings import Settings, env_name, flag_name

if TYPE_CHECKING:
    from server.generator.sync import SyncGenerator


class GeneratorBuilder:
    """`Generator.builder(model)`: chain the set-up calls, then `await .build()` (or `.build_sync()`)."""

    def __init__(self, model: str) -> None:
        self._settings: dict[str, Any] = {"model": model}
        self._config: dict[str, Any] = {}
        self._quiet = False
        self._offline = False

    # ---- where it runs ----
    def device(self, device: str) -> GeneratorBuilder:
        """Any torch device: cpu, cuda, cuda:1, ..."""
        return self.setting("device", device)

    def cpu(self) -> GeneratorBuilder:
        return self.device("cpu")

    def gpu(self, index: int | None = None) -> GeneratorBuilder:
        """The (first, or `index`th) CUDA GPU."""
        return self.device("cuda" if index is None else f"cuda:{index}")

    def model_path(self, path: str | Path) -> GeneratorBuilder:
        """Load the weights from a .gguf file or a safetensors directory; the builder's name stays the model's
        name (`Generator.model_name`)."""
        self._settings.setdefault("served_model_name", self._settings["model"])
        return self.setting("model", str(path))

    def prefix_cache(self, enabled: bool = True) -> GeneratorBuilder:
        """Reuse the KV cache of prompt prefixes seen before (on by default)."""
        return self.setting("prefix_caching", enabled)

    def draft(self, name: str, num_tokens: int) -> GeneratorBuilder:
        """Speculative decoding with a draft model of the same vocabulary (a name, a path, or `self-int4` /
        `self-int8`: this model quantized) proposing up to `num_tokens` tokens a step."""
        return self.setting("draft_model", name).setting("num_speculative_tokens", num_tokens)

    def offline(self) -> GeneratorBuilder:
        """Never fetch anything. emberserve never downloads weights (they come from installed packages or local
        paths), so this only makes `build()` refuse at once a model that is not installed or not found."""
        self._offline = True
        return self

    def quiet(self) -> GeneratorBuilder:
        """No load progress bar on stderr."""
        self._quiet = True
        return self

    def setting(self, name: str, value: Any) -> GeneratorBuilder:
        """Any server setting by its Settings field name (`max_running`, `quant`, `kv_cache_memory`, ...)."""
        if name not in Settings.model_fields:
            raise ValueError(f"unknown setting {name!r}; the settings are {', '.join(Settings.model_fields)}")
        self._settings[name] = value
        return self

    # ---- generation values ----
    def temperature(self, value: float) -> GeneratorBuilder:
        return self._value("temperature", value)

    def top_p(self, value: float) -> GeneratorBuilder:
        return self._value("top_p", value)

    def top_k(self, value: int) -> GeneratorBuilder:
        return self._value("top_k", value)

    def min_p(self, value: float) -> GeneratorBuilder:
        return self._value("min_p", value)

    def repetition_penalty(self, value: float) -> GeneratorBuilder:
        return self._value("repetition_penalty", value)

    def max_tokens(self, value: int) -> GeneratorBuilder:
        return self._value("max_tokens", value)

    def seed(self, value: int) -> GeneratorBuilder:
        return self._value("seed", value)

    def greedy(self) -> GeneratorBuilder:
        """Always the most likely token (temperature 0)."""
        return self.temperature(0.0)

    def preset(self, name: str) -> GeneratorBuilder:
        """Start every call from a preset's values (server/presets.py; a call may name another)."""
        return self.setting("preset", get_preset(name).name)

    def creative(self) -> GeneratorBuilder:
        return self.preset("creative")

    def precise(self) -> GeneratorBuilder:
        return self.preset("precise")

    def _value(self, name: str, value: Any) -> GeneratorBuilder:
        self._config[name] = value
        return self

    # ---- building ----
    def settings(self) -> Settings:
        """The server settings collected so far, validated (ValueError naming the setting otherwise)."""
        try:
            return Settings(**self._settings)
        except ValidationError as e:
            err = e.errors()[0]
            name = str(err["loc"][0]) if err["loc"] else "settings"
            raise ValueError(f"{name} ({flag_name(name)} / {env_name(name)}): {err['msg']}") from None

    async def build(self) -> Generator:
        """Load the model (on a thread of its own, as the server does) and start its worker."""
        settings = self.settings()
        config = GenerationConfig.of(self._config)
        generation_request(settings.model, "", config)  # the values are a valid request, or this raises now
        if settings.model in KNOWN_MODELS and not is_generator_model(settings.model):
            raise ValueError(f"{settings.model} is an encoder: it embeds, it does not generate")
        if self._offline:
            _check_local(settings.model)
        progress = no_progress if self._quiet else None
        state = await _in_own_thread(lambda: _load(settings, progress=progress, prepare_grammars=False),
                                     _stop_workers)
        return Generator(state, config)

    def build_sync(self) -> SyncGenerator:
        """A `SyncGenerator`: the same generator for scripts, run on an event loop thread of its own."""
        from server.generator.sync import SyncGenerator

        return SyncGenerator(self)


def _check_local(model: str) -> None:
    """Refuse a model that would need anything fetched: a known one not installed, or a path that is missing."""
    known = KNOWN_MODELS.get(model)
    if known is not None:
        known.path()  # ModelNotInstalledError with the install command
    elif not Path(model).exists():
        raise ModelFormatError(f"model not found: {model!r} is neither a known model name "
                               f"({', '.join(KNOWN_MODELS)}) nor an existing path")
