"""`Runner`: the host-driven loop over one decoder: prefill, cached decode, sessions and their snapshots."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import ModelConfig
from .errors import ContextLengthError
from .kv_cache import KVCache
from .models import DecoderModel
from .tokenizer import Tokenizer

SESSION_SLOT = 0


@dataclass(frozen=True)
class SessionSnapshot:
    """A session frozen for reuse: its token history and the keys/values computed for it."""

    tokens: tuple[int, ...]
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    def __len__(self) -> int:
        return len(self.tokens)


class Runner:
    """Owns a decoder, its tokenizer and a KV cache; exposes logits for the caller's own sampling loop."""

    def __init__(self, model: DecoderModel, tokenizer: Tokenizer, *, name: str, device: torch.device,
                 dtype: torch.dtype, max_context: int | None = None,
                 generation_defaults: dict[str, Any] | None = None) -> None:
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.config: ModelConfig = model.cfg
        self.device, self.dtype = device, dtype
        trained = self.config.max_position
        if max_context is not None and not 0 < max_context <= trained:
            raise ValueError(f"max_context must be between 1 and the model's trained context {trained}, got {max_context}")
        self.context_size = max_context or trained
        self.generation_defaults = dict(generation_defaults or {})
        cfg = self.config
        self.cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, self.context_size, dtype, device)
        self.tokens: list[int] = []

    @property
    def family(self) -> str:
        return self.config.family

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def _check_fits(self, length: int) -> None:
        if length > self.context_size:
            raise ContextLengthError(
                f"sequence of {length} tokens exceeds the context size of {self.context_size} tokens")

    @torch.inference_mode()
    def _extend(self, new_ids: Sequence[int], all_logits: bool) -> torch.Tensor:
        """Run `new_ids` after the current session tokens; logits [T, vocab] or for the last token [vocab]."""
        if not new_ids:
            raise ValueError("at least one token is needed")
        start = len(self.tokens)
        self._check_fits(start + len(new_ids))
        self.cache.ensure_capacity(start + len(new_ids))
        ids = torch.tensor([list(new_ids)], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(new_ids), device=self.device).unsqueeze(0)
        batch = self.model.make_batch([SESSION_SLOT], positions, self.dtype)
        rows = None if all_logits else torch.tensor([len(new_ids) - 1], device=self.device)
        logits = self.model(ids, batch, self.cache, rows)
        self.tokens.extend(int(t) for t in new_ids)
        return logits if all_logits else logits[0]

    def _validate_ids(self, ids: Sequence[int]) -> list[int]:
        ids = [int(t) for t in ids]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return ids

    def prefill_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Start a new session with `ids`; next-token logits [vocab], float32."""
        ids = self._validate_ids(ids)
        self.tokens = []
        return self._extend(ids, all_logits=False)

    def predict_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Start a new session with `ids`; logits [len(ids), vocab] after every prefix (row i predicts ids[i+1])."""
        ids = self._validate_ids(ids)
        self.tokens = []
        return self._extend(ids, all_logits=True)

    def decode_logits(self, token: int) -> torch.Tensor:
        """Append one token to the session using the KV cache; next-token logits [vocab]."""
        if not self.tokens:
            raise RuntimeError("decode_logits needs a session: call prefill_logits first")
        return self._extend(self._validate_ids([token]), all_logits=False)

    @torch.inference_mode()
    def export_session(self) -> SessionSnapshot:
        """A snapshot of the current session (a copy: later decoding does not change it)."""
        return SessionSnapshot(tuple(self.tokens), self.cache.export_slot(SESSION_SLOT, len(self.tokens)))

    @torch.inference_mode()
    def restore_session(self, snapshot: SessionSnapshot, length: int | None = None) -> None:
        """Make the snapshot (or its first `length` tokens) the current session."""
        length = len(snapshot) if length is None else length
        if not 0 <= length <= len(snapshot):
            raise ValueError(f"cannot restore {length} tokens from a snapshot of {len(snapshot)}")
        self._check_fits(length)
        self.cache.import_slot(SESSION_SLOT, snapshot.kv, length)
        self.tokens = list(snapshot.tokens[:length])

    def reset_session(self) -> None:
        """Forget the current session; its cache slot is free for the next one."""
        self.tokens = []

    def prefill_logits_reusing(self, ids: Sequence[int], snapshot: SessionSnapshot, reuse_len: int) -> torch.Tensor:
        """Like prefill_logits, but takes the first `reuse_len` tokens from the snapshot and computes only the rest."""
        ids = self._validate_ids(ids)
        if not 0 <= reuse_len <= min(len(snapshot), len(ids)):
            raise ValueError(f"reuse_len {reuse_len} must be within the snapshot ({len(snapshot)}) and the prompt ({len(ids)})")
        if tuple(ids[:reuse_len]) != snapshot.tokens[:reuse_len]:
            raise ValueError("the reused prefix differs from the snapshot's tokens")
        # At least the last prompt token is recomputed: its logits are the answer.
        reuse_len = min(reuse_len, len(ids) - 1)
        self.restore_session(snapshot, reuse_len)
        return self._extend(ids[reuse_len:], all_logits=False)

    def common_prefix_len(self, ids: Sequence[int], snapshot: SessionSnapshot) -> int:
        """How many leading tokens of `ids` the snapshot already holds."""
        n = 0
        for a, b in zip(ids, snapshot.tokens):
            if a != b:
                break
            n += 1
        return n

    def generate(self, ids: Sequence[int], n: int, on_token: Callable[[int], bool] | None = None) -> list[int]:
        """Greedy: up to `n` new tokens after `ids`, each passed to `on_token`, which returns False to stop."""
        out: list[int] = []
        if n <= 0:
            return out
        logits = self.prefill_logits(ids)
        while True:
            token = int(torch.argmax(logits))
            out.append(token)
            if on_token is not None and on_token(token) is False:
                break
            if len(out) >= n or len(self.tokens) >= self.context_size:
                break
            logits = self.decode_logits(token)
        return out
