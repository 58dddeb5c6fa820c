"""A Hugging Face Hub on 127.0.0.1 for the tests: the endpoints huggingface_hub calls to resolve a revision, list
a repo with its checksums and download files, answered from files in memory by a thread. Point the code under test
at it with `HF_ENDPOINT=hub.url` (and a fresh `HF_HOME`).

    with FakeHub({"tiny/llama-GGUF": {"tiny-Q8_0.gguf": path, "README.md": b"..."}}, gated={"tiny/gated"}) as hub:
        hub.cut_once("tiny/llama-GGUF", "tiny-Q8_0.gguf")  # its next GET stops half-way and drops the connection
        hub.corrupt("tiny/llama-GGUF", "tiny-Q8_0.gguf")   # served with one byte changed, listed with true checksums
        hub.requests                                       # [(method, path, Range header or None), ...]

What it answers, as the Hub does (huggingface_hub 2.4.0: hf_api.py `repo_info`/`model_info`/`list_repo_tree`,
file_download.py `get_hf_file_metadata`/`http_get`):
- GET /api/models/{repo}[/revision/{rev}] (`?blobs=true`: each file's size, git blob id and LFS sha256): the repo's
  commit (`sha`) and its files (`siblings`);
- GET /api/models/{repo}/tree/{rev}[/{path}]: the files as tree entries (`oid`, `size`, `lfs`);
- HEAD and GET /{repo}/resolve/{rev}/{path}: `X-Repo-Commit`, `ETag` (the git blob id, or for an LFS file the
  sha256, also as `X-Linked-Etag` with `X-Linked-Size`), the bytes, `Range: bytes=N-` answered 206.
Weights (.gguf, .safetensors, .bin) are LFS files, others plain git files. A gated repo's files answer 401 with
`X-Error-Code: GatedRepo` without `Authorization: Bearer <token>`; its metadata is public, as on the Hub. An unknown
repo, revision or file is a 404 with `X-Error-Code` RepoNotFound, RevisionNotFound or EntryNotFound.
"""
from __future__ import annotations

import hashlib
import json
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

TOKEN = "hf_fake_token_for_the_tests"
_LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")


@dataclass(frozen=True)
class HubFile:
    path: str
    data: bytes

    @property
    def lfs(self) -> bool:
        return self.path.endswith(_LFS_SUFFIXES)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def blob_id(self) -> str:
        """git's blob hash (`git hash-object`)."""
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.blob_id

    def tree_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "path": self.path, "size": len(self.data), "oid": self.blob_id}
        if self.lfs:
            entry["lfs"] = {"oid": self.sha256, "size": len(self.data), "pointerSize": 134}
        return entry

    def sibling(self, blobs: bool) -> dict[str, Any]:
        entry: dict[str, Any] = {"rfilename": self.path}
        if blobs:
            entry |= {"size": len(self.data), "blobId": self.blob_id}
            if self.lfs:
                entry["lfs"] = {"sha256": self.sha256, "size": len(self.data), "pointerSize": 134}
        return entry


class Repo:
    def __init__(self, repo_id: str, files: dict[str, bytes | Path], gated: bool) -> None:
        self.id = repo_id
        self.files = {name: HubFile(name, data if isinstance(data, bytes) else Path(data).read_bytes())
                      for name, data in sorted(files.items())}
        self.gated = gated
        digest = hashlib.sha1(repo_id.encode())
        for file in self.files.values():
            digest.update(f"{file.path}:{file.etag}".encode())
        self.commit = digest.hexdigest()


class FakeHub:
    """The loopback Hub; a context manager that starts and stops it."""

    def __init__(self, repos: dict[str, dict[str, bytes | Path]], gated: set[str] = frozenset()) -> None:
        self.repos = {repo_id: Repo(repo_id, files, repo_id in gated) for repo_id, files in repos.items()}
        self.requests: list[tuple[str, str, str | None]] = []
        self._cut: set[tuple[str, str]] = set()
        self._corrupt: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.hub = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def file(self, repo_id: str, path: str) -> HubFile:
        return self.repos[repo_id].files[path]

    def cut_once(self, repo_id: str, path: str) -> None:
        """The next GET of this file sends its headers and half its bytes, then closes the connection."""
        with self._lock:
            self._cut.add((repo_id, path))

    def corrupt(self, repo_id: str, path: str, on: bool = True) -> None:
        """Serve this file with its first byte changed (same size), while listing its true checksums."""
        with self._lock:
            (self._corrupt.add if on else self._corrupt.discard)((repo_id, path))

    def reset(self) -> None:
        with self._lock:
            self._cut.clear()
            self._corrupt.clear()
            self.requests.clear()

    def _take_cut(self, key: tuple[str, str]) -> bool:
        with self._lock:
            if key in self._cut:
                self._cut.discard(key)
                return True
            return False

    def _is_corrupt(self, key: tuple[str, str]) -> bool:
        with self._lock:
            return key in self._corrupt


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the tests read `hub.requests`
        pass

    @property
    def hub(self) -> FakeHub:
        return self.server.hub

    def do_GET(self) -> None:
        self._route(body=True)

    def do_HEAD(self) -> None:
        self._route(body=False)

    # ---- answers ----
    def _send(self, status: int, headers: dict[str, str], body: bytes = b"", send_body: bool = True) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", headers.get("Content-Length", str(len(body))))
        self.end_headers()
        if send_body and body:
            self.wfile.write(body)

    def _json(self, data: Any, send_body: bool) -> None:
        self._send(200, {"Content-Type": "application/json"}, json.dumps(data).encode(), send_body)

    def _error(self, status: int, code: str, message: str, send_body: bool, commit: str | None = None) -> None:
        headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}
        if commit is not None:
            headers["X-Repo-Commit"] = commit
        self._send(status, headers, json.dumps({"error": message}).encode(), send_body)

    # ---- routes ----
    def _route(self, body: bool) -> None:
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        self.hub.requests.append((self.command, unquote(url.path), self.headers.get("Range")))
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo = self._repo("/".join(parts[2:4]), body)
            if repo is None:
                return
            rest = parts[4:]
            if not rest or rest[0] == "revision":
                if self._revision(repo, rest[1] if len(rest) > 1 else "main", body):
                    blobs = "blobs=true" in url.query.lower() or "blobs=1" in url.query
                    self._json({"id": repo.id, "modelId": repo.id, "sha": repo.commit, "private": False,
                                "gated": "manual" if repo.gated else False,
                                "siblings": [f.sibling(blobs) for f in repo.files.values()]}, body)
                return
            if rest[0] == "tree" and len(rest) >= 2:
                if self._revision(repo, rest[1], body):
                    under = "/".join(rest[2:])
                    entries = [f.tree_entry() for f in repo.files.values()
                               if not under or f.path.startswith(under + "/")]
                    self._json(entries, body)
                return
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo = self._repo("/".join(parts[:2]), body)
            if repo is not None and self._revision(repo, parts[3], body):
                self._resolve(repo, "/".join(parts[4:]), body)
            return
        self._error(404, "NotFound", f"no route {url.path}", body)

    def _repo(self, repo_id: str, body: bool) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository Not Found for {repo_id}", body)
        return repo

    def _revision(self, repo: Repo, revision: str, body: bool) -> bool:
        if revision in ("main", repo.commit):
            return True
        self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", body)
        return False

    def _resolve(self, repo: Repo, path: str, body: bool) -> None:
        if repo.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._error(401, "GatedRepo", f"Access to model {repo.id} is restricted. You must have access to it and "
                                          "be authenticated to access it.", body)
            return
        file = repo.files.get(path)
        if file is None:
            self._error(404, "EntryNotFound", f"{path} does not exist on main", body, commit=repo.commit)
            return
        data = file.data
        if self.hub._is_corrupt((repo.id, path)):
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{file.etag}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if file.lfs:
            headers |= {"X-Linked-Etag": f'"{file.sha256}"', "X-Linked-Size": str(len(data))}
        start = _range_start(self.headers.get("Range"))
        if not body:
            self._send(200, headers | {"Content-Length": str(len(data))}, send_body=False)
            return
        status = 200
        if start:
            status = 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            data = data[start:]
        if self.hub._take_cut((repo.id, path)):
            self._send(status, headers | {"Content-Length": str(len(data))}, send_body=False)
            self.wfile.write(data[:len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self._send(status, headers, data)


def _range_start(header: str | None) -> int:
    """N of `Range: bytes=N-` (the only form huggingface_hub sends), 0 without one."""
    if not header or not header.startswith("bytes="):
        return 0
    return int(header[len("bytes="):].split("-")[0] or 0)


# ---- the suite's repos ----

GGUF_REPO, SAFETENSORS_REPO, GATED_REPO = "tiny/llama-GGUF", "tiny/llama", "tiny/gated-GGUF"
BIN_REPO, UNSUPPORTED_REPO = "tiny/bin-only", "tiny/mamba"


def tiny_repos(tiny: Any, root: Path) -> dict[str, dict[str, bytes | Path]]:
    """Repos made of a tiny model (tests/support/tiny_models.py), written under `root`: a GGUF repo with a Q8_0
    file and a Q4_0 one split in three (no Q4_K_M, so its default is Q8_0), the safetensors checkpoint with a
    PyTorch copy and an ONNX export beside it (neither to be fetched), the GGUF file again in a gated repo, a repo
    with only `pytorch_model.bin`, and a checkpoint of an architecture the engine does not run."""
    from tests.support.tiny_models import write_gguf

    root.mkdir(parents=True, exist_ok=True)
    q8 = write_gguf(tiny, "Q8_0", root / "tiny-llama-Q8_0.gguf")
    (root / "split").mkdir(exist_ok=True)
    first = write_gguf(tiny, "Q4_0", root / "split" / "tiny-llama-Q4_0.gguf", split_max_tensors=8)
    parts = {p.name: p for p in sorted(first.parent.glob("tiny-llama-Q4_0-*-of-*.gguf"))}
    checkpoint = {p.name: p for p in sorted(tiny.safetensors_dir.iterdir()) if p.is_file()}
    readme = b"# a tiny model for the tests\n"
    return {
        GGUF_REPO: {"README.md": readme, q8.name: q8, **parts},
        SAFETENSORS_REPO: {**checkpoint, "README.md": readme, "pytorch_model.bin": b"\x80\x02pickled" * 64,
                           "onnx/model.onnx": b"onnx" * 64},
        GATED_REPO: {q8.name: q8},
        BIN_REPO: {"config.json": checkpoint["config.json"], "pytorch_model.bin": b"\x80\x02pickled" * 64},
        UNSUPPORTED_REPO: {"config.json": json.dumps({"model_type": "mamba", "hidden_size": 8}).encode(),
                           "model.safetensors": b"\x08" + b"\x00" * 7 + b"{}" + b" " * 6},
    }
