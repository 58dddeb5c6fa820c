"""`emberserve chat`: a conversation in the terminal, with a running server (--url) or a model run in this process.

Answers stream as they come and the conversation is kept (every answer sees the turns before it); `/` commands
(chat_session.HELP) change it. With stdin not a terminal, all of stdin is one message and the answer is printed
once.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from contextlib import closing
from typing import Any, TextIO

from server.config.settings import flag_name
from server.launch.chat_client import API_KEY_VARIABLES, HttpChat, api_key_from_environment
from server.launch.chat_session import ChatBackend, ChatError, Conversation, EndChat, run_command
from server.launch.checks import EXIT_FAILED, EXIT_INTERRUPTED, CommandError
from server.launch.flags import MODEL_SETTINGS, given_settings, sampling_arguments, sampling_values, settings_arguments
from server.launch.in_process import load_generator
from server.launch.local_chat import LocalChat

DEFAULT_MAX_TOKENS = 1024
PROMPT, MORE = ">>> ", "... "
BLOCK = '"""'  # opens and closes a multi-line message


def add_chat_command(sub: argparse._SubParsersAction) -> None:
    """The `chat` subcommand."""
    chat = sub.add_parser("chat", help="chat in the terminal, with a running server (--url) or a model loaded here",
                          description="Chat in the terminal. With --url, with a running server (POST "
                                      "/v1/chat/completions, streamed); without, with a model loaded in this "
                                      "process (--model and the other model flags). Type /help in the chat for "
                                      "its commands. With stdin not a terminal, all of stdin is one message: the "
                                      "answer is printed and the chat ends.")
    chat.add_argument("--url", help="a running server's address, with or without /v1 (e.g. http://127.0.0.1:8000)")
    chat.add_argument("--api-key", help=f"the server's API key, sent as a bearer token [env "
                                        f"{' or '.join(API_KEY_VARIABLES)}]")
    settings_arguments(chat, MODEL_SETTINGS)  # --model: with --url, the model to ask for (default: the first served)
    chat.add_argument("--system", help="the system prompt (/system changes it in the chat)")
    sampling_arguments(chat, max_tokens=DEFAULT_MAX_TOKENS)
    chat.set_defaults(func=_chat)


def _backend(args: argparse.Namespace, options: dict[str, Any]) -> ChatBackend:
    if args.url is None:
        return LocalChat(load_generator(args, options))
    local_only = sorted(set(given_settings(args, MODEL_SETTINGS)) - {"model"})
    if local_only:
        raise CommandError(f"{', '.join(flag_name(n) for n in local_only)}: for a model loaded here, not with --url "
                           "(the server was started with its own)")
    try:
        return HttpChat(args.url, args.api_key or api_key_from_environment(), getattr(args, "model", None))
    except ChatError as e:
        raise CommandError(str(e), status=EXIT_FAILED) from None


def _chat(args: argparse.Namespace) -> int:
    try:
        options = sampling_values(args)
    except ValueError as e:
        raise CommandError(str(e)) from None
    conversation = Conversation(system=args.system, options=options)
    backend = _backend(args, options)
    try:
        if not sys.stdin.isatty():
            return _answer_stdin(backend, conversation)
        return _interactive(backend, conversation)
    finally:
        backend.close()


def answer(backend: ChatBackend, conversation: Conversation, out: TextIO) -> tuple[str, bool]:
    """Ask for the next answer and write it to `out` as it comes: (its text, whether Ctrl-C stopped it). Leaving
    the stream early closes it, which stops the generation."""
    pieces: list[str] = []
    stopped = False
    stream = backend.stream(conversation.messages(), conversation.options)
    try:
        with closing(stream):
            for piece in stream:
                pieces.append(piece)
                out.write(piece)
                out.flush()
    except KeyboardInterrupt:
        stopped = True
    except ChatError:
        if pieces:  # the error goes on a line of its own
            out.write("\n")
        raise
    return "".join(pieces), stopped


def _answer_stdin(backend: ChatBackend, conversation: Conversation) -> int:
    """All of stdin as one message; its answer on stdout."""
    text = sys.stdin.read().strip()
    if not text:
        raise CommandError("no message on stdin")
    conversation.turns.append({"role": "user", "content": text})
    try:
        _, stopped = answer(backend, conversation, sys.stdout)
    except ChatError as e:
        raise CommandError(str(e), status=EXIT_FAILED) from None
    print()
    return EXIT_INTERRUPTED if stopped else 0


def _read_message() -> str:
    """One message from the terminal: a line, or a block between \"\"\" lines (EOFError at Ctrl-D)."""
    line = input(PROMPT)
    if not line.lstrip().startswith(BLOCK):
        return line.strip()
    first = line.lstrip()[len(BLOCK):].rstrip()
    if first.endswith(BLOCK):  # opened and closed on one line
        return first[:-len(BLOCK)].strip()
    lines = [first]
    while not (line := input(MORE).rstrip()).endswith(BLOCK):
        lines.append(line)
    lines.append(line[:-len(BLOCK)])
    return "\n".join(lines).strip()


def _interactive(backend: ChatBackend, conversation: Conversation) -> int:
    try:
        importlib.import_module("readline")  # line editing and history for input(), where the platform has it
    except ImportError:
        pass
    print(f"chatting with {backend.model}; /help lists the commands, /quit or Ctrl-D leaves")
    while True:
        try:
            text = _read_message()
        except EOFError:  # Ctrl-D
            print()
            return 0
        except KeyboardInterrupt:  # Ctrl-C at the prompt clears the line (or the unfinished block)
            print()
            continue
        if not text:
            continue
        if text.startswith("/"):
            try:
                print(run_command(conversation, text, backend.model))
            except EndChat:
                return 0
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
            continue
        conversation.turns.append({"role": "user", "content": text})
        try:
            reply, stopped = answer(backend, conversation, sys.stdout)
        except ChatError as e:
            conversation.turns.pop()  # unanswered: as if it had not been sent
            print(f"error: {e}", file=sys.stderr)
            continue
        if reply or not stopped:
            conversation.turns.append({"role": "assistant", "content": reply})
        else:  # stopped before anything came: as if it had not been sent
            conversation.turns.pop()
        print("\n(stopped)" if stopped else "")
