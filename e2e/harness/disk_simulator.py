"""A disk that fails the way real ones do, for the driver's ledger and CDI specs.

:class:`DiskSimulator` is a :class:`driver.disk.Disk` over the real file system that can

- fail the N-th call with a real ``OSError``: ``ENOSPC`` where a full disk raises it
  (mkdir, create, write, fsync, rename, close) and ``EIO`` at any file call;
- fail calls at random with a rate, once or from then on ("the disk is full");
- crash: from the N-th call on every call raises :class:`SimulatedCrash` (a
  ``BaseException``, so no ``except Exception`` handler runs) and the simulator's open
  descriptors are closed, as the kernel does for a killed process, which frees its locks;
- hand a free ``flock`` to the newest waiter first (the kernel promises no order, and a
  newer waiter, polling with a shorter delay, often does win);
- write at most ``max_write`` bytes per ``write`` call, so whole-file writes take several.

Calls are counted and recorded (``calls``), and ``on_call`` runs before each one.
"""

from __future__ import annotations

import errno as errno_codes
import os
import random
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from driver.disk import Disk

__all__ = ["ENOSPC_CALLS", "FILE_CALLS", "DiskSimulator", "SimulatedCrash"]

FILE_CALLS = frozenset({"read_bytes", "list_files", "makedirs", "create", "write", "fchmod",
                        "fsync", "close", "replace", "unlink", "open_dir"})
"""Calls that can fail with EIO (the lock calls never fail here)."""
ENOSPC_CALLS = frozenset({"makedirs", "create", "write", "fsync", "replace", "close"})
"""Calls a full disk fails with ENOSPC."""


class SimulatedCrash(BaseException):
    """The process died at this call: nothing after it reaches the disk."""


@dataclass
class _Fault:
    error: int
    at: int | None = None  # the N-th eligible call (0-based) fails
    rate: float = 0.0
    sticky: bool = False  # once failed, every later eligible call fails too
    tripped: bool = False


def _eligible(call: str, error: int) -> bool:
    return call in (ENOSPC_CALLS if error == errno_codes.ENOSPC else FILE_CALLS)


class DiskSimulator(Disk):
    """See the module docstring. Thread-safe: the driver calls it from worker threads."""

    def __init__(self, *, rng: random.Random | None = None, max_write: int = 1024) -> None:
        self.rng = rng or random.Random(0)
        self.max_write = max_write
        self.calls: list[tuple[str, str]] = []
        self.on_call: Callable[[int, str], None] | None = None
        self.failures: list[tuple[str, str, int]] = []
        self._mutex = threading.Lock()
        self._faults: list[_Fault] = []
        self._eligible_counts: dict[int, int] = {}
        self._crash_at: int | None = None
        self._crashed = False
        self._fds: set[int] = set()
        self._lock_fds: set[int] = set()
        self._waiters: dict[int, int] = {}
        self._arrivals = 0

    # -- configuration -----------------------------------------------------------------

    def fail_at(self, index: int, error: int, *, sticky: bool = False) -> None:
        """Fail the ``index``-th call (0-based) among those that can raise ``error``."""
        self._faults.append(_Fault(error=error, at=index, sticky=sticky))

    def fail_randomly(self, rate: float, errors: Collection[int] = (errno_codes.ENOSPC,
                                                                  errno_codes.EIO)) -> None:
        """Fail each eligible call with probability ``rate``, with one of ``errors``."""
        for error in errors:
            self._faults.append(_Fault(error=error, rate=rate / len(errors)))

    def crash_at(self, index: int) -> None:
        """Die at the ``index``-th call (0-based, counting every call)."""
        self._crash_at = index

    def heal(self) -> None:
        """No more faults (a crash already happened stays)."""
        self._faults.clear()

    @property
    def crashed(self) -> bool:
        return self._crashed

    @property
    def lock_waiters(self) -> int:
        """Lock descriptors waiting for the lock right now."""
        with self._mutex:
            return len(self._waiters)

    @property
    def open_locks(self) -> int:
        """Lock descriptors opened and not closed yet (callers inside ``file_lock``)."""
        with self._mutex:
            return len(self._lock_fds)

    def count(self, error: int | None = None) -> int:
        """Calls made so far (only those that could raise ``error``, when given)."""
        with self._mutex:
            return sum(1 for call, _ in self.calls if error is None or _eligible(call, error))

    # -- the gate every call passes ------------------------------------------------------

    def _enter(self, call: str, path: object, *, lock_call: bool = False) -> None:
        hook = self.on_call
        with self._mutex:
            index = len(self.calls)
            self.calls.append((call, str(path)))
        if hook is not None:
            hook(index, call)
        with self._mutex:
            if self._crashed or (self._crash_at is not None and index >= self._crash_at):
                self._die()
                raise SimulatedCrash(f"crashed at call {index} ({call} {path})")
            if lock_call:
                return
            for fault in self._faults:
                if not _eligible(call, fault.error):
                    continue
                seen = self._eligible_counts.get(fault.error, 0)
                fail = (fault.tripped and fault.sticky) or seen == fault.at or (
                    fault.rate > 0 and self.rng.random() < fault.rate)
                if fail:
                    fault.tripped = True
                    self._count_eligible(call)
                    self.failures.append((call, str(path), fault.error))
                    raise OSError(fault.error, os.strerror(fault.error), str(path))
            self._count_eligible(call)

    def _count_eligible(self, call: str) -> None:
        for error in {f.error for f in self._faults} | {errno_codes.ENOSPC, errno_codes.EIO}:
            if _eligible(call, error):
                self._eligible_counts[error] = self._eligible_counts.get(error, 0) + 1

    def _die(self) -> None:
        if self._crashed:
            return
        self._crashed = True
        for fd in self._fds:  # the kernel closes a dead process's files (and frees flocks)
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        self._lock_fds.clear()
        self._waiters.clear()

    def _opened(self, fd: int, *, lock: bool = False) -> int:
        with self._mutex:
            self._fds.add(fd)
            if lock:
                self._lock_fds.add(fd)
        return fd

    # -- Disk ----------------------------------------------------------------------------

    def read_bytes(self, path: Path) -> bytes:
        self._enter("read_bytes", path)
        return super().read_bytes(path)

    def list_files(self, directory: Path) -> list[str]:
        self._enter("list_files", directory)
        return super().list_files(directory)

    def makedirs(self, directory: Path) -> None:
        self._enter("makedirs", directory)
        super().makedirs(directory)

    def create(self, path: Path, mode: int) -> int:
        self._enter("create", path)
        return self._opened(super().create(path, mode))

    def write(self, fd: int, data: bytes) -> int:
        self._enter("write", fd)
        return super().write(fd, data[:self.max_write])

    def fchmod(self, fd: int, mode: int) -> None:
        self._enter("fchmod", fd)
        super().fchmod(fd, mode)

    def fsync(self, fd: int) -> None:
        self._enter("fsync", fd)
        super().fsync(fd)

    def close(self, fd: int) -> None:
        with self._mutex:
            lock = fd in self._lock_fds
        try:
            # Lock files are opened and closed by file_lock; only data files fail here.
            self._enter("close_lock" if lock else "close", fd, lock_call=lock)
        finally:
            # close() frees the descriptor even when it reports an error.
            with self._mutex:
                owned = fd in self._fds  # not when a crash already closed it
                self._fds.discard(fd)
                self._lock_fds.discard(fd)
                self._waiters.pop(fd, None)
            if owned:
                super().close(fd)

    def replace(self, source: Path, target: Path) -> None:
        self._enter("replace", target)
        super().replace(source, target)

    def unlink(self, path: Path) -> None:
        self._enter("unlink", path)
        super().unlink(path)

    def open_dir(self, directory: Path) -> int:
        self._enter("open_dir", directory)
        return self._opened(super().open_dir(directory))

    def open_lock(self, path: Path) -> int:
        self._enter("open_lock", path, lock_call=True)
        return self._opened(super().open_lock(path), lock=True)

    def try_lock(self, fd: int) -> bool:
        self._enter("try_lock", fd, lock_call=True)
        with self._mutex:
            if fd not in self._waiters:
                self._arrivals += 1
                self._waiters[fd] = self._arrivals
            mine = self._waiters[fd]
            if any(arrival > mine for arrival in self._waiters.values()):
                return False  # a newer waiter goes first
            got = super().try_lock(fd)
            if got:
                del self._waiters[fd]
            return got

    def unlock(self, fd: int) -> None:
        self._enter("unlock", fd, lock_call=True)
        super().unlock(fd)
