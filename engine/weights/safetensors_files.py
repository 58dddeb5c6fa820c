"""A safetensors checkpoint's files, found without torch (listing and showing models read only their headers)."""
from __future__ import annotations

import json
from pathlib import Path

from engine.errors import ModelFormatError


def shard_files(directory: Path) -> list[Path]:
    """The checkpoint's .safetensors files: those its index names, else every one in `directory`."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({directory / f for f in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{directory}: no model.safetensors or safetensors shards found")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelFormatError(f"{directory}: missing safetensors shards: {', '.join(missing)}")
    return files
