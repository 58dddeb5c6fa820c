"""`Scheduler`: continuous batching. Each step runs every decoding sequence plus as much waiting prefill as a token
budget allows (long prompts in chunks), samples all rows at once, then retires finished sequences and admits more.

A Generation starts as one prompt sequence; once its prompt is computed it forks into `n` choices that share the
prompt's KV blocks, each counting as one of the `max_running` sequences. When the pool runs out of blocks, the
newest sequence is preempted: its blocks are freed and it waits to be recomputed (mostly from the prefix cache),
keeping every token it generated.

Faults stay with the requests they belong to: a row the runner refuses (RowError) fails only its generation, with
a 400; a step that crashes fails the generations in that step (`fail_step`), and everything else keeps going.

Embedding requests (server/scheduling/embedding_jobs.py) run as forward passes of their own: while both kinds have work,
an embedding step and a generation step take turns.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine import Runner
from engine.model.batch import StepRow, TokenFeed
from engine.cache.block_manager import PENDING_TOKEN, KVSequence
from engine.errors import RowError

from server.sampling.device_tokens import DeviceTokens, TokenLanding, sample_greedy_on_device
from server.scheduling.embedding_jobs import EmbeddingJob, EmbeddingSteps
from server.scheduling.generation import (ChoiceDelta, EventBatch, Generation, GenerationDone, GenerationFailed,
    PromptLogprobs, TokenLogprob)
from server.grammar.compiler import GrammarMatcher, fill_bitmasks, fill_draft_bitmasks
from server.sampling.logprobs import token_logprobs
from server.sampling.sampler import SequenceSampler, sample_batch
from server.speculative.speculator import Speculator
from server.speculative.rejection import DraftCheck, Proposal, verify_drafts
from server.scheduling.stopping import StopChecker
from server.grammar.token_bitmask import allocate_bitmask

log = logging.getLogger("emberserve.scheduler")
# Generation.stream_interval 0: a chunk per token up to 2 * AUTO_STREAMS running sequences, then one more token a
# chunk per AUTO_STREAMS of them, at most AUTO_MAX_INTERVAL. Each chunk costs the event loop the same whatever its
# tokens, and the loop shares the GIL with this thread: at 128 streams one chunk a token is most of the server's
# time (bench/RESULTS.md#issue-13-gpu-chunk-graphs).
AUTO_STREAMS = 16
AUTO_MAX_INTERVAL = 16


def auto_stream_interval(running: int) -> int:
    """Tokens a chunk gathers when the generation leaves it to the load: `running` sequences decoding."""
    return min(AUTO_MAX_INTERVAL, max(1, running // AUTO_STREAMS))


@dataclass(eq=False)
class HeldOutput:
    """A choice's output not sent yet (gathered up to its generation's stream_interval), kept as its parts: one
    ChoiceDelta is made when it goes, rather than one a token and their merge."""

    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    at: float = 0.0  # when its last token was made

    def delta(self, choice: int | None, logprobs: bool) -> ChoiceDelta:
        """All of it as one delta (the last token's time, no finish)."""
        return ChoiceDelta(choice, "".join(self.text), self.tokens, self.logprobs if logprobs else None, at=self.at)


@dataclass(eq=False)
class Unit:
    """A sequence the scheduler runs: a Generation's prompt (choice None) or one of its choices."""

    gen: Generation
    kv: KVSequence
    choice: int | None = None
    sampler: SequenceSampler | None = None
    stopper: StopChecker | None = None
    # The choice's place in its grammar (gen.grammar); it moves with the unit through preemption, which keeps
    # the generated tokens too.
    matcher: GrammarMatcher | None = None
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    held: HeldOutput = field(default_factory=HeldOutput)
    # Out of the batch for good (its blocks freed): a row of it in a step already launched is dropped.
    finished: bool = False
    # What the generation asks that the unit's every step looks at, fixed once here rather than read through
    # `gen` per token: a prompt whose every position's logprob is asked for (echo with logprobs); each token's
    # logprobs; end tokens kept from being sampled until min_tokens.
    wants_prompt_logprobs: bool = field(init=False)
    wants_logprobs: bool = field(init=False)
    suppresses_early_ends: bool = field(init=False)

    def __post_init__(self) -> None:
        gen = self.gen
        self.wants_prompt_logprobs = self.choice is None and gen.prompt_logprobs is not None
        self.wants_logprobs = bool(gen.params.logprobs)
        self.suppresses_early_ends = gen.min_tokens > 0 and not gen.ignore_eos

    @property
    def slots(self) -> int:
        """Running sequences this unit stands for: its `n` choices once a prompt forks."""
        return self.gen.n if self.choice is None else 1


@dataclass
class _EarlyMasks:
    """Bitmasks being filled while the forward pass runs: the units, the bitmask (row i: units[i]), the fill."""

    units: list[Unit]
    bitmask: torch.Tensor
    future: Future
    index: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.index = {id(u): i for i, u in enumerate(self.units)}

    def row(self, unit: Unit) -> int | None:
        """The unit's row, by identity: a unit that left during the pass (failed, cancelled) may be freed and its
        id() reused by a choice forked after it, which must not take its mask."""
        i = self.index.get(id(unit))
        return i if i is not None and self.units[i] is unit else None


@dataclass(eq=False)
class _Inflight:
    """A step's tokens still on their way to the host (async scheduling): the units that sampled them, in the order
    of `tokens`, and where each one's PENDING_TOKEN stands in its sequence."""

    units: list[Unit]
    tokens: DeviceTokens
    positions: list[int]
    interval: int  # auto_stream_interval of the step that sampled them
    index: dict[Unit, int] = field(init=False)

    def __post_init__(self) -> None:
        self.index = {u: i for i, u in enumerate(self.units)}


@dataclass(eq=False)
class _GenState:
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    open_choices: int = 0
    started: bool = False  # its prompt was admitted to the running batch once


class Scheduler:
    """Owns the waiting and running sequences of one runner; `step()` advances them all by one forward pass."""

    def __init__(self, runner: Runner, max_batched_tokens: int = 512, max_running: int = 32,
                 speculator: Speculator | None = None, defer_text: bool | None = None,
                 async_scheduling: bool = False) -> None:
        if max_batched_tokens < max_running:
            # A step's budget must hold a token of every running sequence, or some would wait behind the others.
            raise ValueError(f"max_batched_tokens ({max_batched_tokens}) must be at least max_running "
                             f"({max_running}): every running sequence decodes one token each step")
        self.runner, self.max_batched_tokens, self.max_running = runner, max_batched_tokens, max_running
        self.waiting: deque[Unit] = deque()
        self.running: list[Unit] = []
        self._gens: dict[Generation, _GenState] = {}
        self._take: dict[Unit, int] = {}
        # Speculative decoding: each speculating unit's drafted tokens this step (appended to its tokens, computed
        # with its last token in one row, verified after the pass); see _propose and _verify.
        self.speculator = speculator
        self._drafts: dict[Unit, Proposal] = {}
        self._stepping: list[Unit] = []  # the units of the step under way, failed together if it crashes
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self.generated_tokens = 0
        self.preemptions = 0
        self.peak_running = 0  # the most sequences one step has run together, since start
        self.num_queued = 0  # generations not started yet (read from other threads: one int, always current)
        self.events = EventBatch()
        self._auto_interval = 1  # auto_stream_interval of the step under way
        self.embeddings = EmbeddingSteps(runner, max_batched_tokens)
        self._embeddings_turn = True
        # On a GPU a step's launch does not wait for it, so the host work of a sampled token that the next step's
        # schedule does not need (detokenizing, stop strings, its event) waits until that step is launched and
        # runs beside it (`_take_token`, then `_hand_on` from `_pending`). A stop string found then has cost its unit
        # one row of that step, dropped. None: defer where the runner is on a GPU.
        self.defer_text = runner.device.type == "cuda" if defer_text is None else defer_text
        self._pending: list[tuple[Unit, int, float | None, list[tuple[int, float]] | None]] = []
        self._pending_interval = 1  # auto_stream_interval of the step that sampled the pending tokens
        # Async scheduling (vLLM's name; off unless asked for): a plain greedy step's tokens stay on the device
        # (DeviceTokens); the next step is scheduled and launched reading them there (TokenFeed), each sequence
        # holding a PENDING_TOKEN in their place, and only then are they taken on the host (`_collect`), beside the
        # device's work. An end found then has cost its unit one row of the launched step, dropped. Not with
        # speculation (drafts are read from the tokens) nor a tensor-parallel runner. It pays only where the host's
        # Python is not already the bottleneck: with the HTTP side on the same GIL it does not
        # (bench/RESULTS.md#issue-13-gpu-async-scheduling).
        self.async_scheduling = async_scheduling and speculator is None \
            and getattr(runner, "tensor_parallel", None) is None
        self._inflight: _Inflight | None = None
        self._landing = TokenLanding(max_running) if self.async_scheduling and runner.device.type == "cuda" \
            else None

    @property
    def num_generations(self) -> int:
        return len(self._gens)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending or self._inflight) or self.embeddings.has_work()

    def add(self, gen: Generation | EmbeddingJob) -> None:
        if isinstance(gen, EmbeddingJob):
            self.embeddings.add(gen)
            return
        kv = KVSequence(list(gen.prompt_ids))
        self._gens[gen] = _GenState(prompt_tokens=len(gen.prompt_ids))
        self.waiting.append(Unit(gen, kv))
        self.num_queued += 1

    # ---- bookkeeping ----
    def _drop(self, gen: Generation) -> None:
        """Free everything a cancelled or failed generation holds."""
        for unit in [u for u in self.running if u.gen is gen]:
            self.running.remove(unit)
            self.runner.free_sequence(unit.kv)
        for unit in [u for u in self.waiting if u.gen is gen]:
            self.waiting.remove(unit)
            self.runner.free_sequence(unit.kv)
        state = self._gens.pop(gen, None)
        if state is not None and not state.started:
            self.num_queued -= 1

    def drop_cancelled(self) -> None:
        for gen in [g for g in self._gens if g.cancelled]:
            self._drop(gen)

    def fail(self, gens: list[Generation], status: int, message: str, code: str | None = None) -> None:
        """End `gens` with an error event, freeing what they hold; what was produced before goes out first."""
        # Deferred tokens (defer_text) first. Tokens still on their way (async scheduling) are not waited for here
        # (this may run while a step is being scheduled): those of `gens` are never sent, the others' later.
        self._hand_on_pending()
        failing = set(gens)
        for unit in self.running + list(self.waiting):
            if unit.held.tokens and unit.gen in failing:
                self.events.emit(unit.gen, unit.held.delta(unit.choice, unit.wants_logprobs))
                unit.held = HeldOutput()
        self.events.flush()
        for gen in dict.fromkeys(gens):
            if gen in self._gens:
                self._drop(gen)
                gen.emit(GenerationFailed(status, message, code))

    def fail_step(self, status: int, message: str) -> int:
        """Fail the generations (or embedding jobs) of the step that was under way (it crashed); returns how many."""
        gens = [u.gen for u in self._stepping]
        self._stepping = []
        self.fail(gens, status, message)
        return len(dict.fromkeys(gens)) + self.embeddings.fail_step(status, message)

    def fail_all(self, status: int, message: str) -> None:
        """Fail every generation and embedding job this scheduler holds (its worker cannot go on)."""
        self._stepping, self._inflight = [], None
        self.fail(list(self._gens), status, message)
        self.embeddings.fail_all(status, message)

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
    def _running_order(self) -> tuple[list[Unit], int]:
        """Decoding sequences first (the budget holds one token of each), then prompts still being prefilled,
        oldest first, with what is left of it; and how many decode."""
        decoding, prefilling = [], []
        for u in self.running:
            (decoding if len(u.kv.tokens) - u.kv.num_computed <= 1 else prefilling).append(u)
        return decoding + prefilling, len(decoding)

    def _refused(self, unit: Unit, take: int) -> bool:
        """Fail the unit's generation if the runner would refuse its next row (before blocks are spent on it)."""
        error = self.runner.row_error(unit.kv, unit.kv.num_computed, unit.kv.num_computed + take)
        if error is not None:
            self._refuse(unit, error)
        return error is not None

    def _refuse(self, unit: Unit, error: str) -> None:
        log.warning("%s: %s", unit.gen.request_id, error)
        self.fail([unit.gen], 400, error, "context_length_exceeded" if "context" in error else None)

    def _schedule(self) -> list[Unit]:
        """Pick this step's units and give each the blocks it needs; a unit computes min(pending, budget) tokens."""
        blocks, budget, chosen = self.runner.blocks, self.max_batched_tokens, []
        self._take, self._drafts = {}, {}
        proposals = self._propose()
        order, decoding = self._running_order()
        # Drafts take the budget's tokens beyond one for every decoding sequence.
        spare = budget - decoding
        running = set(self.running)  # membership in O(1): preemption and failures take units out as we go
        inflight = self._inflight
        row_error = self.runner.row_error
        for unit in order:  # every running sequence, every step: what is read more than once is read once
            if unit not in running or budget <= 0 or unit.gen.backlogged:
                continue  # preempted or failed meanwhile, out of budget, or paused: its reader is far behind
            if inflight is not None and unit in inflight.index and unit.stopper.ends_next():
                continue  # its token on the way is its last (max_tokens): no row for what would follow
            kv = unit.kv
            start = kv.num_computed
            take = min(len(kv.tokens) - start, budget)
            error = row_error(kv, start, start + take)
            if error is not None:
                self._refuse(unit, error)
                running = set(self.running)
                continue
            proposal = proposals.get(unit) if proposals else None
            drafts = proposal.cut(max(0, min(spare, budget - take))) if proposal is not None else None
            # Speculation never preempts: drafts go only where their blocks are free beside one for each sequence.
            if drafts and drafts.tokens and blocks.can_allocate(
                    kv, start + take + len(drafts.tokens), reserve=len(self.running)):
                take += len(drafts.tokens)
                spare -= len(drafts.tokens)
            else:
                drafts = None
            fits = blocks.can_allocate(kv, start + take)
            while not fits and self._preempt_newest(unit, self._take):
                running = set(self.running)
                fits = blocks.can_allocate(kv, start + take)
            if not fits:
                self.running.remove(unit)  # even alone it does not fit now: wait for blocks
                self.runner.free_sequence(kv)
                self.waiting.appendleft(unit)
                continue
            blocks.allocate(kv, start + take)
            if drafts is not None:
                kv.tokens.extend(drafts.tokens)
                self._drafts[unit] = drafts
            self._take[unit] = take
            chosen.append(unit)
            budget -= take
        while self.waiting and budget > 0 and (not self.running or
                                               len(self.running) + self.waiting[0].slots <= self.max_running):
            unit = self.waiting[0]
            if unit.kv.tokens and unit.kv.tokens[-1] == PENDING_TOKEN:
                break  # preempted just now with its token on the way: it is back once the token is taken
            if unit.kv.num_computed == 0 and not unit.kv.block_table:
                if unit.wants_prompt_logprobs:
                    # Every prompt position's logprob is computed, so no prefix is reused; a restart recomputes.
                    unit.prompt_logprobs = []
                else:
                    blocks.match_prefix(unit.kv, len(unit.kv.tokens) - 1)
                if unit.choice is None:
                    self._gens[unit.gen].cached_tokens = unit.kv.num_cached
            take = min(unit.kv.num_pending, budget)
            if self._refused(unit, take):
                continue
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
                        # Cannot happen while the context is capped to the pool (Runner); fail it, not the worker.
                        log.error("%s: the KV cache cannot hold a sequence of %d tokens", unit.gen.request_id,
                                  len(unit.kv.tokens))
                        self.fail([unit.gen], 500, "the KV cache cannot hold this sequence")
                        continue
            self.waiting.popleft()
            blocks.allocate(unit.kv, unit.kv.num_computed + take)
            self.running.append(unit)
            state = self._gens[unit.gen]
            if not state.started:
                state.started = True
                self.num_queued -= 1
            self._take[unit] = take
            chosen.append(unit)
            budget -= take
        return chosen

    def _propose(self) -> dict[Unit, Proposal]:
        """Draft tokens of the decoding choices that speculate this step."""
        spec = self.speculator
        if spec is None:
            return {}
        spec.retain(self.running)
        rows = []
        for unit in self.running:
            if unit.choice is None or unit.kv.num_pending != 1 or unit.gen.backlogged:
                continue
            # The step makes one token anyway; drafts stay within max_tokens and the context (the tokens made so
            # far counted from the sequence: its stop checker may not have seen the last one yet, see defer_text).
            most = self.runner.context_size - len(unit.kv.tokens)
            if unit.gen.max_tokens is not None:
                most = min(most, unit.gen.max_tokens - (len(unit.kv.tokens) - len(unit.gen.prompt_ids)) - 1)
            if most > 0:
                rows.append((unit, unit.kv.tokens, most, unit.sampler))
        return spec.propose(rows)  # type: ignore[return-value]

    def _rows(self, units: list[Unit]) -> list[StepRow]:
        rows, take, drafts = [], self._take, self._drafts
        for unit in units:
            kv = unit.kv
            start = kv.num_computed
            end = start + take[unit]
            logits = "all" if unit.wants_prompt_logprobs or (drafts and unit in drafts) else \
                "last" if end == len(kv.tokens) else "none"
            rows.append(StepRow(kv, start, end, logits))
        return rows

    def _forward(self, units: list[Unit]) -> tuple[list[Unit], list[StepRow], torch.Tensor] | None:
        """The runner's step over `units`; rows it refuses fail their generations (400) and the rest run."""
        while units:
            rows = self._rows(units)
            feed = self._feed(units, rows)
            try:
                return units, rows, self.runner.step(rows) if feed is None else self.runner.step(rows, feed)
            except RowError as e:  # what _refused did not foresee: fail those rows, run the rest
                for i, message in sorted(e.errors.items()):
                    log.warning("%s: %s", units[i].gen.request_id, message)
                    self.fail([units[i].gen], 400, message)
                units = [u for u in units if u.gen in self._gens]
        return None

    def step(self) -> None:
        """One forward pass: of pending embeddings or of the generations, taking turns while both have work."""
        generating = bool(self.waiting or self.running or self._pending or self._inflight)
        if self.embeddings.has_work() and (self._embeddings_turn or not generating):
            self._collect()
            self._hand_on_pending()
            self.events.flush()
            self._embeddings_turn = False
            if self.embeddings.step(alone=not generating) or not generating:
                return
        self._embeddings_turn = True
        self._generation_step()

    @torch.inference_mode()
    def _generation_step(self) -> None:
        """Advance every scheduled sequence by one forward pass and handle what it produced."""
        self.drop_cancelled()
        started = time.perf_counter()
        self._stepping = self._schedule()
        self.peak_running = max(self.peak_running, len(self.running))
        self._auto_interval = auto_stream_interval(len(self.running))
        early = self._start_masks(self._stepping)
        try:
            done = self._forward(self._stepping)
        finally:
            if self._inflight is not None or self._pending:  # the last step's tokens, text and events, while the
                self._collect()                                # device computes this one
                self._hand_on_pending()
                self.events.flush()
        if done is None:
            self._stepping = []
            return
        units, rows, logits = done
        self._stepping = units
        finished: list[tuple[Unit, int]] = []  # units whose next token is due, and their row of `logits`
        speculated: list[tuple[Unit, StepRow, int]] = []  # units that drafted, and their first row of `logits`
        offset = 0
        for unit, row in zip(units, rows):
            if row.logits == "last":  # the common row, a sequence's next token (never a draft's: those are "all")
                offset += 1
                # Not finished by a stop string after this step was launched (its row is then dropped).
                if not unit.finished and row.end == len(unit.kv.tokens):
                    finished.append((unit, offset - 1))
                continue
            if row.logits == "none":
                continue
            n = row.end - row.start
            if unit.finished:  # a stop string ended it after this step was launched: its row is dropped
                offset += n
                continue
            if unit in self._drafts:
                speculated.append((unit, row, offset))
                offset += n
                continue
            self._collect_prompt_logprobs(unit, row, logits[offset:offset + n])
            offset += n
            if row.end == len(unit.kv.tokens):
                finished.append((unit, offset - 1))
        self._sample(finished, logits, early)
        if speculated:
            self._verify(speculated, logits)
        self._cap_running()
        self._stepping = []
        self.events.flush()
        if self.speculator is not None:
            self._observe_step(units, rows, time.perf_counter() - started)
        self._drafts = {}

    def _observe_step(self, units: list[Unit], rows: list[StepRow], seconds: float) -> None:
        """Tell the speculator how a decode-only step went (a step with prompt chunks says nothing about it)."""
        for unit, row in zip(units, rows):
            drafts = self._drafts.get(unit)
            if unit.choice is None or row.end - row.start != 1 + (len(drafts.tokens) if drafts else 0):
                return
        self.speculator.observe_step(len(units), sum(len(d.tokens) for d in self._drafts.values()), seconds)

    def _collect_prompt_logprobs(self, unit: Unit, row: StepRow, logits: torch.Tensor) -> None:
        """Logprobs of the prompt tokens after each position of the chunk (row i predicts token start + i + 1)."""
        top_n = unit.gen.prompt_logprobs or 0
        if row.start == 0:
            unit.prompt_logprobs.append(None)  # the first token has no context to be predicted from
        targets = unit.kv.tokens[row.start + 1:row.end + 1]  # the last chunk's last row predicts no prompt token
        if not targets:
            return
        ids = torch.tensor(targets, dtype=torch.long, device=logits.device)
        chosen, top = token_logprobs(logits[:len(targets)], ids, top_n)
        for i, token in enumerate(targets):
            unit.prompt_logprobs.append(TokenLogprob(token, chosen[i], top[i]))

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
            matcher = gen.grammar.matcher() if gen.grammar is not None else None
            choices.append(Unit(gen, kv, index, sampler, stopper, matcher))
        state.open_choices = gen.n
        position = self.running.index(unit)
        self.running[position:position + 1] = choices
        return choices

    def _cap_running(self) -> None:
        """Past `max_running` (a prompt forked into more choices than there was room for), the newest choices wait
        at the head of the queue, keeping their blocks, until others finish."""
        excess = len(self.running) - self.max_running
        for unit in list(reversed(self.running)):
            if excess <= 0:
                break
            if unit.choice is not None and len(self.running) > 1:
                self.running.remove(unit)
                self.waiting.appendleft(unit)
                excess -= 1

    def _sample(self, finished: list[tuple[Unit, int]], logits: torch.Tensor,
                early: _EarlyMasks | None = None) -> None:
        """Sample the next token of every unit in `finished` from its row of `logits` (a prompt: its choices')."""
        todo: list[Unit] = []
        index: list[int] = []
        for unit, row in finished:
            if unit.choice is None:
                if unit.gen.max_tokens == 0:
                    self._finish_empty(unit)
                    continue
                choices = self._fork(unit)
                todo += choices
                index += [row] * len(choices)
            else:
                todo.append(unit)
                index.append(row)
        if not todo:
            return
        for unit in todo:
            if not unit.suppresses_early_ends:  # then `suppressed` is never set
                continue
            if unit.stopper.num_tokens < unit.gen.min_tokens:
                unit.sampler.suppressed = self._end_ids(unit.gen)
            elif unit.sampler.suppressed is not None:
                unit.sampler.suppressed = None
        # The common step (every row a decode row's next token, in order) samples the logits as they are.
        rows = logits if index == list(range(len(logits))) else \
            logits.index_select(0, torch.tensor(index, device=logits.device))
        if self.async_scheduling and early is None and all(u.matcher is None for u in todo):
            tokens = sample_greedy_on_device(rows, [u.sampler for u in todo], self._landing)
            if tokens is not None:
                self._launched(todo, tokens)
                return
        sampled = sample_batch(rows, [u.sampler for u in todo], self._grammar_masks(todo, early))
        gens, defer_text = self._gens, self.defer_text
        for unit, s in zip(todo, sampled):
            if unit.gen not in gens:  # failed by a choice before it
                continue
            if defer_text and unit.matcher is None:  # a grammar's next mask needs the token's whole effect
                self._take_token(unit, s.token)
                self._pending.append((unit, s.token, s.logprob, s.top_logprobs))
                self._pending_interval = self._auto_interval
            else:
                self._advance(unit, s.token, s.logprob, s.top_logprobs)

    def _start_masks(self, units: list[Unit]) -> _EarlyMasks | None:
        """Start filling, on a thread while the forward pass runs, the bitmasks of the grammar-constrained units
        whose next token this step samples: their matchers are final (the last step advanced them), and
        llguidance fills masks with the GIL released, so a constrained batch is not serialised behind them."""
        # A speculating unit's masks (one per drafted position) are filled when its drafts are verified.
        due = [u for u in units if u.matcher is not None and u not in self._drafts
               and u.kv.num_computed + self._take[u] == len(u.kv.tokens)]
        if not due:
            return None
        bitmask = allocate_bitmask(len(due), self.runner.vocab_size)
        future = self._mask_pool.submit(fill_bitmasks, [u.matcher for u in due], bitmask)
        return _EarlyMasks(due, bitmask, future)

    def _grammar_masks(self, units: list[Unit],
                       early: _EarlyMasks | None = None) -> tuple[torch.Tensor, list[int]] | None:
        """The token bitmask of the grammar-constrained rows among `units`, and their positions: the rows filled
        early (`_start_masks`) as they are, the rest (choices just forked) now."""
        rows = [i for i, u in enumerate(units) if u.matcher is not None]
        if not rows:
            return None
        if early is not None:
            early.future.result()
        bitmask = allocate_bitmask(len(rows), self.runner.vocab_size)
        late: list[tuple[int, GrammarMatcher]] = []
        for j, i in enumerate(rows):
            k = None if early is None else early.row(units[i])
            if k is None:
                late.append((j, units[i].matcher))
            else:
                bitmask[j] = early.bitmask[k]
        for j, matcher in late:
            matcher.fill_bitmask(bitmask, j)
        return bitmask, rows


    def _end_ids(self, gen: Generation) -> torch.Tensor | None:
        ids = sorted(gen.stop_token_ids)
        return torch.tensor(ids, dtype=torch.long, device=self.runner.device) if ids else None

    def _verify(self, speculated: list[tuple[Unit, StepRow, int]], logits: torch.Tensor) -> None:
        """Accept or reject each speculating unit's drafts (server/speculative/rejection.py), roll its sequence back
        to the accepted tokens (their KV stays; the rejected ones' leaves the prefix cache), and hand on the
        accepted tokens and the target's own next one, which stop strings, end tokens and max_tokens may cut."""
        checks, index = [], []
        for unit, row, offset in speculated:
            drafts = self._drafts[unit]
            views = unit.sampler.lookahead(drafts.tokens)
            ends = self._end_ids(unit.gen)
            for i, view in enumerate(views):  # min_tokens: position i makes the choice's token num_tokens + i + 1
                early_end = unit.stopper.num_tokens + i < unit.gen.min_tokens and not unit.gen.ignore_eos
                view.suppressed = ends if early_end else None
            allowed = None
            if unit.matcher is not None:
                allowed = allocate_bitmask(len(views), self.runner.vocab_size)
                fill_draft_bitmasks(unit.matcher, drafts.tokens, allowed)
            checks.append(DraftCheck(drafts.tokens, views, drafts.probs, allowed))
            index += range(offset, offset + len(drafts.tokens) + 1)
        rows = logits if index == list(range(len(logits))) else \
            logits.index_select(0, torch.tensor(index, device=logits.device))
        for (unit, row, _), result in zip(speculated, verify_drafts(rows, checks)):
            if unit.gen not in self._gens:  # failed by a choice before it
                continue
            self.speculator.record(unit, len(self._drafts[unit].tokens), result.accepted)
            self.runner.rollback_sequence(unit.kv, row.start + 1 + result.accepted)
            for j, s in enumerate(result.sampled):
                # The accepted drafts are already the sequence's tokens (computed); the last token is new.
                if not self._advance(unit, s.token, s.logprob, s.top_logprobs, append=j == result.accepted):
                    break

    def _advance(self, unit: Unit, token: int, logprob: float | None, top: list[tuple[int, float]] | None,
                 append: bool = True) -> bool:
        """Hand on the unit's next token; whether the unit goes on (False: it finished, or its generation failed).
        `append`: the token is new to the sequence (not an accepted draft already in its tokens)."""
        unit.sampler.observe(token)
        self.generated_tokens += 1
        return self._hand_on(unit, token, logprob, top, append)

    def _take_token(self, unit: Unit, token: int) -> None:
        """Of a deferred token (defer_text), what the next step's schedule needs: the sampler's counts, the token in
        the sequence, or the unit out of the batch if the token itself ends it (an end token, max_tokens)."""
        unit.sampler.observe(token)
        self.generated_tokens += 1
        if unit.stopper.ends_at(token):
            self._leave(unit)
        else:
            unit.kv.tokens.append(token)

    def _launched(self, units: list[Unit], tokens: DeviceTokens) -> None:
        """Async scheduling: `units`' next tokens are on the device; each sequence holds their place."""
        positions = []
        for unit in units:
            positions.append(len(unit.kv.tokens))
            unit.kv.tokens.append(PENDING_TOKEN)
        self._inflight = _Inflight(units, tokens, positions, self._auto_interval)

    def _feed(self, units: list[Unit], rows: list[StepRow]) -> TokenFeed | None:
        """The rows whose token is on its way (async scheduling): the step reads it on the device."""
        inflight = self._inflight
        if inflight is None:
            return None
        sources = []
        for unit, row in zip(units, rows):
            i = inflight.index.get(unit, -1)
            if i >= 0 and (row.start != inflight.positions[i] or row.end != row.start + 1):
                raise RuntimeError(f"a row [{row.start}, {row.end}) holds a token still on its way at "
                                   f"{inflight.positions[i]}")
            sources.append(i)
        return TokenFeed(inflight.tokens.tokens, sources) if any(s >= 0 for s in sources) else None

    def _collect(self) -> None:
        """The tokens on their way (async scheduling), taken: into their sequences, then their text, stops and
        events (a unit they end leaves the batch; its row in a step launched since is dropped)."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        tokens = inflight.tokens.collect()
        current, self._auto_interval = self._auto_interval, inflight.interval
        try:
            for unit, position, token in zip(inflight.units, inflight.positions, tokens):
                if unit.gen in self._gens:  # not failed or cancelled since
                    unit.kv.tokens[position] = token
                    self._advance(unit, token, None, None, append=False)
        finally:
            self._auto_interval = current

    def _hand_on_pending(self) -> None:
        """The text, stops and events of the deferred tokens (`_take_token` did the rest)."""
        pending, self._pending = self._pending, []
        current, self._auto_interval = self._auto_interval, self._pending_interval
        try:
            for unit, token, logprob, top in pending:
                if unit.gen in self._gens:  # not failed or cancelled since
                    self._hand_on(unit, token, logprob, top, append=False)
        finally:
            self._auto_interval = current

    def _leave(self, unit: Unit) -> None:
        """A finished unit out of the batch (or the queue, where a preemption put it since), its blocks freed."""
        try:
            self.running.remove(unit)
        except ValueError:
            self.waiting.remove(unit)
        self.runner.free_sequence(unit.kv)
        unit.finished = True

    def _hand_on(self, unit: Unit, token: int, logprob: float | None, top: list[tuple[int, float]] | None,
                 append: bool) -> bool:
        """The token's text and stops, its event, and the unit's end if it finished; whether the unit goes on."""
        gen, stopper = unit.gen, unit.stopper
        text, finish, stop_reason = stopper.push(token)
        if finish is None and unit.matcher is not None:
            if not unit.matcher.advance(token):  # the mask allowed it: a grammar engine failure
                log.error("%s: the grammar refused token %d: %s", gen.request_id, token, unit.matcher.error)
                self.fail([gen], 500, "the output's grammar failed")
                return False
            if unit.matcher.is_stopped:  # the output is complete: nothing but an end token could follow
                end = stopper.end()
                text, finish = text + end.text, end.finish_reason
        entry = TokenLogprob(token, logprob, top or []) if unit.wants_logprobs else None
        interval = gen.stream_interval or self._auto_interval
        held = unit.held
        if finish is None and interval > 1 and len(held.tokens) + 1 < interval and stopper.num_tokens > 1:
            # The first token goes at once (TTFT); then every stream_interval-th, with those held since.
            held.text.append(text)
            held.tokens.append(token)
            if entry is not None:
                held.logprobs.append(entry)
            held.at = time.perf_counter()
        else:
            if held.tokens:
                text, tokens = "".join(held.text) + text, held.tokens
                tokens.append(token)
                logprobs = None
                if entry is not None:
                    logprobs = held.logprobs
                    logprobs.append(entry)
                unit.held = HeldOutput()
            else:
                tokens, logprobs = [token], None if entry is None else [entry]
            self.events.emit(gen, ChoiceDelta(unit.choice, text, tokens, logprobs, finish, stop_reason))
        if finish is None:
            if append:
                unit.kv.tokens.append(token)
            return True
        state = self._gens[gen]
        state.completion_tokens += stopper.num_tokens
        if not unit.finished:
            self._leave(unit)
        state.open_choices -= 1
        if state.open_choices == 0:
            self._done(gen)
        return False

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
