"""Tensor parallelism (engine/parallel/) on CPU: gloo, 2 processes.

Every tiny family (tests/support/tiny_models.py: one variant of each; gemma3's one KV head is replicated on both
ranks) gives, split over 2 ranks, the logits of the single-process runner within 1e-5 in float32: a prefill of
every position, decode steps, a chunk over cached blocks after copy-on-write of a shared block, a batched step of a
fresh prefill beside a decode row, and embeddings (hidden states). Models that do not split are refused before
anything is spawned (a rank that dies: tests/e2e/test_tensor_parallel_server.py, through the server). The step
message and the sharding plan are checked on their own against brute-force references.
"""
from __future__ import annotations

import multiprocessing

import pytest
import torch

from engine import load_runner
from engine.model.batch import ForwardBatch, StepRow, build_batch
from engine.config import ModelConfig, RopeConfig
from engine.errors import UnsupportedModelError
from engine.parallel.messages import MODE_HIDDEN, MODE_STOP, StepMessage, decode_step, encode_step
from engine.config import MoEConfig
from engine.parallel.sharding import check_shardable, shard_of, shard_state
from engine.model.quant import Affine4Bit, Int4Linear, quantize_4bit
from engine.model.quant.dot import Int4DotLinear
from engine.model.quant.experts import Int4DotExperts, Int4Experts
from engine.model.quant.mxfp4 import quantize_mxfp4
from engine.weights.lazy_experts import LazyExperts
from tests.support.tiny_models import prompt_ids

TP = 2
TOLERANCE = 1e-5  # float32, absolute
FOUR_BIT_EXPERTS = (Int4Experts, Int4DotExperts)
# one variant per family (llama3_scaled: llama again); the mixtures of experts split each expert's FFN width
FAMILIES = ["llama_tied", "qwen2", "qwen3", "gemma3", "qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"]


@pytest.fixture(autouse=True)
def cores_shared_with_the_ranks():
    """This process is rank 0: its torch threads and the other rank's share the cores, as the server shares them
    (server/api/app.py); more threads than cores make each collective wait on descheduled ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // TP))
    yield
    torch.set_num_threads(threads)


def _scenario(runner, tiny) -> list[torch.Tensor]:
    """The same steps on any runner: every output it gives, in order."""
    a, b = prompt_ids(tiny, 0, 24), prompt_ids(tiny, 1, 24)
    out = [runner.predict_logits(a[:20])]                # a fresh prefill, logits at every position
    snapshot = runner.export_session()
    for token in a[20:23]:                               # decode steps
        out.append(runner.decode_logits(token)[None])
    # The snapshot's last block is partial and shared: extending it copies that block first (copy-on-write), and
    # the new tokens are a chunk over cached blocks.
    out.append(runner.prefill_logits_reusing(a[:18] + b[:5], snapshot, 18)[None])
    out.append(runner.decode_logits(b[5])[None])
    other = runner.new_sequence(b[:10], use_prefix_cache=False)
    out.append(runner.step([StepRow(other, 0, 10)]))
    other.tokens.append(b[10])
    fresh = runner.new_sequence(a[3:24], use_prefix_cache=False)
    out.append(runner.step([StepRow(other, 10, 11), StepRow(fresh, 0, 21, logits="all")]))  # decode + prefill
    for seq in (other, fresh):
        runner.free_sequence(seq)
    out.append(runner.embed([b[:9], a[:13]]))            # hidden states, pooled
    runner.reset_session()
    return out


@pytest.mark.parametrize("variant", FAMILIES)
def test_two_ranks_give_the_single_process_logits(tiny_zoo, variant: str) -> None:
    tiny = tiny_zoo.model(variant)
    single = load_runner(str(tiny.safetensors_dir), dtype="float32")
    expected = _scenario(single, tiny)
    split = load_runner(str(tiny.safetensors_dir), dtype="float32", tensor_parallel_size=TP)
    try:
        cfg = single.config
        # Rank 0 holds its share only: half the query heads, its KV heads (a replicated one when there is one).
        attn = split.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (cfg.num_heads // TP, max(1, cfg.num_kv_heads // TP))
        assert split.cache.keys[0].shape[0] == max(1, cfg.num_kv_heads // TP)
        assert split.blocks.num_blocks == single.blocks.num_blocks  # a context's worth either way (the CPU default)
        got = _scenario(split, tiny)
    finally:
        split.close()
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape and g.dtype == e.dtype, f"output {i}"
        diff = float((g - e).abs().max())
        assert diff <= TOLERANCE, f"{variant} output {i}: max abs diff {diff:.2e} (scale {float(e.abs().max()):.1f})"


@pytest.mark.parametrize("variant", ["llama_tied", "qwen3_moe"])
def test_int4_weights_split_into_the_same_weights(tiny_zoo, variant: str) -> None:
    """Sharding happens before quantization, on 4-bit GGUF blocks: each rank's int4 share holds exactly the rows and
    groups of the whole (the split points fall on group boundaries; a mixture's experts are split an expert at a
    time), so the logits are the single process's again (float32 activations: only the order of the sums differs)."""
    tiny = tiny_zoo.model(variant)
    path = str(tiny_zoo.gguf(variant, "Q4_0"))
    single = load_runner(path, dtype="float32", quant="int4")
    expected = _scenario(single, tiny)
    split = load_runner(path, dtype="float32", quant="int4", tensor_parallel_size=TP)
    try:
        for runner in (single, split):  # packed 4-bit shares (the row-parallel one inside its wrapper)
            attn = runner.model.layers[0].self_attn
            assert isinstance(attn.qkv_proj, (Int4Linear, Int4DotLinear))
            assert isinstance(getattr(attn.o_proj, "inner", attn.o_proj), (Int4Linear, Int4DotLinear))
            if runner.config.moe is not None:  # the experts' stacks are the 4-bit codes of the file too
                experts = getattr(runner.model.layers[0].mlp, "inner", runner.model.layers[0].mlp).experts
                assert isinstance(experts.gate_up, FOUR_BIT_EXPERTS) and isinstance(experts.down, FOUR_BIT_EXPERTS)
        got = _scenario(split, tiny)
    finally:
        split.close()
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        diff = float((g - e).abs().max())
        assert diff <= TOLERANCE, f"{variant} int4 output {i}: max abs diff {diff:.2e}"


def test_a_model_that_does_not_split_is_refused_before_spawning(tiny_zoo) -> None:
    tiny = tiny_zoo.model("llama_tied")  # 4 heads, 2 KV heads, FFN 128
    before = set(multiprocessing.active_children())  # (another test's child may still be on its way out)
    with pytest.raises(UnsupportedModelError, match="4 attention heads.*3 tensor-parallel ranks"):
        load_runner(str(tiny.safetensors_dir), dtype="float32", tensor_parallel_size=3)
    assert set(multiprocessing.active_children()) <= before  # no rank was spawned


# --- the pieces on their own ------------------------------------------------------------------------------------

def _config(heads: int, kv_heads: int, ffn: int = 192) -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=320, hidden_size=64, intermediate_size=ffn, num_layers=1,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=16, rms_eps=1e-5, max_position=64,
                       rope=RopeConfig(10_000.0))


@pytest.mark.parametrize("heads, kv_heads, size", [(4, 2, 2), (4, 1, 2), (8, 2, 4), (8, 8, 4), (8, 2, 8),
                                                   (16, 4, 2), (6, 3, 3)])
def test_each_rank_holds_the_kv_heads_its_query_heads_read(heads: int, kv_heads: int, size: int) -> None:
    cfg = _config(heads, kv_heads)
    group = heads // kv_heads
    for rank in range(size):
        shard = shard_of(cfg, rank, size)
        queries = range(rank * shard.num_heads, (rank + 1) * shard.num_heads)
        assert len(queries) * size == heads
        # Within the rank, query head j reads local KV head j // (local group), as the attention assumes.
        local_group = shard.num_heads // shard.num_kv_heads
        for j, q in enumerate(queries):
            assert q // group == shard.first_kv_head + j // local_group
        assert shard.vocab_rows * size >= cfg.vocab_size


@pytest.mark.parametrize("heads, kv_heads, ffn, size, why", [
    (4, 2, 128, 3, "4 attention heads"), (6, 3, 128, 2, "3 KV heads"), (4, 4, 100, 8, "FFN width of 100")])
def test_shapes_that_do_not_split_are_refused(heads: int, kv_heads: int, ffn: int, size: int, why: str) -> None:
    with pytest.raises(UnsupportedModelError, match=why):
        check_shardable(_config(heads, kv_heads, ffn), size)


def _batches(tiny_zoo) -> list[ForwardBatch]:
    tiny = tiny_zoo.model("gemma3")  # a sliding window of 8: sliding masks too
    runner = load_runner(str(tiny.safetensors_dir), dtype="float32")
    a, b = prompt_ids(tiny, 0, 24), prompt_ids(tiny, 1, 24)
    done = runner.new_sequence(a[:20], use_prefix_cache=False)
    runner.step([StepRow(done, 0, 20)])
    done.tokens.append(a[20])
    runner.blocks.allocate(done, 21)
    again = runner.new_sequence(a[:17] + b[:4])  # a chunk over its cached first block
    fresh = runner.new_sequence(b[:19], use_prefix_cache=False)
    for seq in (again, fresh):
        runner.blocks.allocate(seq, len(seq.tokens))
    rows = [StepRow(done, 20, 21), StepRow(again, again.num_computed, 21, "all"), StepRow(fresh, 0, 19)]
    bs, window = runner.blocks.block_size, runner.config.sliding_window
    return [build_batch(rows, bs, window, runner.device), build_batch(rows, bs, window, runner.device, paged=True,
                                                                      table_width=8),
            build_batch(rows[:1], bs, window, runner.device, deterministic=True)]


def test_a_step_message_carries_every_field_of_the_batch(tiny_zoo) -> None:
    for batch in _batches(tiny_zoo):
        header_len, payload = encode_step(StepMessage(MODE_HIDDEN, [(3, 5), (4, 6)], batch), torch.device("cpu"))
        assert payload.dtype == torch.int64 and payload.dim() == 1
        message = decode_step(header_len, payload)
        assert (message.mode, message.copies) == (MODE_HIDDEN, [(3, 5), (4, 6)])
        for name, sent, got in zip(ForwardBatch._fields, batch, message.batch):
            _assert_same(sent, got, name)
    stop = decode_step(*encode_step(StepMessage(MODE_STOP), torch.device("cpu")))
    assert (stop.mode, stop.copies, stop.batch) == (MODE_STOP, [], None)


def _assert_same(sent, got, name: str) -> None:
    assert type(sent) is type(got), f"{name}: {type(sent).__name__} became {type(got).__name__}"
    if isinstance(sent, torch.Tensor):
        assert sent.dtype == got.dtype and sent.shape == got.shape and torch.equal(sent, got), name
    elif isinstance(sent, list):
        assert len(sent) == len(got), name
        for s, g in zip(sent, got):
            _assert_same(s, g, name)
    else:
        assert sent == got, name


def test_olmoe_full_width_qk_norms_are_refused_and_experts_must_split(tiny_zoo) -> None:
    from engine.weights.summary import model_config

    cfg = model_config(tiny_zoo.model("olmoe").safetensors_dir)
    with pytest.raises(UnsupportedModelError, match="q/k norms over all heads"):
        check_shardable(cfg, 2)
    moe_cfg = model_config(tiny_zoo.model("qwen3_moe").safetensors_dir)
    check_shardable(moe_cfg, 2)  # expert width 64 splits
    with pytest.raises(UnsupportedModelError, match="expert FFN width of 64"):
        check_shardable(moe_cfg, 3)


def _moe_state(form: str, width: int, reads: list[int], experts: int = 3,
               hidden: int = 64) -> tuple[ModelConfig, dict, dict]:
    """A one-layer MoE config and a state dict of its (fused) tensors, with its expert stacks in `form`, and
    those stacks dequantized (what every share is checked against); a lazy stack's reads are appended to `reads`."""
    cfg = ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=hidden, intermediate_size=128, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_eps=1e-6, max_position=64,
                      rope=RopeConfig(10_000.0), tie_embeddings=False,
                      moe=MoEConfig(num_experts=experts, top_k=2, expert_intermediate=width))
    g = torch.Generator().manual_seed(width)
    floats = {"gate_up": torch.randn(experts, 2 * width, hidden, generator=g),
              "down": torch.randn(experts, hidden, width, generator=g)}
    state = {"layers.0.self_attn.qkv_proj.weight": torch.randn(8 * 16, hidden, generator=g),
             "layers.0.self_attn.o_proj.weight": torch.randn(hidden, 4 * 16, generator=g),
             "embed_tokens.weight": torch.randn(64, hidden, generator=g),
             "lm_head.weight": torch.randn(64, hidden, generator=g)}
    whole = {}
    for name, w in floats.items():
        if form == "float":
            stack = w
        elif form == "mxfp4":
            stack = quantize_mxfp4(w)
        else:  # 4-bit blocks, stacked or (as the GGUF reader gives them) read an expert at a time
            four = [quantize_4bit(e) for e in w]
            stack = Affine4Bit(*(torch.stack([getattr(f, k) for f in four]) for k in ("codes", "scale", "offset")))
            if form == "lazy_affine4bit":  # counting its reads
                stack = LazyExperts(experts, *w.shape[1:], lambda e, four=four: reads.append(e) or four[e],
                                    "affine4bit")
        whole[name] = w if form == "float" else (stack.dequantize() if form != "lazy_affine4bit" else
                                                  torch.stack([f.dequantize() for f in four]))
        state[f"layers.0.mlp.experts.{name}.weight"] = stack
    return cfg, state, whole


@pytest.mark.parametrize("form", ["float", "affine4bit", "lazy_affine4bit", "mxfp4"])
@pytest.mark.parametrize("width", [128, 96])  # a rank's 64 columns of down fall on 4-bit block edges; 48 cut one
def test_each_rank_holds_its_slice_of_every_expert_in_4_bits_where_blocks_allow(form: str, width: int) -> None:
    part = width // TP
    for rank in range(TP):
        reads: list[int] = []
        cfg, state, whole = _moe_state(form, width, reads)
        shard_state(state, cfg, shard_of(cfg, rank, TP))
        assert reads == []  # no expert is read until the stacks are placed, an expert at a time
        gate_up, down = state["layers.0.mlp.experts.gate_up.weight"], state["layers.0.mlp.experts.down.weight"]
        rows = torch.cat((torch.arange(rank * part, (rank + 1) * part),
                          torch.arange(width + rank * part, width + (rank + 1) * part)))
        assert torch.equal(gate_up.dequantize(), whole["gate_up"][:, rows])  # nothing rounded again
        assert torch.equal(down.dequantize(), whole["down"][:, :, rank * part:(rank + 1) * part])
        four_bit = "float" if form == "float" else form.removeprefix("lazy_")
        assert gate_up.form == four_bit  # rows never cut a block
        assert down.form == (four_bit if part % 32 == 0 else "float")
