"""The mixture-of-experts feed-forward layer: a router picks `top_k` of `num_experts` gated MLPs per token, only those
are computed, and their outputs are summed with the router's weights (plus a shared expert where a family has one).

On CPU the experts run grouped: the step's (token, expert) pairs are sorted by expert, and each expert with tokens
multiplies all of them at once, so its weights are read once per step whatever the number of tokens routed to it.
On CUDA the same sums run in the fused Triton kernel of engine/kernels/moe.py (tokens sorted by expert on the
device, static shapes: capturable in CUDA graphs). Each projection of every expert is one `ExpertStack`
(engine/model/quant/experts.py, `matmul(x, expert, deterministic)`): the model is built with `CheckpointExperts`
(float parameters the loader fills), which the loader replaces by the form that serves (engine/loader/experts.py):
a quantized CPU stack, or `KernelExperts` on CUDA.
"""
# No `from __future__ import annotations`: TorchScript compiles this module as part of the decoder stack.
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config import ModelConfig, MoEConfig
from engine.kernels.fused import gated_activation
from engine.model.layers import GatedMLP, Linear
from engine.model.quant.experts import ExpertStack, float_expert_matmul

if TYPE_CHECKING:
    from engine.kernels.moe import ExpertWeights


def _top_k(scores: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    values, ids = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[:, :k], ids[:, :k]


def route(logits: Tensor, top_k: int, top_k_first: bool, renormalize: bool) -> Tuple[Tensor, Tensor]:
    """(weights [N, k] float32, expert ids [N, k] int64) from router logits [N, E].

    Softmax over all experts, the k largest kept (divided by their sum when `renormalize`); or, `top_k_first`
    (gpt-oss), the k largest logits and a softmax over them. Ties go to the lower expert id, on every device and
    whatever the batch (torch.topk leaves their order unspecified: a stable sort keeps it)."""
    logits = logits.float()
    if top_k_first:
        top, ids = _top_k(logits, top_k)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(logits, dim=-1)
    top, ids = _top_k(probs, top_k)
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, ids


def expert_activation(gate_up: Tensor, clamp: bool, alpha: float, limit: float) -> Tensor:
    """act(gate) * up of the [gate | up] rows [M, 2I] → [M, I]: SwiGLU, or gpt-oss's clamped form (gate clamped
    above at `limit`, up to ±limit, gate * sigmoid(alpha * gate) * (up + 1))."""
    if not clamp:
        return gated_activation(gate_up, False)
    half = gate_up.shape[-1] // 2
    gate = gate_up[:, :half].clamp(max=limit)
    up = gate_up[:, half:].clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


class CheckpointExperts(ExpertStack):
    """One projection of every expert as a checkpoint has it, in float: weight [E, out, in], optional bias [E, out].
    The model is built with these (parameters the loader's state dict fills); the loader then puts the stack that
    serves in their place (`place_experts`): a quantized CPU form (engine/model/quant/experts.py) or, on CUDA,
    `KernelExperts`."""

    def __init__(self, experts: int, out_features: int, in_features: int, bias: bool) -> None:
        super().__init__()
        self.num_experts, self.out_features, self.in_features = experts, out_features, in_features
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(experts, out_features), requires_grad=False)
        else:
            self.register_buffer("bias", None)

    def expert_matmul(self, x: Tensor, expert: int, deterministic: bool) -> Tensor:
        return float_expert_matmul(x, self.weight[expert], deterministic)

    def dequantize_expert(self, expert: int) -> Tensor:
        return self.weight[expert].float()


class KernelExperts(ExpertStack):
    """A stack in the fused MoE kernel's formats (engine/kernels/moe.py `ExpertWeights`: dense, MXFP4 or int4),
    on the GPU; `matmul` (the eager reference) dequantizes an expert."""

    def __init__(self, weights: "ExpertWeights", bias: Optional[Tensor], dtype: torch.dtype) -> None:
        super().__init__()
        e, out_f, in_f = weights.shape
        self._init_stack(e, out_f, in_f, bias, dtype)
        self.format = weights.format
        self.register_buffer("data", weights.data)
        self.register_buffer("scales", weights.scales)
        self.register_buffer("offsets", weights.offsets)

    @torch.jit.unused
    def kernel_weights(self) -> "ExpertWeights":
        from engine.kernels.moe import ExpertWeights

        return ExpertWeights(self.format, self.data, self.scales, self.offsets)

    @torch.jit.unused
    def expert_matmul(self, x: Tensor, expert: int, deterministic: bool) -> Tensor:
        from engine.kernels.moe import expert_matrix

        return F.linear(x, expert_matrix(self.kernel_weights(), expert, x.dtype))

    @torch.jit.unused
    def dequantize_expert(self, expert: int) -> Tensor:
        from engine.kernels.moe import expert_matrix

        return expert_matrix(self.kernel_weights(), expert, torch.float32)


@torch.jit.unused
def _fused_experts(x: Tensor, ids: Tensor, weights: Tensor, gate_up: nn.Module, down: nn.Module, clamp: bool,
                   alpha: float, limit: float) -> Tensor:
    from engine.kernels.moe import fused_experts

    return fused_experts(x, ids, weights, _kernel_weights(gate_up), _kernel_weights(down), gate_up.bias, down.bias,
                         "swiglu_clamp" if clamp else "silu", alpha, limit)


def _kernel_weights(stack: nn.Module) -> Any:
    if isinstance(stack, KernelExperts):
        return stack.kernel_weights()
    if isinstance(stack, CheckpointExperts):
        return stack.weight
    raise TypeError(f"{type(stack).__name__} experts do not run on a GPU (the loader places KernelExperts there)")


class MoEExperts(nn.Module):
    """Every routed expert of one layer: `gate_up` [E, 2I, H] and `down` [E, H, I] stacks."""

    def __init__(self, moe: MoEConfig, hidden: int) -> None:
        super().__init__()
        self.gate_up: ExpertStack = CheckpointExperts(moe.num_experts, 2 * moe.expert_intermediate, hidden,
                                                      moe.expert_bias)
        self.down: ExpertStack = CheckpointExperts(moe.num_experts, hidden, moe.expert_intermediate, moe.expert_bias)
        self.num_experts = moe.num_experts
        self.clamp = moe.activation == "swiglu_clamp"
        self.alpha, self.limit = float(moe.swiglu_alpha), float(moe.swiglu_limit)

    def forward(self, x: Tensor, ids: Tensor, weights: Tensor, deterministic: bool) -> Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) → [N, H] in x's dtype."""
        if not torch.jit.is_scripting():
            if x.is_cuda:
                return _fused_experts(x, ids, weights, self.gate_up, self.down, self.clamp, self.alpha, self.limit)
        k = ids.shape[1]
        if x.shape[0] == 1:  # one token (a single stream's decode): no grouping to do
            slots: List[int] = ids[0].tolist()
            return self._one_token(x, slots, weights[0], deterministic)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert, tokens in order
        counts: List[int] = torch.bincount(flat, minlength=self.num_experts).tolist()
        pair_weights = weights.reshape(-1).index_select(0, order)
        tokens = torch.div(order, k, rounding_mode="floor")
        # Summed in float32: a token's k contributions are added in expert order, whatever its neighbours.
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        for expert in range(self.num_experts):
            count = counts[expert]
            if count == 0:
                continue
            rows = tokens[start:start + count]
            hidden = self.gate_up.matmul(x.index_select(0, rows), expert, deterministic)
            act = expert_activation(hidden, self.clamp, self.alpha, self.limit)
            y = self.down.matmul(act, expert, deterministic).float()
            out.index_add_(0, rows, y * pair_weights[start:start + count].unsqueeze(1))
            start += count
        return out.to(x.dtype)

    def _one_token(self, x: Tensor, ids: List[int], weights: Tensor, deterministic: bool) -> Tensor:
        """The grouped sum for one token x [1, H], its experts taken in id order as there (the same float32 sums, so
        a deterministic step gives a token the same output alone as beside others)."""
        order: List[int] = []
        for j in range(len(ids)):  # insertion sort of the k slots by expert id: k is a handful
            at = len(order)
            while at > 0 and ids[order[at - 1]] > ids[j]:
                at -= 1
            order.insert(at, j)
        out = torch.zeros(1, x.shape[1], dtype=torch.float32, device=x.device)
        for j in order:
            expert = ids[j]
            act = expert_activation(self.gate_up.matmul(x, expert, deterministic), self.clamp, self.alpha, self.limit)
            out = out + self.down.matmul(act, expert, deterministic).float() * weights[j:j + 1].unsqueeze(1)
        return out.to(x.dtype)


class _Absent(nn.Module):
    """Stands in for a shared expert a family does not have (TorchScript compiles the branch that never calls it)."""

    def forward(self, x: Tensor, packed_rows: int, deterministic: bool) -> Tensor:
        return x


class MoEMLP(nn.Module):
    """The mixture-of-experts MLP, called like GatedMLP: router, routed experts, and the optional shared expert."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.router = Linear(cfg.hidden_size, moe.num_experts, bias=moe.router_bias)
        self.experts = MoEExperts(moe, cfg.hidden_size)
        self.top_k = moe.top_k
        self.top_k_first = moe.router == "topk_softmax"
        self.renormalize = bool(moe.renormalize)
        self.has_shared = moe.shared_intermediate > 0
        if self.has_shared:
            self.shared_expert = GatedMLP(cfg, moe.shared_intermediate)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)
        else:
            self.shared_expert = _Absent()
            self.shared_expert_gate = _Absent()

    def forward(self, x: Tensor, packed_rows: int, deterministic: bool) -> Tensor:
        # The router is float32 (never quantized, never bfloat16): its top-k choice flips on small errors. (A
        # bfloat16 matmul of this size is also slower than a float32 one on CPUs without AMX.)
        logits = self.router(x.to(self.router.weight.dtype), 0, deterministic)
        weights, ids = route(logits, self.top_k, self.top_k_first, self.renormalize)
        out = self.experts(x, ids, weights, deterministic)
        if self.has_shared:
            gate = torch.sigmoid(self.shared_expert_gate(x, 0, deterministic))
            out = out + gate * self.shared_expert(x, packed_rows, deterministic)
        return out


def build_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    """The MLP of block `layer`: MoEMLP on a mixture-of-experts model's sparse layers, else GatedMLP."""
    if cfg.moe is not None and layer not in cfg.moe.dense_layers:
        return MoEMLP(cfg)
    return GatedMLP(cfg)
