"""One decoder per family, built from the shared blocks in `engine.model.layers`; the BERT encoder for embeddings."""
from __future__ import annotations

from engine.config import MOE_FAMILIES, ModelConfig
from engine.model.decoder import DecoderModel
from engine.model.bert import BertEncoder
from engine.model.gemma3 import Gemma3Block
from engine.model.llama import LlamaBlock

_BLOCKS = {"llama": LlamaBlock, "qwen2": LlamaBlock, "qwen3": LlamaBlock, "gemma3": Gemma3Block,
           **{family: LlamaBlock for family in MOE_FAMILIES}}


def build_model(cfg: ModelConfig) -> DecoderModel:
    """An uninitialised decoder of the config's family (weights are loaded into it afterwards)."""
    return DecoderModel(cfg, _BLOCKS[cfg.family])


__all__ = ["BertEncoder", "DecoderModel", "build_model"]
