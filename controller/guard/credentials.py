"""The guard's two credentials, each from a mounted Secret file, compared in constant time.

Every non-empty line of a file is a valid credential (old and new overlap during a
rotation). The guard looks at the file again (its inode, size and modification time; a
Secret volume swaps a symlink) at most once per ``recheck_s``, and at once when a
credential matches nothing, and re-reads it when it changed: a rotated Secret takes effect
as soon as the volume has it, and a removed value stops working, without a restart.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from pathlib import Path

from controller.gateway.credentials import SecretFile, bearer

__all__ = ["Credential", "bearer"]

log = logging.getLogger(__name__)

_Stamp = tuple[int, int, int]


def _stamp(path: Path) -> _Stamp | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns)


class Credential:
    """The valid values of one credential: the lines of one file."""

    def __init__(self, path: Path, *, recheck_s: float) -> None:
        self._file = SecretFile(path)
        self._recheck_s = recheck_s
        self._checked_at = float("-inf")
        self._stamp: _Stamp | None = None
        self._lock = asyncio.Lock()

    @property
    def path(self) -> Path:
        return self._file.path

    async def load(self) -> None:
        """Read the file now (at start: a file that cannot be read stops the guard)."""
        stamp = await asyncio.to_thread(_stamp, self._file.path)
        await self._file.load()
        if not self._file.lines:
            raise OSError(f"{self._file.path} holds no credential")
        self._stamp, self._checked_at = stamp, time.monotonic()

    def _matches(self, given: str) -> bool:
        wanted = given.encode()
        found = False
        for line in self._file.lines:
            found |= hmac.compare_digest(wanted, line.encode())  # look at every line
        return found

    async def _refresh(self, *, force: bool) -> None:
        async with self._lock:
            if not force and time.monotonic() - self._checked_at < self._recheck_s:
                return
            self._checked_at = time.monotonic()
            stamp = await asyncio.to_thread(_stamp, self._file.path)
            if stamp is None or stamp == self._stamp:
                return
            try:
                await self._file.load()
            except OSError as exc:
                log.warning("cannot re-read a credential file; keeping the values it had",
                            extra={"path": str(self._file.path), "error": str(exc)[:200]})
                return
            self._stamp = stamp
            log.info("credential file re-read", extra={"path": str(self._file.path),
                                                       "values": len(self._file.lines)})

    async def accepts(self, given: str | None) -> bool:
        """True when ``given`` is one of the file's values as it is now."""
        if not given:
            return False
        await self._refresh(force=False)
        if self._matches(given):
            return True
        await self._refresh(force=True)
        return self._matches(given)
