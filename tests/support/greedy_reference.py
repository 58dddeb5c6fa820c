"""Greedy decoding in the test process with the engine the server runs: the reference for e2e outputs."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class Reference:
    """Greedy decoding in the test process with the engine the server runs."""

    def __init__(self, runner) -> None:
        self.runner, self.tok = runner, runner.tokenizer
        self.end_ids = set(self.tok.end_token_ids)
        self._cache: dict[tuple, list[int]] = {}

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return self.tok.apply_chat_template(messages, add_generation_prompt=True)

    def generate(self, ids: Sequence[int], n: int, *, stop_at_end: bool = True,
                 adjust: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None) -> list[int]:
        """Up to `n` tokens, each the argmax of `adjust(logits, tokens so far)` (the raw logits without adjust)."""
        key = (tuple(ids), stop_at_end)
        cached = self._cache.get(key) if adjust is None else None
        if cached is not None and (len(cached) >= n or (stop_at_end and cached[-1] in self.end_ids)):
            return cached[:n]
        out: list[int] = []
        logits = self.runner.prefill_logits(list(ids))
        while True:
            x = logits.float().clone()
            if adjust is not None:
                x = adjust(x, out)
            out.append(int(x.argmax()))
            if len(out) >= n or (stop_at_end and out[-1] in self.end_ids):
                break
            logits = self.runner.decode_logits(out[-1])
        if adjust is None:
            self._cache[key] = out
        return out

    def text(self, tokens: Sequence[int]) -> str:
        return self.tok.decode(list(tokens), skip_special_tokens=True)

    def finish_reason(self, tokens: Sequence[int]) -> str:
        return "stop" if tokens and tokens[-1] in self.end_ids else "length"

    def logprobs(self, ids: Sequence[int], generated: Sequence[int]) -> torch.Tensor:
        """Row i: log_softmax of the engine's logits for the position of generated[i]."""
        logits = self.runner.predict_logits(list(ids) + list(generated[:-1]))
        return torch.log_softmax(logits[len(ids) - 1:].float(), -1)


def spanning_stop(text_of: Callable[[Sequence[int]], str], tokens: Sequence[int], start_token: int,
                  spanned: int = 2) -> tuple[str, int]:
    """A substring of the decoded `tokens` from the last character of token `start_token` into the first character
    of token `start_token + spanned` (so it spans `spanned + 1` tokens), occurring nowhere earlier; and the number
    of tokens needed to complete it."""
    for b in range(start_token, len(tokens) - spanned):
        begin = len(text_of(tokens[:b + 1])) - 1
        end = len(text_of(tokens[:b + spanned])) + 1
        text = text_of(tokens)
        stop = text[begin:end]
        if (len(text_of(tokens[:b])) <= begin and len(text_of(tokens[:b + spanned + 1])) >= end
                and stop.strip() and text.find(stop) == begin):
            needed = next(m for m in range(1, len(tokens) + 1) if stop in text_of(tokens[:m]))
            return stop, needed
    raise AssertionError(f"no stop string spanning tokens after {start_token} in {text_of(tokens)!r}")
