"""`Scheduler`: continuous batching. Each step runs every decoding sequence plus as much waiting prefill as a token
budget allows (long prompts in chunks), samples all rows at once, then retires finished sequences and admits more.

A Generation starts as one prompt sequence; once its prompt is computed it forks into `n` choices that share the
prompt's KV blocks. When the pool runs out of blocks, the newest sequence is preempted: its blocks are freed and it
waits to be recomputed (mostly from the prefix cache), keeping every token it generated.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from engine import Runner
from engine.batch import StepRow
from engine.block_manager import KVSequence

from .generation import ChoiceDelta, EventBatch, Generation, GenerationDone, PromptLogprobs, TokenLogprob
from .sampling import SequenceSampler, sample_batch
from .stopping import StopChecker

log = logging.getLogger("emberserve.scheduler")


@dataclass(eq=False)
class Unit:
    """A sequence the scheduler runs: a Generation's prompt (choice None) or one of its choices."""

    gen: Generation
    kv: KVSequence
    choice: int | None = None
    sampler: SequenceSampler | None = None
    stopper: StopChecker | None = None
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)


@dataclass(eq=False)
class _GenState:
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    open_choices: int = 0


class Scheduler:
    """Owns the waiting and running sequences of one runner; `step()` advances them all by one forward pass."""

    def __init__(self, runner: Runner, max_batched_tokens: int = 512, max_running: int = 32) -> None:
        self.runner, self.max_batched_tokens, self.max_running = runner, max_batched_tokens, max_running
        self.waiting: deque[Unit] = deque()
        self.running: list[Unit] = []
        self._gens: dict[Generation, _GenState] = {}
        self.generated_tokens = 0
        self.preemptions = 0
        self.events = EventBatch()

    @property
    def num_generations(self) -> int:
        return len(self._gens)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, gen: Generation) -> None:
        kv = KVSequence(list(gen.prompt_ids))
        self._gens[gen] = _GenState(prompt_tokens=len(gen.prompt_ids))
        self.waiting.append(Unit(gen, kv))

    # ---- bookkeeping ----
    def _drop(self, gen: Generation) -> None:
        """Free everything a cancelled or failed generation holds."""
        for unit in [u for u in self.running if u.gen is gen]:
            self.running.remove(unit)
            self.runner.free_sequence(unit.kv)
        for unit in [u for u in self.waiting if u.gen is gen]:
            self.waiting.remove(unit)
            self.runner.free_sequence(unit.kv)
        self._gens.pop(gen, None)

    def drop_cancelled(self) -> None:
        for gen in [g for g in self._gens if g.cancelled]:
            self._drop(gen)

    def fail_all(self) -> list[Generation]:
        """Free every generation after a failed step; returns them so the caller can report the error."""
        self.events.flush()  # what the step produced before failing goes out first
        gens = list(self._gens)
        for gen in gens:
            self._drop(gen)
        return gens

    def _preempt_newest(self, keep: Unit, scheduled: dict[Unit, int]) -> bool:
        """Free the blocks of the most recently admitted running sequence not yet scheduled this step (nor `keep`)."""
        for unit in reversed(self.running):
            if unit is not keep and unit not in scheduled:
                self.running.remove(unit)
                self.runner.free_sequence(unit.kv)
                self.waiting.appendleft(unit)
                self.preemptions += 1
                log.info("preempted a sequence of %s (%d tokens) to free KV blocks", unit.gen.request_id,
                         len(unit.kv.tokens))
                return True
        return False

    # ---- one step ----
    def _schedule(self) -> list[Unit]:
        """Pick this step's units and give each the blocks it needs; a unit computes min(pending, budget) tokens."""
        blocks, budget, chosen = self.runner.blocks, self.max_batched_tokens, []
        self._take: dict[Unit, int] = {}
        for unit in list(self.running):
            if unit not in self.running or budget <= 0:
                continue
            take = min(unit.kv.num_pending, budget)
            while not blocks.can_allocate(unit.kv, unit.kv.num_computed + take) and self._preempt_newest(unit, self._take):
                pass
            if not blocks.can_allocate(unit.kv, unit.kv.num_computed + take):
                self.running.remove(unit)  # even alone it does not fit now: wait for blocks
                self.runner.free_sequence(unit.kv)
                self.waiting.appendleft(unit)
                continue
            blocks.allocate(unit.kv, unit.kv.num_computed + take)
            self._take[unit] = take
            chosen.append(unit)
            budget -= take
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            unit = self.waiting[0]
            if unit.kv.num_computed == 0 and not unit.kv.block_table:
                want_all = unit.choice is None and unit.gen.prompt_logprobs is not None
                if not want_all:  # prompt logprobs need every position computed, so no prefix reuse then
                    blocks.match_prefix(unit.kv, len(unit.kv.tokens) - 1)
                    if unit.choice is None:
                        self._gens[unit.gen].cached_tokens = unit.kv.num_cached
            take = min(unit.kv.num_pending, budget)
            # Keep one free block per running sequence so admitting this one does not force a preemption.
            if not blocks.can_allocate(unit.kv, unit.kv.num_computed + take, reserve=len(self.running)):
                if self.running:
                    break
                if not blocks.can_allocate(unit.kv, unit.kv.num_computed + take):
                    # Nothing runs, so only waiting sequences hold blocks: prefixes they matched before a
                    # preempted sequence was put back ahead of them. Let those go; they match again in turn.
                    for other in self.waiting:
                        if other is not unit and other.kv.block_table:
                            self.runner.free_sequence(other.kv)
                    if not blocks.can_allocate(unit.kv, unit.kv.num_computed + take):
                        raise RuntimeError("the KV cache cannot hold even one sequence of this length")
            self.waiting.popleft()
            blocks.allocate(unit.kv, unit.kv.num_computed + take)
            self.running.append(unit)
            self._take[unit] = take
            chosen.append(unit)
            budget -= take
        return chosen

    @torch.inference_mode()
    def step(self) -> None:
        """Advance every scheduled sequence by one forward pass and handle what it produced."""
        self.drop_cancelled()
        units = self._schedule()
        if not units:
            return
        rows = []
        for unit in units:
            kv, end = unit.kv, unit.kv.num_computed + self._take[unit]
            done = end == len(kv.tokens)
            want_all = unit.choice is None and unit.gen.prompt_logprobs is not None
            rows.append(StepRow(kv, kv.num_computed, end, ("all" if want_all else "last") if done else "none"))
        logits = self.runner.step(rows)
        finished_rows, offset = [], 0
        for unit, row in zip(units, rows):
            if row.logits == "none":
                continue
            n = row.end - row.start if row.logits == "all" else 1
            chunk = logits[offset:offset + n]
            offset += n
            if row.logits == "all":
                self._collect_prompt_logprobs(unit, row, chunk)
            finished_rows.append((unit, chunk[-1]))
        self._sample(finished_rows)
        self.events.flush()

    def _collect_prompt_logprobs(self, unit: Unit, row: StepRow, logits: torch.Tensor) -> None:
        """Logprobs of prompt tokens row.start+1 .. row.end-1 given their prefixes (row i predicts token i+1)."""
        top_n = unit.gen.prompt_logprobs or 0
        logp = torch.log_softmax(logits[:-1].float(), dim=-1) if len(logits) > 1 else None
        if row.start == 0:
            unit.prompt_logprobs.append(None)
        if logp is not None:
            targets = torch.tensor(unit.kv.tokens[row.start + 1:row.end], dtype=torch.long, device=logp.device)
            chosen = logp.gather(1, targets[:, None])[:, 0].tolist()
            top_vals, top_ids = logp.topk(top_n, dim=-1) if top_n else (None, None)
            for i, token in enumerate(targets.tolist()):
                top = list(zip(top_ids[i].tolist(), top_vals[i].tolist())) if top_n else []
                unit.prompt_logprobs.append(TokenLogprob(token, chosen[i], top))

    def _fork(self, unit: Unit) -> list[Unit]:
        """Turn a computed prompt into its `n` choices, sharing the prompt's blocks."""
        gen, state = unit.gen, self._gens[unit.gen]
        if gen.prompt_logprobs is not None:
            self.events.emit(gen, PromptLogprobs(unit.prompt_logprobs))
        choices = []
        for index in range(gen.n):
            kv = unit.kv if index == gen.n - 1 else self.runner.blocks.share(unit.kv, unit.kv.num_computed)
            sampler = SequenceSampler(gen.params, self.runner.vocab_size, gen.prompt_ids,
                                      self.runner.device, seed_offset=index)
            stopper = StopChecker(self.runner.tokenizer.detokenizer(skip_special_tokens=True), stop=gen.stop,
                                  stop_token_ids=gen.stop_token_ids, max_tokens=gen.max_tokens,
                                  min_tokens=gen.min_tokens, ignore_eos=gen.ignore_eos)
            choices.append(Unit(gen, kv, index, sampler, stopper))
        state.open_choices = gen.n
        position = self.running.index(unit)
        self.running[position:position + 1] = choices
        return choices

    def _sample(self, rows: list[tuple[Unit, torch.Tensor]]) -> None:
        todo: list[tuple[Unit, torch.Tensor]] = []
        for unit, last in rows:
            if unit.choice is None:
                gen = unit.gen
                if gen.max_tokens == 0:
                    self._finish_empty(unit)
                    continue
                todo += [(choice, last) for choice in self._fork(unit)]
            else:
                todo.append((unit, last))
        if not todo:
            return
        for unit, _ in todo:
            early = unit.stopper.num_tokens < unit.gen.min_tokens and not unit.gen.ignore_eos
            unit.sampler.suppressed = self._end_ids(unit.gen) if early else None
        sampled = sample_batch(torch.stack([last for _, last in todo]), [u.sampler for u, _ in todo])
        for (unit, _), s in zip(todo, sampled):
            self._advance(unit, s.token, s.logprob, s.top_logprobs)

    def _end_ids(self, gen: Generation) -> torch.Tensor | None:
        ids = sorted(gen.stop_token_ids)
        return torch.tensor(ids, dtype=torch.long, device=self.runner.device) if ids else None

    def _advance(self, unit: Unit, token: int, logprob: float | None, top: list[tuple[int, float]] | None) -> None:
        gen, state = unit.gen, self._gens[unit.gen]
        unit.sampler.observe(token)
        self.generated_tokens += 1
        update = unit.stopper.push(token)
        logprobs = [TokenLogprob(token, logprob, top or [])] if gen.params.logprobs else None
        self.events.emit(gen, ChoiceDelta(unit.choice, update.text, [token], logprobs, update.finish_reason))
        if update.finish_reason is None:
            unit.kv.tokens.append(token)
            return
        state.completion_tokens += unit.stopper.num_tokens
        self.running.remove(unit)
        self.runner.free_sequence(unit.kv)
        state.open_choices -= 1
        if state.open_choices == 0:
            self._done(gen)

    def _finish_empty(self, unit: Unit) -> None:
        """max_tokens 0 (echo only): every choice ends at once with no tokens."""
        gen = unit.gen
        if gen.prompt_logprobs is not None:
            self.events.emit(gen, PromptLogprobs(unit.prompt_logprobs))
        for index in range(gen.n):
            self.events.emit(gen, ChoiceDelta(index, "", [], [] if gen.params.logprobs else None, "length"))
        self.running.remove(unit)
        self.runner.free_sequence(unit.kv)
        self._done(gen)

    def _done(self, gen: Generation) -> None:
        state = self._gens.pop(gen)
        self.events.emit(gen, GenerationDone(state.prompt_tokens, state.completion_tokens, state.cached_tokens))
