"""The tensor-parallel modules: each wraps a rank's share of a layer (dense or packed, engine/model/quant/formats.py) and adds the
collective that makes its output whole, over the process group named at load (`group`, an attribute of the layer).

The collectives are torch's functional ones (`torch.ops._c10d_functional`): plain operators, so the decoder stack
still runs as one TorchScript call on CPU (engine/model/decoder.py), and with NCCL they are kernels on the current
stream that a CUDA graph captures, with no host synchronisation inside a step.
"""
# No `from __future__ import annotations`: TorchScript reads the annotations of what it compiles as types.
import torch
from torch import Tensor, nn

from engine.config import ModelConfig
from engine.model.moe import MoEMLP
from engine.parallel.sharding import Shard


def all_reduce(x: Tensor, group: str) -> Tensor:
    """The sum of `x` over the ranks of `group`, in place."""
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce_(x, "sum", group))


def all_gather_columns(x: Tensor, world: int, group: str) -> Tensor:
    """Every rank's [R, C] side by side: [R, world * C], rank r's columns at [r * C, (r + 1) * C)."""
    rows, cols = x.shape[0], x.shape[1]
    gathered = torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), world, group))  # [world * R, C]
    return gathered.view(world, rows, cols).transpose(0, 1).reshape(rows, world * cols)


class RowParallel(nn.Module):
    """A row-parallel projection (o, down): this rank's input columns of the weight; the partial products are summed
    over the ranks. A bias would be added once per rank: the wrapped layer has none, or (`bias_sharded`) the loader
    gave the whole bias to rank 0 and zeros to the others (engine/parallel/sharding.py)."""

    def __init__(self, inner: nn.Module, group: str, bias_sharded: bool = False) -> None:
        super().__init__()
        if getattr(inner, "bias", None) is not None and not bias_sharded:
            raise ValueError("a row-parallel layer takes no bias")
        self.inner, self.group = inner, group

    def forward(self, x: Tensor, packed_rows: int, deterministic: bool) -> Tensor:
        return all_reduce(self.inner(x, packed_rows, deterministic).contiguous(), self.group)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, start + rows) of the embedding; other ids give zeros here, and the sum over the
    ranks is every id's own row."""

    def __init__(self, inner: nn.Module, start: int, rows: int, group: str) -> None:
        super().__init__()
        self.inner, self.start, self.rows, self.group = inner, start, rows, group

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        x = self.inner(torch.where(inside, local, torch.zeros_like(local)))
        return all_reduce(x.masked_fill(~inside.unsqueeze(-1), 0.0), self.group)


class GatheredLMHead(nn.Module):
    """This rank's vocabulary rows of the output projection; the logits of all ranks gathered side by side, the
    padding past `vocab` dropped. Every rank gets them (an all-gather, which every backend has); rank 0 samples."""

    def __init__(self, inner: nn.Module, vocab: int, world: int, group: str) -> None:
        super().__init__()
        self.inner, self.vocab, self.world, self.group = inner, vocab, world, group

    def forward(self, x: Tensor, packed_rows: int, deterministic: bool) -> Tensor:
        local = self.inner(x, packed_rows, deterministic)
        return all_gather_columns(local, self.world, self.group)[:, :self.vocab]


def parallelize(model: nn.Module, cfg: ModelConfig, shard: Shard, group: str) -> None:
    """Wrap the loaded shares of `model` (engine/parallel/sharding.py) in the modules that communicate over `group`."""
    for block in model.layers:
        block.self_attn.o_proj = RowParallel(block.self_attn.o_proj, group, bias_sharded=cfg.o_proj_bias)
        if isinstance(block.mlp, MoEMLP):  # routed and shared experts' partial sums, reduced once
            block.mlp = RowParallel(block.mlp, group)
        else:
            block.mlp.down_proj = RowParallel(block.mlp.down_proj, group)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, shard.vocab_start, shard.vocab_rows, group)
    model.lm_head = GatheredLMHead(model.lm_head, cfg.vocab_size, shard.size, group)
