"""Loading a model for serving: each worker's runner (and draft model), started workers, the served model's state.

What the one-process server, the engine process and the in-process `Generator` all load through.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path
from collections.abc import Callable

import torch

from engine import Runner, load_runner
from engine.kernels.switches import configure as configure_kernels
from engine.model.quant import dense_copy_bytes
from engine.weights import Progress

from server import __version__
from server.config.presets import get_preset
from server.config.served_models import alias_of
from server.config.settings import SELF_DRAFTS, Settings, device_default
from server.grammar.compiler import GrammarCompiler
from server.reasoning.formats import choose_format
from server.scheduling.model_state import ModelState, Pool, ServedModel
from server.scheduling.progress import LoadProgress
from server.scheduling.worker import Worker, WorkerPool
from server.speculative.draft_model import DraftModel, vocabulary_mismatch
from server.speculative.speculator import SpeculativeConfig, Speculator

log = logging.getLogger("emberserve")


def worker_device(settings: Settings, index: int) -> str:
    """One device per worker on a multi-GPU host ("cuda" → cuda:0, cuda:1, ...); otherwise the device as given."""
    if settings.workers > 1 and settings.device == "cuda":
        return f"cuda:{index}"
    return settings.device




def load_speculator(settings: Settings, runner: Runner, device: str, progress: Progress) -> Speculator | None:
    """The worker's speculative decoding, with its draft model loaded beside the target; None when off."""
    method = settings.speculative_method
    if method is None or runner.is_encoder:
        return None
    config = SpeculativeConfig(method, settings.num_speculative_tokens, settings.ngram_min, settings.ngram_max,
                               device_default(settings, "speculative_disable_by_batch_size"))
    if method == "ngram":
        return Speculator(config)
    name, quant = settings.draft_model, SELF_DRAFTS.get(settings.draft_model)
    draft = load_runner(settings.model if quant else name, device=device, quant=quant,
                        dtype="bfloat16" if quant else settings.dtype, max_context=settings.max_model_len,
                        prefix_caching=settings.prefix_caching, progress=progress,
                        dense_prefill=settings.dense_prefill)
    mismatch = vocabulary_mismatch(runner, draft)
    if mismatch is not None:
        raise ValueError(mismatch)
    if draft.device.type == "cuda" and settings.cuda_graphs:  # the draft's decode steps replay graphs too
        draft.capture_cuda_graphs(device_default(settings, "max_num_seqs"))
    log.info("draft model %s (%s weights) proposes up to %d tokens per step", name,
             draft.quant if draft.quant != "none" else "dense", settings.num_speculative_tokens)
    return Speculator(config, DraftModel(draft))


def load_worker_runner(settings: Settings, index: int, progress: Progress) -> Runner:
    """Worker `index`'s runner, loaded as the settings say (and its CUDA graphs captured on a GPU)."""
    runner = load_runner(settings.model, device=worker_device(settings, index), dtype=settings.dtype,
                         quant=settings.quant,
                         max_context=settings.max_model_len, kv_cache_memory=settings.kv_cache_memory,
                         prefix_caching=settings.prefix_caching, progress=progress,
                         dense_prefill=settings.dense_prefill, deterministic=settings.deterministic,
                         tensor_parallel_size=settings.tensor_parallel_size)
    if settings.chat_template is not None:  # --chat-template: the operator's template over the model's own
        runner.tokenizer.set_chat_template(Path(settings.chat_template).read_text())
    blocks = runner.blocks
    if blocks is None:
        log.info("worker %d: %s on %s; an encoder: embeddings only, no KV cache", index, runner.name, runner.device)
    else:
        log.info("worker %d: %s on %s; KV cache: %d blocks = %d tokens (%.0f MiB %s), prefix caching %s", index,
                 runner.name, runner.device, blocks.num_blocks, blocks.num_blocks * blocks.block_size,
                 runner.cache.nbytes() / 2**20, str(runner.dtype).removeprefix("torch."),
                 "on" if blocks.prefix_caching else "off")
    if runner.device.type == "cuda" and settings.cuda_graphs and not runner.is_encoder:
        if runner.tensor_parallel is None:
            runner.capture_cuda_graphs(device_default(settings, "max_num_seqs"))
        else:
            log.warning("CUDA graphs are not used with tensor parallelism yet: decode steps run eagerly")
    return runner


def start_serving(settings: Settings, runners: list[Runner], on_worker_failure: Callable[[Worker], None] | None = None,
                  prepare_grammars: bool = True, speculators: list[Speculator | None] | None = None) -> ModelState:
    """A worker (thread and scheduler) for each runner, started, and the served model's state over them: what
    the HTTP app and the in-process `Generator` (server/generator/generator.py) both serve from. `prepare_grammars`: build
    the grammar engine's vocabulary now, beside serving (else on the first constrained request); `speculators`:
    each worker's speculative decoding (`load_speculator`), none by default."""
    # CPU workers (and tensor-parallel ranks) share the cores: more OpenMP threads than cores make every one of
    # them sleep at its barriers.
    processes = len(runners) * settings.tensor_parallel_size
    threads = max(1, torch.get_num_threads() // processes) if settings.device == "cpu" else None
    max_running = device_default(settings, "max_num_seqs")
    speculators = speculators or [None] * len(runners)
    workers = [Worker(runner, f"worker-{i}", max_running=max_running, threads=threads, on_failure=on_worker_failure,
                      max_batched_tokens=device_default(settings, "max_num_batched_tokens", encoder=runner.is_encoder),
                      speculator=speculators[i],
                      async_scheduling=bool(device_default(settings, "async_scheduling")))
               for i, runner in enumerate(runners)]
    for i, worker in enumerate(workers):
        tp = worker.runner.tensor_parallel
        if tp is not None:
            log.info("worker %d: tensor parallel over %d ranks (%s)", i, tp.size,
                     torch.distributed.get_backend(tp.group.group))
            tp.on_failure(worker.fail)  # a rank that dies takes the worker, and so the server, down
    pool = WorkerPool(workers, settings.max_queued)
    pool.start()
    return model_state(settings, runners[0], pool, prepare_grammars)


def model_state(settings: Settings, runner: Runner | ServedModel, pool: Pool,
                prepare_grammars: bool = True, model_id: str | None = None) -> ModelState:
    """The served model's state over its pool: in this process (`runner`), or the engine process's (its facts);
    `model_id`: the id clients send (default: its --served-model-name alias, else its name)."""
    served = runner if isinstance(runner, ServedModel) else ServedModel.of(runner)
    model_id = model_id or alias_of(settings, runner.name) or runner.name
    digest = hashlib.sha256(f"{__version__}:{model_id}:{runner.dtype}:{runner.quant}:{runner.device}:"
                            f"{runner.deterministic}".encode()).hexdigest()[:10]
    grammars = GrammarCompiler(runner.tokenizer) if prepare_grammars else None
    if grammars is not None:
        # The grammar engine's view of the vocabulary (slow to build for a large one:
        # bench/RESULTS.md#issue-14-grammar-engines) is built beside serving, not on the first structured request;
        # that request waits for it only if it comes first.
        threading.Thread(target=grammars.vocabulary, name="grammar-vocabulary", daemon=True).start()
    tokenizer = runner.tokenizer
    reasoning = None if runner.is_encoder else choose_format(
        settings.reasoning_parser, tokenizer.chat_template,
        lambda text: tokenizer.encode(text, add_special_tokens=False))
    if reasoning is not None:
        log.info("reasoning: %s (thinking between %s and %s, apart from the answer)", reasoning.name, reasoning.start,
                 reasoning.end)
    return ModelState(model_id=model_id, model=served, pool=pool, fingerprint=f"fp_{digest}",
                      reasoning=reasoning, chat_template_kwargs=dict(settings.chat_template_kwargs),
                      created=int(time.time()), max_prompt_tokens=settings.max_prompt_tokens,
                      stream_timeout=settings.stream_timeout, stream_interval=settings.stream_interval,
                      max_tokens_default=settings.max_tokens_default,
                      parse_special_in_messages=settings.parse_special_in_messages, grammars=grammars,
                      embeddings=settings.embeddings or runner.is_encoder, pooling=settings.pooling,
                      preset=get_preset(settings.preset) if settings.preset is not None else None)


def load_model(settings: Settings, on_worker_failure: Callable[[Worker], None] | None = None,
          progress: Progress | None = None, prepare_grammars: bool = True) -> ModelState:
    """Load the model for every worker and start serving it (`progress`: default, a bar or log lines)."""
    started = time.perf_counter()
    configure_kernels(settings.kernel_switches)  # Settings over the engine's environment defaults
    if progress is None:
        progress = LoadProgress(interactive=None if settings.log_format == "text" else False)
    runners = [load_worker_runner(settings, i, progress) for i in range(settings.workers)]
    speculators = [load_speculator(settings, r, worker_device(settings, i), progress) for i, r in enumerate(runners)]
    state = start_serving(settings, runners, on_worker_failure, prepare_grammars, speculators)
    runner, threads = runners[0], state.pool.workers[0].threads
    dense = dense_copy_bytes(runner.model)
    log.info("loaded %s (%s, %s activations, %s weights%s on %s, %d threads, context %d%s) "
             "in %.1fs", state.model_id, runner.family, str(runner.dtype).removeprefix("torch."),
             runner.quant if runner.quant != "none" else "dense",
             f" + a bfloat16 copy for prefill ({dense / 2**20:.0f} MiB)" if dense else "",
             runner.device, threads or torch.get_num_threads(), runner.context_size,
             ", deterministic steps" if runner.deterministic else "", time.perf_counter() - started)
    return state


def stop_workers(state: ModelState) -> None:
    """What a load cancelled before it finished (a SIGTERM while loading) started: its workers."""
    state.pool.stop()
