"""`Worker`: a thread that owns a Runner and turns queued Generations into token events, one step at a time."""
from __future__ import annotations

import logging
import queue
import threading

import torch

from engine import Runner
from engine.errors import EngineError

from .generation import ChoiceDelta, Generation, GenerationDone, GenerationFailed, PromptLogprobs, TokenLogprob
from .sampling import SequenceSampler, sample_batch
from .stopping import StopChecker

log = logging.getLogger("emberserve.worker")


def prompt_logprobs(logits: torch.Tensor, ids: list[int], top_n: int) -> list[TokenLogprob | None]:
    """Logprob of each prompt token given the ones before it (row i of `logits` predicts ids[i + 1])."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    targets = torch.tensor(ids[1:], dtype=torch.long)
    chosen = logp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    top_vals, top_ids = (logp.topk(top_n, dim=-1) if top_n else (None, None))
    entries: list[TokenLogprob | None] = [None]
    for i, token in enumerate(ids[1:]):
        top = list(zip(top_ids[i].tolist(), top_vals[i].tolist())) if top_n else []
        entries.append(TokenLogprob(token, chosen[i], top))
    return entries


class Worker:
    """Owns one runner on one thread; the event loop only submits Generations and reads their events."""

    def __init__(self, runner: Runner, name: str = "worker-0") -> None:
        self.runner = runner
        self._queue: queue.Queue[Generation | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.running = 0
        self.generated_tokens = 0  # total over the worker's life; tests watch it stop growing on disconnect

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def submit(self, gen: Generation) -> None:
        self._queue.put(gen)

    def _run(self) -> None:
        while (gen := self._queue.get()) is not None:
            if gen.cancelled:
                continue
            self.running = 1
            try:
                self._generate(gen)
            except EngineError as e:
                gen.emit(GenerationFailed(400, str(e)))
            except Exception:
                log.exception("generation %s failed", gen.request_id)
                gen.emit(GenerationFailed(500, "internal error while generating"))
            finally:
                self.runner.reset_session()
                self.running = 0

    def _generate(self, gen: Generation) -> None:
        runner = self.runner
        if gen.prompt_logprobs is not None:
            all_logits = runner.predict_logits(gen.prompt_ids)
            gen.emit(PromptLogprobs(prompt_logprobs(all_logits, gen.prompt_ids, gen.prompt_logprobs)))
            first_logits = all_logits[-1]
        else:
            first_logits = runner.prefill_logits(gen.prompt_ids)
        snapshot = runner.export_session() if gen.n > 1 else None
        completion_tokens = 0
        for index in range(gen.n):
            if index and snapshot is not None:
                runner.restore_session(snapshot)
            completion_tokens += self._generate_choice(gen, index, first_logits)
            if gen.cancelled:
                return
        gen.emit(GenerationDone(len(gen.prompt_ids), completion_tokens))

    def _generate_choice(self, gen: Generation, index: int, logits: torch.Tensor) -> int:
        """Sample one choice to its end; returns how many tokens it generated."""
        runner = self.runner
        if gen.max_tokens == 0:
            gen.emit(ChoiceDelta(index, "", [], [] if gen.params.logprobs else None, "length"))
            return 0
        sampler = SequenceSampler(gen.params, runner.vocab_size, gen.prompt_ids, logits.device, seed_offset=index)
        stopper = StopChecker(runner.tokenizer.detokenizer(skip_special_tokens=True), stop=gen.stop,
                              stop_token_ids=gen.stop_token_ids, max_tokens=gen.max_tokens,
                              min_tokens=gen.min_tokens, ignore_eos=gen.ignore_eos)
        # As in vLLM, the end tokens cannot be drawn before min_tokens tokens exist (unless they are ignored anyway).
        ends = (torch.tensor(sorted(gen.stop_token_ids), dtype=torch.long, device=logits.device)
                if gen.min_tokens and gen.stop_token_ids and not gen.ignore_eos else None)
        while not gen.cancelled:
            sampler.suppressed = ends if stopper.num_tokens < gen.min_tokens else None
            sampled = sample_batch(logits.unsqueeze(0), [sampler])[0]
            sampler.observe(sampled.token)
            self.generated_tokens += 1
            update = stopper.push(sampled.token)
            logprobs = None
            if gen.params.logprobs:
                logprobs = [TokenLogprob(sampled.token, sampled.logprob, sampled.top_logprobs or [])]
            gen.emit(ChoiceDelta(index, update.text, [sampled.token], logprobs, update.finish_reason))
            if update.finish_reason is not None:
                break
            logits = runner.decode_logits(sampled.token)
        return stopper.num_tokens
