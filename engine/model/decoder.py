"""`DecoderModel`: embedding, a stack of family blocks, final norm and LM head, run over a flat `ForwardBatch`.

The stack of blocks runs as one TorchScript call on CPU: the same modules compiled (engine/model/layers.py), bit-identical
to running them eagerly. A step is some 40 small operator calls per layer; from Python each costs dispatch overhead
and each releases and re-takes the GIL, so in a server every step queued behind the event loop's Python again and
again (an 8-row step beside a thread running Python a small part of the time took markedly longer than alone:
bench/RESULTS.md#issue-5-cpu-scripted-decode). Scripted,
they run in TorchScript's interpreter with the GIL released throughout. On other devices the modules run eagerly
(captured in CUDA graphs for decode steps, engine/runtime/cuda_graphs.py).
"""
from __future__ import annotations

import logging
import time
import warnings

import torch
from torch import nn

from engine.model.batch import ForwardBatch
from engine.config import ModelConfig
from engine.cache.kv_cache import PagedKVCache
from engine.kernels.fused import add_rms_norm
from engine.model.layers import (CPU_PAGED_DECODE, DecoderStack, Linear, RMSNorm, RopeTables, embedding_table,
    rope_attention_factor, rope_inv_freq, rope_lookup, rope_table)

log = logging.getLogger("emberserve.engine")


class DecoderModel(nn.Module):
    """A decoder-only transformer; `block_cls(cfg, layer)` supplies the family's layer."""

    def __init__(self, cfg: ModelConfig, block_cls: type[nn.Module]) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = embedding_table(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(block_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if self.norm.weight.is_meta:  # built to be loaded: the loader builds the tables for its context
            for name in ("inv_freq", "local_inv_freq", "rope_cos", "rope_sin", "local_rope_cos", "local_rope_sin"):
                self.register_buffer(name, None, persistent=False)
        else:
            self.set_rope(rope_inv_freq(cfg.rope, cfg.head_dim),
                          rope_inv_freq(cfg.local_rope, cfg.head_dim) if cfg.local_rope else None,
                          cfg.max_position, torch.float32)
        # On CPU the stack runs scripted, built on the first step; False keeps it eager everywhere.
        self.script = True
        self.__dict__["_stack"] = DecoderStack(self.layers)  # not submodules: they are the model's own layers
        self.__dict__["_scripted"] = None

    def refresh(self) -> None:
        """Recompute what derives from loaded weights (the norms' bfloat16 CPU tables)."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.refresh()

    def set_rope(self, inv_freq: torch.Tensor, local_inv_freq: torch.Tensor | None, positions: int,
                 dtype: torch.dtype) -> None:
        """Build the rope tables of positions 0 .. `positions` - 1 in `dtype`, on `inv_freq`'s device (cos and sin
        times the config's rope attention factor: yarn's).

        Every step reads its positions' rows of the same tables: a token's rotation does not depend on when it
        is computed. (Computed per step, torch's CPU cos gave a few entries one unit different in a process's
        first call after other kernels had run: the first prompt's keys differed from a later run's.)"""
        every = torch.arange(positions, device=inv_freq.device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("local_inv_freq", local_inv_freq, persistent=False)
        factors = (rope_attention_factor(self.cfg.rope), rope_attention_factor(self.cfg.local_rope))
        for prefix, inv, factor in (("", inv_freq, factors[0]), ("local_", local_inv_freq, factors[1])):
            cos, sin = rope_table(inv, every, dtype, factor) if inv is not None else (None, None)
            self.register_buffer(f"{prefix}rope_cos", cos, persistent=False)
            self.register_buffer(f"{prefix}rope_sin", sin, persistent=False)

    def rope_tables(self, positions: torch.Tensor) -> RopeTables:
        """The step's rotation tables, in the compute dtype (positions [N] below the range `set_rope` built)."""
        cos, sin = rope_lookup(self.rope_cos, self.rope_sin, positions)
        if self.local_rope_cos is None:
            return RopeTables(cos, sin, cos, sin)
        return RopeTables(cos, sin, *rope_lookup(self.local_rope_cos, self.local_rope_sin, positions))

    def stack(self, scripted: bool) -> nn.Module:
        """The module that runs the layers: scripted (built on first use) if asked and possible, else the eager one."""
        if not (scripted and self.script):
            return self._stack
        if self._scripted is None:
            self.__dict__["_scripted"] = _script(self._stack) or False
        return self._scripted or self._stack

    def forward(self, batch: ForwardBatch, cache: PagedKVCache, hidden_states: bool = False) -> torch.Tensor:
        """Float32 logits [R, vocab] at the batch's `logit_index` positions; with `hidden_states`, the final norm's
        output [R, hidden] there instead (what embeddings pool), in the compute dtype."""
        x = self.embed_tokens(batch.ids)
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        rope = self.rope_tables(batch.positions)
        # Unoptimized execution: the same speed here, without the profiling executor's slow re-optimizing runs on
        # the first calls of a scripted stack (bench/RESULTS.md#issue-5-cpu-scripted-decode); nothing for an eager one.
        with torch.jit.optimized_execution(False):
            # (paged batches call the Triton kernels, which only the eager stack can: GPU steps, or tests; on CPU
            # block tables go to the compiled CPU kernels, which the scripted stack calls)
            paged = batch.block_tables is not None or batch.paged_prefill is not None
            scriptable = x.is_cpu and (not paged or CPU_PAGED_DECODE)
            branch, residual = self.stack(scriptable)(x, batch, rope, cache.keys, cache.values)
        rows = batch.logit_index  # the last block's add, and the final norm, for the rows whose logits are returned
        x, _ = add_rms_norm(branch.index_select(0, rows), residual.index_select(0, rows), self.norm.weight,
                            self.norm.eps, self.norm.doubled)
        if hidden_states:
            return x
        logits = self.lm_head(x, x.shape[0], batch.deterministic).float()
        if self.cfg.final_logit_softcap:
            cap = self.cfg.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits


def _script(stack: DecoderStack) -> torch.jit.ScriptModule | None:
    """The stack scripted, or None when a layer has no scripted form (then the eager path serves)."""
    started = time.perf_counter()
    try:
        with warnings.catch_warnings():
            # TorchScript is deprecated in favour of torch.compile, which does not pay here: compiled per layer, its
            # guards cost what it saves; compiled per step, it takes long to compile and recompiles as the context
            # grows (bench/RESULTS.md#issue-5-cpu-scripted-decode).
            warnings.simplefilter("ignore", DeprecationWarning)
            scripted = torch.jit.script(stack)
    except Exception as e:  # noqa: BLE001 - any TorchScript failure leaves the eager stack, which is the same maths
        log.warning("the decoder stack stays eager: %s", e)
        return None
    log.debug("scripted the decoder stack in %.2f s", time.perf_counter() - started)
    return scripted
