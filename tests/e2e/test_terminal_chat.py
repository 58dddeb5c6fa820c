"""`emberserve chat` in a real terminal (pexpect's pseudo-terminal) against a real server (--url), and piped, also
with the model loaded in the chat's own process. What the server received is read from its JSON access log."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pexpect
import pytest

from tests.support.server_process import EXACT, ServerProcess, start_server, stop_server

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"
API_KEY = "chat-test-key"
PROMPT = ">>> "
MAX_TOKENS = 8  # short answers: each costs the shared CPU a few decode steps
LONG = 2000  # an answer that runs long after Ctrl-C is sent
STOP_WITHIN_S = 5.0  # generous: a step on a shared 2-core machine can take a while


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path_factory.mktemp("chat"), "--model", MODEL, *EXACT, "--log-format", "json",
                       "--api-key", API_KEY)
    yield srv
    stop_server(srv)


def requests_received(srv: ServerProcess, count: int = 0) -> list[dict[str, Any]]:
    """The server's access-log records of chat completions, in order (at least `count` of them, waited for)."""
    return srv.access_records(count, path="/v1/chat/completions")


def requests_after(srv: ServerProcess, before: int, count: int = 1) -> list[dict[str, Any]]:
    """The `count` records logged after the first `before`."""
    return requests_received(srv, before + count)[before:before + count]


def direct_answer(srv: ServerProcess, messages: list[dict[str, str]], **options: Any) -> str:
    """The server's answer to a plain (not streamed) request: what the chat should show for the same values."""
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "messages": messages, **options}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def running(srv: ServerProcess) -> float:
    text = httpx.get(f"{srv.base_url}/metrics", timeout=10).text
    match = re.search(r"^emberserve:num_requests_running (\S+)$", text, re.M)
    assert match, text
    return float(match.group(1))


def spawn_chat(url: str, *args: str, max_tokens: int = MAX_TOKENS) -> pexpect.spawn:
    """`emberserve chat` in a pseudo-terminal, at its first prompt."""
    child = pexpect.spawn(sys.executable, ["-m", "server", "chat", "--url", url, "--max-tokens", str(max_tokens),
                                           *args], cwd=str(ROOT), encoding="utf-8", timeout=120,
                          dimensions=(24, 1000), env={**os.environ, "TERM": "dumb", "EMBERSERVE_API_KEY": API_KEY})
    child.expect_exact(PROMPT)
    return child


def send(child: pexpect.spawn, line: str) -> str:
    """Type a line; what the chat printed until its next prompt (the echo left out)."""
    child.sendline(line)
    child.expect_exact(line + "\r\n")
    child.expect_exact(PROMPT)
    return child.before.replace("\r\n", "\n")


def quit_chat(child: pexpect.spawn) -> None:
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before


def test_the_answer_streams_as_it_is_generated(chat_server: ServerProcess) -> None:
    """The first piece of the answer is on the screen while the server is still generating the rest."""
    child = spawn_chat(chat_server.base_url, "--temperature", "0", max_tokens=16)
    before = len(requests_received(chat_server))
    child.sendline("Count from 1 to 30.")
    child.expect_exact("Count from 1 to 30.\r\n")
    first = child.read_nonblocking(4096, timeout=120)
    assert first.strip() and PROMPT not in first, first
    assert running(chat_server) == 1  # the answer was still being generated when its first piece showed
    child.expect_exact(PROMPT)
    whole = (first + child.before).replace("\r\n", "\n")
    assert len(whole.strip()) > len(first.strip())
    assert requests_after(chat_server, before)[0]["output_tokens"] == 16
    quit_chat(child)


def test_turns_are_kept_reset_forgets_them_and_save_writes_them(chat_server: ServerProcess,
                                                                 tmp_path: Path) -> None:
    child = spawn_chat(f"{chat_server.base_url}/v1", "--temperature", "0")  # a URL with /v1 works too
    before = len(requests_received(chat_server))
    first = send(child, "My name is Zorblax.").strip()
    second = send(child, "What is my name?").strip()
    seen = requests_after(chat_server, before, 2)
    assert seen[1]["prompt_tokens"] > seen[0]["prompt_tokens"] + seen[0]["output_tokens"]  # the first turn went too
    saved = tmp_path / "conversation.json"
    assert str(saved) in send(child, f"/save {saved}")
    conversation = json.loads(saved.read_text())
    assert conversation["model"] == MODEL and conversation["options"] == {"temperature": 0.0, "max_tokens": 8}
    assert [(m["role"], m["content"].strip()) for m in conversation["messages"]] == [
        ("user", "My name is Zorblax."), ("assistant", first), ("user", "What is my name?"), ("assistant", second)]
    assert "cleared" in send(child, "/reset")
    again = send(child, "My name is Zorblax.").strip()
    assert requests_after(chat_server, before + 2)[0]["prompt_tokens"] == seen[0]["prompt_tokens"]  # nothing else sent
    assert again == first
    quit_chat(child)


def test_the_system_prompt_from_the_flag_and_the_command(chat_server: ServerProcess, tokenizer) -> None:
    """--system starts the conversation with it; /system replaces it; /reset keeps it."""
    def prompt_tokens(system: str) -> int:
        return len(tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                   {"role": "user", "content": "Hello"}], add_generation_prompt=True))

    pirate, poet = "You are a pirate.", "You are a poet who answers every question with a rhyme about the sea."
    child = spawn_chat(chat_server.base_url, "--system", pirate)
    before = len(requests_received(chat_server))
    send(child, "Hello")
    assert requests_after(chat_server, before)[0]["prompt_tokens"] == prompt_tokens(pirate)
    assert "set" in send(child, f"/system {poet}")
    send(child, "/reset")
    assert poet in send(child, "/system")
    send(child, "Hello")
    assert requests_after(chat_server, before + 1)[0]["prompt_tokens"] == prompt_tokens(poet) != prompt_tokens(pirate)
    quit_chat(child)


def test_set_changes_the_values_of_the_next_answers(chat_server: ServerProcess) -> None:
    question = [{"role": "user", "content": "Name a colour."}]
    greedy = direct_answer(chat_server, question, temperature=0, max_tokens=MAX_TOKENS)
    sampled = direct_answer(chat_server, question, temperature=1.5, seed=11, max_tokens=MAX_TOKENS)
    assert sampled != greedy  # else the test below could not tell the values apart
    child = spawn_chat(chat_server.base_url)
    send(child, "/set temperature 0")
    assert send(child, "Name a colour.").strip() == greedy.strip()
    send(child, "/reset")
    send(child, "/set temperature 1.5")
    assert "seed 11" in send(child, "/set seed 11")
    assert send(child, "Name a colour.").strip() == sampled.strip()
    errors = [send(child, "/set warmth 1"), send(child, "/set temperature hot")]
    assert errors[0].strip().startswith("error: unknown value 'warmth'") and errors[0].strip().count("\n") == 0
    assert errors[1].strip() == "error: temperature: takes a number, not 'hot'"
    assert "temperature 1.5" in send(child, "/set")  # the bad values changed nothing
    send(child, "/set temperature -1")  # one the server refuses: its error on one line, and the chat goes on
    refused = send(child, "Name a colour.").strip()
    assert refused.startswith("error: ") and "temperature" in refused and "\n" not in refused, refused
    quit_chat(child)


def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(chat_server: ServerProcess) -> None:
    child = spawn_chat(chat_server.base_url, "--temperature", "0", max_tokens=LONG)
    before = len(requests_received(chat_server))
    child.sendline("Write a very long story about a dragon.")
    child.expect_exact("dragon.\r\n")
    child.expect(r"\w")  # the answer has begun
    child.sendintr()
    child.expect_exact("(stopped)")
    child.expect_exact(PROMPT)
    deadline = time.monotonic() + STOP_WITHIN_S
    while running(chat_server) != 0:  # the server stopped generating it: the chat closed the stream
        assert time.monotonic() < deadline, "the stopped answer is still being generated"
        time.sleep(0.05)
    [stopped] = requests_after(chat_server, before)
    assert stopped["finish_reason"] == "abort" and stopped["output_tokens"] < LONG, stopped
    send(child, f"/set max_tokens {MAX_TOKENS}")
    assert send(child, "What is 2 + 2?").strip()
    [answered] = requests_after(chat_server, before + 1)
    assert answered["finish_reason"] != "abort" and answered["prompt_tokens"] > stopped["prompt_tokens"]
    quit_chat(child)


def test_a_triple_quoted_block_is_one_message(chat_server: ServerProcess, tmp_path: Path) -> None:
    child = spawn_chat(chat_server.base_url)
    child.sendline('"""First line,')
    child.expect_exact("... ")  # the block goes on
    child.sendline("second line.")
    child.expect_exact("... ")
    send(child, 'Answer briefly."""')
    send(child, f"/save {tmp_path / 'block.json'}")
    messages = json.loads((tmp_path / "block.json").read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"] == "First line,\nsecond line.\nAnswer briefly."
    quit_chat(child)


def test_ctrl_d_leaves_and_ctrl_c_at_the_prompt_clears_the_line(chat_server: ServerProcess) -> None:
    child = spawn_chat(chat_server.base_url)
    before = len(requests_received(chat_server))
    child.send("half a question")
    child.expect_exact("half a question")  # read and echoed: readline waits for more (a signal wakes it only then)
    child.sendintr()
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and len(requests_received(chat_server)) == before  # nothing was sent


def run_chat(*args: str, stdin: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server", "chat", *args], input=stdin, capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env={**os.environ, **(env or {})})


def test_piped_stdin_is_one_message_answered_once(chat_server: ServerProcess) -> None:
    message = "What is the capital of France?\nAnswer in one word."
    expected = direct_answer(chat_server, [{"role": "user", "content": message}], temperature=0,
                             max_tokens=MAX_TOKENS)
    done = run_chat("--url", chat_server.base_url, "--temperature", "0", "--max-tokens", str(MAX_TOKENS),
                    stdin=message, env={"OPENAI_API_KEY": API_KEY})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected.strip() and PROMPT not in done.stdout


def test_a_server_that_refuses_is_one_line_and_exit_1(chat_server: ServerProcess) -> None:
    done = run_chat("--url", chat_server.base_url, "--api-key", "wrong", stdin="Hello")
    assert done.returncode == 1 and done.stdout == "", done
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1 and "401" in done.stderr


def test_piped_stdin_in_process(ref) -> None:
    """Without --url the chat loads the model itself; greedy, it answers as the engine does."""
    system, message = "You are terse.", "What is 2 + 2?"
    done = run_chat("--model", MODEL, *EXACT, "--temperature", "0", "--max-tokens", str(MAX_TOKENS),
                    "--system", system, stdin=message + "\n")
    assert done.returncode == 0, done.stderr
    ids = ref.chat_ids([{"role": "system", "content": system}, {"role": "user", "content": message}])
    assert done.stdout.strip() == ref.text(ref.generate(ids, MAX_TOKENS)).strip()
