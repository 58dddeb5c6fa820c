"""`emberserve serve | models | generate`: the command line (also `python -m server`)."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import uvicorn

from engine import KNOWN_MODELS, ModelFormatError, ModelNotInstalledError
from engine.__main__ import add_commands, run
from engine.quant import QUANT_MODES

from .app import create_app
from .settings import DEFAULT_HOST, DEFAULT_PORT, Settings, parse_bytes

EXIT_LOAD_FAILED = 3


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _serve(args: argparse.Namespace) -> int:
    settings = Settings(model=args.model, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
                        quant=args.quant,
                        max_context=args.max_context, served_model_name=args.served_model_name,
                        log_level=args.log_level, workers=args.workers, max_queued=args.max_queued,
                        max_running=args.max_running, max_batched_tokens=args.max_batched_tokens,
                        kv_cache_memory=args.kv_cache_memory, prefix_caching=not args.no_prefix_cache)
    # Fail before binding the port when there is clearly nothing to load.
    known = KNOWN_MODELS.get(settings.model)
    try:
        if known is not None:
            known.path()
        elif not Path(settings.model).exists():
            raise ModelFormatError(f"model not found: {settings.model!r} is neither a known model name "
                                   f"({', '.join(KNOWN_MODELS)}) nor an existing path")
    except (ModelNotInstalledError, ModelFormatError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    print(f"emberserve: loading {settings.model}; will listen on http://{settings.host}:{settings.port}/v1",
          flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level))
    app.state.request_shutdown = lambda: setattr(server, "should_exit", True)
    server.run()
    if app.state.load_error:
        print(f"error: cannot load model {settings.model!r}: {app.state.load_error}", file=sys.stderr)
        return EXIT_LOAD_FAILED
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="emberserve", description="OpenAI-compatible LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API")
    serve.add_argument("--model", default=Settings.model, help="known model name, .gguf file or safetensors dir")
    serve.add_argument("--host", default=DEFAULT_HOST)
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    serve.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ...")
    serve.add_argument("--dtype", default=None,
                       help="activations: float32 or bfloat16 (default: bfloat16; float32 for unquantized "
                            "checkpoints on CPU)")
    serve.add_argument("--quant", default=None, choices=QUANT_MODES,
                       help="weights kept as int8 per-channel or int4 group-wise (CPU); default: int4 for a GGUF "
                            "model on CPU unless --dtype float32, else none")
    serve.add_argument("--max-context", type=int, default=None, help="cap the context below the model's")
    serve.add_argument("--served-model-name", default=None, help="the model id clients use (default: its name)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--workers", type=_positive, default=Settings.workers,
                       help="runners, each on its own thread (with --device cuda: one per GPU)")
    serve.add_argument("--max-queued", type=int, default=Settings.max_queued,
                       help="waiting requests per worker before answering 429")
    serve.add_argument("--max-running", type=_positive, default=Settings.max_running,
                       help="sequences batched together")
    serve.add_argument("--max-batched-tokens", type=_positive, default=Settings.max_batched_tokens,
                       help="tokens per forward pass; longer prompts are prefilled in chunks")
    serve.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                       help="memory for the paged KV cache, e.g. 1GiB (default: 512MiB on CPU, 90%% of free GPU memory)")
    serve.add_argument("--no-prefix-cache", action="store_true", help="do not reuse cached prompt prefixes")
    serve.set_defaults(func=_serve)
    add_commands(sub)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
