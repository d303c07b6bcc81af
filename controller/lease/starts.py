"""The start-gate API: where engines that start through rota's gate ask for a start slot.

The lease controller serves it on a unix socket in a host directory that the driver's CDI
spec mounts (read-only, host path = container path) into every container of every claim
with an engine config; see :mod:`driver.startgate` and :mod:`controller.lease.admission`.

``POST /v1/start`` with :class:`StartRequest`: the claim's uid and its token (both from the
container's CDI environment). The controller checks the token with the driver, finds the
claim's GPU, and holds the request (a long poll, ``--start-hold-s``) until the engine may
start. Answers, always :class:`StartReply`:

- 200 ``granted: true``: start now (the gate execs the engine);
- 200 ``granted: false``: ask again after ``retry_after_s`` (the GPU is busy, the
  instance does not lead the node, the claim is not known yet);
- 400 ``invalid_request`` a malformed request, 413 ``request_too_large`` a body over
  :data:`MAX_BODY_BYTES`, 401 a token that is not the claim's, 503 the driver's inspection
  API did not answer (ask again).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controller.lease.device import DeviceError
from controller.lease.node import NodeController
from rota.api.start_contract import MAX_BODY_BYTES, PATH
from rota.kit.sockets import drop_link, point_link, prepare_socket_path

__all__ = ["MAX_BODY_BYTES", "PATH", "StartReply", "StartRequest", "StartServer", "StartSocket",
           "instance_socket", "listening", "make_app", "serve"]

log = logging.getLogger(__name__)

NODE: web.AppKey[NodeController] = web.AppKey("node", NodeController)


class StartRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    claim_uid: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9-]+$")
    token: str = Field(min_length=1, max_length=256)
    attempt: int = Field(default=0, ge=0)
    """How many times this gate asked before (for logs)."""


class StartReply(BaseModel):
    model_config = ConfigDict(extra="forbid")

    granted: bool = False
    reason: str = ""
    message: str = ""
    retry_after_s: float = 0.0


def _reply(reply: StartReply, status: int = 200) -> web.Response:
    return web.json_response(reply.model_dump(), status=status)


async def start(request: web.Request) -> web.Response:
    try:
        body = StartRequest.model_validate_json(await request.read())
    except web.HTTPRequestEntityTooLarge:
        return _reply(StartReply(reason="request_too_large", message=f"the request body is "
                                 f"longer than {MAX_BODY_BYTES} bytes"), 413)
    except web.RequestPayloadError as exc:  # a Content-Encoding that does not decode
        return _reply(StartReply(reason="invalid_request", message=f"the request body cannot "
                                 f"be read: {exc}"[:300]), 400)
    except ValidationError as exc:
        return _reply(StartReply(reason="invalid_request", message=str(exc)[:300]), 400)
    try:
        answer = await request.app[NODE].request_start(body.claim_uid, body.token)
    except DeviceError as exc:
        return _reply(StartReply(reason="driver_unavailable", message=str(exc)[:300],
                                 retry_after_s=1.0), 503)
    if answer.granted:
        log.info("start slot granted", extra={"claim": body.claim_uid,
                                              "attempt": body.attempt})
    return _reply(StartReply(granted=answer.granted, reason=answer.reason,
                             message=answer.message, retry_after_s=answer.retry_after_s),
                  answer.status)


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


def make_app(node: NodeController) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[NODE] = node
    app.router.add_post(PATH, start)
    app.router.add_get("/healthz", healthz)
    return app


SOCKET_CHECK_S = 1.0
"""How often an instance checks where the gates' fixed path leads (a leader that finds it
taken away or dead points it back at its own socket within this)."""
STALE_AFTER_S = 60.0
"""An instance socket nobody listens on, older than this, is a dead instance's and is
removed at start (a younger one may be a twin's between its bind and its listen)."""


def instance_socket(link: Path, instance: str) -> Path:
    """This instance's own socket, beside the gates' fixed path: ``start-<instance>.sock``
    (a sibling, so the link resolves inside the directory the CDI spec mounts)."""
    return link.with_name(f"{link.stem}-{instance[:16]}{link.suffix}")


def listening(path: Path) -> bool:
    """True when a process listens at ``path`` (a link is followed): a connection is
    accepted, or the backlog is full. Refused, missing or not a socket: False."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.setblocking(False)
        code = probe.connect_ex(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return code in (0, errno.EAGAIN, errno.EINPROGRESS)


def _replaceable(link: Path) -> bool:
    """The gates' path may be pointed anew: it is missing, a link, or a socket (never a
    file or directory somebody else put there)."""
    try:
        mode = link.lstat().st_mode
    except FileNotFoundError:
        return True
    return stat.S_ISLNK(mode) or stat.S_ISSOCK(mode)


def _points_to(link: Path, target: Path) -> bool:
    try:
        return os.readlink(link) == target.name
    except OSError:
        return False


def _clear_dead(link: Path, own: Path, *, now: float) -> None:
    """Remove the instance sockets of dead instances (SIGKILLed ones never remove theirs)."""
    for path in link.parent.glob(f"{link.stem}-*{link.suffix}"):
        if path == own:
            continue
        with contextlib.suppress(OSError):
            info = path.lstat()
            if (stat.S_ISSOCK(info.st_mode) and now - info.st_mtime > STALE_AFTER_S
                    and not listening(path)):
                path.unlink()
                log.info("removed a dead instance's start socket", extra={"socket": str(path)})


@dataclass
class StartSocket:
    """Where gates reach this instance: its own socket, and the fixed path
    (:data:`driver.startgate.SOCKET_NAME`) as a symlink to the leader's socket.

    No instance ever takes another's socket. The link is swapped atomically
    (:func:`rota.kit.sockets.point_link`) by the leader whenever it leads elsewhere, and
    by any instance only where it leads nowhere that answers: a twin that starts and exits
    beside the leader (a surge pod, a rollback) never leaves the gates a dead path, and a
    leader whose path was taken anyway (an older rota that unlinks it) points it back.
    """

    link: Path
    own: Path
    leading: Callable[[], bool]

    def prepare(self) -> None:
        self.link.parent.mkdir(parents=True, exist_ok=True)
        prepare_socket_path(self.own)
        _clear_dead(self.link, self.own, now=time.time())

    def check(self) -> bool:
        """Point the link at this instance where it should; True when it did."""
        if _points_to(self.link, self.own) or not _replaceable(self.link):
            return False
        if not self.leading() and listening(self.link):
            return False  # another live instance answers there: not ours to take
        point_link(self.link, self.own)
        log.info("start gate path points to this instance",
                 extra={"socket": str(self.link), "target": self.own.name,
                        "leading": self.leading()})
        return True

    def release(self) -> None:
        drop_link(self.link, self.own)
        with contextlib.suppress(FileNotFoundError):
            self.own.unlink()


class StartServer:
    """The start-gate API on this instance's socket, with the task that keeps the gates'
    path pointing at it while it leads (see :class:`StartSocket`)."""

    def __init__(self, runner: web.AppRunner, path: StartSocket) -> None:
        self.runner = runner
        self.path = path
        self._keeper: asyncio.Task[None] | None = None

    def keep(self) -> None:
        self._keeper = asyncio.create_task(self._keep(), name="start-socket")

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(SOCKET_CHECK_S)
            try:
                await asyncio.to_thread(self.path.check)
            except OSError as exc:
                log.warning("could not point the start gate path",
                            extra={"socket": str(self.path.link), "error": str(exc)})

    async def cleanup(self) -> None:
        """Stop answering: the link is removed if it still leads here (another live
        instance's keeper points it at itself), then the socket."""
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        await asyncio.to_thread(self.path.release)
        await self.runner.cleanup()


async def serve(node: NodeController, socket_path: Path, *, instance: str | None = None,
                leading: Callable[[], bool] | None = None) -> StartServer:
    """Listen on this instance's own socket beside ``socket_path`` and make
    ``socket_path`` lead to it where it should (see :class:`StartSocket`); every local
    user may connect: the token decides.

    Args:
        instance: this process's id (the election's); default: a fresh one.
        leading: whether this instance leads its node; default: its election's word.
    """
    path = StartSocket(link=socket_path,
                       own=instance_socket(socket_path, instance or uuid.uuid4().hex),
                       leading=leading or node.election.is_leader)
    await asyncio.to_thread(path.prepare)
    runner = web.AppRunner(make_app(node), access_log=None)
    await runner.setup()
    await web.UnixSite(runner, str(path.own)).start()
    await asyncio.to_thread(os.chmod, path.own, 0o666)
    server = StartServer(runner, path)
    await asyncio.to_thread(path.check)
    server.keep()
    log.info("start gate listening", extra={"socket": str(path.own),
                                            "path": str(socket_path)})
    return server
