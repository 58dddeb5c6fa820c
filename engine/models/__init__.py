"""One decoder per family, built from the shared blocks in `engine.layers`; the BERT encoder for embeddings."""
from __future__ import annotations

from ..config import ModelConfig
from .base import DecoderModel
from .bert import BertEncoder
from .gemma3 import Gemma3Block
from .llama import LlamaBlock

_BLOCKS = {"llama": LlamaBlock, "qwen2": LlamaBlock, "qwen3": LlamaBlock, "gemma3": Gemma3Block}


def build_model(cfg: ModelConfig) -> DecoderModel:
    """An uninitialised decoder of the config's family (weights are loaded into it afterwards)."""
    return DecoderModel(cfg, _BLOCKS[cfg.family])


__all__ = ["BertEncoder", "DecoderModel", "build_model"]
