"""engine/model/layers.py's Attention module against transformers' own attention modules, on tiny random configs in
float32: gpt-oss (attention sinks, biases on every projection, yarn rope, a sliding and a full layer) and OLMoE
(q/k norms over all heads' features).

Each test drives one Attention layer over a paged cache the way the runner does (engine.model.batch.build_batch),
through every attention path of a CPU step: a fresh prompt, chunks over cached blocks (gathered, through the
compiled kernels' block tables, deterministic), decode rows (one row read in place, gathered, paged, deterministic)
and a step mixing them; eager and scripted. The reference is the transformers module on the whole sequence at once
(eager attention, an explicit causal / sliding mask).
"""
from __future__ import annotations

import random
import warnings

import pytest
import torch

from engine.cache.block_manager import KVSequence
from engine.config import ModelConfig, config_from_hf
from engine.model.batch import StepRow, build_batch
from engine.model.layers import (CPU_PAGED_DECODE, Attention, RMSNorm, RopeTables, rope_attention_factor,
    rope_inv_freq, rope_lookup, rope_table)

BLOCK = 4
TOLERANCE = 1e-4


def _gpt_oss():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

    hf = GptOssConfig(hidden_size=96, head_dim=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2,
                      sliding_window=8, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                      vocab_size=64, max_position_embeddings=2048,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                       "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
    return hf, GptOssAttention, GptOssRotaryEmbedding


def _olmoe():
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeAttention, OlmoeRotaryEmbedding

    hf = OlmoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                     intermediate_size=32, num_experts=4, num_experts_per_tok=2, vocab_size=64,
                     max_position_embeddings=2048)
    return hf, OlmoeAttention, OlmoeRotaryEmbedding


FAMILIES = {"gpt_oss": _gpt_oss, "olmoe": _olmoe}


class Layer:
    """One attention layer: transformers' module with random weights, ours with the same, a KV pool, rope tables."""

    def __init__(self, family: str, layer: int, scripted: bool) -> None:
        hf_cfg, attention_cls, rotary_cls = FAMILIES[family]()
        hf_cfg._attn_implementation = "eager"
        torch.manual_seed(layer)
        self.hf = attention_cls(hf_cfg, layer).eval()
        with torch.no_grad():
            for name, p in self.hf.named_parameters():  # sinks around the scores' own range: a real share
                p.copy_(torch.randn_like(p) + 1 if name == "sinks" else
                        torch.randn_like(p) * (0.5 if p.dim() == 1 else p.shape[-1] ** -0.5))
        self.rotary = rotary_cls(hf_cfg)
        cfg = config_from_hf(hf_cfg.to_dict())
        assert isinstance(cfg, ModelConfig)
        self.cfg = cfg
        self.ours = Attention(cfg, layer).eval()
        self.ours.load_state_dict(_our_weights(self.hf.state_dict()))
        for module in self.ours.modules():  # as the loader's model.refresh(): the norms' CPU tables
            if isinstance(module, RMSNorm):
                module.refresh()
        self.window = cfg.sliding_window if cfg.layer_is_sliding[layer] else 0
        if scripted:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                self.ours = torch.jit.script(self.ours)
        inv = rope_inv_freq(cfg.rope, cfg.head_dim)
        self.tables = rope_table(inv, torch.arange(256), torch.float32, rope_attention_factor(cfg.rope))
        blocks = 64
        self.keys = torch.zeros(cfg.num_kv_heads, blocks * BLOCK, cfg.head_dim)
        self.values = torch.zeros_like(self.keys)
        self.free = list(range(blocks))
        random.Random(layer).shuffle(self.free)  # scattered blocks: the gathered and paged paths, not the span

    def sequence(self, length: int, consecutive: bool = False) -> KVSequence:
        need = -(-length // BLOCK)
        if consecutive:
            self.free.sort()
        table, self.free = self.free[:need], self.free[need:]
        return KVSequence(tokens=list(range(length)), block_table=table)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' output for the whole sequence x [T, hidden] at positions 0..T-1."""
        t = x.shape[0]
        pos = torch.arange(t)
        visible = pos.unsqueeze(0) <= pos.unsqueeze(1)
        if self.window:
            visible &= pos.unsqueeze(0) > pos.unsqueeze(1) - self.window
        mask = torch.zeros(t, t).masked_fill(~visible, float("-inf")).view(1, 1, t, t)
        with torch.no_grad():
            cos_sin = self.rotary(x.unsqueeze(0), pos.unsqueeze(0))
            return self.hf(x.unsqueeze(0), cos_sin, mask)[0][0]

    def step(self, x: torch.Tensor, rows: list[tuple[KVSequence, int, int]], **flags) -> torch.Tensor:
        """Our layer's output for the new tokens of `rows` [(sequence, start, end)], x [T, hidden] the whole
        sequence's hidden states (shared by every sequence here: they attend over their own copies)."""
        step_rows = [StepRow(seq, start, end) for seq, start, end in rows]
        batch = build_batch(step_rows, BLOCK, self.cfg.sliding_window, torch.device("cpu"), **flags)
        cos, sin = rope_lookup(*self.tables, batch.positions)
        with torch.no_grad():
            out = self.ours(x[batch.positions], batch, RopeTables(cos, sin, cos, sin), self.keys, self.values)
        for seq, _, end in rows:
            seq.num_computed = end
        return out


def _our_weights(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' attention weights under our names: q, k, v in one projection (as the loader fuses them)."""
    ours = {"qkv_proj.weight": torch.cat([hf[f"{p}_proj.weight"] for p in "qkv"])}
    if "q_proj.bias" in hf:
        ours["qkv_proj.bias"] = torch.cat([hf[f"{p}_proj.bias"] for p in "qkv"])
    for name in ("o_proj.weight", "o_proj.bias", "sinks", "q_norm.weight", "k_norm.weight"):
        if name in hf:
            ours[name] = hf[name]
    return ours


# The CPU paths of a step, as the runner picks them: torch's (gathered or read in place), the compiled kernels'
# block tables (decode rows and chunks over cached blocks), deterministic (float64 exact attention).
PATHS = {"torch": {}, "deterministic": {"deterministic": True}}
if CPU_PAGED_DECODE:
    PATHS["paged"] = {"paged_decode": True, "chunk_kernel": True}
    PATHS["paged-chunk-gathered"] = {"paged_decode": True}


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    err = float((got - want).abs().max())
    assert err <= TOLERANCE, f"max abs error {err:.2e}"


@pytest.mark.parametrize("scripted", [False, True], ids=["eager", "scripted"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("family,layer", [("gpt_oss", 0), ("gpt_oss", 1), ("olmoe", 0)],
                         ids=["gpt-oss-sliding", "gpt-oss-full", "olmoe"])
def test_attention_equals_transformers(family: str, layer: int, path: str, scripted: bool) -> None:
    """A prompt of 21 tokens (past gpt-oss's window of 8) as: one fresh prefill; 6 tokens then chunks of 5 and 10
    over the cached blocks; 13 tokens then decode steps, the first sequence's keys in scattered blocks and a second
    one's in consecutive blocks (read in place when it decodes alone); and a step mixing a decode row with another
    sequence's fresh prefill. Every token's output equals transformers' within 1e-4."""
    attn = Layer(family, layer, scripted)
    flags = PATHS[path]
    t = 21
    x = torch.randn(t, attn.cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    want = attn.reference(x)
    assert (attn.ours.sinks is not None) == (family == "gpt_oss")

    fresh = attn.sequence(t)
    _check(attn.step(x, [(fresh, 0, t)], **flags), want)

    chunked = attn.sequence(t)
    got = [attn.step(x, [(chunked, 0, 6)], **flags), attn.step(x, [(chunked, 6, 11)], **flags),
           attn.step(x, [(chunked, 11, t)], **flags)]
    _check(torch.cat(got), want)

    decoded, alone = attn.sequence(t), attn.sequence(t, consecutive=True)
    attn.step(x, [(decoded, 0, 13)], **flags)
    attn.step(x, [(alone, 0, 13)], **flags)
    for pos in range(13, 17):  # both rows in one step
        _check(attn.step(x, [(decoded, pos, pos + 1), (alone, pos, pos + 1)], **flags), want[[pos, pos]])
    for pos in range(17, t):  # one row alone: its keys in consecutive blocks are read in place
        _check(attn.step(x, [(alone, pos, pos + 1)], **flags), want[pos:pos + 1])

    mixed = attn.sequence(t)
    out = attn.step(x, [(decoded, 17, 18), (mixed, 0, 12)], **flags)  # decode rows come first in the flat batch
    _check(out, want[[17, *range(12)]])
