"""Load a Hugging Face safetensors directory: config.json, one or many shards, renamed to the decoder's names
(an encoder's tensors keep their Hugging Face names: engine/model/bert.py maps them)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.config import EncoderConfig, ModelConfig, config_from_hf
from engine.errors import ModelFormatError
from engine.weights import Progress, no_progress
from engine.weights.experts import stack_experts
from engine.weights.safetensors_files import shard_files

# Checkpoints nest the model under different prefixes (plain, multimodal gemma3, BERT with task heads).
_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "bert.")
_SKIPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                     # BERT's pooler and pre-training heads: sentence embeddings pool the last hidden states
                     "pooler.", "bert.pooler.", "cls.")
_SKIPPED_SUFFIXES = ("position_ids",)  # BERT's position index buffer (0..max-1), not a weight


def _param_name(name: str) -> str | None:
    if name.startswith(_SKIPPED_PREFIXES) or name.endswith(_SKIPPED_SUFFIXES):
        return None
    if name == "lm_head.weight" or name.startswith("language_model.lm_head."):
        return "lm_head.weight"
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def load_safetensors_dir(directory: str | Path, progress: Progress = no_progress
                         ) -> tuple[ModelConfig | EncoderConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, state dict in the decoder's names, the raw config.json).

    Tensors keep the checkpoint's dtype (a 30B bfloat16 mixture of experts would double in float32); the loader
    converts each to the compute dtype as it places it. Experts are stacked per projection (engine/weights/experts.py).
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelFormatError(f"{directory}: not a model directory (no config.json)")
    raw_cfg = json.loads(config_path.read_text())
    cfg = config_from_hf(raw_cfg)
    state: dict[str, torch.Tensor] = {}
    files = shard_files(directory)
    for done, file in enumerate(files, 1):
        try:
            with safe_open(str(file), framework="pt") as f:
                names = list(f.keys())
                for i, name in enumerate(names, 1):
                    progress(f"reading shard {done}/{len(files)}", i, len(names))
                    param = _param_name(name)
                    if param is not None:
                        state[param] = f.get_tensor(name)
        except (OSError, ValueError, RuntimeError) as e:  # safetensors reports truncation as a generic error
            raise ModelFormatError(f"{file}: cannot read safetensors file: {e}") from None
    if cfg.family == "gemma3":  # gemma stores norm weights as w and multiplies by (1 + w)
        for name in state:
            if name.endswith("norm.weight"):
                state[name] = state[name].float() + 1.0
    if isinstance(cfg, ModelConfig):
        stack_experts(state, cfg)
    return cfg, state, raw_cfg
