"""`emberserve serve | pull | list (models) | rm | show | presets | generate | chat`: the command line (also
`python -m server`)."""
from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import sys
import tempfile
from typing import NoReturn

from engine.__main__ import run
from engine.kernels.switches import configure as configure_kernels

from server import __version__
from server.config.presets import presets_text
from server.config.settings import Settings, env_name
from server.launch.chat import add_chat_command
from server.launch.checks import (EXIT_INTERRUPTED, EXIT_LOAD_FAILED, EXIT_PORT_IN_USE, EXIT_WORKER_FAILED,
                                  CommandError, bind_error, check_loadable, settings_from)
from server.launch.flags import given_settings, settings_arguments
from server.launch.generate import add_generate_command
from server.launch.model_commands import add_model_commands
from server.logs import configure_logging
from server.scheduling.threads import cap_malloc_arenas

log = logging.getLogger("emberserve")


def apply_kernel_switches(settings: Settings) -> None:
    """Put the settings' kernel switches in force before anything imports the engine's kernels (the compiled CPU
    kernels are chosen then): in this process, and through the environment in those it starts (the engine
    process, tensor-parallel ranks, more HTTP processes), which import the kernels before they read settings."""
    configure_kernels(settings.kernel_switches)
    os.environ.update(settings.kernel_switches.as_environ())


def _serve(args: argparse.Namespace) -> int:
    cap_malloc_arenas()
    settings = settings_from(given_settings(args))
    check_loadable(settings)  # fail before binding the port when there is clearly nothing to load (--pull: downloaded first)
    configure_logging(settings.log_level, settings.log_format)
    listen_error = bind_error(settings.host, settings.port)
    if listen_error is not None:
        print(f"error: cannot listen on {settings.host}:{settings.port}: {listen_error.strerror or listen_error} "
              f"(--port / {env_name('port')} chooses another)", file=sys.stderr)
        return EXIT_PORT_IN_USE
    apply_kernel_switches(settings)
    metrics_dir = None
    if settings.api_server_count > 1:  # every HTTP process's metrics in files that a scrape of any one sums
        from server.api.metrics import share_metrics_across_processes  # it imports the app's stack: after the above

        metrics_dir = tempfile.mkdtemp(prefix="emberserve-metrics-")
        share_metrics_across_processes(metrics_dir)
    try:
        return _run_server(settings)
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _run_server(settings: Settings) -> int:
    # Imported here, after the kernel switches are in force: importing the app imports the engine's kernels.
    from server.api.app import create_app
    from server.api.state import app_state
    from server.launch.http_fronts import Fronts
    from server.launch.lifecycle import serve_until_stopped

    try:
        app = create_app(settings, start_fronts=Fronts)
    except ValueError as e:  # what a multi-model server finds out about its models and memory before it starts
        raise CommandError(str(e)) from None
    log.info("emberserve %s: loading %s on %s%s; will listen on http://%s:%d/v1", __version__, settings.model,
             settings.device, _auto_note(settings), settings.host, settings.port)
    log.debug("settings: %r", settings)  # SecretStr: the API key shows as '**********'
    # Several HTTP processes: the port is bound here, as uvicorn's own workers do, for every one of them to share.
    serve_until_stopped(app, settings, bind=settings.api_server_count > 1)
    state = app_state(app)
    if state.load_error:
        print(f"error: cannot load model {settings.model!r}: {state.load_error}", file=sys.stderr)
        return EXIT_LOAD_FAILED
    if state.fatal_error:
        print(f"error: {state.fatal_error}", file=sys.stderr)
        return EXIT_WORKER_FAILED
    return 0


def _auto_note(settings: Settings) -> str:
    """Why the device is what it is, when --device was left to `auto`."""
    if "device" in settings.model_fields_set:
        return ""
    return " (--device auto: " + ("a CUDA GPU is present)" if settings.device == "cuda" else "no CUDA GPU found)")


def _presets(_: argparse.Namespace) -> int:
    print(presets_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="emberserve", description="OpenAI-compatible LLM server")
    parser.add_argument("--version", action="version", version=f"emberserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API")
    settings_arguments(serve)
    serve.set_defaults(func=_serve)
    sub.add_parser("presets", help="list the generation presets (--preset, a request's \"preset\")").set_defaults(
        func=_presets)
    add_model_commands(sub)
    add_generate_command(sub)
    add_chat_command(sub)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except CommandError as e:
        for line in e.lines:
            print(f"error: {line}", file=sys.stderr)
        return e.status
    except KeyboardInterrupt:  # Ctrl-C while a command loads or runs: it ends, without a traceback
        print(file=sys.stderr)
        return EXIT_INTERRUPTED


def entry() -> NoReturn:
    """The `emberserve` command (and `python -m server`): `main`, then the process exits with its status."""
    status = main()
    # What is still alive (torch, a model, the tokenizer, the app) is frozen: left to the operating system, not
    # walked by the collector's last pass as the interpreter exits, which takes about a second after a model ran.
    gc.freeze()
    sys.exit(status)


if __name__ == "__main__":
    entry()
