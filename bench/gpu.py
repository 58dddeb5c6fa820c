"""GPU benchmark (issue 13): how close emberserve comes to the hardware, in one command of about five minutes.

For each shape (random weights at a real model's dimensions, written as a hub directory; bench/synthetic_model.py):
  bandwidth  device-to-device copy of --bandwidth-gib (bytes read + written / time, CUDA events), once per run;
             the batch-1 roofline of a shape is that bandwidth over its weight bytes
  anchor     a bare PyTorch decode loop (bench/decode_anchor.py), one CUDA graph per step, tokens/s per batch
  engine     `Runner.step` decode steps with greedy argmax after a --prompt-tokens prompt per row: ms per step,
             tokens/s, and at batch 1 the fraction of the roofline (public engine API only)
  ttft       prefill + first token of --ttft-prompts through `Runner.step`, median of --ttft-repeats
  server     `python -m server serve` on the directory, streaming /v1/completions (bench/serve.py's client) with
             token-id prompts, ignore_eos, temperature 0, at each --server-concurrency: output tokens/s, TTFT p50,
             ITL p50; --server-args passes flags through (e.g. "--max-running 128")
  peer       llama.cpp's llama-server (bench/llama_peer.py) on the same weights, converted by its
             convert_hf_to_gguf.py (--peer-outtype), driven by the same client at the same concurrencies
Mixture-of-experts shapes (bench/synthetic_model.py: qwen3-30b-a3b, gpt-oss-20b[-mxfp4]) have no anchor; their
roofline at batch B is the bandwidth over the bytes a step must read (attention, router, the experts B tokens route
to, the LM head: synthetic_model.active_weight_bytes), so the engine rows give the fraction at every batch size.
A shape "NAME@L" is NAME with L layers; --fit-layers cuts a shape's layers to what the work directory holds.
Each part guards its own --part-budget (skipping the batch sizes / concurrencies left once over it), all within
--budget-s. Progress goes to stderr; a markdown table and the JSON go to stdout; --json-out gets the JSON after
every part, so a run cut short still leaves its results.

    python bench/gpu.py --json-out /tmp/gpu.json                                # llama-1b, every part (H200: ~5 min)
    python bench/gpu.py --shapes qwen3-0.6b,gemma3-1b --parts anchor,engine,ttft
    python bench/gpu.py --device cpu --shapes tiny --batches 1,2 --decode-steps 4 --ttft-prompts 16 \\
        --server-concurrency 1,2 --server-max-tokens 8                          # CPU smoke check
    python bench/gpu.py --merge /tmp/a.json /tmp/b.json --json-out /tmp/all.json   # one report of several runs
bench/gpu_moe.sh runs the issue-36 benchmark (MoE shapes, the llama.cpp peer) in parts of under ten minutes.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import resource
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree's engine, wherever it is run from (the GPU machine installs nothing)

from decode_anchor import DecodeAnchor, measure as measure_anchor  # noqa: E402
import llama_peer  # noqa: E402
from server.process.memory import available_memory  # noqa: E402
from synthetic_model import (MAX_POSITION, SHAPES, ModelDir, Shape, active_weight_bytes,  # noqa: E402
                             estimated_weight_bytes, roofline_tokens_per_s, shape_by_name, write_model_dir)

PARTS = ("bandwidth", "anchor", "engine", "ttft", "server", "peer")
DEFAULT_PART_BUDGET = {"bandwidth": 15.0, "anchor": 45.0, "engine": 75.0, "ttft": 30.0, "server": 120.0,
                       "peer": 360.0}
GIB = 2**30
HOST_RESERVE = 16 * GIB  # host memory a model in /dev/shm must leave to the processes that load it
WARMUP_STEPS = 3
START = time.monotonic()


def log(message: str) -> None:
    print(f"[gpu.py {time.monotonic() - START:6.1f}s] {message}", file=sys.stderr, flush=True)


class Budget:
    """A deadline: `seconds` from now, or the enclosing budget's end if that comes first."""

    def __init__(self, seconds: float, within: Budget | None = None) -> None:
        self.end = time.monotonic() + seconds
        if within is not None:
            self.end = min(self.end, within.end)

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, estimate: float = 0.0) -> bool:
        return self.left() > estimate


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                           "platform": platform.platform(), "cpu_count": os.cpu_count(), "device": str(device)}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    from engine.kernels import paged_attention
    env["paged_attention_triton"] = paged_attention.triton_available()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                "sm_count": props.multi_processor_count, "capability": f"{props.major}.{props.minor}"}
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                           timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    return env


# ---- parts ---------------------------------------------------------------------------------------------------

def copy_bandwidth(device: torch.device, gib: float, repeats: int = 10) -> dict[str, Any]:
    """(bytes read + bytes written) / time of a device-to-device copy of `gib` GiB: best and median."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 2):
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        if i >= 2:  # the first copies page memory in
            times.append(seconds)
    del src, dst
    free_memory()
    return {"bytes_per_copy": 2 * n, "best_gb_s": round(2 * n / min(times) / 1e9, 1),
            "median_gb_s": round(2 * n / statistics.median(times) / 1e9, 1), "repeats": repeats}


def anchor_part(shape: Shape, device: torch.device, args: argparse.Namespace, budget: Budget,
                roofline: float | None) -> list[dict]:
    rows: list[dict] = []
    anchor = DecodeAnchor(shape, device, max(args.batches), args.prompt_tokens + args.decode_steps + 8)
    last = 0.0
    for batch in args.batches:
        if not budget.allows(2 * last):
            rows.append({"batch": batch, "skipped": "over the part's budget"})
            continue
        t0 = time.monotonic()
        try:
            rows.append(measure_anchor(anchor, batch, args.prompt_tokens, args.decode_steps))
            if batch == 1 and roofline:
                rows[-1]["fraction_of_roofline"] = round(rows[-1]["tokens_per_s"] / roofline, 4)
        except torch.OutOfMemoryError as e:
            rows.append({"batch": batch, "error": f"out of memory: {str(e)[:200]}"})
        last = time.monotonic() - t0
        log(f"  anchor batch {batch}: {rows[-1]}")
    del anchor
    free_memory()
    return rows


def random_ids(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]  # ids 0-2 are the special tokens


def engine_part(runner: Any, args: argparse.Namespace, budget: Budget,
                roofline: Callable[[int], float | None]) -> list[dict]:
    """Decode steps of `args.batches` rows through the public Runner API; `roofline(batch)`: tokens/s the
    weights' reads allow at that batch (None: not reported)."""
    from engine.model.batch import StepRow

    rng = random.Random(1)
    rows: list[dict] = []
    last = 0.0
    for batch in args.batches:
        if not budget.allows(2 * last):
            rows.append({"batch": batch, "skipped": "over the part's budget"})
            continue
        t0 = time.monotonic()
        seqs = [runner.new_sequence(random_ids(args.prompt_tokens, runner.vocab_size, rng)) for _ in range(batch)]
        try:
            per_step = max(1, args.prefill_tokens // args.prompt_tokens)
            for i in range(0, batch, per_step):  # prompts in steps of at most --prefill-tokens tokens
                chunk = seqs[i:i + per_step]
                logits = runner.step([StepRow(s, s.num_computed, len(s.tokens)) for s in chunk])
                for s, token in zip(chunk, logits.argmax(dim=-1).tolist()):
                    s.tokens.append(token)
            prefill_s = time.monotonic() - t0

            def decode_step() -> None:
                logits = runner.step([StepRow(s, s.num_computed, len(s.tokens)) for s in seqs])
                for s, token in zip(seqs, logits.argmax(dim=-1).tolist()):  # .tolist(): the host sync a server has
                    s.tokens.append(token)

            for _ in range(WARMUP_STEPS):
                decode_step()
            sync(runner.device)
            t1 = time.perf_counter()
            for _ in range(args.decode_steps):
                decode_step()
            sync(runner.device)
            elapsed = time.perf_counter() - t1
            row = {"batch": batch, "steps": args.decode_steps,
                   "ms_per_step": round(1000 * elapsed / args.decode_steps, 3),
                   "tokens_per_s": round(batch * args.decode_steps / elapsed, 1), "prefill_s": round(prefill_s, 3)}
            graphs = getattr(runner, "graphs", None)
            if graphs is not None and graphs.serves([StepRow(s, s.num_computed, len(s.tokens)) for s in seqs]):
                row["graph_replay_ms"] = round(1000 * graph_replay_s(graphs, batch), 3)  # the GPU's share
            if roofline(batch):
                row["roofline_tokens_per_s"] = round(roofline(batch), 1)
                row["fraction_of_roofline"] = round(row["tokens_per_s"] / roofline(batch), 4)
            rows.append(row)
        except torch.OutOfMemoryError as e:
            rows.append({"batch": batch, "error": f"out of memory: {str(e)[:200]}"})
        finally:
            for s in seqs:
                runner.free_sequence(s)
        last = time.monotonic() - t0
        log(f"  engine batch {batch}: {rows[-1]}")
    return rows


def graph_replay_s(graphs: Any, rows: int, repeats: int = 20) -> float:
    """Seconds one replay of the bucket's graph takes back to back (inputs as last filled): the step's GPU time."""
    from engine.runtime.cuda_graphs import bucket_of

    graph, _ = graphs._graphs[bucket_of(rows, graphs.buckets)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def ttft_part(runner: Any, args: argparse.Namespace, budget: Budget) -> list[dict]:
    """Prefill + first token of one prompt per call (fresh random ids: no prefix-cache hit), median of repeats."""
    from engine.model.batch import StepRow

    rng = random.Random(2)
    rows: list[dict] = []
    for n in args.ttft_prompts:
        times: list[float] = []
        for i in range(args.ttft_repeats + 1):  # the first call of a length is a warm-up
            if not budget.allows():
                break
            ids = random_ids(n, runner.vocab_size, rng)
            sync(runner.device)
            t0 = time.perf_counter()
            seq = runner.new_sequence(ids)
            int(runner.step([StepRow(seq, seq.num_computed, len(seq.tokens))])[0].argmax())
            elapsed = time.perf_counter() - t0
            runner.free_sequence(seq)
            if i:
                times.append(elapsed)
        rows.append({"prompt_tokens": n, "repeats": len(times),
                     "ttft_ms": round(1000 * statistics.median(times), 2) if times else None}
                    | ({} if times else {"skipped": "over the part's budget"}))
        log(f"  ttft {n} tokens: {rows[-1]}")
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of every thread of `pid`'s process tree, keyed "pid/tid"."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for p in _process_tree(pid):
        for stat in Path(f"/proc/{p}/task").glob("*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[f"{p}/{stat.parent.name}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_use(before: dict[str, float], after: dict[str, float], wall: float, server_pid: int) -> dict[str, Any]:
    """Cores each process of the server used over `wall` seconds, with its busiest threads: where a scenario's
    host time went (the HTTP process is the server's own pid, the engine process its child)."""
    procs: dict[str, dict[str, Any]] = {}
    for key, t in after.items():
        pid, tid = key.split("/")
        used = t - before.get(key, 0.0)
        proc = procs.setdefault(pid, {"cores": 0.0, "threads": []})
        proc["cores"] += used / wall
        proc["threads"].append(round(used / wall, 3) if tid != pid else f"main {used / wall:.3f}")
    for proc in procs.values():
        proc["cores"] = round(proc["cores"], 3)
        proc["threads"] = sorted(proc["threads"], key=lambda x: -float(str(x).split()[-1]))[:5]
    return {("http" if pid == str(server_pid) else f"child {pid}"): v for pid, v in procs.items() if v["cores"] > 0.01}


def server_part(model: ModelDir, shape: Shape, args: argparse.Namespace, extra: str, budget: Budget,
                work: Path) -> dict:
    """Start the real server on the model directory (with the `serve` flags `extra`) and stream completions at
    each concurrency."""
    port = _free_port()
    log_path = work / f"server-{port}.log"
    cmd = [sys.executable, "-m", "server", "serve", "--model", str(model.path), "--device", args.device,
           "--port", str(port), "--log-level", "warning", *shlex.split(extra)]
    log(f"  starting {' '.join(cmd)}")
    t0 = time.monotonic()
    with log_path.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    result: dict[str, Any] = {"command": cmd, "scenarios": []}
    try:
        base = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                result["error"] = f"server exited with {proc.returncode}: {tail}"
                log(f"  {result['error'][:500]}")
                return result
            if not budget.allows():
                result["error"] = "server not ready within the part's budget"
                log(f"  {result['error']}")
                return result
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        result["startup_s"] = round(time.monotonic() - t0, 1)
        log(f"  server ready after {result['startup_s']}s")
        result["scenarios"] = asyncio.run(_load(base, shape, args, budget, proc.pid))
        return result
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        result["log_tail"] = log_path.read_text(errors="replace")[-1500:] or None


async def _load(base: str, shape: Shape, args: argparse.Namespace, budget: Budget, server_pid: int,
                extra_body: dict[str, Any] | None = None) -> list[dict]:
    """bench/serve.py's streaming load at each --server-concurrency against the server at `base`."""
    import serve  # bench/serve.py: the streaming client, its percentiles and summary rows

    extra_body = extra_body or {}
    limits = httpx.Limits(max_connections=max(args.server_concurrency) + 2)
    rows: list[dict] = []
    async with httpx.AsyncClient(base_url=base, timeout=max(30.0, budget.left()), limits=limits) as client:
        model = await serve.resolve_model(client, None, 30)
        bench = serve.Bench(client, SimpleNamespace(extra_body=extra_body, timeout=max(30.0, budget.left())), model)
        last, last_c = 0.0, 1
        for i, c in enumerate(args.server_concurrency):
            # the next level's time, guessed as the last one's scaled by concurrency (exact once --max-running caps
            # the batch, pessimistic before)
            if not budget.allows(last * c / last_c):
                rows.append({"concurrency": c, "skipped": "over the part's budget"})
                continue
            bench.args.timeout = max(10.0, budget.left())  # per request, stream included
            rng = random.Random(100 + c)
            n = args.server_requests or max(c * args.server_rounds, 2)
            prompts = [random_ids(args.server_prompt_tokens, shape.vocab, rng) for _ in range(n)]
            warmup = random_ids(args.server_prompt_tokens, shape.vocab, rng) if i == 0 else ""
            t0 = time.monotonic()
            cpu0, clients0 = thread_cpu(server_pid), resource.getrusage(resource.RUSAGE_CHILDREN)
            processes = args.client_processes or max(1, c // 16)
            if processes > 1:
                if warmup:
                    await bench.request(warmup, args.server_max_tokens)
                row = await asyncio.to_thread(serve.scenario_in_processes, base, model, f"c{c}",
                                              args.server_prompt_tokens, prompts, c, args.server_max_tokens,
                                              max(10.0, budget.left()), processes, extra_body)
            else:
                row, _ = await bench.scenario(f"c{c}", args.server_prompt_tokens, prompts.__getitem__, len(prompts),
                                              c, args.server_max_tokens, warmup)
            last, last_c = time.monotonic() - t0, c
            clients1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            row["cpu_cores"] = cpu_use(cpu0, thread_cpu(server_pid), last, server_pid) | {
                "clients": round((clients1.ru_utime + clients1.ru_stime - clients0.ru_utime - clients0.ru_stime)
                                 / last, 3)}
            rows.append(row)
            log(f"  server concurrency {c}: {row['output_tok_s']} output tok/s, TTFT p50 {row['ttft_p50_ms']} ms, "
                f"ITL p50 {row['itl_p50_ms']} ms, {row['errors']} errors; cores used {row['cpu_cores']}")
    return rows


# ---- one shape -----------------------------------------------------------------------------------------------

def kv_memory(shape: Shape, args: argparse.Namespace, dtype_bytes: int) -> int:
    """Bytes of KV pool the engine parts need (each row rounded up to whole blocks, plus a margin)."""
    per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes
    per_row = args.prompt_tokens + WARMUP_STEPS + args.decode_steps + 2 * 16
    tokens = max(max(args.batches) * per_row, max(args.ttft_prompts, default=0) + 32, MAX_POSITION)
    return int(1.2 * tokens * per_token)


def _guarded(report: dict, part: str, fn: Callable[[], Any], save: Callable[[], None]) -> None:
    """report[part] = fn(), or the error it raised: one failing part must not cost the run's other results."""
    try:
        report[part] = fn()
    except Exception as e:  # noqa: BLE001 - recorded in the JSON, the run goes on
        log(f"  {part} failed: {type(e).__name__}: {e}")
        report[part] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    free_memory()
    save()


def start_conversion(model: ModelDir, args: argparse.Namespace, work: Path, nice: int) -> llama_peer.Conversion | str:
    """The GGUF conversion of `model` for the peer part, started now; or why it cannot be."""
    opts: llama_peer.PeerOptions = args.peer
    gguf = work / f"{model.path.name}-{opts.outtype}.gguf"
    need, free = llama_peer.gguf_bytes_estimate(model.path), shutil.disk_usage(work).free
    if free < 1.02 * need + GIB:
        return f"no room for the GGUF in {work}: {need / 1e9:.1f} GB needed, {free / 1e9:.1f} free"
    conversion = llama_peer.Conversion(model.path, gguf, opts, nice)
    log(f"  converting to {gguf.name}{f' (nice {nice}, beside the other parts)' if nice else ''}: "
        f"{' '.join(conversion.cmd)}")
    return conversion


def peer_part(model: ModelDir, shape: Shape, args: argparse.Namespace, budget: Budget, work: Path,
              conversion: llama_peer.Conversion | str | None) -> dict:
    """llama.cpp's llama-server on the same weights: the directory converted to a GGUF beside it (`conversion`,
    started earlier, or now), served, and driven with the server part's load (same prompts, same bodies,
    `repeat_penalty` 1 spelled out)."""
    opts: llama_peer.PeerOptions = args.peer
    if not opts.binary.is_file():
        if isinstance(conversion, llama_peer.Conversion):
            conversion.cancel()
        return {"error": f"no llama-server at {opts.binary} (bench/gpu_moe.sh build)"}
    result: dict[str, Any] = {"llama_server_version": llama_peer.version(opts), "outtype": opts.outtype}
    if conversion is None:
        conversion = start_conversion(model, args, work, nice=0)
    if isinstance(conversion, str):
        return result | {"error": conversion}
    gguf = conversion.out
    result |= conversion.result(budget.left())
    if "error" in result:
        return result
    log(f"  converted in {result['convert_s']}s: {result['gguf_bytes'] / 1e9:.2f} GB")
    _wait_for_device_memory(args)
    try:
        with llama_peer.LlamaServer(gguf, opts, work / f"{gguf.stem}.server.log") as server:
            result["command"] = server.cmd
            result["startup_s"] = server.start(max(1.0, budget.left()), log)
            log(f"  llama-server ready after {result['startup_s']}s")
            assert server.proc is not None
            result["scenarios"] = asyncio.run(_load(server.base, shape, args, budget, server.proc.pid,
                                                    {"repeat_penalty": 1.0}))
            result["log_tail"] = server.tail(1000)
    except RuntimeError as e:
        result["error"] = str(e)[:2000]
        log(f"  {result['error'][:500]}")
    finally:
        if not args.keep_model_dir:
            gguf.unlink(missing_ok=True)
    return result


def _wait_for_device_memory(args: argparse.Namespace, within_s: float = 30.0) -> None:
    """Until the device's memory is mostly free again (a server that just exited releases it late)."""
    if not args.device.startswith("cuda"):
        return
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        free, total = torch.cuda.mem_get_info()
        if free > 0.9 * total:
            return
        time.sleep(0.5)
    log(f"  device memory still {torch.cuda.mem_get_info()[0] / GIB:.1f} GiB free after {within_s:.0f}s")


def place_shape(shape: Shape, args: argparse.Namespace) -> tuple[Shape, Path | None, str | None]:
    """(the shape, maybe with fewer layers under --fit-layers; the directory to write it in, or None; a note):
    room for its safetensors, plus its GGUF when the peer runs."""
    copies = 2 if "peer" in args.parts else 1

    def need(s: Shape) -> float:
        return copies * 1.02 * estimated_weight_bytes(s) + GIB

    root, free = _work_root(need(shape), args.work_dir)
    if root is not None:
        return shape, root, None
    note = f"{need(shape) / 1e9:.1f} GB needed ({copies} copies), the most free is {free / 1e9:.1f} GB"
    if not args.fit_layers:
        return shape, None, note
    step = 2 if shape.gpt_oss else 1  # gpt_oss's layers alternate sliding and full
    layers = shape.layers - step
    while layers >= step and _work_root(need(replace(shape, layers=layers)), args.work_dir)[0] is None:
        layers -= step
    if layers < step:
        return shape, None, note
    fitted = replace(shape, layers=layers)
    return fitted, _work_root(need(fitted), args.work_dir)[0], f"{shape.layers} layers cut to {layers}: {note}"


def run_shape(name: str, args: argparse.Namespace, device: torch.device, bandwidth: dict | None, total: Budget,
              save: Callable[[], None], report: dict) -> None:
    shape, root, note = place_shape(shape_by_name(name), args)
    if note:
        report["placement"] = note
        log(f"{name}: {note}")
    if root is None:
        report["skipped"] = "no room for the model"
        return
    work = Path(tempfile.mkdtemp(prefix="emberserve-gpu-bench-", dir=root))
    try:
        _run_shape_in(name, shape, args, device, bandwidth, total, save, report, work)
    finally:
        if not args.keep_model_dir:
            shutil.rmtree(work, ignore_errors=True)


def _run_shape_in(name: str, shape: Shape, args: argparse.Namespace, device: torch.device, bandwidth: dict | None,
                  total: Budget, save: Callable[[], None], report: dict, work: Path) -> None:
    t0 = time.monotonic()
    log(f"{name}: writing random weights ({estimated_weight_bytes(shape) / 1e9:.2f} GB, {shape.layers} layers) "
        f"in {work}")
    model = write_model_dir(shape, work / name.replace("@", "-l"), device)
    report |= {"layers": shape.layers, "weight_bytes": model.weight_bytes, "params": model.params,
               "active_bytes_batch1": round(active_weight_bytes(shape)), "write_s": round(time.monotonic() - t0, 1)}
    save()

    def roofline(batch: int) -> float | None:
        """Weights-read tokens/s at `batch`: batch 1 for every shape, every batch for MoE (expected experts)."""
        if not bandwidth or (batch > 1 and not shape.moe):
            return None
        return roofline_tokens_per_s(shape, bandwidth["best_gb_s"], batch)

    report["roofline_tokens_per_s_batch1"] = round(roofline(1), 1) if roofline(1) else None
    log(f"{name}: {model.params / 1e9:.3f} B parameters, {model.weight_bytes / 1e9:.3f} GB of weights, "
        f"{active_weight_bytes(shape) / 1e9:.3f} GB read per token at batch 1, written in {report['write_s']}s"
        + (f", roofline {roofline(1):.0f} tok/s at batch 1" if roofline(1) else ""))

    def budget(part: str) -> Budget:
        return Budget(args.part_budget[part], within=total)

    conversion = None  # the peer's GGUF, converted beside our parts when --peer-convert-early
    if "peer" in args.parts and args.peer_convert_early:
        conversion = start_conversion(model, args, work, nice=19)
    try:
        if "anchor" in args.parts and shape.moe:
            report["anchor"] = {"skipped": "the anchor is a dense decoder"}
        elif "anchor" in args.parts:
            log(f"{name}: anchor (bare PyTorch decode loop)")
            _guarded(report, "anchor", lambda: anchor_part(shape, device, args, budget("anchor"), roofline(1)), save)
        if {"engine", "ttft"} & set(args.parts):
            from engine import load_runner

            t1 = time.monotonic()
            try:
                runner = load_runner(str(model.path), device=device,
                                     dtype=torch.bfloat16 if device.type == "cuda" else None, quant=args.quant,
                                     kv_cache_memory=kv_memory(shape, args, 2 if device.type == "cuda" else 4))
            except Exception as e:  # noqa: BLE001
                log(f"{name}: engine failed to load: {type(e).__name__}: {e}")
                report["engine_load_error"] = f"{type(e).__name__}: {e}"[:2000]
                runner = None
            if runner is not None:
                report["engine_load_s"] = round(time.monotonic() - t1, 1)
                report["engine_quant"] = runner.quant
                log(f"{name}: engine loaded in {report['engine_load_s']}s ({runner.dtype}, "
                    f"{runner.blocks.num_blocks} KV blocks)")
                if device.type == "cuda" and not args.no_cuda_graphs:
                    try:
                        report["graph_capture_s"] = round(runner.capture_cuda_graphs(max(args.batches)), 1)
                        log(f"{name}: CUDA graphs captured in {report['graph_capture_s']}s")
                    except Exception as e:  # noqa: BLE001
                        log(f"{name}: graph capture failed: {type(e).__name__}: {e}")
                        report["graph_capture_error"] = f"{type(e).__name__}: {e}"[:2000]
                if "engine" in args.parts:
                    _guarded(report, "engine", lambda: engine_part(runner, args, budget("engine"), roofline), save)
                if "ttft" in args.parts:
                    _guarded(report, "ttft", lambda: ttft_part(runner, args, budget("ttft")), save)
                del runner
                free_memory()
        if "server" in args.parts:
            for i, extra in enumerate(args.server_args or [""]):  # one server a variant, the first as "server"
                log(f"{name}: server over HTTP{f' ({extra})' if extra else ''}")
                _guarded(report, "server" if i == 0 else f"server {extra}",
                         lambda: server_part(model, shape, args, extra, budget("server"), work), save)
        if "peer" in args.parts:
            log(f"{name}: llama.cpp's llama-server over HTTP")
            _guarded(report, "peer", lambda: peer_part(model, shape, args, budget("peer"), work, conversion), save)
    finally:
        if isinstance(conversion, llama_peer.Conversion):
            conversion.cancel()  # when a failure left it running


# ---- output --------------------------------------------------------------------------------------------------

def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if "tokens_per_s" in row:
        return f"{row['tokens_per_s']:,.0f} ({row['ms_per_step']:.2f} ms)"
    return "skipped" if "skipped" in row else "error"


def _scenarios(part: Any) -> dict[int, dict]:
    if not isinstance(part, dict):
        return {}
    return {r["concurrency"]: r for r in part.get("scenarios", []) if "output_tok_s" in r}


def _server_table(shape: dict) -> list[str]:
    """Our server's and llama-server's rows side by side, per concurrency."""
    ours, peer = _scenarios(shape.get("server")), _scenarios(shape.get("peer"))
    lines = []
    for key, label in (("server", "emberserve server"), ("peer", "llama.cpp llama-server")):
        part = shape.get(key)
        if isinstance(part, dict) and part.get("error"):
            lines.append(f"\n{label} failed: {part['error'][:300]}")
    if not ours and not peer:
        return lines
    lines += ["\n| concurrency | emberserve tok/s | TTFT p50 ms | ITL p50 ms | llama-server tok/s | TTFT p50 ms "
              "| ITL p50 ms | ratio |", "|---|---|---|---|---|---|---|---|"]
    for c in sorted(ours.keys() | peer.keys()):
        o, p = ours.get(c, {}), peer.get(c, {})
        ratio = (f"{o['output_tok_s'] / p['output_tok_s']:.2f}×" if o.get("output_tok_s") and p.get("output_tok_s")
                 else "")
        errors = sum(r.get("errors", 0) for r in (o, p))
        cells = [o.get("output_tok_s"), o.get("ttft_p50_ms"), o.get("itl_p50_ms"),
                 p.get("output_tok_s"), p.get("ttft_p50_ms"), p.get("itl_p50_ms")]
        lines.append(f"| {c} | " + " | ".join("-" if x is None else str(x) for x in cells)
                     + f" | {ratio}{f' ({errors} errors)' if errors else ''} |")
    peer_part = shape.get("peer")
    if isinstance(peer_part, dict) and peer_part.get("command"):
        lines.append(f"\nllama-server ({peer_part.get('llama_server_version') or 'version unknown'}) on the "
                     f"{peer_part.get('outtype')} GGUF ({peer_part.get('gguf_bytes', 0) / 1e9:.2f} GB, converted in "
                     f"{peer_part.get('convert_s')} s): `{' '.join(peer_part['command'][9:])}`")
    return lines


def markdown(report: dict) -> str:
    lines = []
    bw = report.get("bandwidth")
    env = report["environment"]
    lines.append(f"## emberserve on {env.get('gpu', env['device'])} (torch {env['torch']}, triton {env['triton']}, "
                 f"commit {env.get('git_commit') or 'unknown'})")
    if bw:
        lines.append(f"\ncopy bandwidth: {bw['best_gb_s']:,} GB/s best, {bw['median_gb_s']:,} GB/s median")
    batches = report["parameters"]["batches"]
    for name, shape in report["shapes"].items():
        lines.append(f"\n### {name}: {shape.get('layers', '?')} layers, {shape.get('params', 0) / 1e6:,.1f} M "
                     f"parameters, {shape.get('weight_bytes', 0) / 1e9:.3f} GB of weights, "
                     f"{shape.get('active_bytes_batch1', 0) / 1e9:.3f} GB read per token at batch 1")
        for key in ("placement", "skipped"):
            if shape.get(key):
                lines.append(f"\n{key}: {shape[key]}")
        lines.append("\n| tokens/s (ms/step) | " + " | ".join(f"batch {b}" for b in batches) + " |")
        lines.append("|---|" + "---|" * len(batches))
        engine = shape.get("engine") if isinstance(shape.get("engine"), list) else []
        rooflines = {r["batch"]: r.get("roofline_tokens_per_s") for r in engine if "batch" in r}
        if any(rooflines.values()):
            lines.append("| weights-read roofline | " + " | ".join(
                f"{rooflines[b]:,.0f}" if rooflines.get(b) else "" for b in batches) + " |")
        elif shape.get("roofline_tokens_per_s_batch1"):
            lines.append(f"| weights-read roofline | {shape['roofline_tokens_per_s_batch1']:,.0f} |"
                         + " |" * (len(batches) - 1))
        anchor_mode = next((r["mode"] for r in shape.get("anchor", []) if isinstance(r, dict) and "mode" in r), "")
        for part, label in (("anchor", f"bare PyTorch loop ({anchor_mode.replace('_', ' ')})"),
                            ("engine", "emberserve Runner.step")):
            if isinstance(shape.get(part), dict):  # the part failed or was skipped
                why = shape[part].get("error") or shape[part].get("skipped") or ""
                lines.append(f"| {label} | {why[:200]} |" + " |" * (len(batches) - 1))
            elif part in shape:
                by_batch = {r["batch"]: r for r in shape[part]}
                lines.append(f"| {label} | " + " | ".join(_cell(by_batch.get(b)) for b in batches) + " |")
        for part in ("anchor", "engine"):
            rows = shape.get(part)
            fractions = [r for r in rows if r.get("fraction_of_roofline")] if isinstance(rows, list) else []
            if fractions:
                lines.append(f"\n{part}: " + ", ".join(f"batch {r['batch']} {100 * r['fraction_of_roofline']:.1f}%"
                                                      for r in fractions) + " of the roofline")
        if shape.get("engine_load_error"):
            lines.append(f"\nengine load failed: {shape['engine_load_error'][:300]}")
        ttft = shape.get("ttft")
        if isinstance(ttft, list):
            lines.append("\nTTFT through Runner.step: " + ", ".join(
                f"{r['prompt_tokens']} tokens {r['ttft_ms']} ms" for r in ttft if r.get("ttft_ms")))
        elif ttft:
            lines.append(f"\nTTFT failed: {ttft['error'][:300]}")
        lines += _server_table(shape)
        for key, server in shape.items():  # further server variants (--server-args given twice or more)
            if not key.startswith("server ") or not isinstance(server, dict):
                continue
            lines.append(f"\n| server ({key[7:]}), concurrency | output tok/s | TTFT p50 ms | ITL p50 ms | errors |")
            lines.append("|---|---|---|---|---|")
            for r in server.get("scenarios", []):
                lines.append(f"| {r['concurrency']} | " + ("skipped | | | |" if "skipped" in r else
                             f"{r['output_tok_s']} | {r['ttft_p50_ms']} | {r['itl_p50_ms']} | {r['errors']} |"))
    return "\n".join(lines)


# ---- command line --------------------------------------------------------------------------------------------

def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _part_budgets(text: str) -> dict[str, float]:
    budgets = dict(DEFAULT_PART_BUDGET)
    for item in filter(None, text.split(",")):
        part, _, seconds = item.partition("=")
        if part not in budgets:
            raise argparse.ArgumentTypeError(f"unknown part {part!r}; parts: {', '.join(PARTS)}")
        budgets[part] = float(seconds)
    return budgets


def _work_root(need: float, explicit: Path | None = None) -> tuple[Path | None, float]:
    """(where `need` bytes of files go, or None; the most free space seen). `explicit` if given and it has room;
    else, first that has room: /dev/shm (memory speed) if the host keeps memory for a loader's full host copy of
    the files besides HOST_RESERVE; the temp dir; /dev/shm leaving HOST_RESERVE only."""
    if explicit is not None:
        free = shutil.disk_usage(explicit).free if explicit.is_dir() else 0
        return (explicit if free >= need else None), free
    shm, tmp = Path("/dev/shm"), Path(tempfile.gettempdir())
    free = {p: shutil.disk_usage(p).free if p.is_dir() else 0 for p in (shm, tmp)}
    spare = available_memory() - need  # host memory left once the files are in /dev/shm
    for root, ok in ((shm, spare >= need + HOST_RESERVE), (tmp, True), (shm, spare >= HOST_RESERVE)):
        if ok and free[root] >= need:
            return root, free[root]
    return None, max(free.values())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke check")
    ap.add_argument("--shapes", default="llama-1b", help=f"comma-separated, of: {', '.join(SHAPES)}")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    ap.add_argument("--batches", type=_ints, default=[1, 8, 32, 128, 256], help="decode batch sizes")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt per row before decoding (anchor, engine)")
    ap.add_argument("--decode-steps", type=int, default=48, help="timed decode steps per batch size")
    ap.add_argument("--prefill-tokens", type=int, default=8192, help="engine: prompt tokens per prefill step")
    ap.add_argument("--ttft-prompts", type=_ints, default=[128, 2048])
    ap.add_argument("--ttft-repeats", type=int, default=3)
    ap.add_argument("--server-concurrency", type=_ints, default=[1, 32, 128])
    ap.add_argument("--server-prompt-tokens", type=int, default=128)
    ap.add_argument("--server-max-tokens", type=int, default=256)
    ap.add_argument("--server-requests", type=int, default=0,
                    help="requests per concurrency (default: the concurrency, at least 2)")
    ap.add_argument("--server-rounds", type=int, default=1,
                    help="without --server-requests: requests per concurrency as this many times the concurrency")
    ap.add_argument("--server-args", action="append", default=[],
                    help='extra `serve` flags, e.g. "--max-running 128"; given again, one more server with those '
                         'flags (the server part runs once per value)')
    ap.add_argument("--bandwidth-gib", type=float, default=None, help="copy size (default 4 on GPU, 0.25 on CPU)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="the whole run's deadline")
    ap.add_argument("--part-budget", type=_part_budgets, default=dict(DEFAULT_PART_BUDGET),
                    help="per shape and part, e.g. anchor=30,server=200 (defaults: "
                         + ", ".join(f"{k}={v:g}" for k, v in DEFAULT_PART_BUDGET.items()) + ")")
    ap.add_argument("--work-dir", type=Path, help="where the model directories go (default /dev/shm or the temp dir)")
    ap.add_argument("--fit-layers", action="store_true",
                    help="a shape whose files do not fit the work directory runs with as many layers as fit")
    ap.add_argument("--peer-source", type=Path, default=llama_peer.DEFAULT_SOURCE,
                    help="peer part: the llama.cpp source (its convert_hf_to_gguf.py and gguf-py)")
    ap.add_argument("--peer-binary", type=Path, default=llama_peer.DEFAULT_BINARY, help="peer part: llama-server")
    ap.add_argument("--peer-outtype", default="f16", help="peer part: convert_hf_to_gguf.py --outtype")
    ap.add_argument("--peer-args", default=llama_peer.DEFAULT_ARGS, help="peer part: llama-server's flags")
    ap.add_argument("--peer-convert-early", action="store_true",
                    help="peer part: convert to GGUF (at nice 19, one core) while our parts run, not after them")
    ap.add_argument("--merge", type=Path, nargs="+",
                    help="print the markdown of these --json-out files (and write them as one JSON to --json-out)")
    ap.add_argument("--keep-model-dir", action="store_true")
    ap.add_argument("--json-out", type=Path, help="write the JSON here (after every part)")
    ap.add_argument("--quant", choices=["none", "int8", "int4"], default=None,
                    help="engine parts: the weights' format (int4: what a self-int4 draft decodes with)")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="engine parts without CUDA graphs (eager steps)")
    ap.add_argument("--client-processes", type=int, default=0,
                    help="load-generator processes for the server part (default: one per 16 streams)")
    args = ap.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.parts = [p for p in args.parts.split(",") if p]
    for s in args.shapes:
        try:
            shape_by_name(s)
        except KeyError as e:
            ap.error(str(e))
    for p in args.parts:
        if p not in PARTS:
            ap.error(f"unknown part {p!r}; parts: {', '.join(PARTS)}")
    if not args.batches or min(args.batches) < 1 or not args.server_concurrency or min(args.server_concurrency) < 1:
        ap.error("batch sizes and concurrencies must be >= 1")
    if args.bandwidth_gib is None:
        args.bandwidth_gib = 0.25 if args.device == "cpu" else 4.0
    args.peer = llama_peer.PeerOptions(args.peer_source, args.peer_binary, args.peer_outtype, args.peer_args)
    return args


def merge(paths: list[Path], json_out: Path | None) -> None:
    """The markdown of several runs' reports, one after another; their JSON as one list."""
    reports = [json.loads(p.read_text()) for p in paths]
    print("\n\n".join(markdown(r) for r in reports))
    if json_out:
        json_out.write_text(json.dumps({"reports": reports}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.merge:
        merge(args.merge, args.json_out)
        return
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device (use --device cpu for the smoke check)")
    total = Budget(args.budget_s)
    params = {k: v for k, v in vars(args).items() if k not in ("json_out", "work_dir", "merge")}
    report: dict[str, Any] = {"timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
                              "environment": environment(device), "parameters": params, "shapes": {}}

    def save() -> None:
        if args.json_out:
            args.json_out.write_text(json.dumps(report, indent=2, default=str) + "\n")

    log(f"environment: {report['environment']}")
    if "bandwidth" in args.parts:
        report["bandwidth"] = copy_bandwidth(device, args.bandwidth_gib)
        log(f"copy bandwidth: {report['bandwidth']}")
        save()
    try:
        for name in args.shapes:
            if not total.allows():
                report["shapes"][name] = {"skipped": "over --budget-s"}
                continue
            report["shapes"][name] = {}
            run_shape(name, args, device, report.get("bandwidth"), total, save, report["shapes"][name])
            save()
    finally:
        report["wall_s"] = round(time.monotonic() - START, 1)
        save()
    log(f"done in {report['wall_s']}s")
    print(markdown(report))
    print("\n```json\n" + json.dumps(report, indent=2, default=str) + "\n```")


if __name__ == "__main__":
    main()
