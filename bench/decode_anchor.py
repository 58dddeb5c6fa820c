"""The anchor of bench/gpu.py: a bare PyTorch decode loop for a `synthetic_model.Shape`, one CUDA graph per step.

No engine code: fused qkv and gate/up projections, SDPA over a preallocated contiguous cache [B, kv_heads,
max_len, head_dim] per layer (a KV head's query heads stacked as its queries; a mask hides the unwritten and, on
sliding layers, the out-of-window positions), greedy argmax fed back as the next input, the position advanced on
the device. On CUDA one step is captured in a `torch.cuda.CUDAGraph` and replayed; on CPU (the smoke run) it runs
eagerly. What a hand-written loop with no
scheduler, no paging and no Python per layer reaches on this GPU, the bar our engine's steps are read against.
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from synthetic_model import Shape, layer_is_sliding

DTYPE = torch.bfloat16


class DecodeAnchor:
    """Random weights of `shape` on `device` and a cache for up to `max_batch` rows of `max_len` positions."""

    def __init__(self, shape: Shape, device: torch.device, max_batch: int, max_len: int, seed: int = 0) -> None:
        # a multiple of 16: the mask's rows stay aligned for SDPA's fused kernels
        self.shape, self.device, self.max_len = shape, device, -(-max_len // 16) * 16
        gen = torch.Generator(device=device).manual_seed(seed)
        h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

        def w(rows: int, cols: int) -> torch.Tensor:
            return torch.randn((rows, cols), generator=gen, device=device, dtype=DTYPE).mul_(cols ** -0.5)

        self.embed = w(shape.vocab, h).mul_(0.02 * math.sqrt(h))  # tied: the LM head too
        self.layers = [dict(qkv=w(q + 2 * kv, h), o=w(h, q).mul_(0.3), gate_up=w(2 * shape.ffn, h),
                            down=w(h, shape.ffn).mul_(0.3)) for _ in range(shape.layers)]
        self.norm = torch.ones(h, device=device, dtype=DTYPE)
        self.head_norm = torch.ones(shape.head_dim, device=device, dtype=DTYPE)
        cache = (max_batch, shape.kv_heads, self.max_len, shape.head_dim)
        self.k_cache = [torch.zeros(cache, device=device, dtype=DTYPE) for _ in range(shape.layers)]
        self.v_cache = [torch.zeros(cache, device=device, dtype=DTYPE) for _ in range(shape.layers)]
        self.sliding = layer_is_sliding(shape)
        self.rope = {False: self._rope_table(shape.rope_theta), True: self._rope_table(10000.0)}
        self.scale = shape.head_dim ** -0.5

    def _rope_table(self, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.shape.head_dim
        inv = 1.0 / theta ** (torch.arange(0, d, 2, device=self.device).float() / d)
        angles = torch.arange(self.max_len, device=self.device).float()[:, None] * inv
        return torch.cat((angles.cos(),) * 2, -1).to(DTYPE), torch.cat((-angles.sin(), angles.sin()), -1).to(DTYPE)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, 1e-6)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Next tokens [B] (greedy) after `tokens` [B] at position `pos` (a 0-d device tensor, the same for all)."""
        s, b = self.shape, tokens.shape[0]
        nq, nkv = s.heads, s.kv_heads
        x = self.embed[tokens]
        if s.gemma:
            x = x * math.sqrt(s.hidden)
        key_pos = torch.arange(self.max_len, device=self.device).view(1, 1, 1, -1)  # [B, H, 1, max_len] broadcast
        visible = key_pos <= pos
        windowed = visible & (key_pos > pos - s.sliding_window) if s.sliding_window else visible
        for i, layer in enumerate(self.layers):
            h = self._rms(x, self.norm)
            qkv = (h @ layer["qkv"].T).view(b, nq + 2 * nkv, s.head_dim)
            qk, v = qkv[:, :nq + nkv], qkv[:, nq + nkv:]
            if s.qk_norm:
                qk = self._rms(qk, self.head_norm)
            cos, sin = (t.index_select(0, pos.view(1)) for t in self.rope[self.sliding[i]])  # no host sync
            qk = qk * cos + torch.roll(qk, s.head_dim // 2, dims=-1) * sin
            self.k_cache[i][:b].index_copy_(2, pos.view(1), qk[:, nq:].unsqueeze(2))
            self.v_cache[i][:b].index_copy_(2, pos.view(1), v.unsqueeze(2))
            mask = windowed if self.sliding[i] else visible
            # The query heads of a KV head as that head's "query positions": one SDPA over the cache as it is,
            # no GQA head expansion (each copies the whole cache, every step).
            q = qk[:, :nq].reshape(b, nkv, nq // nkv, s.head_dim)
            o = F.scaled_dot_product_attention(q, self.k_cache[i][:b], self.v_cache[i][:b], attn_mask=mask,
                                               scale=self.scale)
            o = o.reshape(b, nq * s.head_dim) @ layer["o"].T
            x = x + (self._rms(o, self.norm) if s.gemma else o)
            h = self._rms(x, self.norm)
            gate, up = (h @ layer["gate_up"].T).chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") if s.gemma else F.silu(gate)
            m = (act * up) @ layer["down"].T
            x = x + (self._rms(m, self.norm) if s.gemma else m)
        logits = self._rms(x, self.norm) @ self.embed.T
        return logits.argmax(dim=-1)


def measure(anchor: DecodeAnchor, batch: int, start: int, steps: int) -> dict[str, float | int | str]:
    """Decode `steps` tokens for `batch` rows from position `start`: ms per step and tokens/s."""
    tokens = torch.randint(3, anchor.shape.vocab, (batch,), device=anchor.device)
    pos = torch.tensor(start, device=anchor.device)

    def step() -> None:
        tokens.copy_(anchor.forward(tokens, pos))
        pos.add_(1)

    cuda = anchor.device.type == "cuda"
    if cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream, as torch's CUDA-graph notes advise
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
        pos.fill_(start)
        torch.cuda.synchronize()
    else:
        run = step
        for _ in range(3):
            step()
        pos.fill_(start)
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return {"batch": batch, "mode": "cuda_graph" if cuda else "eager", "steps": steps,
            "ms_per_step": round(1000 * elapsed / steps, 3), "tokens_per_s": round(batch * steps / elapsed, 1)}
