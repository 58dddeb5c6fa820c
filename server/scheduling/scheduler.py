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
from concurrent.futures import ThreadPoolExecutor

import torch

from engine import Runner
from engine.model.batch import StepRow, TokenFeed
from engine.cache.block_manager import PENDING_TOKEN, KVSequence
from engine.errors import RowError, RowRefusal

from server.sampling.device_tokens import DeviceTokens, TokenLanding, sample_greedy_on_device
from server.scheduling.drafting import draft_check, observe_decode_step, propose_drafts
from server.scheduling.embedding_jobs import EmbeddingJob, EmbeddingSteps
from server.scheduling.generation import Generation, GenerationFailed
from server.scheduling.output_processor import (AUTO_MAX_INTERVAL, AUTO_STREAMS, OutputProcessor, Outcome,
    auto_stream_interval)
from server.scheduling.pipelining import EarlyMasks, Inflight, grammar_masks, start_masks
from server.scheduling.sequence import GenerationState, SequenceState
from server.sampling.sampler import SequenceSampler, sample_batch
from server.speculative.speculator import Speculator
from server.speculative.rejection import Proposal, verify_drafts
from server.scheduling.stopping import StopChecker
from server.reasoning.gate import choice_matcher
from server.reasoning.harmony import new_splitter

__all__ = ["AUTO_MAX_INTERVAL", "AUTO_STREAMS", "Scheduler", "auto_stream_interval"]

log = logging.getLogger("emberserve.scheduler")


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
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self._gens: dict[Generation, GenerationState] = {}
        self._take: dict[SequenceState, int] = {}
        # Speculative decoding: each speculating sequence's drafted tokens this step (appended to its tokens, computed
        # with its last token in one row, verified after the pass); see _propose and _verify.
        self.speculator = speculator
        self._drafts: dict[SequenceState, Proposal] = {}
        self._stepping: list[SequenceState] = []  # the sequences of the step under way, failed together if it crashes
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self.generated_tokens = 0
        self.preemptions = 0
        self.peak_running = 0  # the most sequences one step has run together, since start
        self.num_waiting = 0  # generations not started yet (read from other threads: one int, always current)
        self.output = OutputProcessor()
        self.events = self.output.events
        self.embeddings = EmbeddingSteps(runner, max_batched_tokens)
        self._embeddings_turn = True
        # On a GPU a step's launch does not wait for it, so the host work of a sampled token that the next step's
        # schedule does not need (detokenizing, stop strings, its event) waits until that step is launched and
        # runs beside it (`_take_token`, then `_hand_on` from `_pending`). A stop string found then cost its sequence
        # one row of that step, dropped. None: defer where the runner is on a GPU.
        self.defer_text = runner.device.type == "cuda" if defer_text is None else defer_text
        self._pending: list[tuple[SequenceState, int, float | None, list[tuple[int, float]] | None]] = []
        self._pending_interval = 1  # auto_stream_interval of the step that sampled the pending tokens
        # Async scheduling (vLLM's name; off unless asked for): a plain greedy step's tokens stay on the device
        # (DeviceTokens); the next step is scheduled and launched reading them there (TokenFeed), each sequence
        # holding a PENDING_TOKEN in their place, and only then are they taken on the host (`_collect`), beside the
        # device's work. An end found then has cost its sequence one row of the launched step, dropped. Not with
        # speculation (drafts are read from the tokens) nor a tensor-parallel runner. It pays only where the host's
        # Python is not already the bottleneck: with the HTTP side on the same GIL it does not
        # (bench/RESULTS.md#issue-13-gpu-async-scheduling).
        self.async_scheduling = async_scheduling and speculator is None \
            and getattr(runner, "tensor_parallel", None) is None
        self._inflight: Inflight | None = None
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
        self._gens[gen] = GenerationState(prompt_tokens=len(gen.prompt_ids))
        self.waiting.append(SequenceState(gen, kv))
        self.num_waiting += 1

    # ---- bookkeeping ----
    def _drop(self, gen: Generation) -> None:
        """Free everything a cancelled or failed generation holds."""
        for seq in [u for u in self.running if u.gen is gen]:
            self.running.remove(seq)
            self.runner.free_sequence(seq.kv)
        for seq in [u for u in self.waiting if u.gen is gen]:
            self.waiting.remove(seq)
            self.runner.free_sequence(seq.kv)
        state = self._gens.pop(gen, None)
        if state is not None and not state.started:
            self.num_waiting -= 1

    def drop_cancelled(self) -> None:
        for gen in [g for g in self._gens if g.cancelled]:
            self._drop(gen)

    def fail(self, gens: list[Generation], status: int, message: str, code: str | None = None) -> None:
        """End `gens` with an error event, freeing what they hold; what was produced before goes out first."""
        # Deferred tokens (defer_text) first. Tokens still on their way (async scheduling) are not waited for here
        # (this may run while a step is being scheduled): those of `gens` are never sent, the others' later.
        self._hand_on_pending()
        failing = set(gens)
        for seq in self.running + list(self.waiting):
            if seq.gen in failing:
                self.output.release_held(seq)
        self.output.flush()
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

    def _preempt_newest(self, keep: SequenceState, scheduled: dict[SequenceState, int]) -> bool:
        """Free the blocks of the most recently admitted running sequence not yet scheduled this step (nor `keep`)."""
        for seq in reversed(self.running):
            if seq is not keep and seq not in scheduled:
                self.running.remove(seq)
                self.runner.free_sequence(seq.kv)
                self.waiting.appendleft(seq)
                self.preemptions += 1
                log.info("preempted a sequence of %s (%d tokens) to free KV blocks", seq.gen.request_id,
                         len(seq.kv.tokens))
                return True
        return False

    # ---- one step ----
    def _running_order(self) -> tuple[list[SequenceState], int]:
        """Decoding sequences first (the budget holds one token of each), then prompts still being prefilled,
        oldest first, with what is left of it; and how many decode."""
        decoding, prefilling = [], []
        for u in self.running:
            (decoding if len(u.kv.tokens) - u.kv.num_computed <= 1 else prefilling).append(u)
        return decoding + prefilling, len(decoding)

    def _refused(self, seq: SequenceState, take: int) -> bool:
        """Fail the sequence's generation if the runner would refuse its next row (before blocks are spent on it)."""
        error = self.runner.row_error(seq.kv, seq.kv.num_computed, seq.kv.num_computed + take)
        if error is not None:
            self._refuse(seq, error)
        return error is not None

    def _refuse(self, seq: SequenceState, refusal: RowRefusal) -> None:
        log.warning("%s: %s", seq.gen.request_id, refusal.message)
        self.fail([seq.gen], 400, refusal.message, refusal.code)

    def _schedule(self) -> list[SequenceState]:
        """Pick this step's sequences and give each the blocks it needs; one computes min(pending, budget) tokens."""
        runner, budget, chosen = self.runner, self.max_batched_tokens, []
        self._take, self._drafts = {}, {}
        proposals = self._propose()
        order, decoding = self._running_order()
        # Drafts take the budget's tokens beyond one for every decoding sequence.
        spare = budget - decoding
        running = set(self.running)  # membership in O(1): preemption and failures take sequences out as we go
        inflight = self._inflight
        row_error = self.runner.row_error
        for seq in order:  # every running sequence, every step: what is read more than once is read once
            if seq not in running or budget <= 0 or seq.gen.backlogged:
                continue  # preempted or failed meanwhile, out of budget, or paused: its reader is far behind
            if inflight is not None and seq in inflight.index and seq.stopper.ends_next():
                continue  # its token on the way is its last (max_tokens): no row for what would follow
            kv = seq.kv
            start = kv.num_computed
            take = min(len(kv.tokens) - start, budget)
            error = row_error(kv, start, start + take)
            if error is not None:
                self._refuse(seq, error)
                running = set(self.running)
                continue
            proposal = proposals.get(seq) if proposals else None
            drafts = proposal.cut(max(0, min(spare, budget - take))) if proposal is not None else None
            # Speculation never preempts: drafts go only where their blocks are free beside one for each sequence.
            if drafts and drafts.tokens and runner.can_allocate(
                    kv, start + take + len(drafts.tokens), reserve=len(self.running)):
                take += len(drafts.tokens)
                spare -= len(drafts.tokens)
            else:
                drafts = None
            fits = runner.can_allocate(kv, start + take)
            while not fits and self._preempt_newest(seq, self._take):
                running = set(self.running)
                fits = runner.can_allocate(kv, start + take)
            if not fits:
                self.running.remove(seq)  # even alone it does not fit now: wait for blocks
                self.runner.free_sequence(kv)
                self.waiting.appendleft(seq)
                continue
            runner.allocate(kv, start + take)
            if drafts is not None:
                kv.tokens.extend(drafts.tokens)
                self._drafts[seq] = drafts
            self._take[seq] = take
            chosen.append(seq)
            budget -= take
        while self.waiting and budget > 0 and (not self.running or
                                               len(self.running) + self.waiting[0].slots <= self.max_running):
            seq = self.waiting[0]
            if seq.kv.tokens and seq.kv.tokens[-1] == PENDING_TOKEN:
                break  # preempted just now with its token on the way: it is back once the token is taken
            if seq.kv.num_computed == 0 and not seq.kv.block_table:
                if seq.wants_prompt_logprobs:
                    # Every prompt position's logprob is computed, so no prefix is reused; a restart recomputes.
                    seq.prompt_logprobs = []
                else:
                    runner.match_prefix(seq.kv, len(seq.kv.tokens) - 1)
                if seq.choice is None:
                    self._gens[seq.gen].cached_tokens = seq.kv.num_cached
            take = min(seq.kv.num_pending, budget)
            if self._refused(seq, take):
                continue
            # Keep one free block per running sequence so admitting this one does not force a preemption.
            if not runner.can_allocate(seq.kv, seq.kv.num_computed + take, reserve=len(self.running)):
                if self.running:
                    break
                if not runner.can_allocate(seq.kv, seq.kv.num_computed + take):
                    # Nothing runs, so only waiting sequences hold blocks: prefixes they matched before a
                    # preempted sequence was put back ahead of them. Let those go; they match again in turn.
                    for other in self.waiting:
                        if other is not seq and other.kv.block_table:
                            self.runner.free_sequence(other.kv)
                    if not runner.can_allocate(seq.kv, seq.kv.num_computed + take):
                        # Cannot happen while the context is capped to the pool (Runner); fail it, not the worker.
                        log.error("%s: the KV cache cannot hold a sequence of %d tokens", seq.gen.request_id,
                                  len(seq.kv.tokens))
                        self.fail([seq.gen], 500, "the KV cache cannot hold this sequence")
                        continue
            self.waiting.popleft()
            runner.allocate(seq.kv, seq.kv.num_computed + take)
            self.running.append(seq)
            state = self._gens[seq.gen]
            if not state.started:
                state.started = True
                self.num_waiting -= 1
            self._take[seq] = take
            chosen.append(seq)
            budget -= take
        return chosen

    def _propose(self) -> dict[SequenceState, Proposal]:
        """Draft tokens of the decoding choices that speculate this step."""
        if self.speculator is None:
            return {}
        return propose_drafts(self.speculator, self.running, self.runner.context_size)

    def _rows(self, seqs: list[SequenceState]) -> list[StepRow]:
        rows, take, drafts = [], self._take, self._drafts
        for seq in seqs:
            kv = seq.kv
            start = kv.num_computed
            end = start + take[seq]
            logits = "all" if seq.wants_prompt_logprobs or (drafts and seq in drafts) else \
                "last" if end == len(kv.tokens) else "none"
            rows.append(StepRow(kv, start, end, logits))
        return rows

    def _forward(self, seqs: list[SequenceState]) -> tuple[list[SequenceState], list[StepRow], torch.Tensor] | None:
        """The runner's step over `sequences`; rows it refuses fail their generations (400) and the rest run."""
        while seqs:
            rows = self._rows(seqs)
            feed = self._feed(seqs, rows)
            try:
                return seqs, rows, self.runner.step(rows) if feed is None else self.runner.step(rows, feed)
            except RowError as e:  # what _refused did not foresee: fail those rows, run the rest
                for i, refusal in sorted(e.errors.items()):
                    log.warning("%s: %s", seqs[i].gen.request_id, refusal.message)
                    self.fail([seqs[i].gen], 400, refusal.message, refusal.code)
                seqs = [u for u in seqs if u.gen in self._gens]
        return None

    def step(self) -> None:
        """One forward pass: of pending embeddings or of the generations, taking turns while both have work."""
        generating = bool(self.waiting or self.running or self._pending or self._inflight)
        if self.embeddings.has_work() and (self._embeddings_turn or not generating):
            self._collect()
            self._hand_on_pending()
            self.output.flush()
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
        self.output.interval = auto_stream_interval(len(self.running))
        early = self._start_masks(self._stepping)
        try:
            done = self._forward(self._stepping)
        finally:
            if self._inflight is not None or self._pending:  # the last step's tokens, text and events, while the
                self._collect()                                # device computes this one
                self._hand_on_pending()
                self.output.flush()
        if done is None:
            self._stepping = []
            return
        seqs, rows, logits = done
        self._stepping = seqs
        finished: list[tuple[SequenceState, int]] = []  # sequences whose next token is due, and their row of `logits`
        speculated: list[tuple[SequenceState, StepRow, int]] = []  # those that drafted, and their first row of `logits`
        offset = 0
        for seq, row in zip(seqs, rows):
            if row.logits == "last":  # the common row, a sequence's next token (never a draft's: those are "all")
                offset += 1
                # Not finished by a stop string after this step was launched (its row is then dropped).
                if not seq.finished and row.end == len(seq.kv.tokens):
                    finished.append((seq, offset - 1))
                continue
            if row.logits == "none":
                continue
            n = row.end - row.start
            if seq.finished:  # a stop string ended it after this step was launched: its row is dropped
                offset += n
                continue
            if seq in self._drafts:
                speculated.append((seq, row, offset))
                offset += n
                continue
            self.output.collect_prompt_logprobs(seq, row, logits[offset:offset + n])
            offset += n
            if row.end == len(seq.kv.tokens):
                finished.append((seq, offset - 1))
        self._sample(finished, logits, early)
        if speculated:
            self._verify(speculated, logits)
        self._cap_running()
        self._stepping = []
        self.output.flush()
        if self.speculator is not None:
            observe_decode_step(self.speculator, seqs, rows, self._drafts, time.perf_counter() - started)
        self._drafts = {}

    def _token_text(self, token: int) -> str:
        """A token's text alone (a reasoning gate finds tags written as text with it)."""
        return self.runner.tokenizer.decode([token])

    def _fork(self, seq: SequenceState) -> list[SequenceState]:
        """Turn a computed prompt into its `n` choices, sharing the prompt's blocks."""
        gen, state = seq.gen, self._gens[seq.gen]
        self.output.prompt_done(seq)
        choices = []
        for index in range(gen.n):
            kv = seq.kv if index == gen.n - 1 else self.runner.share_sequence(seq.kv, seq.kv.num_computed)
            sampler = SequenceSampler(gen.params, self.runner.vocab_size, gen.prompt_ids,
                                      self.runner.device, seed_offset=index)
            stopper = StopChecker(self.runner.tokenizer.detokenizer(skip_special_tokens=True), stop=gen.stop,
                                  stop_token_ids=gen.stop_token_ids, max_tokens=gen.max_tokens,
                                  min_tokens=gen.min_tokens, ignore_eos=gen.ignore_eos)
            matcher = choice_matcher(gen.reasoning, gen.grammar.matcher() if gen.grammar is not None else None,
                                     self.runner.vocab_size, self._token_text)
            splitter = new_splitter(gen.reasoning) if gen.reasoning is not None else None
            choices.append(SequenceState(gen, kv, index, sampler, stopper, matcher, splitter=splitter))
        state.open_choices = gen.n
        position = self.running.index(seq)
        self.running[position:position + 1] = choices
        return choices

    def _cap_running(self) -> None:
        """Past `max_running` (a prompt forked into more choices than there was room for), the newest choices wait
        at the head of the queue, keeping their blocks, until others finish."""
        excess = len(self.running) - self.max_running
        for seq in list(reversed(self.running)):
            if excess <= 0:
                break
            if seq.choice is not None and len(self.running) > 1:
                self.running.remove(seq)
                self.waiting.appendleft(seq)
                excess -= 1

    def _sample(self, finished: list[tuple[SequenceState, int]], logits: torch.Tensor,
                early: EarlyMasks | None = None) -> None:
        """Sample the next token of every sequence in `finished` from its row of `logits` (a prompt: its choices')."""
        todo: list[SequenceState] = []
        index: list[int] = []
        for seq, row in finished:
            if seq.choice is None:
                if seq.gen.max_tokens == 0:
                    self._finish_empty(seq)
                    continue
                choices = self._fork(seq)
                todo += choices
                index += [row] * len(choices)
            else:
                todo.append(seq)
                index.append(row)
        if not todo:
            return
        for seq in todo:
            if not seq.suppresses_early_ends:  # then `suppressed` is never set
                continue
            if seq.stopper.num_tokens < seq.gen.min_tokens:
                seq.sampler.suppressed = self._end_ids(seq.gen)
            elif seq.sampler.suppressed is not None:
                seq.sampler.suppressed = None
        # The common step (every row a decode row's next token, in order) samples the logits as they are.
        rows = logits if index == list(range(len(logits))) else \
            logits.index_select(0, torch.tensor(index, device=logits.device))
        if self.async_scheduling and early is None and all(u.matcher is None for u in todo):
            tokens = sample_greedy_on_device(rows, [u.sampler for u in todo], self._landing)
            if tokens is not None:
                self._launched(todo, tokens)
                return
        sampled = sample_batch(rows, [u.sampler for u in todo], grammar_masks(todo, early, self.runner.vocab_size))
        gens, defer_text = self._gens, self.defer_text
        for seq, s in zip(todo, sampled):
            if seq.gen not in gens:  # failed by a choice before it
                continue
            if defer_text and seq.matcher is None:  # a grammar's next mask needs the token's whole effect
                self._take_token(seq, s.token)
                self._pending.append((seq, s.token, s.logprob, s.top_logprobs))
                self._pending_interval = self.output.interval
            else:
                self._advance(seq, s.token, s.logprob, s.top_logprobs)

    def _start_masks(self, seqs: list[SequenceState]) -> EarlyMasks | None:
        """Start filling the grammar masks of the sequences whose next token this step samples (`start_masks`)."""
        # A speculating sequence's masks (one per drafted position) are filled when its drafts are verified.
        due = [u for u in seqs if u.matcher is not None and u not in self._drafts
               and u.kv.num_computed + self._take[u] == len(u.kv.tokens)]
        return start_masks(due, self._mask_pool, self.runner.vocab_size)

    def _end_ids(self, gen: Generation) -> torch.Tensor | None:
        ids = sorted(gen.stop_token_ids)
        return torch.tensor(ids, dtype=torch.long, device=self.runner.device) if ids else None

    def _verify(self, speculated: list[tuple[SequenceState, StepRow, int]], logits: torch.Tensor) -> None:
        """Accept or reject each speculating sequence's drafts (server/speculative/rejection.py), roll its sequence back
        to the accepted tokens (their KV stays; the rejected ones' leaves the prefix cache), and hand on the
        accepted tokens and the target's own next one, which stop strings, end tokens and max_tokens may cut."""
        checks, index = [], []
        for seq, row, offset in speculated:
            drafts = self._drafts[seq]
            checks.append(draft_check(seq, drafts, self._end_ids(seq.gen), self.runner.vocab_size))
            index += range(offset, offset + len(drafts.tokens) + 1)
        rows = logits if index == list(range(len(logits))) else \
            logits.index_select(0, torch.tensor(index, device=logits.device))
        for (seq, row, _), result in zip(speculated, verify_drafts(rows, checks)):
            if seq.gen not in self._gens:  # failed by a choice before it
                continue
            self.speculator.record(seq, len(self._drafts[seq].tokens), result.accepted)
            self.runner.rollback_sequence(seq.kv, row.start + 1 + result.accepted)
            for j, s in enumerate(result.sampled):
                # The accepted drafts are already the sequence's tokens (computed); the last token is new.
                if not self._advance(seq, s.token, s.logprob, s.top_logprobs, append=j == result.accepted):
                    break

    def _advance(self, seq: SequenceState, token: int, logprob: float | None, top: list[tuple[int, float]] | None,
                 append: bool = True) -> bool:
        """Hand on the sequence's next token; whether it goes on (False: it finished, or its generation failed).
        `append`: the token is new to the sequence (not an accepted draft already in its tokens)."""
        seq.sampler.observe(token)
        self.generated_tokens += 1
        return self._hand_on(seq, token, logprob, top, append)

    def _take_token(self, seq: SequenceState, token: int) -> None:
        """Of a deferred token (defer_text), what the next step's schedule needs: the sampler's counts, the token in
        the sequence, or the sequence out of the batch if the token itself ends it (an end token, max_tokens)."""
        seq.sampler.observe(token)
        self.generated_tokens += 1
        if seq.stopper.ends_at(token):
            self._leave(seq)
        else:
            seq.kv.tokens.append(token)

    def _launched(self, seqs: list[SequenceState], tokens: DeviceTokens) -> None:
        """Async scheduling: `sequences`' next tokens are on the device; each sequence holds their place."""
        positions = []
        for seq in seqs:
            positions.append(len(seq.kv.tokens))
            seq.kv.tokens.append(PENDING_TOKEN)
        self._inflight = Inflight(seqs, tokens, positions, self.output.interval)

    def _feed(self, seqs: list[SequenceState], rows: list[StepRow]) -> TokenFeed | None:
        """The rows whose token is on its way (async scheduling): the step reads it on the device."""
        return None if self._inflight is None else self._inflight.feed(seqs, rows)

    def _collect(self) -> None:
        """The tokens on their way (async scheduling), taken: into their sequences, then their text, stops and
        events (a sequence they end leaves the batch; its row in a step launched since is dropped)."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        tokens = inflight.tokens.collect()
        current, self.output.interval = self.output.interval, inflight.interval
        try:
            for seq, position, token in zip(inflight.seqs, inflight.positions, tokens):
                if seq.gen in self._gens:  # not failed or cancelled since
                    seq.kv.tokens[position] = token
                    self._advance(seq, token, None, None, append=False)
        finally:
            self.output.interval = current

    def _hand_on_pending(self) -> None:
        """The text, stops and events of the deferred tokens (`_take_token` did the rest)."""
        pending, self._pending = self._pending, []
        current, self.output.interval = self.output.interval, self._pending_interval
        try:
            for seq, token, logprob, top in pending:
                if seq.gen in self._gens:  # not failed or cancelled since
                    self._hand_on(seq, token, logprob, top, append=False)
        finally:
            self.output.interval = current

    def _leave(self, seq: SequenceState) -> None:
        """A finished sequence out of the batch (or the queue, where a preemption put it since), its blocks freed."""
        try:
            self.running.remove(seq)
        except ValueError:
            self.waiting.remove(seq)
        self.runner.free_sequence(seq.kv)
        seq.finished = True

    def _hand_on(self, seq: SequenceState, token: int, logprob: float | None, top: list[tuple[int, float]] | None,
                 append: bool) -> bool:
        """The token's text, stops and event (`OutputProcessor.push`), and the sequence's end if it finished; whether
        the sequence goes on."""
        outcome = self.output.push(seq, token, logprob, top)
        if outcome is Outcome.GRAMMAR_FAILED:
            self.fail([seq.gen], 500, "the output's grammar failed")
            return False
        gen = seq.gen
        if outcome is Outcome.GOES_ON:
            if append:
                seq.kv.tokens.append(token)
            return True
        state = self._gens[gen]
        state.completion_tokens += seq.stopper.num_tokens
        if seq.splitter is not None:
            state.reasoning_tokens += seq.splitter.reasoning_tokens
        if not seq.finished:
            self._leave(seq)
        state.open_choices -= 1
        if state.open_choices == 0:
            self._done(gen)
        return False

    def _finish_empty(self, seq: SequenceState) -> None:
        """max_tokens 0 (echo only): every choice ends at once with no tokens."""
        gen = seq.gen
        self.output.prompt_done(seq)
        self.output.empty_choices(gen)
        self.running.remove(seq)
        self.runner.free_sequence(seq.kv)
        self._done(gen)

    def _done(self, gen: Generation) -> None:
        self.output.done(gen, self._gens.pop(gen))
