"""Where built layers and archives are kept, and the content keys they are kept under.

Everything lives under ``${ROTA_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/rota}/images``:
``layers/<key>/`` (a layer's tree, its tar and a small JSON of facts), ``archives/`` (the OCI
archives containerd imports), ``apt/`` (downloaded Debian packages) and ``wheels/<key>/``.
A key is the sha256 of everything that decides a layer's content, so a layer is rebuilt
exactly when one of those inputs changes. Builders take a file lock per entry: parallel
test sessions share the cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("ROTA_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rota")
    return Path(base) / "images"


def content_key(*parts: object) -> str:
    """A stable hex digest of JSON-serialisable parts."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def tree_key(root: Path, relative: Iterable[str]) -> str:
    """The sha256 of the files under ``root`` named by ``relative`` (files or directories,
    walked in sorted order; ``__pycache__`` and ``*.pyc`` skipped): paths, modes and bytes."""
    digest = hashlib.sha256()
    for name in sorted(relative):
        path = root / name
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for file in files:
            if "__pycache__" in file.parts or file.suffix == ".pyc":
                continue
            rel = file.relative_to(root).as_posix()
            digest.update(f"{rel}\0{file.stat().st_mode & 0o111:o}\0".encode())
            digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
