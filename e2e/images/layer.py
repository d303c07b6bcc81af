"""A directory as an OCI layer: an uncompressed tar with overlayfs whiteouts converted.

Layers above the first are built as overlayfs upper directories, where a deleted file is a
character device 0:0 and a directory that hides its lower contents carries the
``trusted.overlay.opaque`` attribute. The OCI layer format says the same with ``.wh.<name>``
files and a ``.wh..wh..opq`` file; :func:`tar_directory` writes those. Modification times
are kept: compiled Python files record their source's time.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from pathlib import Path

from pydantic import BaseModel

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


class LayerInfo(BaseModel):
    """What the OCI manifest and config need to know of a layer tar."""

    path: Path
    digest: str
    """sha256:<hex> of the tar (uncompressed, so it is also the diff id)."""
    size: int


def _is_whiteout(info: os.stat_result) -> bool:
    return stat.S_ISCHR(info.st_mode) and info.st_rdev == 0


def _is_opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, "trusted.overlay.opaque", follow_symlinks=False) == b"y"
    except OSError:
        return False


def _entry(tar: tarfile.TarFile, path: Path, name: str) -> None:
    info = tar.gettarinfo(str(path), arcname=name)
    info.uname = info.gname = ""
    if info.isreg():
        with path.open("rb") as handle:
            tar.addfile(info, handle)
    else:
        tar.addfile(info)


def tar_directory(root: Path, dest: Path) -> LayerInfo:
    """Write ``root``'s tree to ``dest`` as a layer tar (written to a temp file, renamed)."""
    temp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    with tarfile.open(temp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            here = Path(dirpath)
            rel = here.relative_to(root)
            if rel != Path("."):
                _entry(tar, here, rel.as_posix())
                if _is_opaque(here):
                    tar.addfile(tarfile.TarInfo(f"{rel.as_posix()}/{OPAQUE}"))
            for name in sorted(filenames + [d for d in dirnames
                                            if (here / d).is_symlink()]):
                path = here / name
                arc = (rel / name).as_posix()
                info = path.lstat()
                if _is_whiteout(info):
                    tar.addfile(tarfile.TarInfo((rel / f"{WHITEOUT}{name}").as_posix()))
                elif stat.S_ISSOCK(info.st_mode) or stat.S_ISFIFO(info.st_mode):
                    continue
                else:
                    _entry(tar, path, arc)
            dirnames[:] = [d for d in dirnames if not (here / d).is_symlink()]
    digest = file_digest(temp)
    size = temp.stat().st_size
    os.replace(temp, dest)
    return LayerInfo(path=dest, digest=digest, size=size)


def file_digest(path: Path) -> str:
    """``sha256:<hex>`` of a file's bytes."""
    sha = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            sha.update(chunk)
    return f"sha256:{sha.hexdigest()}"
