"""`emberserve generate`: one generation from the command line through the in-process `Generator`, with the
server's sampling (the engine's own `python -m engine generate` stays greedy)."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from engine.__main__ import add_prompt_arguments

from server.launch.checks import EXIT_FAILED, EXIT_INTERRUPTED, CommandError
from server.launch.flags import MODEL_SETTINGS, sampling_arguments, sampling_values, settings_arguments
from server.launch.in_process import load_generator


def add_generate_command(sub: argparse._SubParsersAction) -> None:
    """The `generate` subcommand: the model flags, a prompt, the sampling flags."""
    gen = sub.add_parser("generate", help="generate once from a prompt (or a chat message) and print it",
                         description="Generate once and print the text as it comes (statistics on stderr). "
                                     "Sampling as the server's: the flags, then the preset, then the model's "
                                     "defaults; --temperature 0 is greedy.")
    settings_arguments(gen, MODEL_SETTINGS)
    add_prompt_arguments(gen)
    gen.add_argument("--system", help="a system message before the --chat message")
    sampling_arguments(gen)
    gen.set_defaults(func=_generate)


def _prompt(args: argparse.Namespace) -> str | list[dict[str, Any]]:
    if args.chat is None:
        if args.system is not None:
            raise CommandError("--system goes with --chat (a --prompt is raw text, without the chat template)")
        return args.prompt
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    return [*system, {"role": "user", "content": args.chat}]


def _generate(args: argparse.Namespace) -> int:
    try:
        values = sampling_values(args)
    except ValueError as e:
        raise CommandError(str(e)) from None
    prompt = _prompt(args)
    started = time.perf_counter()
    generator = load_generator(args, values)
    from server.generator.config import GenerationError  # with the generator, loaded above

    with generator:
        print(f"loaded {generator.model_name} on {generator.device} in {time.perf_counter() - started:.2f}s",
              file=sys.stderr)
        t0 = time.perf_counter()
        first, count, finish = None, 0, None
        try:
            for token in generator.stream(prompt, values):
                first = first or time.perf_counter()
                count += 1
                finish = token.finish_reason or finish
                sys.stdout.write(token.text)
                sys.stdout.flush()
        except KeyboardInterrupt:  # the stream's generation is cancelled as the loop is left
            print()
            return EXIT_INTERRUPTED
        except GenerationError as e:
            raise CommandError(e.message, status=EXIT_FAILED) from None
        elapsed = time.perf_counter() - t0
        print()
    rate = (count - 1) / (elapsed - (first - t0)) if first is not None and count > 1 else 0.0
    print(f"generated {count} tokens in {elapsed:.2f}s (first token {1000 * ((first or t0) - t0):.0f} ms, "
          f"{rate:.1f} tokens/s; finish reason {finish})", file=sys.stderr)
    return 0
