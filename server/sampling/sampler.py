"""Batched next-token sampling with per-row parameters, vectorised over the batch.

Order of processing, per row, on a float32 copy of the logits:

1. `logit_bias` is added to the raw logits (vLLM's order: bias before penalties).
2. Penalties: repetition (HF/vLLM: over prompt and generated tokens, a positive logit is divided by the
   penalty, any other multiplied), then frequency and presence (OpenAI: over generated tokens only,
   `logit -= frequency * count + presence * (count > 0)`). Then the grammar's mask (`allowed`, the constrained
   rows only): the tokens it forbids are -inf.
3. Greedy rows (temperature below `GREEDY_TEMPERATURE`, 1e-5 as in vLLM: dividing by less only amplifies
   rounding) take the argmax. The others go on:
4. temperature → top-k → top-p → min-p → one inverse-CDF draw.

Top-k keeps exactly the k most likely tokens (ties broken by sort order). Top-p keeps the smallest set of most
likely tokens whose probability, renormalised after top-k, reaches top_p. Min-p keeps the tokens whose
probability is at least min_p times the most likely one's.

Every value the request schema accepts, and any logits, give a token (the sampler is total):
- The adjustments are float32 arithmetic, so extreme values saturate (a positive logit divided by a repetition
  penalty of 1e-300 is +inf). In the adjusted logits NaN counts as -inf and +inf as the largest float32, so a NaN
  logit (a model bug) is never drawn, and the tokens that overflowed share the probability equally.
- A row in which no token is possible (every adjusted logit -inf: all logits NaN or -inf, or every token
  suppressed) gets token 0 rather than an error.
- Temperature neither overflows nor loses the probabilities to rounding: a row whose largest logit over the
  temperature exceeds `SHIFT_ABOVE` (2**16) in magnitude has that logit subtracted before the division. Softmax
  does not change, and ordinary rows are divided as they are, bit for bit.
- A top_p too small for float32 still keeps the most likely token.

Logprobs are the model's raw distribution: `log_softmax` of the logits as given, before bias, penalties,
temperature and truncation (vLLM's default "raw logprobs"), so they do not depend on the sampling parameters.
There too NaN counts as -inf and +inf as the largest float32; a row without a finite logit has logprobs -inf.
They are computed by `token_logprobs` (server/sampling/logprobs.py), as are echoed prompt logprobs.

Randomness: each sampled row draws one uniform per step from its own `torch.Generator`, so a row's token never
depends on which other rows share the batch. The generator lives on the CPU whatever the device: drawing one
number there is cheaper than a device launch, the batch's uniforms then travel in one copy, and a seeded request
draws the same uniforms on any device.
"""
from __future__ import annotations

import copy
import hashlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from server.grammar.token_bitmask import apply_token_bitmask
from server.sampling.params import GREEDY_TEMPERATURE, SamplingParams, out_of_vocabulary
from server.sampling.logprobs import token_logprobs

# Top-k/top-p look at the most likely candidates first: a full sort of a 262k vocabulary costs far more than the
# top 64 (bench/RESULTS.md#issue-32-sampler-candidate-tiers). A row moves to the next tier only if its nucleus
# does not fit.
_CANDIDATE_TIERS = (64, 256, 4096)
_F32_TINY = 2.0 ** -149  # the smallest positive float32: a positive parameter never rounds to 0
# Beyond this |logit / temperature| float32 keeps under 8 fractional bits: enough to blur ties (logsumexp of two
# equal values would round the log 2 away) and, far beyond, to overflow. Such rows subtract their largest logit first.
SHIFT_ABOVE = 2.0 ** 16


def _seed_for(seed: int, offset: int) -> int:
    """A 64-bit generator seed from (seed, offset), the same in every process."""
    return int.from_bytes(hashlib.sha256(f"emberserve:{seed}:{offset}".encode()).digest()[:8], "little")


def _token_ids(ids: Sequence[int], vocab_size: int, what: str) -> list[int]:
    ids = [int(t) for t in ids]
    bad = out_of_vocabulary(ids, vocab_size)
    if bad:
        raise ValueError(f"{what} ids out of range [0, {vocab_size}): {bad[:5]}")
    return ids


class SequenceSampler:
    """Per-sequence sampling state: its params, a torch.Generator, counts of generated tokens, prompt-token mask."""

    def __init__(self, params: SamplingParams, vocab_size: int, prompt_ids: Sequence[int],
                 device: torch.device | str = "cpu", seed_offset: int = 0) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.params, self.vocab_size, self.device = params, vocab_size, torch.device(device)
        self.generator = torch.Generator()
        self.generator.manual_seed(int.from_bytes(os.urandom(8), "little") if params.seed is None
                                   else _seed_for(params.seed, seed_offset))
        # Ordinary tensors even when built under inference_mode, so that observe() may update them anywhere.
        with torch.inference_mode(False):
            penalised = (params.presence_penalty != 0 or params.frequency_penalty != 0
                         or params.repetition_penalty != 1)
            self.counts = torch.zeros(vocab_size, device=self.device) if penalised else None
            # 0/1 in float32 like counts: float arithmetic is several times faster than boolean kernels on CPU.
            self.prompt_mask: torch.Tensor | None = None
            if params.repetition_penalty != 1:
                self.prompt_mask = torch.zeros(vocab_size, device=self.device)
                ids = _token_ids(prompt_ids, vocab_size, "prompt token")
                if ids:
                    self.prompt_mask[torch.tensor(ids, device=self.device)] = 1
            self.bias_ids: torch.Tensor | None = None
            self.bias_values: torch.Tensor | None = None
            if params.logit_bias:
                ids = _token_ids(list(params.logit_bias), vocab_size, "logit_bias token")
                self.bias_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
                self.bias_values = torch.tensor(list(params.logit_bias.values()), device=self.device)
        # Token ids that may not be drawn at the next step (set by the caller: the end tokens before min_tokens).
        self.suppressed: torch.Tensor | None = None

    def observe(self, token: int) -> None:
        """Record a generated token (for penalties)."""
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token {token} out of range [0, {self.vocab_size})")
        if self.counts is not None:
            with torch.no_grad():
                self.counts[token] += 1

    def lookahead(self, tokens: Sequence[int]) -> list[SequenceSampler]:
        """Views of this sampler after each prefix of `tokens` (len(tokens) + 1 of them), for verifying drafted
        tokens: view i penalises as if tokens[:i] had been observed. They share this sampler's generator; `observe`
        on a view does not change this sampler, and `suppressed` is each view's own."""
        views, counts = [], self.counts
        ids = _token_ids(tokens, self.vocab_size, "draft token")
        for i in range(len(ids) + 1):
            view = copy.copy(self)
            if counts is not None and i:
                with torch.inference_mode(False), torch.no_grad():
                    counts = counts.clone()
                    counts[ids[i - 1]] += 1
            view.counts = counts
            views.append(view)
        return views

    def draw_uniform(self) -> float:
        """The next uniform in [0, 1) from this sequence's own generator."""
        return torch.rand((), generator=self.generator, dtype=torch.float64).item()


@dataclass
class SampledToken:
    token: int
    logprob: float | None  # None unless params.logprobs
    top_logprobs: list[tuple[int, float]] | None  # most likely first; None unless params.logprobs


def _acc_dtype(device: torch.device) -> torch.dtype:
    # Cumulative sums over a vocabulary need float64; MPS has none.
    return torch.float32 if device.type == "mps" else torch.float64


def check_logits(logits: torch.Tensor, samplers: Sequence[SequenceSampler]) -> None:
    """Logits [len(samplers), vocab] with the samplers' vocabulary, or ValueError."""
    if logits.dim() != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"logits must be [{len(samplers)}, vocab], got {list(logits.shape)}")
    for s in samplers:
        if s.vocab_size != logits.shape[1]:
            raise ValueError(f"sampler vocab_size {s.vocab_size} does not match logits vocab {logits.shape[1]}")


# A packed token bitmask [R, words] (server.grammar.token_bitmask) and the R rows of the batch it constrains.
AllowedTokens = tuple[torch.Tensor, Sequence[int]]


def _adjusted_logits(logits: torch.Tensor, samplers: Sequence[SequenceSampler],
                     allowed: AllowedTokens | None = None) -> torch.Tensor:
    """The logits after logit_bias, penalties and the grammar's mask, made safe to sample from (see the module
    docstring); a copy."""
    x = logits.float()
    biased = [(i, s) for i, s in enumerate(samplers) if s.bias_ids is not None]
    repeated = [(i, s) for i, s in enumerate(samplers) if s.params.repetition_penalty != 1]
    counted = [(i, s) for i, s in enumerate(samplers)
               if s.params.presence_penalty != 0 or s.params.frequency_penalty != 0]
    suppressed = [(i, s) for i, s in enumerate(samplers) if s.suppressed is not None]
    masked = allowed is not None and len(allowed[1]) > 0
    if not (biased or repeated or counted or suppressed or masked):
        return _sampleable(x, own=x is not logits)
    x = x.clone() if x is logits else x
    dev = x.device
    if biased:
        # Not repeat_interleave: on a CPU with several threads it takes milliseconds even for a handful of ids.
        rows = torch.cat([torch.full_like(s.bias_ids, i) for i, s in biased])
        ids = torch.cat([s.bias_ids for _, s in biased])
        x.index_put_((rows, ids), torch.cat([s.bias_values for _, s in biased]), accumulate=True)
    # where() rather than a 0/1 lerp: a lerp turns an infinite logit (or quotient) into NaN for every token.
    if repeated:
        index, sub = _rows(x, [i for i, _ in repeated])
        seen = torch.stack([s.prompt_mask for _, s in repeated]).add_(torch.stack([s.counts for _, s in repeated]))
        penalty = torch.tensor([max(s.params.repetition_penalty, _F32_TINY) for _, s in repeated], device=dev)[:, None]
        penalised = (sub / penalty).where(sub > 0, sub * penalty)
        sub = penalised.where(seen > 0, sub)
        x = sub if index is None else x.index_copy_(0, index, sub)
    if counted:
        index, sub = _rows(x, [i for i, _ in counted])
        counts = torch.stack([s.counts for _, s in counted])
        pens = torch.tensor([[s.params.frequency_penalty, s.params.presence_penalty] for _, s in counted], device=dev)
        sub.addcmul_(counts, -pens[:, :1]).addcmul_(counts.clamp_(max=1), -pens[:, 1:])
        if index is not None:
            x.index_copy_(0, index, sub)
    for i, s in suppressed:
        x[i].index_fill_(0, s.suppressed, -math.inf)
    if masked:
        apply_token_bitmask(x, allowed[0], allowed[1])
    return _sampleable(x, own=True)


def _sampleable(x: torch.Tensor, own: bool) -> torch.Tensor:
    """NaN as -inf, +inf as the largest float32, and token 0 possible in a row where no token is; a copy unless own."""
    x = x.nan_to_num_(nan=-math.inf, neginf=-math.inf) if own else x.nan_to_num(nan=-math.inf, neginf=-math.inf)
    x[:, :1].masked_fill_(x.amax(-1, keepdim=True) == -math.inf, 0.0)
    return x


def _rows(x: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(index, a copy of those rows), or (None, x itself) when the rows are all of x."""
    if len(rows) == len(x):
        return None, x
    index = torch.tensor(rows, device=x.device)
    return index, x[index]


def _at_least(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """1.0 where x >= threshold, else 0.0; float arithmetic, far faster on CPU than a boolean mask."""
    return (x - threshold).sign_().add_(1).clamp_(max=1)


def _truncated(x: torch.Tensor, params: Sequence[SamplingParams]) -> Iterator[tuple[list[int], torch.Tensor,
                                                                                    torch.Tensor | None]]:
    """Temperature, top-k, top-p and min-p for sampled rows `x` [R, V].

    Yields groups (row positions, weights [n, S] proportional to the sampling probabilities, token ids of the
    S columns [n, S] or None when the columns are the whole vocabulary); every row is in exactly one group.
    """
    R, V = x.shape
    ks = [p.top_k if 0 < p.top_k < V else V for p in params]
    table = torch.tensor([[p.temperature, k, max(p.top_p, _F32_TINY) if p.top_p < 1 else math.inf, p.min_p]
                          for p, k in zip(params, ks)], device=x.device)
    x = _over_temperature(x, table[:, :1])
    # Rows without top-k/top-p skip the sort altogether.
    plain = [r for r in range(R) if ks[r] == V and params[r].top_p >= 1]
    if plain:
        # In place: x is this function's own copy, and no other group reads it when every row is plain.
        index, xp = _rows(x, plain)
        t = table if index is None else table[index]
        w = xp.sub_(xp.amax(-1, keepdim=True)).exp_()
        if any(params[r].min_p > 0 for r in plain):
            w.mul_(_at_least(w, t[:, 3:]))  # the most likely token has weight exactly 1
        yield plain, w, None
    if len(plain) < R:
        yield from _nucleus_groups(x, table, ks, [r for r in range(R) if ks[r] < V or params[r].top_p < 1])


def _over_temperature(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """x / temperature per row [R, 1], accurately: rows with a huge largest quotient subtract their largest logit."""
    top = x.amax(-1, keepdim=True)  # finite: _sampleable leaves no +inf and no row without a finite logit
    shift = top.where(top.abs() > SHIFT_ABOVE * temperature, 0.0)  # 0 for ordinary rows: (x - 0) / t is x / t
    return (x - shift).div_(temperature)


def _nucleus_groups(x: torch.Tensor, table: torch.Tensor, ks: list[int],
                    pending: list[int]) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Top-k, top-p and min-p over each row's most likely candidates, in tiers (see _CANDIDATE_TIERS)."""
    R, V = x.shape
    dev = x.device
    full_norm = None
    unlimited = [r for r in pending if ks[r] == V]
    if unlimited:
        # Without top-k, top-p is relative to the whole vocabulary: normalise by all of it, once.
        index, sub = _rows(x, unlimited)
        full_norm = sub.logsumexp(-1, keepdim=True)
        if index is not None:
            full_norm = torch.zeros(R, 1, device=dev).index_copy_(0, index, full_norm)
    for size in (*_CANDIDATE_TIERS, V):
        size = min(size, V)
        # A row with top-k needs a tier that holds its k; one without tries each tier until its nucleus fits.
        rows = pending if size == V else [r for r in pending if ks[r] <= size or ks[r] == V]
        if not rows:
            continue
        index, xr = _rows(x, rows)
        t = table if index is None else table[index]
        vals, ids = xr.sort(-1, descending=True) if size == V else xr.topk(size, -1)
        k = t[:, 1:2]
        vals = vals.masked_fill(torch.arange(size, device=dev) >= k, -math.inf)
        norm = vals.logsumexp(-1, keepdim=True)
        if full_norm is not None:
            norm = torch.where(k == V, full_norm if index is None else full_norm[index], norm)
        probs = torch.exp(vals - norm)
        cum = probs.cumsum(-1)
        covered = list(range(len(rows)))
        if size < V and any(ks[r] == V for r in rows):
            # The nucleus fits when the candidates already hold top_p of the mass.
            fits = ((k < V) | (cum[:, -1:] >= t[:, 2:3]))[:, 0].tolist()
            covered = [j for j, ok in enumerate(fits) if ok]
        if covered:
            if len(covered) < len(rows):
                probs, cum, ids, t = probs[covered], cum[covered], ids[covered], t[covered]
            probs = probs.masked_fill(cum - probs >= t[:, 2:3], 0)  # mass above the token already reaches top_p
            probs = probs.masked_fill(probs < t[:, 3:] * probs[:, :1], 0)
            yield [rows[j] for j in covered], probs, ids
            done = {rows[j] for j in covered}
            pending = [r for r in pending if r not in done]
        if not pending:
            break


def _searchsorted(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """First index whose cumulative weight exceeds target; never one of zero weight, even past the end by rounding."""
    hit = torch.searchsorted(cdf, target[:, None], right=True)
    last_positive = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)
    return torch.minimum(hit, last_positive)[:, 0]


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column index per row drawn with probability proportional to `weights` [R, N], using uniforms `u` [R]."""
    R, N = weights.shape
    # Two levels of about sqrt(N): block sums, then one block. One float32 cumsum over a 262k vocabulary would
    # round tail tokens away; here the cumulative sums are float64 and only short ones.
    block = 1 << ((N - 1).bit_length() + 1) // 2
    nb = -(-N // block)
    if nb * block != N:
        weights = torch.nn.functional.pad(weights, (0, nb * block - N))
    blocks = weights.reshape(R, nb, block)
    acc = _acc_dtype(weights.device)
    block_cdf = blocks.sum(-1).to(acc).cumsum(-1)
    target = u.to(acc) * block_cdf[:, -1]
    b = _searchsorted(block_cdf, target).clamp_(max=nb - 1)  # clamps only guard against rounding: never a crash
    start = block_cdf.gather(1, (b - 1).clamp(min=0)[:, None])[:, 0].masked_fill(b == 0, 0)
    inner = blocks[torch.arange(R, device=weights.device), b].to(acc).cumsum(-1)
    return (b * block + _searchsorted(inner, target - start)).clamp_(max=N - 1)


def _merge(into: torch.Tensor, index: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """`values` placed at rows `index` of `into`; `values` itself when index is None (all rows)."""
    return values if index is None else into.index_copy_(0, index, values)


def _draw(x: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Sampled tokens [R] for the sampled rows `x` [R, V], with one uniform per row `u` [R]."""
    R = x.shape[0]
    tokens = torch.empty(R, dtype=torch.long, device=x.device)
    for rows, w, ids in _truncated(x, params):
        index = None if len(rows) == R else torch.tensor(rows, device=x.device)
        col = inverse_cdf(w, u if index is None else u[index])
        tokens = _merge(tokens, index, col if ids is None else ids.gather(1, col[:, None])[:, 0])
    return tokens


@torch.no_grad()
def sample_batch(logits: torch.Tensor, samplers: Sequence[SequenceSampler],
                 allowed: AllowedTokens | None = None) -> list[SampledToken]:
    """One token per row of `logits` [B, vocab]; `allowed` masks the grammar-constrained rows. Does not call
    observe (the caller does, once it keeps the token)."""
    check_logits(logits, samplers)
    if not samplers:
        return []
    fast = None if allowed is not None else _plain_greedy(logits, samplers)
    if fast is not None:
        return fast
    x = _adjusted_logits(logits, samplers, allowed)
    greedy = [i for i, s in enumerate(samplers) if s.params.is_greedy()]
    sampled = [i for i, s in enumerate(samplers) if not s.params.is_greedy()]
    tokens = torch.empty(len(samplers), dtype=torch.long, device=x.device)
    if greedy:
        index, xg = _rows(x, greedy)
        tokens = _merge(tokens, index, xg.argmax(-1))
    if sampled:
        index, xs = _rows(x, sampled)
        u = torch.tensor([samplers[i].draw_uniform() for i in sampled], dtype=torch.float64).to(x.device)
        tokens = _merge(tokens, index, _draw(xs, [samplers[i].params for i in sampled], u))
    out = [SampledToken(t, None, None) for t in tokens.tolist()]
    _fill_logprobs(logits, samplers, tokens, out)
    return out


def draw_from(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids [R] drawn with probability proportional to `weights` [R, vocab] (non-negative, each row with some
    weight), with one uniform per row `u` [R]: the sampler's own inverse-CDF draw."""
    return inverse_cdf(weights, u.to(weights.device))


def chosen_tokens(logits: torch.Tensor, samplers: Sequence[SequenceSampler],
                  tokens: Sequence[int]) -> list[SampledToken]:
    """`tokens` chosen at the rows of `logits` [B, vocab], with their raw logprobs for the rows that ask (as
    `sample_batch` gives them)."""
    check_logits(logits, samplers)
    out = [SampledToken(int(t), None, None) for t in tokens]
    if out:
        _fill_logprobs(logits, samplers, torch.tensor([s.token for s in out], device=logits.device), out)
    return out


def is_plain_greedy(samplers: Sequence[SequenceSampler]) -> bool:
    """Whether every row is greedy with nothing to adjust (bias, penalties, suppressed tokens) and no logprobs:
    its token is the argmax of its raw logits, made safe (`greedy_tokens`)."""
    return all(s.params.is_greedy() and not s.params.logprobs and s.bias_ids is None and s.suppressed is None
               and s.counts is None and s.prompt_mask is None for s in samplers)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The tokens [B] (int64, on the logits' device) that `sample_batch` picks for plain greedy rows (see
    `is_plain_greedy`), without a copy to the host: NaN counts as -inf, and a row with no finite logit gets
    token 0, as the general path's safe logits give."""
    return logits.nan_to_num(nan=-math.inf, neginf=-math.inf).argmax(-1)


def _plain_greedy(logits: torch.Tensor, samplers: Sequence[SequenceSampler]) -> list[SampledToken] | None:
    """The tokens of a batch whose rows are all greedy with nothing to adjust and no logprobs asked, in one pass
    over the logits and one copy to the host; None (the general path decides) when a row's largest logit is not
    finite, or the batch is not of that kind. The common serving step, so it skips the copies the general path
    makes to be safe with NaN and infinities."""
    if not is_plain_greedy(samplers):
        return None
    # Few torch calls: on a GPU each gives up the GIL and may wait to get it back from a busy event loop.
    values, tokens = logits.max(-1)
    tokens, values = tokens.tolist(), values.tolist()
    if not all(map(math.isfinite, values)):
        return None
    return [SampledToken(t, None, None) for t in tokens]


@torch.no_grad()
def sampling_probs(logits: torch.Tensor, samplers: Sequence[SequenceSampler],
                   allowed: AllowedTokens | None = None) -> torch.Tensor:
    """The distribution [B, vocab] each row's next token is drawn from (one-hot for greedy rows): exactly what
    `sample_batch` draws from, after bias, penalties, the grammar's mask, temperature and truncation. Speculative
    decoding runs on it (the draft's proposal distribution q and the target's p in rejection sampling,
    server/speculative/), and the sampling tests check the sampler against it."""
    check_logits(logits, samplers)
    x = _adjusted_logits(logits, samplers, allowed)
    probs = torch.zeros_like(x)
    greedy = [i for i, s in enumerate(samplers) if s.params.is_greedy()]
    sampled = [i for i, s in enumerate(samplers) if not s.params.is_greedy()]
    if greedy:
        index, xg = _rows(x, greedy)
        probs = _merge(probs, index, torch.zeros_like(xg).scatter_(1, xg.argmax(-1, keepdim=True), 1.0))
    if sampled:
        index, xs = _rows(x, sampled)
        dense = torch.zeros_like(xs)
        for rows, w, ids in _truncated(xs, [samplers[i].params for i in sampled]):
            w = w / w.sum(-1, keepdim=True)
            rows_index = torch.tensor(rows, device=x.device)
            dense.index_copy_(0, rows_index, w if ids is None else torch.zeros(len(rows), x.shape[1],
                                                                             device=x.device).scatter_(1, ids, w))
        probs = _merge(probs, index, dense)
    return probs


def _fill_logprobs(logits: torch.Tensor, samplers: Sequence[SequenceSampler], tokens: torch.Tensor,
                   out: list[SampledToken]) -> None:
    """Raw logprobs of the chosen tokens and the top alternatives, for the rows that asked (`token_logprobs`)."""
    rows = [i for i, s in enumerate(samplers) if s.params.logprobs]
    if not rows:
        return
    index, raw = _rows(logits, rows)
    chosen, top = token_logprobs(raw, tokens if index is None else tokens[index],
                                 max(samplers[i].params.top_logprobs for i in rows))
    for j, i in enumerate(rows):
        want = samplers[i].params.top_logprobs
        out[i].logprob = chosen[j]
        out[i].top_logprobs = top[j][:want]
