"""engine/model/layers.py's helpers: the row bucket and fixed-shape tiles deterministic steps rely on, the rope tables
(yarn against transformers), the torch attention paths with attention sinks against their definition."""
from __future__ import annotations

import math

import pytest
import torch

from engine.config import RopeConfig, config_from_hf, gguf_rope_scaling
from engine.model.decoder import DecoderModel
from engine.model.layers import (DENSE_ROW_BUCKET, decode_attention, exact_attention, rope_attention_factor,
    rope_inv_freq, rope_lookup, rope_table, sink_prefill_attention, tiled_matmul)
from engine.model.llama import LlamaBlock


@pytest.mark.parametrize("inner", [576, 1536, 4096])
def test_a_row_gets_the_same_sums_in_any_call_of_tiles(inner: int) -> None:
    """Row i of a chunk: bit-identical whatever the chunk's length and wherever the row sits in it. At inner 1536
    a plain float32 matmul of 64 rows or more sums differently from one of 48 on an AVX-512 Xeon (MKL's blocking)."""
    torch.manual_seed(0)
    w, x, bias = torch.randn(576, inner), torch.randn(200, inner), torch.randn(576)
    alone = torch.cat([tiled_matmul(x[i:i + 1], w, bias) for i in range(40, 60)])
    for start, length in [(40, 20), (0, 100), (33, 27), (40, 160), (1, 199)]:
        out = tiled_matmul(x[start:start + length], w, bias)
        assert out.shape == (length, 576)
        assert torch.equal(out[40 - start:60 - start], alone), (start, length)
    torch.testing.assert_close(alone, x[40:60] @ w.t() + bias, rtol=1e-4, atol=1e-3)  # the same product


@pytest.mark.parametrize("rows", [1, DENSE_ROW_BUCKET, DENSE_ROW_BUCKET + 1, 3 * DENSE_ROW_BUCKET])
def test_tiles_return_exactly_the_rows_asked_for(rows: int) -> None:
    w, x = torch.randn(8, 32), torch.randn(rows, 32)
    torch.testing.assert_close(tiled_matmul(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)
    assert tiled_matmul(x, w).shape == (rows, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rows_of_a_table_are_the_rotation_of_their_positions(dtype: torch.dtype) -> None:
    """Rows looked up in a table of every position = cos / signed sin of those positions rounded once to `dtype`
    (the float32 angles' cos and sin are taken once, so the check does not rest on two calls of torch's cos)."""
    inv = rope_inv_freq(RopeConfig(theta=10000.0, scaling=None), 64)
    every = torch.arange(300)
    angles = every.float().unsqueeze(-1) * inv
    cos32, sin32 = angles.cos(), angles.sin()
    want_cos = torch.cat((cos32, cos32), -1).to(dtype).unsqueeze(-2)
    want_sin = torch.cat((-sin32, sin32), -1).to(dtype).unsqueeze(-2)
    table = rope_table(inv, every, dtype)
    assert table[0].shape == (300, 32) and table[0].dtype == dtype
    for positions in (torch.tensor([0]), torch.tensor([299, 5, 5, 17]), torch.arange(40, 140)):
        cos, sin = rope_lookup(*table, positions)
        assert torch.equal(cos, want_cos[positions]) and torch.equal(sin, want_sin[positions])


# ---- yarn rope: transformers' own rope init function and rotary embedding are the reference ----

# gpt-oss's own (truncate False), the same rounded to whole dimensions (transformers' default), llama.cpp's defaults
# of beta, DeepSeek's mscale pair, an explicit attention factor.
YARN = {
    "gpt-oss": dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
    "truncated": dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=4096),
    "default-betas": dict(factor=4.0, original_max_position_embeddings=2048, truncate=True),
    "mscale": dict(factor=40.0, mscale=1.0, mscale_all_dim=0.707, beta_fast=32, beta_slow=1,
                   original_max_position_embeddings=4096),
    "attention-factor": dict(factor=8.0, attention_factor=1.3, original_max_position_embeddings=8192, truncate=False),
}


def _hf_yarn_config(params: dict, theta: float, head_dim: int):
    from transformers import GptOssConfig

    return GptOssConfig(hidden_size=2 * head_dim, head_dim=head_dim, num_attention_heads=4, num_key_value_heads=2,
                        num_hidden_layers=2, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                        vocab_size=64, max_position_embeddings=131072,
                        rope_parameters={"rope_type": "yarn", "rope_theta": theta, **params})


@pytest.mark.parametrize("theta,head_dim", [(150000.0, 64), (10000.0, 128)])
@pytest.mark.parametrize("name", list(YARN))
def test_yarn_rope_equals_transformers(name: str, theta: float, head_dim: int) -> None:
    """The rope of a gpt-oss config.json read by engine.config (inverse frequencies, attention factor, and the
    tables the decoder looks up) equals transformers' yarn init function and GptOssRotaryEmbedding's cos / sin."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    hf = _hf_yarn_config(YARN[name], theta, head_dim)
    cfg = config_from_hf(hf.to_dict())
    assert cfg.rope.scaling is not None and cfg.rope.scaling["rope_type"] == "yarn" and cfg.rope.theta == theta
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    inv = rope_inv_freq(cfg.rope, head_dim)
    torch.testing.assert_close(inv, want_inv, rtol=1e-7, atol=0)
    assert rope_attention_factor(cfg.rope) == pytest.approx(want_factor, rel=1e-12)
    positions = torch.tensor([0, 1, 7, 100, 4095, 4096, 30000, 131071])
    cos, sin = rope_table(inv, positions, torch.float32, rope_attention_factor(cfg.rope))
    want_cos, want_sin = GptOssRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), positions.unsqueeze(0))
    torch.testing.assert_close(cos, want_cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, want_sin[0], rtol=1e-6, atol=1e-6)


def test_truncate_changes_the_yarn_ramp() -> None:
    """gpt-oss's unrounded ramp is not the rounded one: the flag is read, not ignored."""
    untruncated = RopeConfig(150000.0, {"rope_type": "yarn", **YARN["gpt-oss"]})
    truncated = RopeConfig(150000.0, {**untruncated.scaling, "truncate": True})
    assert not torch.equal(rope_inv_freq(untruncated, 64), rope_inv_freq(truncated, 64))
    assert rope_attention_factor(untruncated) == pytest.approx(0.1 * math.log(32.0) + 1.0)
    assert rope_attention_factor(RopeConfig(10000.0)) == 1.0


def test_the_decoder_tables_carry_the_yarn_attention_factor() -> None:
    """DecoderModel.set_rope's tables (what every step looks up) of a llama config with yarn rope: transformers'
    LlamaRotaryEmbedding's cos / sin, attention factor included."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                     intermediate_size=32, vocab_size=64, max_position_embeddings=512,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **YARN["mscale"],
                                      "original_max_position_embeddings": 128})
    cfg = config_from_hf(hf.to_dict())
    with torch.device("meta"):
        model = DecoderModel(cfg, LlamaBlock)
    model.set_rope(rope_inv_freq(cfg.rope, cfg.head_dim), None, 512, torch.float32)
    want_cos, want_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1), torch.arange(512).unsqueeze(0))
    half = cfg.head_dim // 2
    torch.testing.assert_close(model.rope_cos, want_cos[0, :, :half], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model.rope_sin, want_sin[0, :, :half], rtol=1e-6, atol=1e-6)
    assert rope_attention_factor(cfg.rope) != 1.0


def test_gguf_yarn_metadata_gives_the_config_json_rope() -> None:
    """A gpt-oss GGUF's rope metadata (llama.cpp's keys, as the gguf package names them: type, factor, original
    context; beta left to llama.cpp's defaults) gives the rope of its config.json."""
    from gguf import Keys

    arch = "gpt-oss"
    meta = {Keys.Rope.SCALING_TYPE.format(arch=arch): "yarn", Keys.Rope.SCALING_FACTOR.format(arch=arch): 32.0,
            Keys.Rope.SCALING_ORIG_CTX_LEN.format(arch=arch): 4096}
    scaling = gguf_rope_scaling(meta, arch)
    want = config_from_hf(_hf_yarn_config(YARN["gpt-oss"], 150000.0, 64).to_dict()).rope
    rope = RopeConfig(150000.0, scaling)
    assert torch.equal(rope_inv_freq(rope, 64), rope_inv_freq(want, 64))
    assert rope_attention_factor(rope) == rope_attention_factor(want)
    linear = {Keys.Rope.SCALING_TYPE.format(arch="llama"): "linear", Keys.Rope.SCALING_FACTOR.format(arch="llama"): 2.0}
    assert gguf_rope_scaling(linear, "llama") == {"rope_type": "linear", "factor": 2.0}
    assert gguf_rope_scaling({}, "llama") is None
    # a yarn GGUF of another family: llama.cpp's ramp, rounded to whole dimensions, and its betas when given
    other = {**{k.replace(arch, "qwen3"): v for k, v in meta.items()},
             Keys.Rope.SCALING_YARN_BETA_FAST.format(arch="qwen3"): 16.0}
    assert gguf_rope_scaling(other, "qwen3") == {"rope_type": "yarn", "factor": 32.0, "beta_fast": 16.0,
                                                  "beta_slow": 1.0, "original_max_position_embeddings": 4096}


# ---- attention sinks: every torch path against the definition in float64 ----

def _sink_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float,
                    sinks: torch.Tensor) -> torch.Tensor:
    """q [T, H, D] over keys/values [KVH, L, D], visible [T, L]: softmax over [scores, sink] per head, the sink's
    column dropped (transformers' gpt-oss eager attention), in float64 → [T, H, D]."""
    group = q.shape[1] // keys.shape[0]
    k = keys.double().repeat_interleave(group, dim=0)
    v = values.double().repeat_interleave(group, dim=0)
    scores = torch.einsum("thd,hld->htl", q.double(), k) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.double().view(-1, 1, 1).expand(-1, q.shape[0], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("htl,hld->thd", probs, v)


def _sink_problem(t: int, length: int, heads: int = 8, kv_heads: int = 2, d: int = 32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, heads, d, generator=gen)
    keys, values = torch.randn(kv_heads, length, d, generator=gen), torch.randn(kv_heads, length, d, generator=gen)
    return q, keys, values, torch.randn(heads, generator=gen) * 2 + 1


def _visible(t: int, length: int, window: int) -> torch.Tensor:
    """[t, length]: the last t of `length` positions, causal, within `window` if > 0."""
    q_pos = torch.arange(length - t, length).unsqueeze(1)
    pos = torch.arange(length)
    mask = pos <= q_pos
    return mask & (pos > q_pos - window) if window > 0 else mask


@pytest.mark.parametrize("window", [0, 5])
def test_decode_and_exact_attention_with_sinks_are_the_definition(window: int) -> None:
    """Decode rows (float32 batched matmuls) and the exact float64 path, one row of each length in a batch (the
    shorter rows' padding masked), sinks included."""
    lengths, scale = [1, 9, 17], 32 ** -0.5
    q, keys, values, sinks = _sink_problem(len(lengths), 17)
    # each row's key positions: its own 0..n-1, then padding (masked); the query sits at n - 1
    mask = torch.stack([(torch.arange(17) < n) & ((torch.arange(17) > n - 1 - window) if window else True)
                        for n in lengths]).view(3, 1, 1, 17)
    k_rows, v_rows = keys.expand(3, -1, -1, -1), values.expand(3, -1, -1, -1)
    want = torch.cat([_sink_reference(q[r:r + 1], keys, values, mask[r, 0], scale, sinks) for r in range(3)])
    got = decode_attention(q, k_rows, v_rows, mask, 2, scale, sinks)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    exact = exact_attention(q.unsqueeze(1), k_rows, v_rows, mask, 2, scale, sinks)[:, 0]
    torch.testing.assert_close(exact.double(), want, rtol=0, atol=1e-6)
    assert not torch.allclose(decode_attention(q, k_rows, v_rows, mask, 2, scale), got, atol=1e-2)  # sinks matter


@pytest.mark.parametrize("t,length,window,tile", [(23, 23, 0, 5), (23, 23, 0, 256), (9, 30, 0, 4), (20, 41, 7, 6)],
                         ids=["fresh-tiles", "fresh-one-tile", "chunk-over-cache", "chunk-window"])
def test_prefill_attention_with_sinks_is_the_definition(t: int, length: int, window: int, tile: int) -> None:
    """The prefill rows torch's fused attention takes without sinks: fresh (causal, no mask) and a chunk over cached
    keys (a mask, sliding or not), over several query tiles or one."""
    q, keys, values, sinks = _sink_problem(t, length, seed=t + length)
    visible = _visible(t, length, window)
    mask = None if length == t and window == 0 else visible.view(1, 1, t, length)
    got = sink_prefill_attention(q, keys, values, mask, 2, 0.2, sinks, tile=tile)
    torch.testing.assert_close(got.double(), _sink_reference(q, keys, values, visible, 0.2, sinks), rtol=0, atol=1e-5)
    if mask is not None:
        exact = exact_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), mask, 2, 0.2, sinks)[0]
        torch.testing.assert_close(exact.double(), _sink_reference(q, keys, values, visible, 0.2, sinks), rtol=0,
                                   atol=1e-6)
