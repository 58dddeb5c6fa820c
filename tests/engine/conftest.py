"""Session-wide tiny models (tests/support/tiny_models.py), built once per test session in a tmp dir."""

from pathlib import Path

import pytest

from tests.support import tiny_models


class TinyZoo:
    """Builds each variant, each GGUF copy and each quantized reference model on first use."""

    def __init__(self, root: Path):
        self.root = root
        self._models = {}
        self._ggufs = {}
        self._refs = {}

    def model(self, variant: str) -> "tiny_models.TinyModel":
        if variant not in self._models:
            self._models[variant] = tiny_models.build_tiny_model(variant, self.root)
            self._ggufs[variant, "F32"] = self._models[variant].gguf_path
        return self._models[variant]

    def gguf(self, variant: str, gguf_type: str = "F32") -> Path:
        tiny = self.model(variant)
        if (variant, gguf_type) not in self._ggufs:
            self._ggufs[variant, gguf_type] = tiny_models.write_gguf(tiny, gguf_type)
        return self._ggufs[variant, gguf_type]

    def reference(self, variant: str, gguf_type: str = "F32"):
        """The HF model holding exactly the weights of the `gguf_type` copy."""
        if (variant, gguf_type) not in self._refs:
            self._refs[variant, gguf_type] = tiny_models.reference_model(self.model(variant), gguf_type)
        return self._refs[variant, gguf_type]


@pytest.fixture(scope="session")
def tiny_zoo(tmp_path_factory) -> TinyZoo:
    return TinyZoo(tmp_path_factory.mktemp("tiny_models"))
