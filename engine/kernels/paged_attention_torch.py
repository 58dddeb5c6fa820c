"""Paged attention in plain torch: the fallback `engine.kernels.paged_attention` runs without Triton, and the reference.

`decode` and `prefill` are the fallback: batched float32 maths over keys gathered through the block tables (a
copy, unlike the kernels). `decode` stays on the device (lengths are masks, no host sync); `prefill` reads the
row lengths on the host once and loops over rows. `reference_decode` and `reference_prefill` are the
straightforward definition the tests check both against: row by row, in float64.

Every call takes optional attention sinks [H] (gpt-oss): a logit per query head that joins the head's every softmax
and has no value (softmax over [scores, sink], the sink's share dropped).
"""
from __future__ import annotations

import torch


def _slots(table: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Cache slots of positions 0..length-1 of a row with block table `table` [W] (or [B, W] → [B, length])."""
    pos = torch.arange(length, device=table.device)
    return table.long()[..., pos // block_size] * block_size + pos % block_size


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension, with each row's sink (`sinks` broadcast to scores[..., :1]) if given."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


def decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, block_size: int, scale: float, window: int = 0,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] at positions seq_lens - 1 → [B, H, D] in q's dtype; padding rows (seq_len 0) give zeros."""
    b, h, d = q.shape
    kvh = keys.shape[0]
    span = block_tables.shape[1] * block_size
    slots = _slots(block_tables, block_size, span)                     # [B, span]
    k = keys[:, slots].float().transpose(0, 1)                          # [B, kvh, span, D]
    v = values[:, slots].float().transpose(0, 1)
    scores = q.float().view(b, kvh, h // kvh, d) @ k.transpose(-1, -2) * scale  # [B, kvh, G, span]
    pos = torch.arange(span, device=q.device)
    lens = seq_lens.long().unsqueeze(1)
    visible = pos < lens
    if window > 0:
        visible &= pos >= lens - window
    scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
    head_sinks = None if sinks is None else sinks.view(kvh, h // kvh, 1)
    probs = _softmax(scores, head_sinks).nan_to_num_(0.0)               # all-masked (padding) rows: zeros
    return (probs @ v).view(b, h, d).to(q.dtype)


def prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, query_lens: torch.Tensor, query_starts: torch.Tensor, block_size: int,
            scale: float, window: int, out: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
    """Causal attention of each row's packed queries over its cached keys, written into `out` [T, H, D]."""
    h, d = q.shape[1], q.shape[2]
    kvh = keys.shape[0]
    for r, (length, n, start) in enumerate(zip(seq_lens.tolist(), query_lens.tolist(), query_starts.tolist())):
        if n == 0:
            continue
        slots = _slots(block_tables[r], block_size, length)
        k, v = keys[:, slots].float(), values[:, slots].float()           # [kvh, L, D]
        qr = q[start:start + n].float().transpose(0, 1).reshape(kvh, h // kvh * n, d)  # head-major rows
        scores = (qr @ k.transpose(-1, -2) * scale).view(kvh, h // kvh, n, length)
        q_pos = torch.arange(length - n, length, device=q.device).unsqueeze(1)
        key_pos = torch.arange(length, device=q.device)
        visible = key_pos <= q_pos
        if window > 0:
            visible &= key_pos > q_pos - window
        probs = _softmax(scores.masked_fill(~visible, float("-inf")),
                         None if sinks is None else sinks.view(kvh, h // kvh, 1, 1))
        o = probs.reshape(kvh, -1, length) @ v                           # [kvh, G * n, D]
        out[start:start + n] = o.view(h, n, d).transpose(0, 1).to(out.dtype)


def _reference_row(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                   block_size: int, scale: float, window: int, length: int, first: int,
                   sinks: torch.Tensor | None) -> torch.Tensor:
    """q [n, H, D] at positions first..first+n-1 over a row's keys 0..length-1 (CPU tensors) → [n, H, D] float64;
    with `sinks` [H], each head's softmax over its scores and its sink, the sink's share dropped."""
    n, group = q.shape[0], q.shape[1] // keys.shape[0]
    pos = torch.arange(length)
    slots = table.long()[pos // block_size] * block_size + pos % block_size
    k = keys[:, slots].double().repeat_interleave(group, dim=0)  # [H, length, D]: query head h reads KV head h // G
    v = values[:, slots].double().repeat_interleave(group, dim=0)
    q_pos = torch.arange(first, first + n).unsqueeze(1)
    visible = pos <= q_pos                                       # [n, length]
    if window > 0:
        visible &= pos > q_pos - window
    scores = torch.einsum("nhd,hld->hnl", q.double(), k) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # [H, n, length + 1]: the sink a last key of every query
        sink = sinks.double().view(-1, 1, 1).expand(-1, n, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :length]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hnl,hld->nhd", probs, v)


def reference_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, block_size: int, scale: float, window: int = 0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The definition of `paged_decode_attention`: float64 [B, H, D] on the CPU (zeros for seq_len 0)."""
    q, keys, values, block_tables = q.cpu(), keys.cpu(), values.cpu(), block_tables.cpu()
    sinks = None if sinks is None else sinks.cpu()
    rows = [_reference_row(q[r:r + 1], keys, values, block_tables[r], block_size, scale, window, n, n - 1, sinks)
            if n > 0 else torch.zeros((1, *q.shape[1:]), dtype=torch.float64)
            for r, n in enumerate(seq_lens.tolist())]
    return torch.cat(rows)


def reference_prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_lens: torch.Tensor, query_starts: torch.Tensor,
                      block_size: int, scale: float, window: int = 0,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The definition of `paged_prefill_attention`: float64 [T, H, D] on the CPU (zeros for unclaimed tokens)."""
    q, keys, values, block_tables = q.cpu(), keys.cpu(), values.cpu(), block_tables.cpu()
    sinks = None if sinks is None else sinks.cpu()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r, (length, n, start) in enumerate(zip(seq_lens.tolist(), query_lens.tolist(), query_starts.tolist())):
        if n:
            out[start:start + n] = _reference_row(q[start:start + n], keys, values, block_tables[r], block_size,
                                                  scale, window, length, length - n, sinks)
    return out
