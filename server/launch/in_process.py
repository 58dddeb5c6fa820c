"""A model run in this process for the command line (`generate`, `chat` without --url): the in-process Python
API's `Generator`, loaded from the model flags after the same checks as `serve`'s."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from engine import EngineError

from server.launch.checks import EXIT_LOAD_FAILED, CommandError, check_loadable, settings_from
from server.launch.flags import MODEL_SETTINGS, given_settings

if TYPE_CHECKING:
    from server.generator.generator import SyncGenerator


def load_generator(args: argparse.Namespace, values: dict[str, Any]) -> SyncGenerator:
    """The model of the command line's settings, loaded and serving; CommandError (one line) for bad settings or
    sampling `values`, a model or device that is not there, or a load that fails."""
    given = given_settings(args, MODEL_SETTINGS)
    settings = settings_from(given)
    check_loadable(settings)
    # Imported here: the generator imports the engine's kernels, which must not load before the settings are known.
    from server.generator.config import GenerationConfig, GenerationError, generation_request
    from server.generator.generator import Generator

    try:
        generation_request(settings.model, "", GenerationConfig.of(values))  # the values are a valid request
    except GenerationError as e:
        raise CommandError(e.message) from None
    builder = Generator.builder(settings.model)
    for name, value in given.items():
        builder.setting(name, value)
    try:
        return builder.build_sync()
    except (EngineError, ValueError) as e:
        raise CommandError(f"cannot load model {settings.model!r}: {e}", status=EXIT_LOAD_FAILED) from None
