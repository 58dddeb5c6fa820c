"""The mixture-of-experts layer (engine/model/moe.py) against brute-force references of its rules: routing (both
orders of softmax and top-k, renormalisation, ties), the grouped expert computation against one token at a time,
and the edge cases of routing (every token to one expert, experts with no tokens, deterministic steps)."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from engine.config import ModelConfig, MoEConfig, RopeConfig
from engine.model.moe import MoEMLP, expert_activation, route


def brute_force_route(logits: torch.Tensor, k: int, top_k_first: bool, renormalize: bool):
    """Per token: experts ordered by (-score, id), the first k kept; weights as each family defines them."""
    weights, ids = [], []
    for row in logits.detach().double():
        scores = row if top_k_first else torch.softmax(row, -1)
        chosen = sorted(range(len(row)), key=lambda e: (-float(scores[e]), e))[:k]
        w = scores[chosen]
        if top_k_first:
            w = torch.softmax(w, -1)
        elif renormalize:
            w = w / w.sum()
        weights.append(w)
        ids.append(chosen)
    return torch.stack(weights).float(), torch.tensor(ids)


@pytest.mark.parametrize("top_k_first,renormalize", [(False, True), (False, False), (True, False)])
def test_route_matches_the_brute_force_rule(top_k_first, renormalize):
    logits = torch.randn(37, 8, generator=torch.Generator().manual_seed(3)) * 2
    weights, ids = route(logits, 3, top_k_first, renormalize)
    want_w, want_ids = brute_force_route(logits, 3, top_k_first, renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
    if renormalize or top_k_first:
        torch.testing.assert_close(weights.sum(-1), torch.ones(37))


@pytest.mark.parametrize("top_k_first", [False, True])
def test_ties_go_to_the_lower_expert_id(top_k_first):
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0], [0.5] * 5, [3.0, 3.0, -1.0, 3.0, 3.0]])
    weights, ids = route(logits, 2, top_k_first, True)
    want_w, want_ids = brute_force_route(logits, 2, top_k_first, True)
    assert ids.tolist() == want_ids.tolist() == [[1, 2], [0, 1], [0, 1]]
    torch.testing.assert_close(weights, want_w)
    torch.testing.assert_close(weights, torch.full((3, 2), 0.5))  # equal scores, equal shares


def _config(clamp: bool, bias: bool, experts: int = 6, shared: int = 0) -> ModelConfig:
    moe = MoEConfig(experts, 2, 24, router="topk_softmax" if clamp else "softmax_topk", router_bias=bias,
                    expert_bias=bias, activation="swiglu_clamp" if clamp else "silu", shared_intermediate=shared)
    return ModelConfig(family="qwen3_moe", vocab_size=10, hidden_size=32, intermediate_size=48, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=16, rms_eps=1e-6, max_position=64,
                       rope=RopeConfig(10000.0), moe=moe)


def _random_mlp(cfg: ModelConfig, seed: int) -> MoEMLP:
    gen = torch.Generator().manual_seed(seed)
    mlp = MoEMLP(cfg)
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 2.0))
    return mlp.eval()


def per_token_reference(mlp: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """Every token alone, every one of its experts a dense float64 gated MLP, summed with the routing weights."""
    logits = F.linear(x.double(), mlp.router.weight.double(),
                      mlp.router.bias.double() if mlp.router.bias is not None else None)
    weights, ids = brute_force_route(logits, mlp.top_k, mlp.top_k_first, mlp.renormalize)
    ex = mlp.experts
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].double(), ids[t].tolist()):
            h = F.linear(x[t].double(), ex.gate_up.weight[e].double(),
                         ex.gate_up.bias[e].double() if ex.gate_up.bias is not None else None)
            gate, up = h.chunk(2)
            if ex.clamp:
                gate, up = gate.clamp(max=ex.limit), up.clamp(-ex.limit, ex.limit)
                act = gate * torch.sigmoid(ex.alpha * gate) * (up + 1)
            else:
                act = F.silu(gate) * up
            y = F.linear(act, ex.down.weight[e].double(), ex.down.bias[e].double() if ex.down.bias is not None else None)
            out[t] += w * y
    if mlp.has_shared:
        shared = mlp.shared_expert
        gate, up = F.linear(x.double(), shared.gate_up_proj.weight.double()).chunk(2, -1)
        y = F.linear(F.silu(gate) * up, shared.down_proj.weight.double())
        out += torch.sigmoid(F.linear(x.double(), mlp.shared_expert_gate.weight.double())) * y
    return out.float()


@pytest.mark.parametrize("clamp,bias,shared", [(False, False, 0), (True, True, 0), (False, False, 40)])
def test_grouped_experts_equal_each_token_alone(clamp, bias, shared):
    mlp = _random_mlp(_config(clamp, bias, shared=shared), seed=5)
    x = torch.randn(29, 32, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(mlp(x, 0, False), per_token_reference(mlp, x), rtol=1e-5, atol=1e-5)


def test_scripted_layer_equals_the_eager_one():
    mlp = _random_mlp(_config(True, True), seed=8)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(2))
    assert torch.equal(torch.jit.script(mlp)(x, 0, False), mlp(x, 0, False))


def test_every_token_to_one_expert_and_experts_without_tokens():
    mlp = _random_mlp(_config(False, False), seed=11)
    with torch.no_grad():  # a router that prefers experts 4 then 1 for every token, whatever x
        mlp.router.weight.zero_()
        mlp.router.bias = None
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(4))
    ids = torch.tensor([[4, 1]] * 16)
    weights = torch.tensor([[0.75, 0.25]] * 16)
    got = mlp.experts(x, ids, weights, False)
    ex = mlp.experts
    want = torch.zeros_like(x)
    for e, w in ((4, 0.75), (1, 0.25)):
        want += w * F.linear(expert_activation(F.linear(x, ex.gate_up.weight[e]), False, 0.0, 0.0), ex.down.weight[e])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # no token at all: an empty result, no expert computed
    assert mlp.experts(x[:0], ids[:0], weights[:0], False).shape == (0, 32)


def test_deterministic_rows_do_not_depend_on_their_neighbours():
    mlp = _random_mlp(_config(False, False, experts=4), seed=13)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([mlp(x[i:i + 1], 0, True) for i in range(5)])
    for rows in (x[:5], x[:17], x):
        assert torch.equal(mlp(rows, 0, True)[:5], alone)


def test_only_the_routed_experts_are_computed(monkeypatch):
    mlp = _random_mlp(_config(False, False, experts=6), seed=17)
    called = []
    original = type(mlp.experts.gate_up).matmul

    def spy(self, x, expert, deterministic):
        called.append((expert, x.shape[0]))
        return original(self, x, expert, deterministic)

    monkeypatch.setattr(type(mlp.experts.gate_up), "matmul", spy)
    ids = torch.tensor([[0, 3], [3, 5], [0, 5]])
    mlp.experts(torch.randn(3, 32), ids, torch.full((3, 2), 0.5), False)
    gate_up_calls = called[0::2]  # gate_up then down, per expert
    assert gate_up_calls == [(0, 2), (3, 2), (5, 2)]  # each routed expert once, with all of its tokens
    assert not set(itertools.chain([1, 2, 4])) & {e for e, _ in called}
