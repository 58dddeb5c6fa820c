"""`emberserve serve | pull | list (models) | rm | show | presets | generate`: the command line (also
`python -m server`)."""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from typing import Any, Literal, Optional, get_args, get_origin

from pydantic import ValidationError

from engine import EngineError
from engine.__main__ import add_commands, run

from server import __version__
from engine.kernels.switches import configure as configure_kernels
from server.config.model_store import ensure_model
from server.config.presets import presets_text
from server.config.settings import RENAMED, SELF_DRAFTS, Settings, env_name, flag_name
from server.launch.checks import EXIT_LOAD_FAILED, EXIT_PORT_IN_USE, EXIT_WORKER_FAILED, bind_error
from server.launch.model_commands import add_model_commands, say
from server.logs import configure_logging
from server.scheduling.threads import cap_malloc_arenas

log = logging.getLogger("emberserve")


def _choices(annotation: Any) -> list[str] | None:
    """The strings a Literal[...] (or Literal[...] | None) annotation allows; None for anything else."""
    if get_origin(annotation) is Literal:
        return [str(a) for a in get_args(annotation)]
    for arg in get_args(annotation):
        if get_origin(arg) is Literal:
            return _choices(arg)
    return None


def settings_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per Settings field; a flag left out leaves the environment variable or the default in force."""
    for name, info in Settings.model_fields.items():
        help_text = f"{info.description} [env {env_name(name)}]".replace("%", "%%")
        if info.annotation in (bool, Optional[bool]):
            parser.add_argument(flag_name(name), dest=name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag_name(name), dest=name, default=argparse.SUPPRESS, choices=_choices(info.annotation),
                                help=help_text)
    parser.add_argument("--no-prefix-cache", dest="prefix_caching", action="store_false", default=argparse.SUPPRESS,
                        help="the same as --no-prefix-caching")
    for old, new in RENAMED.items():  # the settings' old names, before they took vLLM's
        parser.add_argument(flag_name(old), dest=new, default=argparse.SUPPRESS,
                            help=f"the same as {flag_name(new)} (its old name)")


def apply_kernel_switches(settings: Settings) -> None:
    """Put the settings' kernel switches in force before anything imports the engine's kernels (the compiled CPU
    kernels are chosen then): in this process, and through the environment in those it starts (the engine
    process, tensor-parallel ranks, more HTTP processes), which import the kernels before they read settings."""
    configure_kernels(settings.kernel_switches)
    os.environ.update(settings.kernel_switches.as_environ())


def _serve(args: argparse.Namespace) -> int:
    cap_malloc_arenas()
    given = {name: value for name, value in vars(args).items() if name in Settings.model_fields}
    try:
        settings = Settings(**given)
    except ValidationError as e:
        for err in e.errors():
            name = str(err["loc"][0]) if err["loc"] else "settings"
            print(f"error: {flag_name(name)} / {env_name(name)}: {err['msg']}", file=sys.stderr)
        return 2
    # Fail before binding the port when there is clearly nothing to load (with --pull, after downloading it).
    try:
        ensure_model(settings.model, settings.pull, say=say)
        if settings.draft_model is not None and settings.draft_model not in SELF_DRAFTS:
            ensure_model(settings.draft_model, settings.pull, say=say, what="draft model", also=tuple(SELF_DRAFTS))
    except (EngineError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
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

    app = create_app(settings, start_fronts=Fronts)
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
    add_commands(sub, models=False)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
