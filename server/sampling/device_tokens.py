"""`DeviceTokens`: a step's sampled tokens on the device, on their way to the host (async scheduling).

With async scheduling (server/scheduling/scheduler.py) the next step is launched before the host has this step's tokens: it
reads them on the device (engine.model.batch.TokenFeed), while their copy to pinned host memory runs behind this step's
sampling on the same stream. Only plain greedy batches (sampling.is_plain_greedy) are sampled this way: their
tokens are an argmax on the device, with no host state to update before the next step's sampling.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from server.sampling.sampler import SequenceSampler, check_logits, greedy_tokens, is_plain_greedy


class TokenLanding:
    """Where a step's tokens land on the host: pinned memory and an event, reused step after step (one step's
    tokens are taken before the next step's are sampled), so that a step costs no allocation. Each torch call
    releases the GIL and may wait to get it back from a busy event loop: a step makes as few as it can."""

    def __init__(self, rows: int) -> None:
        self.host = torch.empty(rows, dtype=torch.long, pin_memory=True)
        self.event = torch.cuda.Event()


class DeviceTokens:
    """Tokens [R] on the device (what the next step reads) and their copy to the host, started at once."""

    def __init__(self, tokens: torch.Tensor, landing: TokenLanding | None = None) -> None:
        self.tokens = tokens
        self._event: torch.cuda.Event | None = None
        if tokens.device.type == "cuda":
            if landing is None or len(landing.host) < len(tokens):
                landing = TokenLanding(len(tokens))
            self._host = landing.host[:len(tokens)]
            self._host.copy_(tokens, non_blocking=True)
            self._event = landing.event
            self._event.record()
        else:
            self._host = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def collect(self) -> list[int]:
        """The tokens on the host, once their copy is done (waiting for it without holding the GIL)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


def sample_greedy_on_device(logits: torch.Tensor, samplers: Sequence[SequenceSampler],
                            landing: TokenLanding | None = None) -> DeviceTokens | None:
    """The rows' tokens as `sample_batch` picks them, left on the device (their copy to the host lands in
    `landing`); None unless every row is plain greedy."""
    check_logits(logits, samplers)
    if not samplers or not is_plain_greedy(samplers):
        return None
    return DeviceTokens(greedy_tokens(logits), landing)


__all__ = ["DeviceTokens", "TokenLanding", "sample_greedy_on_device"]
