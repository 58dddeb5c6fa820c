"""`ScriptedDecoder`: the decoder layers of a pure decode step as one TorchScript call.

A decode step is some 40 small operator calls per layer. From Python each call costs dispatch overhead, and each
releases and re-takes the GIL, so in a server every step queues behind the event loop's Python again and again
(an 8-row step: 19.5 ms alone, 21-23 ms beside a thread running Python for 0.1-0.4 ms of every 3). TorchScript
runs the same aten operators, built from the same functions the eager modules use (`rms_norm`, `apply_rope`,
`decode_attention`, `gated_activation`, `gather_blocks`, `write_slots`, `window_span`, `int4_matmul`), in its C++
interpreter with the GIL released throughout.
Steps with prefill rows, and non-CPU devices, stay on the eager modules.
"""
# No `from __future__ import annotations`: TorchScript reads the class annotations as types.
import logging
import time
import warnings
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import gather_blocks, window_span, write_slots
from .layers import Attention, GatedMLP, RMSNorm, apply_rope, decode_attention, gated_activation, rms_norm
from .quant import Int4Linear, Int8Linear, int4_matmul

log = logging.getLogger("emberserve.engine")


class ScriptedLinear(nn.Module):
    """The decode-row matmul of an nn.Linear, Int8Linear or Int4Linear, sharing its tensors."""

    bias: Optional[torch.Tensor]

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.out_features = int(linear.out_features)
        self.bias = linear.bias
        self.scale = torch.empty(0)
        self.int4 = self.int8 = False
        if isinstance(linear, Int4Linear):
            self.int4, self.weight, self.scale = True, linear.weight, linear.scale_and_zero
        elif isinstance(linear, Int8Linear):
            self.int8, self.weight, self.scale = True, linear.weight, linear.scale
        elif type(linear) is nn.Linear:
            self.weight = linear.weight
        else:
            raise TypeError(f"no scripted form for {type(linear).__name__}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.int4 or self.int8):  # nn.Linear's own call: bias fused in
            return F.linear(x, self.weight, self.bias)
        if self.int4:
            y = int4_matmul(x, self.weight, self.scale, self.out_features)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scale)
        bias = self.bias
        return y if bias is None else y + bias


class ScriptedNorm(nn.Module):
    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight, self.doubled, self.eps = norm.weight, norm.doubled(), float(norm.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.doubled, self.eps)


class ScriptedLayer(nn.Module):
    """One decoder block (llama/qwen pre-norm, or gemma3's sandwich norms) for decode rows only."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        attn, mlp = block.self_attn, block.mlp
        assert isinstance(attn, Attention) and isinstance(mlp, GatedMLP)
        cfg = attn.cfg
        self.sandwich = hasattr(block, "pre_feedforward_layernorm")
        self.input_norm = ScriptedNorm(block.input_layernorm)
        self.post_attention_norm = ScriptedNorm(block.post_attention_layernorm)
        # For llama-style blocks the second norm is the post-attention one; these two are unused then.
        self.pre_ffw_norm = ScriptedNorm(block.pre_feedforward_layernorm if self.sandwich else block.input_layernorm)
        self.post_ffw_norm = ScriptedNorm(block.post_feedforward_layernorm if self.sandwich else block.input_layernorm)
        self.qk_norm = attn.q_norm is not None
        self.q_norm = ScriptedNorm(attn.q_norm if self.qk_norm else block.input_layernorm)
        self.k_norm = ScriptedNorm(attn.k_norm if self.qk_norm else block.input_layernorm)
        self.qkv, self.o = ScriptedLinear(attn.qkv_proj), ScriptedLinear(attn.o_proj)
        self.gate_up, self.down = ScriptedLinear(mlp.gate_up_proj), ScriptedLinear(mlp.down_proj)
        self.gelu = bool(mlp.gelu)
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = float(cfg.query_scale)
        self.sliding, self.window = bool(attn.sliding), int(cfg.sliding_window or 0)
        self.local_rope = attn.rope == "local"

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, span_first: int, span_length: int,
                  key_blocks: Optional[torch.Tensor], full_mask: Optional[torch.Tensor],
                  sliding_mask: Optional[torch.Tensor], block_size: int) -> torch.Tensor:
        n, h, kvh = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv(x).view(n, h + 2 * kvh, self.head_dim)
        qk, v = qkv[:, :h + kvh], qkv[:, h + kvh:]
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, :h], qk[:, h:]
        write_slots(keys, values, slots, k, v)
        if span_length > 0:  # one row whose keys are consecutive slots, read in place
            first, length = window_span(span_first, span_length, self.window if self.sliding else 0)
            k_all, v_all = keys[:, first:first + length].unsqueeze(0), values[:, first:first + length].unsqueeze(0)
            mask: Optional[torch.Tensor] = None
        else:
            assert key_blocks is not None
            k_all, v_all = gather_blocks(keys, key_blocks, block_size), gather_blocks(values, key_blocks, block_size)
            mask = sliding_mask if self.sliding else full_mask
        o = decode_attention(q, k_all, v_all, mask, kvh, self.scale)
        return self.o(o.reshape(n, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, local_cos: torch.Tensor,
                local_sin: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                span_first: int, span_length: int, key_blocks: Optional[torch.Tensor],
                full_mask: Optional[torch.Tensor], sliding_mask: Optional[torch.Tensor],
                block_size: int) -> torch.Tensor:
        if self.local_rope:
            cos, sin = local_cos, local_sin
        a = self.attention(self.input_norm(x), cos, sin, slots, keys, values, span_first, span_length, key_blocks,
                           full_mask, sliding_mask, block_size)
        if self.sandwich:
            x = x + self.post_attention_norm(a)
            return x + self.post_ffw_norm(self.down(gated_activation(self.gate_up(self.pre_ffw_norm(x)), self.gelu)))
        x = x + a
        return x + self.down(gated_activation(self.gate_up(self.post_attention_norm(x)), self.gelu))


class ScriptedDecoder(nn.Module):
    """Every layer of a decode step: x [B, hidden] of B one-token rows in, the last layer's output out."""

    def __init__(self, layers: nn.ModuleList) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ScriptedLayer(block) for block in layers)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, local_cos: torch.Tensor,
                local_sin: torch.Tensor, slots: torch.Tensor, keys: List[torch.Tensor], values: List[torch.Tensor],
                span_first: int, span_length: int, key_blocks: Optional[torch.Tensor],
                full_mask: Optional[torch.Tensor], sliding_mask: Optional[torch.Tensor],
                block_size: int) -> torch.Tensor:
        i = 0
        for layer in self.layers:
            x = layer(x, cos, sin, local_cos, local_sin, slots, keys[i], values[i], span_first, span_length,
                      key_blocks, full_mask, sliding_mask, block_size)
            i += 1
        return x


def script_decoder(layers: nn.ModuleList) -> Optional[torch.jit.ScriptModule]:
    """The scripted decode layers, or None when a layer has no scripted form (then the eager path serves)."""
    started = time.perf_counter()
    try:
        with warnings.catch_warnings():
            # TorchScript is deprecated in favour of torch.compile, which does not pay here: compiled per layer, its
            # guards cost what it saves; compiled per step, it takes ~47 s and recompiles as the context grows.
            warnings.simplefilter("ignore", DeprecationWarning)
            scripted = torch.jit.script(ScriptedDecoder(layers))
    except (TypeError, ValueError, AssertionError, RuntimeError) as e:
        log.warning("decode steps stay eager: %s", e)
        return None
    log.debug("scripted the decode step in %.2f s", time.perf_counter() - started)
    return scripted
