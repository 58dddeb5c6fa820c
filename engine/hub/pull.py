"""`download`: download a model named `owner/repo[:QUANT]` into the Hugging Face cache, through huggingface_hub.

The revision is resolved once to a commit (and remembered under `refs/`, so the name resolves offline later); the
repo's file list with its checksums comes from the model info; the files the name means are chosen by the rules of
`engine.hub.names` (a GGUF quantization, or a safetensors checkpoint's config, tokenizer and weights; a repo with
only PyTorch `.bin` weights is refused, and a checkpoint's config is read before its weights, so that an
architecture the engine does not run is refused before gigabytes move) and fetched by `snapshot_download`, which
shows its progress bars (bytes and rate) on a terminal, resumes a dropped connection from where it stopped, and
keeps the files already there. huggingface_hub checks sizes only, so each newly downloaded file is then checked
against the Hub's checksum (an LFS file's sha256, another file's git blob hash); a mismatch deletes it.

`HF_TOKEN` (or `hf auth login`) opens gated and private repos, `HF_ENDPOINT` points at a mirror, `HF_HOME` moves
the cache: huggingface_hub reads them itself.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.config import config_from_hf
from engine.errors import ModelDownloadError, UnsupportedModelError
from engine.hub.cache import CachedModel, find_cached
from engine.hub.names import (CONFIG_FILE, INDEX_FILE, HubName, gguf_models, gguf_quants, has_torch_bin,
                              safetensors_files, select_gguf)


def _silent(message: str) -> None:
    """The default: nobody is told."""


def download(name: HubName, revision: str | None = None, say: Callable[[str], None] = _silent) -> CachedModel:
    """Download what `name` means at `revision` (default: the repo's main branch) unless the cache has it, verify
    it, and return it as the cache holds it; ModelDownloadError (or UnsupportedModelError) saying why not."""
    from huggingface_hub import HfApi

    api = HfApi(library_name="emberserve")
    with _hub_errors(name, revision):
        pull = _Pull(api, name, api.resolve_revision(name.repo, revision=revision))
        wanted = pull.choose()
        new = [f for f in wanted if f not in pull.cached]
        size = sum(pull.remote[f].size or 0 for f in new)
        say(f"{name}: {len(wanted)} file(s) at {revision or 'main'} ({pull.commit[:12]}), {len(new)} to download "
            f"({_mib(size)})")
        started = time.monotonic()
        folder = Path(api.snapshot_download(name.repo, revision=pull.revision, allow_patterns=wanted,
                                            tqdm_class=_bars()))
        elapsed = time.monotonic() - started
        if new:
            say(f"{name}: downloaded {_mib(size)} in {elapsed:.1f} s ({_mib(size / max(elapsed, 1e-9))}/s); "
                "verifying checksums")
        for filename in wanted:
            pull.check(folder / filename, filename)
    model = find_cached(name, pull.commit)
    if model is None:  # the files are there, as the Hub listed them: only a broken cache could get here
        raise ModelDownloadError(f"{name}: downloaded, but not found in the cache at {folder}")
    return model


def _bars() -> type:
    """huggingface_hub's progress bars (shown on a terminal) in tqdm's own layout, whose byte bars show the rate
    and the time left as well: huggingface_hub's layout shows a rate only for Xet downloads."""
    from huggingface_hub.utils import tqdm

    class Bars(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("bar_format", None)
            super().__init__(*args, **kwargs)

    return Bars


class _Pull:
    """One pull: the repo at the commit its revision resolved to, its files with the Hub's checksums, which of them
    the cache held before it began (those were checked when they came), and which it has checked since."""

    def __init__(self, api: Any, name: HubName, revision: Any) -> None:
        from huggingface_hub import try_to_load_from_cache

        self.api, self.name, self.revision, self.commit = api, name, revision, revision.resolved
        info = api.model_info(name.repo, revision=self.commit, files_metadata=True)
        self.remote = {s.rfilename: s for s in info.siblings or ()}
        self.cached = {f for f in self.remote
                       if isinstance(try_to_load_from_cache(name.repo, f, revision=self.commit), str)}
        self._checked: set[str] = set()

    def choose(self) -> list[str]:
        """The repo files the name means, or ModelDownloadError / UnsupportedModelError saying why there are none."""
        name, files = self.name, list(self.remote)
        if gguf_models(files):
            chosen = select_gguf(files, name.quant)
            if not chosen:
                raise ModelDownloadError(f"{name.repo} has no {name.quant} GGUF file; its quantizations: "
                                         f"{', '.join(gguf_quants(files)) or 'none tagged in the file names'}")
            return chosen
        if name.quant is not None:
            hint = f"; `{name.repo}` is its safetensors checkpoint" if safetensors_files(files) else ""
            raise ModelDownloadError(f"{name.repo} has no GGUF files, so no quantization {name.quant}{hint}")
        shards = self._read_json(INDEX_FILE).get("weight_map", {}).values() if INDEX_FILE in files else None
        wanted = safetensors_files(files, shards)
        if wanted:
            try:
                config_from_hf(self._read_json(CONFIG_FILE))
            except UnsupportedModelError as e:
                raise UnsupportedModelError(f"{name.repo}: {e}") from None
            return wanted
        if has_torch_bin(files):
            raise ModelDownloadError(f"{name.repo} has only PyTorch .bin weights (pytorch_model*.bin), which "
                                     "emberserve does not load: choose a repo with safetensors or GGUF files")
        raise ModelDownloadError(f"{name.repo} has no GGUF model file and no safetensors weights with a config.json")

    def _read_json(self, filename: str) -> dict[str, Any]:
        """A small JSON file of the repo (a config, an index), downloaded into the cache and checked first: it is
        part of what is pulled."""
        path = Path(self.api.hf_hub_download(self.name.repo, filename, revision=self.commit))
        self.check(path, filename)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelDownloadError(f"{self.name.repo}: cannot read {filename}: {e}") from None
        if not isinstance(data, dict):
            raise ModelDownloadError(f"{self.name.repo}: {filename} is not a JSON object")
        return data

    def check(self, path: Path, filename: str) -> None:
        """A file that came in this pull against the Hub's checksum (an LFS file's sha256, another's git blob hash);
        one that does not match is deleted (its blob too) and refused."""
        from huggingface_hub.utils.sha import git_hash, sha_fileobj

        sibling = self.remote[filename]
        if filename in self.cached or filename in self._checked:
            return
        if sibling.lfs is not None:
            algorithm, expected = "sha256", sibling.lfs.sha256
            with open(path, "rb") as f:
                actual = sha_fileobj(f).hex()
        elif sibling.blob_id:
            algorithm, expected, actual = "git blob hash", sibling.blob_id, git_hash(path.read_bytes())
        else:
            return
        if actual != expected:
            blob = Path(os.path.normpath(path.parent / os.readlink(path))) if path.is_symlink() else None
            path.unlink()
            if blob is not None:
                blob.unlink(missing_ok=True)
            raise ModelDownloadError(f"{self.name.repo}: {filename} does not match the Hub's {algorithm} "
                                     f"(expected {expected}, got {actual}): the download is deleted; pull again")
        self._checked.add(filename)


@contextmanager
def _hub_errors(name: HubName, revision: str | None) -> Iterator[None]:
    """huggingface_hub's exceptions as one-line ModelDownloadErrors that say what to do."""
    import httpx2
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    access = (f"set HF_TOKEN to a token of an account that has access to {name.repo} (accept its conditions on "
              f"{constants.ENDPOINT}/{name.repo})")
    if get_token() is not None:
        access = f"HF_TOKEN is set, but its account has no access to {name.repo}: accept its conditions on " \
                 f"{constants.ENDPOINT}/{name.repo}"
    try:
        yield
    except GatedRepoError:
        raise ModelDownloadError(f"{name.repo} is a gated repo: {access}") from None
    except RevisionNotFoundError:
        raise ModelDownloadError(f"{name.repo} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise ModelDownloadError(f"no model repo {name.repo} on {constants.ENDPOINT} (a private one needs HF_TOKEN)"
                                 ) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):
            raise ModelDownloadError(f"{name.repo}: access refused (HTTP {status}): {access}") from None
        raise ModelDownloadError(f"{name.repo}: the Hub answered HTTP {status}: {str(e).splitlines()[0]}") from None
    except (OfflineModeIsEnabled, LocalEntryNotFoundError, httpx2.TransportError) as e:
        if constants.HF_HUB_OFFLINE:
            raise ModelDownloadError(f"{name}: HF_HUB_OFFLINE is set, and pulling needs the network") from None
        raise ModelDownloadError(f"cannot reach the Hugging Face Hub at {constants.ENDPOINT} ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else 'no answer'}); HF_ENDPOINT sets a mirror"
                                 ) from None
    except OSError as e:  # a download that ended short of its size (huggingface_hub's consistency check), the disk
        raise ModelDownloadError(f"{name}: {str(e).splitlines()[0]}") from None


def _mib(size: float) -> str:
    return f"{size / (1 << 20):.1f} MiB"
