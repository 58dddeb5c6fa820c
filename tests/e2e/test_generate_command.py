"""`emberserve generate`: one generation through the in-process Generator, with the server's sampling flags; and
the command line's one-line errors for settings and devices it cannot use (generate, chat, serve alike)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.server_process import EXACT

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"
MAX_TOKENS = 8


def emberserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def generate(*args: str) -> str:
    """The text `emberserve generate` printed (stdout: the text and a newline; statistics go to stderr)."""
    done = emberserve("generate", "--model", MODEL, *EXACT, "--max-tokens", str(MAX_TOKENS), *args)
    assert done.returncode == 0, done.stderr
    assert "generated" in done.stderr and "Traceback" not in done.stderr, done.stderr
    return done.stdout.removesuffix("\n")


def test_a_seed_makes_sampling_repeatable_and_temperature_0_is_greedy(ref) -> None:
    prompt = "Once upon a time"
    sampled = [generate("--prompt", prompt, "--temperature", "1.5", "--top-k", "50", "--seed", "5")
               for _ in range(2)]
    greedy_text = ref.text(ref.generate(ref.tok.encode(prompt), MAX_TOKENS))
    assert sampled[0] == sampled[1] != greedy_text  # the same seed, the same text; sampled, not greedy
    system, message = "You are terse.", "What is the capital of France?"
    greedy_chat = generate("--chat", message, "--system", system, "--temperature", "0", "--seed", "5")
    ids = ref.chat_ids([{"role": "system", "content": system}, {"role": "user", "content": message}])
    assert greedy_chat == ref.text(ref.generate(ids, MAX_TOKENS))


BAD = [("--dtype", "float16"), ("--temperature", "hot"), ("--preset", "nope"), ("--device", "tpu")]
if not torch.cuda.is_available():
    BAD.append(("--device", "cuda"))


# serve has no sampling flags (a request sets its own): the others are for every command.
CASES = [(command, flag, value) for command in ("generate", "chat", "serve") for flag, value in BAD
         if not (command == "serve" and flag == "--temperature")]


@pytest.mark.parametrize("command, flag, value", CASES, ids=[f"{c}:{f}={v}" for c, f, v in CASES])
def test_what_cannot_run_is_one_line_and_exit_2(command: str, flag: str, value: str) -> None:
    """Said before anything loads: one `error:` line naming the value, exit status 2, never a traceback."""
    given = {"generate": ("--prompt", "Hello"), "chat": (), "serve": ("--port", "0")}[command]
    done = subprocess.run([sys.executable, "-m", "server", command, *given, flag, value], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, input="Hello")
    assert done.returncode == 2, done
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert value in done.stderr or flag in done.stderr, done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr
