"""Command line: `python -m engine models` lists known models; `python -m engine generate` runs greedy generation."""
from __future__ import annotations

import argparse
import sys
import time

from engine import available_models
from engine.errors import EngineError
from engine.config import QUANT_MODES
from engine.registry import DEFAULT_MODEL


def _models(_: argparse.Namespace) -> int:
    for m in available_models():
        state = "installed" if m["installed"] else f"not installed ({m['install']})"
        print(f"{m['name']:<16} {m['family']:<8} {state}  {m['description']}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from engine.loader.load import load_runner  # here, not at import: the command line's other commands need no torch

    started = time.perf_counter()
    runner = load_runner(args.model, device=args.device, dtype=args.dtype, max_context=args.max_context,
                         quant=args.quant)
    tok = runner.tokenizer
    print(f"loaded {runner.name} ({runner.family}, {runner.dtype}, {runner.quant} weights, {runner.device}) "
          f"in {time.perf_counter() - started:.2f}s", file=sys.stderr)
    if args.chat is not None:
        ids = tok.apply_chat_template([{"role": "user", "content": args.chat}], add_generation_prompt=True)
    else:
        ids = tok.encode(args.prompt)
    detok = tok.detokenizer(skip_special_tokens=True)
    t0 = time.perf_counter()
    first: list[float] = []

    def on_token(token: int) -> bool:
        if not first:
            first.append(time.perf_counter())
        if token in tok.end_token_ids:
            return False
        sys.stdout.write(detok.push(token))
        sys.stdout.flush()
        return True

    out = runner.generate(ids, args.max_tokens, on_token)
    sys.stdout.write(detok.flush() + "\n")
    elapsed = time.perf_counter() - t0
    decode_s = elapsed - (first[0] - t0) if first else 0.0
    rate = (len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else 0.0
    print(f"prompt {len(ids)} tokens, generated {len(out)} tokens in {elapsed:.2f}s "
          f"(first token {1000 * (first[0] - t0) if first else 0:.0f} ms, {rate:.1f} tokens/s)", file=sys.stderr)
    return 0


def add_models_command(sub: argparse._SubParsersAction) -> None:
    """The `models` subcommand, for this CLI and the server's."""
    sub.add_parser("models", help="list the known model names").set_defaults(func=_models)


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """What a one-shot generation generates from: --prompt or --chat (one is required), and --max-tokens."""
    text = parser.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="raw text prompt")
    text.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default: 128)")


def add_commands(sub: argparse._SubParsersAction) -> None:
    """The engine's `models` and `generate` subcommands."""
    add_models_command(sub)
    gen = sub.add_parser("generate", help="greedy generation from the command line")
    gen.add_argument("--model", default=DEFAULT_MODEL, help="known model name, .gguf file or safetensors directory")
    add_prompt_arguments(gen)
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16, float32 for an "
                                                   "unquantized checkpoint on CPU)")
    gen.add_argument("--quant", default=None, choices=QUANT_MODES, help="none, int8 or int4 (default: int4 for "
                                                                      "GGUF on CPU unless --dtype float32)")
    gen.add_argument("--max-context", type=int, default=None)
    gen.set_defaults(func=_generate)


def run(args: argparse.Namespace) -> int:
    """Run a parsed subcommand; engine errors become a one-line message and exit status 2."""
    try:
        return args.func(args)
    except (EngineError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    add_commands(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
