"""Sentence embeddings from hidden states: mean, last-token or first-token ([CLS]) pooling, then L2 normalisation.

Mean pooling and the normalisation are what sentence-transformers' Pooling and Normalize modules compute; last-token
pooling is what llama-server's `--pooling last` takes from a decoder. The pooling a sentence-transformers model was
trained with is read from its own config (`1_Pooling/config.json`).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

POOLING_MODES = ("mean", "last", "cls")
# sentence-transformers' pooling config keys, in the order it checks them.
_ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}


def pool(hidden: torch.Tensor, lengths: Sequence[int], mode: str) -> torch.Tensor:
    """Unit-length float32 embeddings [B, dim] of B sequences whose hidden states lie one after the other in
    `hidden` [sum(lengths), dim]: the mean of each sequence's states, its last one, or its first one."""
    if mode not in POOLING_MODES:
        raise ValueError(f"unknown pooling {mode!r}; use one of {', '.join(POOLING_MODES)}")
    if not lengths or min(lengths) < 1:
        raise ValueError("every sequence needs at least one token")
    if sum(lengths) != hidden.shape[0]:
        raise ValueError(f"{hidden.shape[0]} hidden states for sequences of {sum(lengths)} tokens")
    hidden = hidden.float()
    counts = torch.tensor(list(lengths), device=hidden.device)
    ends = counts.cumsum(0)
    if mode == "last":
        pooled = hidden.index_select(0, ends - 1)
    elif mode == "cls":
        pooled = hidden.index_select(0, ends - counts)
    else:
        owner = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), counts)
        sums = hidden.new_zeros(len(lengths), hidden.shape[1]).index_add_(0, owner, hidden)
        pooled = sums / counts.unsqueeze(1).to(hidden.dtype)
    return F.normalize(pooled, p=2.0, dim=1)


def sentence_transformers_pooling(directory: Path) -> str | None:
    """The pooling a sentence-transformers model directory declares (its Pooling module's config), or None."""
    modules = directory / "modules.json"
    if not modules.is_file():
        return None
    for module in json.loads(modules.read_text()):
        if str(module.get("type", "")).endswith("Pooling"):
            config = directory / module.get("path", "") / "config.json"
            settings = json.loads(config.read_text()) if config.is_file() else {}
            mode = settings.get("pooling_mode")  # newer sentence-transformers write the mode by name
            if mode in ("mean", "cls", "lasttoken"):
                return "last" if mode == "lasttoken" else mode
            return next((m for key, m in _ST_MODES.items() if settings.get(key)), None)
    return None
