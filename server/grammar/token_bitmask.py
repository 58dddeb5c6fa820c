"""Packed token bitmasks: one bit per vocabulary token, 32 to an int32 word, as grammar engines fill them.

Token t is allowed when bit t % 32 of word t // 32 is set. The words are little-endian, so viewed as bytes, token
t is bit t % 8 of byte t // 8: unpacking goes through a 256-entry table of each byte's 8 bits, one row gather per
byte, on the device of the logits (only the packed words travel there, 32 times fewer bytes than a dense mask).

Applying a mask takes the elementwise minimum of the logits and a bound that is +inf for allowed tokens and -inf
for forbidden ones, in float arithmetic: on CPU boolean kernels (a bool mask, masked_fill) are several times
slower (bench/RESULTS.md#issue-32-bitmask-float-mask).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["allocate_bitmask", "allowed_tokens", "apply_token_bitmask", "bitmask_words", "unpack_bitmask"]

_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask [rows, words] with every token allowed (grammar engines fill rows on the CPU)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def _byte_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8] of `dtype`: +inf where bit j of byte value i is set, else -inf."""
    table = _TABLES.get((device, dtype))
    if table is None:
        values = torch.arange(256, dtype=torch.int32)[:, None]
        bits = (values >> torch.arange(8, dtype=torch.int32)) & 1
        table = torch.where(bits == 1, math.inf, -math.inf).to(device=device, dtype=dtype)
        _TABLES[(device, dtype)] = table
    return table


def _bounds(bitmask: torch.Tensor, vocab_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[rows, vocab_size]: +inf for the allowed tokens, -inf for the others."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be a 2-D int32 tensor, got {bitmask.dtype} {list(bitmask.shape)}")
    if bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(f"bitmask of {bitmask.shape[1]} words covers {bitmask.shape[1] * 32} tokens, "
                         f"fewer than the vocabulary's {vocab_size}")
    packed = bitmask.contiguous().to(device, non_blocking=True).view(torch.uint8).flatten()  # little-endian bytes
    bounds = _byte_table(device, dtype).index_select(0, packed.long())  # [rows * 4 * words, 8]
    return bounds.view(bitmask.shape[0], -1)[:, :vocab_size]


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The dense bool mask [rows, vocab_size] (True: allowed) of a packed int32 bitmask [rows, words]."""
    device = torch.device(device) if device is not None else bitmask.device
    return _bounds(bitmask, vocab_size, device, torch.float32) > 0


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """Set to -inf, in place, the logits [B, V] of the tokens that `bitmask` [R, words] forbids in rows `rows` (R
    row indices of `logits`, distinct; None: every row, R == B). Rows not listed are left as they are; a NaN
    logit stays NaN (the sampler counts NaN as -inf)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got {list(logits.shape)}")
    rows = list(range(logits.shape[0])) if rows is None else list(rows)
    if len(rows) != bitmask.shape[0]:
        raise ValueError(f"{len(rows)} rows for a bitmask of {bitmask.shape[0]} rows")
    if not rows:
        return
    bounds = _bounds(bitmask, logits.shape[1], logits.device, logits.dtype)
    if rows == list(range(logits.shape[0])):
        torch.minimum(logits, bounds, out=logits)
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits.index_copy_(0, index, torch.minimum(logits.index_select(0, index), bounds))


def allowed_tokens(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    """The token ids row `row` of `bitmask` allows, ascending."""
    return unpack_bitmask(bitmask[row:row + 1], vocab_size)[0].nonzero()[:, 0].tolist()
