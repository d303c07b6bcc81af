"""The driver's door to the files it must not lose: the ledger, CDI specs and the node lock.

Every file operation the ledger and the CDI specs need is one method of :class:`Disk`, and
each method is one system call, so that what a full or failing disk does (``ENOSPC``,
``EIO`` at any write, fsync, rename or unlink) can be reproduced call by call: a
simulator subclass fails the N-th call with a real ``OSError`` and the code above runs
unchanged. :data:`OS_DISK` is the real one.

:func:`atomic_write` replaces a file so that a crash or an error leaves the old or the new
content, never a mix: temp file in the same directory (``.<name>.<random>.tmp``), write,
fsync, rename over the file, fsync the directory. An error before the rename is raised and
leaves the old content. Once the rename is done the new content is what every reader sees
for the rest of the boot, which is all the driver's state needs (the ledger belongs to one
boot, and the kubelet prepares everything again after a reboot), so a failing directory
fsync after it is logged, not raised: a write reported failed never took effect.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
from pathlib import Path

__all__ = ["OS_DISK", "Disk", "atomic_write", "fsync_dir", "remove_temp_files", "temp_name"]

log = logging.getLogger(__name__)


class Disk:
    """File operations on durable state, one system call per method."""

    def read_bytes(self, path: Path) -> bytes:
        """The whole content of a file; FileNotFoundError when it does not exist."""
        return path.read_bytes()

    def list_files(self, directory: Path) -> list[str]:
        """The names of the regular files in a directory; FileNotFoundError when it does
        not exist."""
        with os.scandir(directory) as entries:
            return [entry.name for entry in entries if entry.is_file(follow_symlinks=False)]

    def makedirs(self, directory: Path) -> None:
        """Create a directory and its parents (nothing when it exists)."""
        directory.mkdir(parents=True, exist_ok=True)

    def create(self, path: Path, mode: int) -> int:
        """Create a new file for writing (never an existing one); return its descriptor."""
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)

    def write(self, fd: int, data: bytes) -> int:
        """Write some of ``data``; return how many bytes were written."""
        return os.write(fd, data)

    def fchmod(self, fd: int, mode: int) -> None:
        os.fchmod(fd, mode)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def replace(self, source: Path, target: Path) -> None:
        """Rename ``source`` over ``target`` atomically."""
        os.replace(source, target)

    def unlink(self, path: Path) -> None:
        """Remove a file; FileNotFoundError when it does not exist."""
        path.unlink()

    def open_dir(self, directory: Path) -> int:
        """Open a directory (to fsync its entries)."""
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def open_lock(self, path: Path) -> int:
        """Open (create) a lock file."""
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def try_lock(self, fd: int) -> bool:
        """Take an exclusive ``flock`` without waiting; False when another holder has it."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            # EACCES: some file systems answer a held lock so.
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def unlock(self, fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)


OS_DISK = Disk()
"""The real disk."""


def temp_name(path: Path) -> Path:
    """A fresh temp-file path next to ``path``, ignored by readers of ``*.json`` files."""
    return path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")


def fsync_dir(directory: Path, disk: Disk = OS_DISK) -> None:
    """Flush a directory's entries (a rename or unlink in it) to disk."""
    fd = disk.open_dir(directory)
    try:
        disk.fsync(fd)
    finally:
        disk.close(fd)


def _write_all(disk: Disk, fd: int, content: bytes) -> None:
    view = memoryview(content)
    while view:
        view = view[disk.write(fd, view.tobytes()):]


def atomic_write(path: Path, content: bytes, *, mode: int = 0o600,
                 disk: Disk = OS_DISK) -> None:
    """Replace ``path`` with ``content`` so that a crash leaves the old or the new file.

    On failure the temp file is removed (best effort) and ``path`` is unchanged. Once the
    rename is done the write counts as done: a failure of the final directory fsync is
    logged (see the module docstring).

    Raises:
        OSError: a call of the disk failed before the rename.
    """
    temp = temp_name(path)
    fd = disk.create(temp, mode)
    try:
        try:
            _write_all(disk, fd, content)
            disk.fchmod(fd, mode)
            disk.fsync(fd)
        finally:
            disk.close(fd)
        disk.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            disk.unlink(temp)
        raise
    try:
        fsync_dir(path.parent, disk)
    except OSError as exc:
        log.warning("renamed a file in place but could not flush its directory; it stays "
                    "in place for this boot", extra={"path": str(path), "error": str(exc)})


def remove_temp_files(path: Path, disk: Disk = OS_DISK) -> int:
    """Delete temp files a crashed :func:`atomic_write` of ``path`` left; return how many."""
    prefix, removed = f".{path.name}.", 0
    try:
        names = disk.list_files(path.parent)
    except FileNotFoundError:
        return 0
    for name in names:
        if name.startswith(prefix) and name.endswith(".tmp"):
            with contextlib.suppress(FileNotFoundError):
                disk.unlink(path.parent / name)
                removed += 1
    return removed
