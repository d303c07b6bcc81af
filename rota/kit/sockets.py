"""Unix-socket gRPC servers: stale sockets removed, permissions tightened, clean stop.

A socket file left by a crashed predecessor would make ``bind`` fail, so it is removed
first (only if it is a socket: never a regular file someone put there). The kubelet
treats removing a registration socket as deregistration, so a stopping server removes
its own sockets and nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from rota.kit.errors import ConfigError

log = logging.getLogger(__name__)

UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL


def prepare_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise ConfigError(f"socket path {path} is longer than {UNIX_PATH_MAX} bytes")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"{path} exists and is not a socket; refusing to remove it")
    path.unlink()
    log.info("removed stale socket", extra={"socket": str(path)})


class UnixServer:
    """A grpc.aio server listening on one unix socket."""

    def __init__(self, path: Path, handlers: Sequence[grpc.GenericRpcHandler[Any, Any]], *,
                 mode: int = 0o600) -> None:
        self.path = path
        self.mode = mode
        self._server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        self._server.add_generic_rpc_handlers(tuple(handlers))
        self._inode: tuple[int, int] | None = None

    async def start(self) -> None:
        prepare_socket_path(self.path)
        self._server.add_insecure_port(f"unix://{self.path}")
        await self._server.start()
        os.chmod(self.path, self.mode)
        info = self.path.lstat()
        self._inode = (info.st_dev, info.st_ino)
        log.info("grpc server listening", extra={"socket": str(self.path)})

    async def stop(self, grace_s: float = 5.0) -> None:
        await self._server.stop(grace_s)
        # Remove the socket only if it is still ours: during a rolling update the next
        # driver may have bound the same path since.
        try:
            info = self.path.lstat()
        except FileNotFoundError:
            return
        if stat.S_ISSOCK(info.st_mode) and (info.st_dev, info.st_ino) == self._inode:
            self.path.unlink()


def point_link(link: Path, target: Path) -> None:
    """Make ``link`` a symlink to ``target``, atomically (a temp link renamed over it)."""
    temp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        temp.unlink()
    temp.symlink_to(target.name)
    os.replace(temp, link)


def drop_link(link: Path, target: Path) -> None:
    """Remove ``link`` if it still points to ``target`` (a newer process may own it)."""
    with contextlib.suppress(OSError):
        if os.readlink(link) == target.name:
            link.unlink()

