"""What the command line settles before it loads anything: its exit statuses, the settings it was given, whether
the model and the device are there, and whether the port is free."""
from __future__ import annotations

import socket
import sys
from typing import Any

from pydantic import ValidationError

from engine import DeviceError, EngineError

from server.config.model_store import ensure_model
from server.config.served_models import servable_models
from server.config.settings import SELF_DRAFTS, Settings, env_name, flag_name

EXIT_FAILED = 1  # a command that ran could not do its work (say, the chat's server refused it)
EXIT_USAGE = 2
EXIT_LOAD_FAILED = 3
EXIT_WORKER_FAILED = 4
EXIT_PORT_IN_USE = 5
EXIT_INTERRUPTED = 130  # the shell's status for a command ended by Ctrl-C (128 + SIGINT)


class CommandError(Exception):
    """What ends a command before it does its work: one line per problem (printed as `error: ...`, never a
    traceback) and the exit status."""

    def __init__(self, *lines: str, status: int = EXIT_USAGE) -> None:
        super().__init__("; ".join(lines))
        self.lines, self.status = lines, status


def settings_from(given: dict[str, Any]) -> Settings:
    """The Settings of these flags (and the environment), or CommandError naming each bad value's flag and
    variable."""
    try:
        return Settings(**given)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            name = str(err["loc"][0]) if err["loc"] else "settings"
            lines.append(f"{flag_name(name)} / {env_name(name)}: {err['msg']}" if name in Settings.model_fields
                         else str(err["msg"]).removeprefix("Value error, "))
        raise CommandError(*lines) from None


def say(message: str) -> None:
    """A line of what a command is doing (a pull's progress), on stderr: stdout keeps the command's answer."""
    print(message, file=sys.stderr, flush=True)


def check_loadable(settings: Settings) -> None:
    """CommandError unless the model (and the draft model) can be found — with `pull` set, a Hugging Face model not
    in the cache is downloaded first — and the device exists: settled before the port is bound or anything loads,
    so that a start that cannot work ends at once."""
    try:
        for source in [m.source for m in servable_models(settings)] if settings.serves_many else [settings.model]:
            ensure_model(source, settings.pull, say=say)
        if settings.draft_model is not None and settings.draft_model not in SELF_DRAFTS:
            ensure_model(settings.draft_model, settings.pull, say=say, what="draft model", also=tuple(SELF_DRAFTS))
        from engine.loader.devices import check_device  # torch: only once the flags are known to be good

        check_device(settings.device)
    except (EngineError, DeviceError, ValueError) as e:
        raise CommandError(str(e)) from None


def bind_error(host: str, port: int) -> OSError | None:
    """Why the server could not listen on (host, port) now (bound as uvicorn binds it), or None: checked before
    the model loads, so that a taken port ends the start at once rather than after the load."""
    if port == 0:  # any free port
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as e:
        return e
    return None
