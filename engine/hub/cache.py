"""The models in the local Hugging Face cache (`$HF_HOME/hub`, the layout `hf download` and transformers share, so
nothing is stored twice): finding one by name without the network, listing and removing them, all through
huggingface_hub's own cache functions.

A name without a revision looks in the snapshot `main` points to, then in the other cached snapshots, newest first
(a model pulled with `--revision` and nothing else is found); a name with a quantization tag means the GGUF file(s)
`select_gguf` picks among the snapshot's files; a name without one means the GGUF default when the snapshot has GGUF
models, else its safetensors weights (the directory). A split GGUF or a sharded checkpoint with a part missing is
not found.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import ModelNotPulledError
from engine.hub.names import INDEX_FILE, HubName, gguf_models, gguf_part, safetensors_files, select_gguf

# huggingface_hub is imported where it is used: importing the registry (every command, `--help`) need not load it.
if TYPE_CHECKING:
    from huggingface_hub import HFCacheInfo


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps models: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


@dataclass(frozen=True)
class CachedModel:
    """A model found in the cache: the snapshot it is in, its files there (relative paths), and what loads it (the
    first GGUF file, or the snapshot directory of a safetensors checkpoint)."""

    name: HubName
    snapshot: Path
    files: tuple[str, ...]

    @property
    def path(self) -> Path:
        first = self.files[0]
        return self.snapshot / first if first.endswith(".gguf") else self.snapshot


def _snapshot_files(snapshot: Path) -> list[str]:
    """The files of a snapshot (symlinks into the blobs; a dangling one is not a file)."""
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def model_files(files: list[str], quant: str | None, snapshot: Path | None = None) -> list[str]:
    """The files of `files` that the name's quantization (None: the default) means: GGUF parts, or, without a tag
    and without GGUF models, a safetensors checkpoint's files (the index read from `snapshot`, when there is one);
    [] when they are not all there."""
    gguf = select_gguf(files, quant)
    if gguf:
        part = gguf_part(gguf[0])
        return gguf if part is not None and len(gguf) == part.count else []
    if quant is not None or gguf_models(files) or snapshot is None:
        return []
    shards = None
    if INDEX_FILE in files:
        try:
            shards = json.loads((snapshot / INDEX_FILE).read_text())["weight_map"].values()
        except (OSError, ValueError, KeyError, AttributeError):
            return []
    wanted = safetensors_files(files, shards)
    return wanted if wanted and set(wanted) <= set(files) else []


def _snapshots(repo: str, revision: str | None) -> list[Path]:
    """The repo's cached snapshots to look in, best first."""
    from huggingface_hub import resolve_revision
    from huggingface_hub.errors import RevisionResolutionError
    from huggingface_hub.file_download import repo_folder_name

    folder = hub_cache_dir() / repo_folder_name(repo_id=repo, repo_type="model") / "snapshots"
    if not folder.is_dir():
        return []
    try:
        pinned = folder / resolve_revision(repo, revision=revision, local_files_only=True).resolved
    except RevisionResolutionError:
        pinned = None
    if revision is not None:
        return [pinned] if pinned is not None and pinned.is_dir() else []
    others = sorted((p for p in folder.iterdir() if p.is_dir() and p != pinned), key=lambda p: p.stat().st_mtime,
                    reverse=True)
    return ([pinned] if pinned is not None and pinned.is_dir() else []) + others


def find_cached(name: HubName, revision: str | None = None) -> CachedModel | None:
    """The cached model `name` means (at `revision`, when given), or None; never touches the network."""
    for snapshot in _snapshots(name.repo, revision):
        files = model_files(_snapshot_files(snapshot), name.quant, snapshot)
        if files:
            return CachedModel(name, snapshot, tuple(files))
    return None


def _cache_info() -> HFCacheInfo | None:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        return scan_cache_dir()
    except CacheNotFound:  # nothing was ever downloaded
        return None


def _names_in(repo: str, files: list[str], snapshot: Path) -> list[HubName]:
    """The names that reach a model among a snapshot's files: `repo:TAG` for each GGUF model its tag picks, and
    `repo` for a default that no tag reaches (a safetensors checkpoint, a GGUF file without a tag)."""
    names = [HubName(repo, p.tag) for p in gguf_models(files) if p.tag and select_gguf(files, p.tag)[:1] == [p.path]]
    default = model_files(files, None, snapshot)
    if default and not any(select_gguf(files, name.quant) == default for name in names):
        names.append(HubName(repo))
    return names


def cached_models() -> list[CachedModel]:
    """Every model the cache holds that a name reaches, by name (each as `find_cached` resolves it)."""
    info = _cache_info()
    if info is None:
        return []
    found: dict[str, CachedModel] = {}
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        for revision in repo.revisions:
            files = _snapshot_files(revision.snapshot_path)
            for name in _names_in(repo.repo_id, files, revision.snapshot_path):
                if str(name) not in found and (model := find_cached(name)) is not None:
                    found[str(name)] = model
    return [found[key] for key in sorted(found, key=str.lower)]


def remove_cached(name: HubName) -> int:
    """Delete `name` from the cache through huggingface_hub's cache API and return the bytes freed: without a tag the
    whole repo (every revision); with one, that quantization's files, and their snapshot too when no other model
    is left in it. ModelNotPulledError when there is nothing to delete."""
    info = _cache_info()
    repo = next((r for r in info.repos if r.repo_type == "model" and r.repo_id == name.repo), None) if info else None
    model = find_cached(name) if name.quant is not None else None
    if repo is None or (name.quant is not None and model is None):
        raise ModelNotPulledError(f"{name} is not in the Hugging Face cache ({hub_cache_dir()})")
    if model is None:
        strategy = info.delete_revisions(*(r.commit_hash for r in repo.revisions))
    else:
        revision = next(r for r in repo.revisions if r.commit_hash == model.snapshot.name)
        left = [f for f in _snapshot_files(model.snapshot) if f not in model.files]
        if _names_in(name.repo, left, model.snapshot):
            files = [f for f in revision.files
                     if f.file_path.relative_to(revision.snapshot_path).as_posix() in model.files]
            strategy = info.delete_files(*files)
        else:
            strategy = info.delete_revisions(revision.commit_hash)
    strategy.execute()
    return strategy.expected_freed_size

