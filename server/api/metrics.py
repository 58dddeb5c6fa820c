"""Prometheus metrics for GET /metrics, named as vLLM names them (`emberserve:` for `vllm:`) so dashboards carry over.

The request metrics count sequences: each choice of each prompt is one, as vLLM counts the children of a request
with n > 1. Token times are when the worker made the tokens (each event carries it), from the request's arrival;
running and waiting requests, KV blocks and prefix-cache figures are read from the worker pool at scrape time.
"""
from __future__ import annotations

import copy
import functools
import os
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from server.scheduling.generation import ChoiceDelta, Event, Generation, GenerationFailed
from server.logs import RequestRecord
from server.scheduling.model_state import PoolStats

PREFIX = "emberserve:"
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's: where every process writes its metrics
FINISH_REASONS = ("stop", "length", "abort")
# vLLM's buckets, so quantiles read the same on its dashboards; ITL adds finer ones below vLLM's 10 ms, where small
# models decode.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


def share_metrics_across_processes(directory: str) -> None:
    """From now on this process's metrics live in files under `directory`, which every HTTP process in front of one
    engine writes and a scrape of any of them sums (prometheus_client's multiprocess mode; set before the metrics
    are made, and inherited by the processes started after it)."""
    os.environ[MULTIPROCESS_ENV] = directory
    values.ValueClass = values.get_value_class()  # chosen by prometheus_client when first imported


StatsSource = Callable[[], PoolStats | None]  # the served pool's `stats`; None while the model loads
# A multi-model server's models at scrape time: each one's id, state (0 unloaded, 1 loading, 2 loaded) and pool
# figures (None unless loaded).
ModelsSource = Callable[[], list[tuple[str, int, PoolStats | None]]]


class _PoolCollector:
    """The worker pool's figures as gauges and counters at scrape time; zeros while the model loads. On a
    multi-model server, every loaded model's labelled by model, and each model's state (`model_state`)."""

    def __init__(self, stats: StatsSource | None, models: ModelsSource | None) -> None:
        self.stats, self.models = stats, models

    def collect(self) -> Iterator[Metric]:
        if self.models is None:
            yield from _pool_metrics([], [([], self.stats() or PoolStats())])
            return
        models = self.models()
        state = GaugeMetricFamily(f"{PREFIX}model_state", "Each servable model's state: 0 unloaded, 1 loading, "
                                  "2 loaded.", labels=["model"])
        for model, value, _ in models:
            state.add_metric([model], value)
        yield state
        yield from _pool_metrics(["model"], [([model], s) for model, _, s in models if s is not None])


Pools = list[tuple[list[str], PoolStats]]  # each pool's figures under its label values


def _family(kind: type[Metric], name: str, doc: str, labels: list[str], pools: Pools,
            value: Callable[[PoolStats], float]) -> Metric:
    metric = kind(f"{PREFIX}{name}", doc, labels=labels)
    for values, s in pools:
        metric.add_metric(values, value(s))
    return metric


def _pool_metrics(labels: list[str], pools: Pools) -> Iterator[Metric]:
    """The pools' figures, each pool's under its label values."""
    yield _family(GaugeMetricFamily, "num_requests_running", "Requests whose sequences are in the running batch.",
                  labels, pools, lambda s: s.running)
    yield _family(GaugeMetricFamily, "num_requests_waiting", "Requests submitted and waiting to run.",
                  labels, pools, lambda s: s.queued)
    yield _family(GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
                  labels, pools, lambda s: s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
    yield _family(GaugeMetricFamily, "prefix_cache_hit_rate",
                  "Prompt tokens found in the prefix cache / prompt tokens looked up, since start.", labels, pools,
                  lambda s: s.prefix_cache_hit_tokens / s.prefix_cache_queried_tokens
                  if s.prefix_cache_queried_tokens else 0.0)
    yield _family(CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                  labels, pools, lambda s: s.prefix_cache_queried_tokens)
    yield _family(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                  labels, pools, lambda s: s.prefix_cache_hit_tokens)
    yield _family(CounterMetricFamily, "num_preemptions", "Sequences preempted for lack of KV blocks.",
                  labels, pools, lambda s: s.preemptions)
    speculating = [(values, s) for values, s in pools if s.speculative is not None]
    if speculating:
        yield from _speculation_metrics(labels, speculating)


def _speculation_metrics(labels: list[str], pools: Pools) -> Iterator[Metric]:
    """vLLM's spec_decode counters, and the acceptance rate and mean acceptance length they imply."""
    yield _family(CounterMetricFamily, "spec_decode_num_drafts", "Sequence steps that verified drafted tokens.",
                  labels, pools, lambda s: s.spec_decode_num_drafts)
    yield _family(CounterMetricFamily, "spec_decode_num_draft_tokens", "Tokens drafted for verification.",
                  labels, pools, lambda s: s.spec_decode_num_draft_tokens)
    yield _family(CounterMetricFamily, "spec_decode_num_accepted_tokens", "Drafted tokens the model accepted.",
                  labels, pools, lambda s: s.spec_decode_num_accepted_tokens)
    per_pos = CounterMetricFamily(f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted drafted tokens, by their position in the draft.",
                                  labels=[*labels, "position"])
    for values, s in pools:
        for position, count in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([*values, str(position)], count)
    yield per_pos
    yield _family(GaugeMetricFamily, "spec_decode_draft_acceptance_rate",
                  "Accepted / drafted tokens since start (0 before any draft).", labels, pools,
                  lambda s: s.spec_decode_acceptance_rate or 0.0)
    yield _family(GaugeMetricFamily, "spec_decode_mean_acceptance_length",
                  "Tokens per speculating sequence step: 1 + accepted / drafts (0 before any draft).", labels, pools,
                  lambda s: s.spec_decode_mean_acceptance_length or 0.0)


class ServerMetrics:
    """One app's metrics in its own registry, so that several apps in one process do not clash. On a multi-model
    server (`models`: its models at scrape time) the request metrics are labelled by model, recorded through each
    model's view (`for_model`); error responses stay server-wide (one for an unknown model names none)."""

    def __init__(self, stats: StatsSource | None, models: ModelsSource | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        by = [] if models is None else ["model"]
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens prefilled.", by, registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Tokens generated.", by, registry=r)
        self.success = Counter(f"{PREFIX}request_success", "Sequences finished, by finish reason.",
                               [*by, "finished_reason"], registry=r)
        self.failure = Counter(f"{PREFIX}request_failure", "Error responses, by OpenAI error type.",
                               ["error_type"], registry=r)
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "From arrival to the first token.", by,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds", "Between consecutive tokens of a sequence.", by,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "From arrival to the sequence's finish.", by,
                             buckets=E2E_BUCKETS, registry=r)
        self._finished: Callable[[str], Counter] = self.success.labels
        if models is None:
            self._count_reasons()
        shared = os.environ.get(MULTIPROCESS_ENV)
        if shared is not None:  # a scrape reads every process's files (and the pool once), not this registry
            self.registry = CollectorRegistry()
            MultiProcessCollector(self.registry, path=shared)
        self.registry.register(_PoolCollector(stats, models))

    def _count_reasons(self) -> None:
        for reason in FINISH_REASONS:  # present at 0 from the start, so rate() sees the first one
            self._finished(reason)

    def for_model(self, model: str) -> ServerMetrics:
        """These metrics as `model` records them (a multi-model server's: its labelled series)."""
        view = copy.copy(self)
        view.prompt_tokens = self.prompt_tokens.labels(model)
        view.generation_tokens = self.generation_tokens.labels(model)
        view.ttft, view.itl, view.e2e = self.ttft.labels(model), self.itl.labels(model), self.e2e.labels(model)
        view._finished = functools.partial(self.success.labels, model)
        view._count_reasons()
        return view

    def observe_first_token(self, arrival: float, now: float) -> None:
        """A sequence's first token."""
        self.generation_tokens.inc()
        self.ttft.observe(now - arrival)

    def observe_tokens(self, previous: float, now: float, count: int) -> None:
        """`count` later tokens of a sequence, made since its last one at `previous`: each observes its share of
        the interval (a chunk of a stream interval carries several tokens, each made by a step of its own)."""
        self.generation_tokens.inc(count)
        interval = (now - previous) / count
        for _ in range(count):
            self.itl.observe(interval)

    def finish(self, arrival: float, now: float, reason: str) -> None:
        """A sequence that ended with `reason` (stop, length, or abort when its client left)."""
        self._finished(reason).inc()
        self.e2e.observe(now - arrival)

    def fail(self, error_type: str) -> None:
        """An error answered to the client, by its OpenAI `type`."""
        self.failure.labels(error_type).inc()

    def track(self, gen: Generation, record: RequestRecord | None = None) -> GenerationTrack:
        """A tracker for one submitted generation's events, also filling in its request's log record."""
        return GenerationTrack(self, gen, record)

    def exposition(self) -> tuple[bytes, str]:
        """The registry in the Prometheus text format, and its content type."""
        # Always text 0.0.4, not negotiated: for the OpenMetrics that Prometheus 2 asks for first, prometheus-client
        # writes `emberserve_` in samples under `emberserve:` metadata (prometheus/client_python#1177).
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4


class GenerationTrack:
    """The clocks of one generation's choices, fed its events as the serving layer hands them on."""

    def __init__(self, metrics: ServerMetrics, gen: Generation, record: RequestRecord | None) -> None:
        self.metrics, self.arrival, self.prompt_len = metrics, gen.arrival, len(gen.prompt_ids)
        self.record = record
        self.last: list[float | None] = [None] * gen.n
        self.open = set(range(gen.n))
        self.prefilled = self.failed = False

    def observe(self, event: Event) -> None:
        """Count the event's tokens, time them, and record a choice that finished."""
        if isinstance(event, GenerationFailed):
            self.failed = True
        if not isinstance(event, ChoiceDelta):
            return
        now = event.at  # when the worker made the tokens, not when this reader got to them
        if not self.prefilled:  # the first delta comes once the prompt is computed
            self.prefilled = True
            self.metrics.prompt_tokens.inc(self.prompt_len)
            if self.record is not None:
                self.record.prompt_tokens += self.prompt_len
        i, count = event.index, len(event.tokens)
        if count:
            last = self.last[i]
            if last is None:
                self.metrics.observe_first_token(self.arrival, now)
                if self.record is not None and self.record.ttft is None:
                    self.record.ttft = now - self.arrival
                if count > 1:  # came with the first (a reader that fell behind): no interval of their own known
                    self.metrics.observe_tokens(now, now, count - 1)
            else:
                self.metrics.observe_tokens(last, now, count)
            self.last[i] = now
        if self.record is not None:
            self.record.output_tokens += count
        if event.finish_reason is not None:
            self.open.discard(i)
            self._finish(now, event.finish_reason)

    def close(self) -> None:
        """Choices left open when nobody reads on (the client went away) finished as 'abort', as in vLLM."""
        if self.failed:  # counted as a failure where the error is answered
            return
        now = time.perf_counter()
        for _ in self.open:
            self._finish(now, "abort")
        self.open.clear()

    def _finish(self, now: float, reason: str) -> None:
        self.metrics.finish(self.arrival, now, reason)
        if self.record is not None:
            self.record.finish_reasons.append(reason)
