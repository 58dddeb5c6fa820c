"""`Runner`: the host-driven loop over one decoder: batched steps over the paged KV cache, and a single session;
and embeddings, of a decoder or of an encoder (which has no KV cache and only embeds).

Block ownership: the Runner owns its KV pool (`blocks`, a BlockManager); every change to it goes through a Runner
method (allocate, match_prefix, share_sequence, free_sequence, rollback_sequence, step, embed). Callers decide
*which* sequences hold blocks and when (the scheduler: admission, preemption, forks, asking `can_allocate`) but
never touch the BlockManager themselves; `step` allocates whatever its rows still lack (already-held blocks are
kept), performs the copy-on-write copies and commits computed blocks to the prefix cache. One owner keeps the
pool's invariants (refcounts, pending copies, cache registration) in one module; `blocks` is read-only to others."""
from __future__ import annotations

import logging
import queue
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.model.batch import ForwardBatch, StepRow, TokenFeed, build_batch
from engine.cache.block_manager import BlockManager, KVSequence
from engine.runtime.chunk_graphs import CHUNK_BUCKETS, ChunkGraphs, GraphStep
from engine.runtime.cuda_graphs import DecodeGraphs, table_width
from engine.config import EncoderConfig, ModelConfig
from engine.errors import CONTEXT_LENGTH_EXCEEDED, ContextLengthError, EngineError, RowError, RowRefusal
from engine.cache.kv_cache import DEFAULT_BLOCK_SIZE, PagedKVCache
from engine.kernels.cpu import chunk_attention_kernel
from engine.model.layers import CPU_PAGED_DECODE
from engine.model import BertEncoder, DecoderModel
from engine.model.bert import pack_sentences
from engine.parallel.messages import MODE_HIDDEN, MODE_LOGITS
from engine.parallel.ranks import RankProcesses, TensorParallelFailure
from engine.runtime.pooling import POOLING_MODES, pool
from engine.tokenizer.tokenizer import Tokenizer
from engine.weights.summary import WeightsSummary

log = logging.getLogger("emberserve.engine")


@dataclass(frozen=True, eq=False)
class SessionSnapshot:
    """A session frozen for reuse: its token history and a share of its KV blocks (no copy; freed with it)."""

    tokens: tuple[int, ...]
    handle: KVSequence = field(repr=False)

    def __len__(self) -> int:
        return len(self.tokens)


class Runner:
    """Owns a decoder, its tokenizer and a paged KV cache; gives logits for the caller's own sampling loop.

    `step` runs many sequences (prefill chunks and decode tokens) in one forward pass; `prefill_logits`,
    `decode_logits` and the snapshot methods drive one implicit session on top of it; `embed` pools hidden states
    into embeddings. An encoder's runner (`is_encoder`) only embeds: it has no KV cache (`blocks` and `cache` are
    None). Not thread-safe: one thread owns a runner.
    """

    def __init__(self, model: DecoderModel | BertEncoder, tokenizer: Tokenizer, *, name: str, device: torch.device,
                 dtype: torch.dtype, quant: str = "none", max_context: int | None = None,
                 generation_defaults: dict[str, Any] | None = None, kv_cache_tokens: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, prefix_caching: bool = True,
                 deterministic: bool = False, pooling: str = "last", kv_heads: int | None = None,
                 tensor_parallel: RankProcesses | None = None, weights: WeightsSummary | None = None,
                 chat_tuned: bool = False) -> None:
        """`kv_heads`: the KV heads this process holds (a tensor-parallel rank's share; default the model's);
        `tensor_parallel`: on rank 0 of a tensor-parallel runner, its handle on the other ranks, which are sent
        every step before this process runs it; `weights`: what the model's files say of it (its parameter count,
        file type, ...), `chat_tuned`: whether it is tuned to chat (engine/weights/summary.py)."""
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.weights, self.chat_tuned = weights, chat_tuned
        self.tensor_parallel = tensor_parallel
        # Every token through the same kernels, whatever shares its step (see batch.ForwardBatch); CPU only.
        if deterministic and device.type != "cpu":
            raise ValueError(f"deterministic steps run on CPU only, not on {device.type}: the GPU matmul kernels "
                             "pick their reduction order by batch shape")
        self.deterministic = deterministic
        # On a GPU decode rows (and prefill over cached blocks) read the cache through the paged kernels.
        self.paged_attention = device.type == "cuda"
        # On CPU decode rows do too with the compiled kernel (engine/kernels/cpu.py); deterministic steps keep their
        # float64 attention.
        self.paged_decode = device.type == "cpu" and CPU_PAGED_DECODE and not deterministic
        self.config: ModelConfig | EncoderConfig = model.cfg
        # ... and chunks over cached blocks, at any length, where the build has the chunk kernel for the head size.
        self.chunk_kernel = self.paged_decode and chunk_attention_kernel(self.config.head_dim)
        if pooling not in POOLING_MODES:
            raise ValueError(f"unknown pooling {pooling!r}; use one of {', '.join(POOLING_MODES)}")
        self.pooling = pooling  # what `embed` does by default
        self.device, self.dtype, self.quant = device, dtype, quant
        trained = self.config.max_position
        if max_context is not None and not 0 < max_context <= trained:
            raise ValueError(f"max_context must be between 1 and the model's trained context {trained}, got {max_context}")
        self.context_size = max_context or trained
        self.generation_defaults = dict(generation_defaults or {})
        self.graphs: DecodeGraphs | None = None
        self.chunk_graphs: ChunkGraphs | None = None
        self._graph_step: GraphStep | None = None  # steps of decode rows and a few chunks, replayed
        self._session: KVSequence | None = None
        self._released: queue.SimpleQueue[KVSequence] = queue.SimpleQueue()  # snapshots collected by the GC
        self.blocks: BlockManager | None = None
        self.cache: PagedKVCache | None = None
        if self.config.is_encoder:
            return
        num_blocks = -(-(kv_cache_tokens or self.context_size) // block_size)
        if num_blocks * block_size < self.context_size:
            # One sequence can never outgrow the pool: a smaller pool caps the context, and says so.
            log.warning("the KV cache holds %d tokens, fewer than the context of %d: capping the context",
                        num_blocks * block_size, self.context_size)
            self.context_size = num_blocks * block_size
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        # The two pool operations the scheduler calls for every running sequence at every step are the block
        # manager's own bound methods: a Runner method around each would add a Python call there.
        self.can_allocate = self.blocks.can_allocate
        self.allocate = self.blocks.allocate
        # On a GPU one spare block past the manager's: CUDA-graph padding rows write there (engine/runtime/cuda_graphs.py).
        spare = 1 if device.type == "cuda" else 0
        self.cache = PagedKVCache(self.config, num_blocks + spare, block_size, dtype, device, kv_heads)

    @property
    def family(self) -> str:
        return self.config.family

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def is_encoder(self) -> bool:
        """An encoder computes embeddings only; a decoder generates (and embeds)."""
        return self.config.is_encoder

    @property
    def embedding_size(self) -> int:
        return self.config.hidden_size

    @property
    def tokens(self) -> list[int]:
        """The current session's tokens."""
        return list(self._session.tokens) if self._session else []

    def _check_fits(self, length: int) -> None:
        if length > self.context_size:
            raise ContextLengthError(
                f"sequence of {length} tokens exceeds the context size of {self.context_size} tokens")

    def _validate_ids(self, ids: Sequence[int]) -> list[int]:
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("at least one token is needed")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return ids

    def _check_decoder(self) -> None:
        if self.is_encoder:
            raise EngineError(f"{self.name} is an encoder: it computes embeddings, not next-token logits")

    # ---- many sequences ----
    def new_sequence(self, ids: Sequence[int], use_prefix_cache: bool = True) -> KVSequence:
        """A sequence for `ids`, already holding the longest cached prefix (at least one token is left to compute)."""
        self._check_decoder()
        ids = self._validate_ids(ids)
        self._check_fits(len(ids))
        seq = KVSequence(ids)
        if use_prefix_cache:
            self._drain_released()
            self.blocks.match_prefix(seq, len(ids) - 1)
        return seq

    # can_allocate(seq, total_tokens, reserve=0): whether `seq` can be given the blocks for `total_tokens` tokens,
    # leaving `reserve` blocks free; allocate(seq, total_tokens): give them (NoFreeBlocks if the pool cannot).
    # Set in __init__ for a decoder (BlockManager.can_allocate / allocate, bound).
    can_allocate: Callable[..., bool]
    allocate: Callable[[KVSequence, int], None]

    def match_prefix(self, seq: KVSequence, max_tokens: int) -> int:
        """Attach the longest cached prefix (at most `max_tokens` tokens) to `seq`, which holds no blocks."""
        return self.blocks.match_prefix(seq, max_tokens)

    def share_sequence(self, seq: KVSequence, length: int) -> KVSequence:
        """A new sequence holding the first `length` computed tokens of `seq`, sharing its blocks (no copy)."""
        return self.blocks.share(seq, length)

    def commit_sequence(self, seq: KVSequence) -> None:
        """Enter `seq`'s computed full blocks into the prefix cache (tokens written in after they were computed,
        as a draft's placeholders are)."""
        self.blocks.commit(seq)

    def free_sequence(self, seq: KVSequence) -> None:
        """Return every block of `seq` to the pool (cached prefix blocks stay cached)."""
        self.blocks.release(seq)

    def rollback_sequence(self, seq: KVSequence, length: int) -> None:
        """Cut `seq` back to its first `length` computed tokens (see BlockManager.rollback)."""
        self.blocks.rollback(seq, length)

    def _drain_released(self) -> None:
        while True:
            try:
                self.blocks.release(self._released.get_nowait())
            except queue.Empty:
                return

    def row_error(self, seq: KVSequence, start: int, end: int) -> RowRefusal | None:
        """Why computing tokens [start, end) of `seq` cannot run (not where the sequence continues, or past the
        context), or None."""
        if start != seq.num_computed or not start < end <= len(seq.tokens):
            return RowRefusal(f"row [{start}, {end}) does not continue a sequence of {seq.num_computed} computed of "
                              f"{len(seq.tokens)} tokens")
        if end > self.context_size:
            return RowRefusal(f"sequence of {end} tokens exceeds the context size of {self.context_size} tokens",
                              CONTEXT_LENGTH_EXCEEDED)
        return None

    def row_errors(self, rows: Sequence[StepRow]) -> dict[int, RowRefusal]:
        """`row_error` of every row that cannot run, by index."""
        return {i: error for i, (seq, start, end, _) in enumerate(rows)
                if (error := self.row_error(seq, start, end)) is not None}

    @torch.inference_mode()
    def step(self, rows: list[StepRow], feed: TokenFeed | None = None) -> torch.Tensor:
        """One forward pass over every row; float32 logits [R, vocab] for the rows' "last"/"all" positions in order.
        `feed`: rows whose first token is read on the device (TokenFeed; not with tensor parallelism).

        Rows that cannot run (see `row_errors`) raise RowError naming them before anything changes. Blocks a row
        still lacks are allocated here (NoFreeBlocks if the pool cannot hold it; a scheduler that allocated them
        beforehand, through `allocate`, finds them kept); afterwards each row's sequence counts the
        tokens as computed and its completed blocks enter the prefix cache.
        """
        self._check_decoder()
        self._drain_released()
        errors = self.row_errors(rows)
        if errors:
            raise RowError(errors)
        if feed is not None and self.tensor_parallel is not None:
            raise ValueError("a tensor-parallel step reads every token from its rows (no TokenFeed)")
        for row in rows:
            self.blocks.allocate(row.seq, row.end)
        copies = self.blocks.take_copies()
        if self._graph_step is not None and self._graph_step.serves(rows):
            self.cache.copy_blocks(copies)
            logits = self._graph_step.run(rows, feed)
        else:
            batch = build_batch(rows, self.blocks.block_size, self.config.sliding_window, self.device,
                                paged=self.paged_attention, paged_decode=self.paged_decode,
                                chunk_kernel=self.chunk_kernel,
                                deterministic=self.deterministic,
                                table_width=table_width(self.context_size, self.blocks.block_size)
                                if self.paged_attention else None, feed=feed)
            logits = self.forward_batch(batch, copies)
        for row in rows:
            row.seq.num_computed = row.end
            self.blocks.commit(row.seq)
        return logits

    def forward_batch(self, batch: ForwardBatch, copies: list[tuple[int, int]] = (),
                      hidden_states: bool = False) -> torch.Tensor:
        """The model's forward pass over `batch` after copying the KV blocks `copies` (source, destination); on
        rank 0 of a tensor-parallel runner, sent to the other ranks first, which run it alongside."""
        tp = self.tensor_parallel
        if tp is None:
            self.cache.copy_blocks(copies)
            return self.model(batch, self.cache, hidden_states=hidden_states)
        tp.send(MODE_HIDDEN if hidden_states else MODE_LOGITS, list(copies), batch)
        try:
            self.cache.copy_blocks(copies)
            return self.model(batch, self.cache, hidden_states=hidden_states)
        except BaseException as e:
            # The other ranks are inside this step's collectives, or have died: either way out of step for good.
            raise TensorParallelFailure(tp.step_failed(e, "a step")) from e

    def close(self) -> None:
        """Stop a tensor-parallel runner's other ranks (nothing for one process). The caller must be the only
        thread using the runner."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    # ---- embeddings ----
    def embedding_fits(self, lengths: Sequence[int]) -> bool:
        """Whether `embed` can take sequences of these lengths now: an encoder always; a decoder when its KV pool
        has the blocks for all of them (they are given back when `embed` returns)."""
        if self.blocks is None:
            return True
        bs = self.blocks.block_size
        return sum(-(-n // bs) for n in lengths) <= self.blocks.num_free

    @torch.inference_mode()
    def embed(self, inputs: Sequence[Sequence[int]], pooling: str | None = None) -> torch.Tensor:
        """Unit-length float32 embeddings [B, embedding_size] of the token-id sequences `inputs`, in one forward
        pass; `pooling` mean, last or cls (default: `self.pooling`).

        An encoder attends within each sequence in both directions and pools its last hidden states. A decoder runs
        its causal forward over the sequences as fresh ones (no prefix cache: every position's state is computed)
        and pools the final norm's output, as llama-server does; their KV blocks are given back afterwards
        (NoFreeBlocks when the pool cannot hold them: see `embedding_fits`).
        """
        seqs = [self._validate_ids(ids) for ids in inputs]
        if not seqs:
            raise ValueError("at least one input is needed")
        for ids in seqs:
            self._check_fits(len(ids))
        if self.is_encoder:
            hidden = self.model(pack_sentences(seqs, self.device))
        else:
            hidden = self._decoder_hidden_states(seqs)
        return pool(hidden, [len(ids) for ids in seqs], pooling or self.pooling)

    def _decoder_hidden_states(self, seqs: list[list[int]]) -> torch.Tensor:
        """The final norm's output at every position of every sequence, one sequence after the other."""
        kv = [KVSequence(ids) for ids in seqs]
        try:
            for seq in kv:
                self.blocks.allocate(seq, len(seq.tokens))
            rows = [StepRow(seq, 0, len(seq.tokens), logits="all") for seq in kv]
            batch = build_batch(rows, self.blocks.block_size, self.config.sliding_window, self.device,
                                paged=self.paged_attention, deterministic=self.deterministic)
            return self.forward_batch(batch, hidden_states=True)
        finally:
            for seq in kv:
                self.blocks.release(seq)

    def capture_cuda_graphs(self, max_batch: int, chunk_tokens: int = CHUNK_BUCKETS[-1]) -> float:
        """Capture decode steps of up to `max_batch` rows (engine/runtime/cuda_graphs.py) and prompt chunks of up to
        `chunk_tokens` tokens (engine/runtime/chunk_graphs.py; 0: none) as CUDA graphs; returns the seconds it took. GPU
        only."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device.type}")
        if self.tensor_parallel is not None:
            # The layers' collectives can be captured (engine/parallel/layers.py), but the other ranks would have
            # to replay their own graphs in step: not wired yet.
            raise ValueError("CUDA graphs do not run tensor-parallel steps yet")
        bs = self.blocks.block_size
        started = time.perf_counter()
        self._warm_up_kernels()
        width, trash = table_width(self.context_size, bs), self.blocks.num_blocks * bs
        self.graphs = DecodeGraphs(self.model, self.cache, max_batch, width, trash_slot=trash)
        self.graphs.capture()
        if chunk_tokens > 0:
            self.chunk_graphs = ChunkGraphs(self.model, self.cache, min(chunk_tokens, self.context_size), width,
                                            trash_slot=trash)
            self.chunk_graphs.capture()
        self._graph_step = GraphStep(self.graphs, self.chunk_graphs)
        return time.perf_counter() - started

    def _warm_up_kernels(self) -> None:
        """Steps of every kind the eager path runs (fresh chunks, chunks over cached blocks beside a decode row),
        so that their kernels are compiled now rather than while serving: with 2 rows and with 4, since Triton
        compiles a kernel again for per-row arguments (slices of one [3, rows] tensor) 16-byte aligned or not."""
        bs = self.blocks.block_size
        seqs = [self.new_sequence([0] * (2 * bs + 3), use_prefix_cache=False) for _ in range(5)]
        other = self.new_sequence([0] * (bs + 1), use_prefix_cache=False)
        try:
            self.step([StepRow(seqs[0], 0, bs + 1), StepRow(other, 0, bs + 1)])
            other.tokens.append(0)
            self.step([StepRow(other, bs + 1, bs + 2), StepRow(seqs[0], bs + 1, 2 * bs + 3)])
            self.step([StepRow(seq, 0, bs + 1) for seq in seqs[1:]])
            self.step([StepRow(seq, bs + 1, 2 * bs + 3) for seq in seqs[1:]])
        finally:
            for seq in [*seqs, other]:
                self.free_sequence(seq)
            self.blocks.reset_prefix_cache()

    # ---- one session ----
    def _start_session(self, seq: KVSequence | None) -> None:
        if self._session is not None:
            self.blocks.release(self._session)
        self._session = seq

    def prefill_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Start a new session with `ids`; next-token logits [vocab], float32."""
        seq = self.new_sequence(ids)
        self._start_session(seq)
        return self.step([StepRow(seq, seq.num_computed, len(seq.tokens))])[0]

    def predict_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Start a new session with `ids`; logits [len(ids), vocab] after every prefix (row i predicts ids[i+1])."""
        seq = self.new_sequence(ids, use_prefix_cache=False)
        self._start_session(seq)
        return self.step([StepRow(seq, 0, len(seq.tokens), logits="all")])

    def decode_logits(self, token: int) -> torch.Tensor:
        """Append one token to the session using the KV cache; next-token logits [vocab]."""
        seq = self._session
        if seq is None:
            raise RuntimeError("decode_logits needs a session: call prefill_logits first")
        token = self._validate_ids([token])[0]
        self._check_fits(len(seq.tokens) + 1)
        seq.tokens.append(token)
        try:
            return self.step([StepRow(seq, seq.num_computed, len(seq.tokens))])[0]
        except Exception:
            seq.tokens.pop()
            raise

    def reset_session(self) -> None:
        """Forget the current session; its blocks go back to the pool."""
        self._start_session(None)

    def export_session(self) -> SessionSnapshot:
        """A snapshot of the current session: it shares the session's blocks, which later decoding never changes."""
        seq = self._session
        if seq is None:
            return SessionSnapshot((), KVSequence([]))
        handle = self.blocks.share(seq, seq.num_computed)
        snapshot = SessionSnapshot(tuple(handle.tokens), handle)
        weakref.finalize(snapshot, self._released.put, handle)
        return snapshot

    def restore_session(self, snapshot: SessionSnapshot, length: int | None = None) -> None:
        """Make the snapshot (or its first `length` tokens) the current session."""
        length = len(snapshot) if length is None else length
        if not 0 <= length <= len(snapshot):
            raise ValueError(f"cannot restore {length} tokens from a snapshot of {len(snapshot)}")
        self._check_fits(length)
        self._start_session(self.blocks.share(snapshot.handle, length))

    def prefill_logits_reusing(self, ids: Sequence[int], snapshot: SessionSnapshot, reuse_len: int) -> torch.Tensor:
        """Like prefill_logits, but takes the first `reuse_len` tokens from the snapshot and computes only the rest."""
        ids = self._validate_ids(ids)
        if not 0 <= reuse_len <= min(len(snapshot), len(ids)):
            raise ValueError(f"reuse_len {reuse_len} must be within the snapshot ({len(snapshot)}) and the prompt ({len(ids)})")
        if tuple(ids[:reuse_len]) != snapshot.tokens[:reuse_len]:
            raise ValueError("the reused prefix differs from the snapshot's tokens")
        # At least the last prompt token is recomputed: its logits are the answer.
        reuse_len = min(reuse_len, len(ids) - 1)
        self._check_fits(len(ids))
        self.restore_session(snapshot, reuse_len)
        seq = self._session
        seq.tokens.extend(ids[reuse_len:])
        return self.step([StepRow(seq, reuse_len, len(ids))])[0]

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
            if len(out) >= n or len(self._session.tokens) >= self.context_size:
                break
            logits = self.decode_logits(token)
        return out
